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
    "codec_options",
    "get_codec",
    "lowrank",
]

CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (IdentityCodec, Fp16Codec, Bf16Codec, OneBitCodec, QBitCodec, TopKCodec, SignCodec)
}


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec`."""
    return sorted(CODECS)


def codec_options(cls: type[Codec]) -> list[str]:
    """The options a codec class takes: its constructor's named parameters (none for a codec without a
    constructor of its own, such as ``none``: ``object.__init__``'s ``*args, **kwargs`` take nothing)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self" and p.kind in kinds]


def get_codec(name: str, **options: Any) -> Codec:
    """Build a codec by name, e.g. ``get_codec("qbit", bits=2, seed=7)``.

    Raises:
        ValueError: unknown name (the message lists the valid ones), unknown
            option (lists the codec's options, and the codecs that take it) or an invalid option value.
    """
    from sylvie_comm import registry

    try:
        cls = CODECS[name]
    except (KeyError, TypeError):
        raise registry.unknown(name, "codec") from None
    valid = codec_options(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        given, owners = ", ".join(unknown), registry.takers(unknown, "codec")
        if not valid:
            raise ValueError(f"codec {name!r} takes no options, got {given} ({owners})")
        raise ValueError(f"codec {name!r} has no option(s) {given}; its options: {', '.join(valid)} ({owners})")
    return cls(**options)
