"""Codecs: framework-free compression of tensors, by name (their part of :mod:`sylvie_comm.registry`)."""

from __future__ import annotations

import inspect
from typing import Any

from sylvie_comm.codecs import lowrank
from sylvie_comm.codecs.base import SUPPORTED_DTYPES, Codec, Encoded, TensorMeta
from sylvie_comm.codecs.cast import Bf16Codec, Fp16Codec, IdentityCodec
from sylvie_comm.codecs.feedback import ErrorFeedback
from sylvie_comm.codecs.onebit import OneBitCodec
from sylvie_comm.codecs.quant import QBitCodec
from sylvie_comm.codecs.sign import SignCodec
from sylvie_comm.codecs.topk import TopKCodec

__all__ = [
    "SUPPORTED_DTYPES",
    "Bf16Codec",
    "Codec",
    "Encoded",
    "ErrorFeedback",
    "Fp16Codec",
    "IdentityCodec",
    "OneBitCodec",
    "QBitCodec",
    "SignCodec",
    "TensorMeta",
    "TopKCodec",
    "available_codecs",
    "get_codec",
    "lowrank",
]

CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (IdentityCodec, Fp16Codec, Bf16Codec, OneBitCodec, QBitCodec, TopKCodec, SignCodec)
}


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec`."""
    return sorted(CODECS)


def get_codec(name: str, **options: Any) -> Codec:
    """Build a codec by name, e.g. ``get_codec("qbit", bits=2, seed=7)``.

    Raises:
        ValueError: unknown name (the message lists the valid ones), unknown
            option (lists the codec's options) or an invalid option value.
    """
    try:
        cls = CODECS[name]
    except (KeyError, TypeError):
        from sylvie_comm import registry

        raise registry.unknown(name, "codec") from None
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(valid) if valid else "none"
        raise ValueError(f"codec {name!r} has no option(s) {', '.join(unknown)}; its options: {listed}")
    return cls(**options)
