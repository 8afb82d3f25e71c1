"""What an algorithm class declares about itself: one frozen record per class.

An algorithm is a core (options, build, step, state spec and state: :class:`~sylvie_comm.algorithms.base.Algorithm`)
plus a :class:`Record`, set once as the class's ``record``. Everything that lists, sizes or picks algorithms (the
Horovod optimizer's groups, the compressed optimizers' codecs, the FSDP benchmark's rows, the policy's warm-up and
monitor, the docs' tables) reads the record, never the algorithm's name.

Bytes, named apart (each one fact, in one place):

- a codec's **payload** of one tensor, exact: :meth:`Codec.payload_bytes(shape) <sylvie_comm.codecs.Codec>` (what
  :attr:`Encoded.nbytes <sylvie_comm.codecs.Encoded>` measures once encoded);
- a codec's **payload per element** of a large tensor, its scales and headers aside:
  :meth:`Codec.payload_per_element <sylvie_comm.codecs.Codec>`, the one declaration an algorithm's figure is read
  from (:meth:`Record.payload_per_element`, for sizing before anything is encoded);
- the **traffic** one rank sends for a collective on a payload, in the ring convention the
  :class:`~sylvie_comm.collectives.Meter` counts with: :func:`sylvie_comm.collectives.wire_bytes`
  (:meth:`Record.sent_bytes` for an algorithm's whole tensor, through its ``collective``);
- an algorithm instance's **bytes per element of one tensor** for the monitor's budget, where the shape sets the
  size (the low-rank factors): :meth:`Algorithm.bytes_per_element <sylvie_comm.algorithms.base.Algorithm>`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from sylvie_comm.codecs import CODECS, codec_options
from sylvie_comm.collectives import wire_bytes

NO_FORM_YET = "its encoding has no reduce-scatter form yet"
COLLECTIVES = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class Record:
    """What an algorithm class declares: its codec, options, capabilities and bytes on the wire.

    ``error_feedback`` is the class's default; an instance whose option turns it off (qsgd's
    ``error_feedback=False``) answers ``Algorithm.error_feedback`` for itself.
    """

    # The registered codec it encodes with (its bytes per element are that codec's); None: a format of its own
    # (low-rank factors, sparseloco's chunks, auto's candidates), whose bytes ``payload`` declares.
    codec_name: str | None = None
    # The options it takes, with their defaults (unknown ones raise ValueError).
    option_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Options a per-name rule may set (each tensor's own value is honoured); the others hold for the whole run.
    per_name_options: frozenset[str] = frozenset()
    # More than one dependent collective per group: ``_prepare`` on the caller's thread, ``_finish`` on one
    # thread per algorithm that runs groups in submission order.
    serial: bool = False
    # Whether it keeps an error-feedback residual (the hooks' warm-up must then cover DDP's bucket rebuild).
    error_feedback: bool = False
    # Gradient dtypes the compressed tensors may have (None: every floating-point dtype).
    gradient_dtypes: tuple[torch.dtype, ...] | None = None
    # Why it has no reduce-scatter form (sharded data parallel), the reason its refusal gives; None: it has one.
    no_shards_reason: str | None = NO_FORM_YET
    # Whether it lost accuracy against plain averaging at its defaults on the real workloads of ``sylvie-comm
    # bench quality`` (docs/benchmarks/quality.md): ``auto`` then takes it only with the compression monitor on.
    needs_monitor: bool = False
    # Bytes per element of a format of its own (``codec_name`` None), a figure or a function of the options (the
    # defaults filled in): fp32's 4 where no figure holds before it runs (the low-rank factors follow each
    # matrix's shape, ``compression_rate``; ``auto``'s choice is measured later).
    payload: float | Callable[[Mapping[str, Any]], float] | None = None
    # How each rank's payload travels: ``all_reduce`` (summed on the wire, or its two phases: an all-to-all of
    # the payload, then an all-gather of the reduced shard) or ``all_gather`` (every rank's to every peer).
    collective: str = "all_reduce"
    # Whether it can average an optimizer's momentum (:mod:`sylvie_comm.optim`: casts and error-feedback codecs).
    averages_momentum: bool = False
    # Whether it sends each matrix as low-rank factors of the rank its ``rank`` option sets.
    low_rank: bool = False
    # Whether it averages through other registered algorithms (``auto``) and so has no encoding of its own.
    delegates: bool = False
    # The registered algorithm whose code it runs with another setting (``bf16``: ``fp16``'s cast), where it is one.
    variant_of: str | None = None
    # Whether it sends the gradient as it is (``none``): nothing to monitor.
    sends_raw: bool = False
    # Whether what it loses is the rounding of a float format alone: nothing for ``warmup: auto`` to wait for.
    rounds_only: bool = False
    # Per-name keys a checkpoint may hold beside the state spec's (an older release's), ignored on load.
    legacy_state_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.option_defaults, dict):  # read-only: the record is the one copy
            object.__setattr__(self, "option_defaults", MappingProxyType(dict(self.option_defaults)))
        if (self.codec_name is None) == (self.payload is None):
            raise ValueError(
                f"record: declare the bytes per element from a codec (codec_name) or a format of its own (payload), "
                f"not {'both' if self.codec_name is not None else 'neither'}"
            )
        if self.codec_name is not None and self.codec_name not in CODECS:
            raise ValueError(f"record: codec_name {self.codec_name!r} is not a registered codec; valid: "
                             f"{', '.join(sorted(CODECS))}")  # fmt: skip
        if self.collective not in COLLECTIVES:
            raise ValueError(f"record: collective must be one of {', '.join(COLLECTIVES)}, got {self.collective!r}")
        unknown = sorted(self.per_name_options - set(self.option_defaults))
        if unknown:
            raise ValueError(f"record: per-name option(s) {', '.join(unknown)} are not options "
                             f"({', '.join(sorted(self.option_defaults)) or 'none'})")  # fmt: skip

    @property
    def shards(self) -> bool:
        """Whether it has a reduce-scatter form (each rank ends with its shard's average)."""
        return self.no_shards_reason is None

    def payload_per_element(self, options: Mapping[str, Any] | None = None) -> float:
        """Bytes per element of a large fp32 tensor it sends with ``options`` (a tensor's; the defaults fill in
        those missing), its scales and headers aside, for sizing before anything is encoded: its codec's
        declaration with the options the codec takes, or its own format's."""
        opts = {**self.option_defaults, **(options or {})}
        if self.codec_name is None:
            own = self.payload
            assert own is not None  # checked at construction
            return float(own) if isinstance(own, (int, float)) else float(own(opts))
        takes = {k: opts[k] for k in _codec_takes(self.codec_name) if k in opts}
        key = tuple(sorted(takes.items()))
        try:
            hash(key)
        except TypeError:  # a value no codec option has (the codec's own check names it)
            return CODECS[self.codec_name](**takes).payload_per_element()
        return _codec_payload(self.codec_name, key)

    def sent_bytes(self, numel: int, world_size: int, options: Mapping[str, Any] | None = None) -> int:
        """The traffic one rank sends for a tensor of ``numel`` elements at ``world_size`` ranks, scales and
        headers aside: its payload through its ``collective``, counted as the Meter counts."""
        return wire_bytes(self.collective, round(numel * self.payload_per_element(options)), world_size)


@functools.cache
def _codec_takes(codec: str) -> tuple[str, ...]:
    """The options codec ``codec`` takes (read from its constructor once)."""
    return tuple(codec_options(CODECS[codec]))


@functools.lru_cache(maxsize=256)
def _codec_payload(codec: str, options: tuple[tuple[str, Any], ...]) -> float:
    """Codec ``codec``'s payload per element with ``options`` (built once per setting: sizing asks per tensor)."""
    return CODECS[codec](**dict(options)).payload_per_element()


__all__ = ["COLLECTIVES", "NO_FORM_YET", "Record"]
