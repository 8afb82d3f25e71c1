"""What every gradient algorithm shares: named tensors in, a future out, per-name state.

An algorithm is written once, free of any framework: it takes the named tensors
of one fusion group (a DDP bucket, a Horovod fusion buffer, or any list of
tensors), a step number and a :class:`~sylvie_comm.collectives.Transport`, and
returns a future that completes once the averaged values are written back into
the tensors, in place. Its per-name state (residuals, factors) is keyed by
name, so it survives regrouping and checkpoints. Which tensors compress, and
from which step, is policy (:mod:`sylvie_comm.algorithms.policy`), not here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import torch

from sylvie_comm.algorithms.guard import StepGuard
from sylvie_comm.algorithms.record import Record
from sylvie_comm.collectives import Meter, SerialExecutor, Transport, fusion
from sylvie_comm.registry import takers

Future = torch.futures.Future
T = TypeVar("T")


@dataclass
class Member:
    """One named tensor of a group: the averaged values are written back into ``tensor`` (a view)."""

    name: str
    tensor: torch.Tensor
    compress: bool = True  # False: travels raw (fp32) in the group's fused buffer
    options: Mapping[str, Any] = field(default_factory=dict)  # the algorithm's options for this name


@dataclass(frozen=True)
class Segment:
    """One named tensor's part of every rank's shard in a reduce-scatter (an FSDP parameter's dim-0 shard).

    Each of the ``world_size`` shards of the flat input holds this tensor's slice at the same place:
    ``numel`` elements from ``offset`` (padding included), as rows of ``row`` elements (``prod(shape[1:])``,
    1 for a vector), so per-row scales are the tensor's own rows.
    """

    name: str
    offset: int  # elements into each rank's shard
    numel: int  # elements of the tensor's slice in each rank's shard (a multiple of ``row``)
    row: int = 1
    compress: bool = True  # False: travels as a plain fp32 reduce-scatter
    options: Mapping[str, Any] = field(default_factory=dict)  # the algorithm's options for this name


@dataclass(frozen=True)
class ShardLayout:
    """What a reduce-scatter input holds: ``key`` names it between steps (an FSDP unit: its per-rank state,
    such as residuals, is kept under it), ``segments`` tile each rank's shard in order."""

    key: str
    segments: tuple[Segment, ...]
    # The shard size this layout was found to tile (-1: none yet): a layout is frozen, so a caller that keeps
    # its layout object (an FSDP unit) has it checked at its first step only.
    _tiles: int = field(default=-1, init=False, repr=False, compare=False)

    def check(self, shard: int, what: str) -> None:
        """A ValueError unless the segments tile ``shard`` elements, in order, in whole rows, under distinct names
        (checked once per layout object and shard size)."""
        if shard == self._tiles:
            return
        names = [s.name for s in self.segments]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"{what}: shard layout {self.key!r} names segment {twice!r} twice (its state is kept "
                             "by name)")  # fmt: skip
        at = 0
        for seg in self.segments:
            if seg.offset != at or seg.numel < 0 or seg.row < 1 or seg.numel % seg.row:
                raise ValueError(
                    f"{what}: shard layout {self.key!r}: segment {seg.name!r} (offset {seg.offset}, {seg.numel} "
                    f"elements in rows of {seg.row}) does not follow at offset {at} in whole rows"
                )
            at += seg.numel
        if at != shard:
            raise ValueError(f"{what}: shard layout {self.key!r} covers {at} elements, the shard has {shard}")
        object.__setattr__(self, "_tiles", shard)  # frozen: the one field a check may set


@dataclass
class Group:
    """The named tensors that travel together.

    ``key`` names the group between steps (a DDP bucket's index): buffers laid
    out for a group are kept under it and rebuilt when its members change.
    ``flat``, when given, is one buffer whose consecutive slices are the members,
    in order; algorithms that send everything as it is use it directly. A group
    may give only ``flat`` while its tensors are not yet named (a framework's
    first steps): only plain averaging (:mod:`.none`, the policy's warm-up) runs then.
    """

    key: int
    members: list[Member]
    flat: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the group's tensors live: every buffer serving them is made there."""
        if self.flat is not None:
            return self.flat.device
        return self.members[0].tensor.device if self.members else torch.device("cpu")

    @functools.cached_property
    def signature(self) -> tuple[tuple[str, bool], ...]:
        """The members' names and whether each compresses: what a layout is built for (computed once per group;
        a group's members are not changed after it is made: a changed membership is a new group)."""
        return tuple((m.name, m.compress) for m in self.members)

    @property
    def compressed(self) -> list[Member]:
        return [m for m in self.members if m.compress]

    @property
    def raw(self) -> list[Member]:
        return [m for m in self.members if not m.compress]


def then(futs: Future[Any] | Sequence[Future[Any]], fn: Callable[[Future[Any]], T]) -> Future[T]:
    """``fut.then(fn)`` (``collect_all(futs).then(fn)`` for a list) that runs ``fn`` only after success.

    torch runs a ``then`` callback even when its future failed; this one first reads every value,
    so a failed collective's error fails the returned future and its buffer is never decoded.
    Every future an algorithm returns comes from here: DDP reads a future completed with
    ``set_exception`` as a result, not as an error, and fails to cast it to a tensor.
    """
    # torch._C.Future (what a process group hands out) is not a torch.futures.Future: test for sequences.
    group: list[Future[Any]] = list(futs) if isinstance(futs, (list, tuple)) else [futs]  # type: ignore[list-item]

    def checked(f: Future[Any]) -> T:
        if len(group) > 1:
            # collect_all completes early when an input fails inside torch (a failed ``then``): the
            # others may still be running, and reading them would trip torch's completed() assert.
            f.value()
        for g in group:
            g.value()  # raises the collective's error
        return fn(f)

    return (group[0] if len(group) == 1 else torch.futures.collect_all(group)).then(checked)


def _done(_: Future[Any]) -> None:
    return None


def check_entry(where: str, entry: Mapping[str, Any], spec: Mapping[str, tuple[int, ...]],
                legacy: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """One per-name checkpoint entry: exactly the spec's keys (plus legacy ones), each a finite fp32 tensor of its
    shape; a ValueError naming the field otherwise."""
    keys = set(entry) - legacy
    if keys != set(spec):
        raise ValueError(f"{where} has {sorted(keys)}; expected {sorted(spec)}")
    for key, shape in spec.items():
        t = entry[key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: '{key}' must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{where}: '{key}' must be a float32 tensor of shape {tuple(shape)}, got {t.dtype} of shape "
                f"{tuple(t.shape)}"
            )
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: '{key}' holds NaN or Inf")


def real_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the real tensor of its (real, imaginary) pairs, shape ``(*shape, 2)`` (how DDP's
    buckets hold it); any other tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


class Algorithm:
    """Base of the gradient algorithms.

    Subclasses set ``name`` and ``record`` (:class:`~sylvie_comm.algorithms.record.Record`: what they declare)
    and implement :meth:`_step` (one group of one step) or, with ``serial`` in the record (more than one dependent
    collective per group), :meth:`_prepare` (local work, on the caller's thread)
    and :meth:`_finish` (collectives and decoding, on one thread per algorithm
    that runs groups in submission order, so every rank issues the collectives
    in the same order; launching the second phase from future callbacks lets
    ranks interleave groups differently and gloo aborts with a size mismatch).

    A step whose input is not finite on some rank is skipped (see
    :mod:`sylvie_comm.algorithms.guard`): before changing a state tensor a step
    :meth:`StepGuard.save` s it in ``self.guard``; once its collectives are
    done it reports, from what every rank received, whether the step's input
    was finite, and writes a non-finite average if not.

    Args:
        transport: the ranks to average among.
        options: algorithm options (see the record's ``option_defaults``); unknown ones raise ValueError.
        seed: agreed by every rank; seeds whatever must be random yet identical on every rank.
    """

    name: ClassVar[str]
    # What the class declares (its codec, options, capabilities, bytes on the wire): every concrete algorithm
    # sets its own, once.
    record: ClassVar[Record] = Record(payload=4.0)
    # Whether this instance keeps an error-feedback residual: the record's, unless an option turns it off
    # (qsgd's ``error_feedback=False``).
    error_feedback: bool
    # Every registered algorithm by name: :data:`sylvie_comm.algorithms.registry.ALGORITHMS`, set once the
    # registry has imported them all, so what names the others (the refusal below, ``auto``'s candidates) reads
    # the one list without importing the module that imports it.
    registered: ClassVar[Mapping[str, type[Algorithm]]] = MappingProxyType({})

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        self.options = self.validate_options(dict(options or {}))
        self.error_feedback = self.record.error_feedback
        self.transport = transport
        self.world_size = transport.world_size
        self.seed = seed
        self._layouts: dict[int, tuple[tuple[tuple[str, bool], ...], Any]] = {}
        self.guard = StepGuard()  # ``auto`` gives its candidates its own: one decision per step
        serial = self.record.serial
        self._executor: SerialExecutor | None = SerialExecutor(f"sylvie-comm-{self.name}") if serial else None

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults merged with ``options``; raise ValueError on an unknown or invalid one."""
        defaults = cls.record.option_defaults
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            given, owners = ", ".join(unknown), takers(unknown, "algorithm")
            if not defaults:
                raise ValueError(f"{cls.name}: takes no options, got {given} ({owners})")
            raise ValueError(f"{cls.name}: unknown option(s) {given}; valid: {', '.join(sorted(defaults))} ({owners})")
        return {**defaults, **options}

    def compresses_dtype(self, dtype: torch.dtype) -> bool:
        """Whether gradients of ``dtype`` can be compressed (see the record's ``gradient_dtypes``)."""
        dtypes = self.record.gradient_dtypes
        return dtypes is None or dtype in dtypes

    def compressible(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> bool:
        """Whether a tensor of this shape can be compressed at all (vectors cannot be factored)."""
        return True

    def compression_rate(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> float:
        """Uncompressed over compressed size of a tensor of this shape (policy skips those below its minimum).

        Infinite where the algorithm compresses whatever it is given.
        """
        return math.inf

    # ------------------------------------------------------------------ one group of one step

    def __call__(self, group: Group, step: int, meter: Meter | None = None) -> Future[None]:
        """Average ``group``'s tensors across ranks, in place; the future completes when they are written.

        ``step`` counts the compressed steps (0 first); ``meter`` counts bytes and seconds.
        """
        meter = meter if meter is not None else Meter(self.world_size)
        self.guard.begin(step)
        layout = self._layout(group)
        if self._executor is not None:
            prepared = meter.timed("encode", lambda: self._prepare(group, layout, step, meter))
            # On CUDA the job runs on the caller's current stream (ordered after the gradients' producer).
            device = group.device
            stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            job = self._executor.submit(lambda: self._finish(group, layout, step, meter, prepared), stream)
            return self.guard.track(then(job, _done))
        return self.guard.track(self._step(group, layout, step, meter))

    def _layout(self, group: Group) -> Any:
        cached = self._layouts.get(group.key)
        if cached is not None and cached[0] == group.signature:
            return cached[1]
        layout = self._build(group)
        self._layouts[group.key] = (group.signature, layout)
        return layout

    def _build(self, group: Group) -> Any:
        """Lay out a group's buffers (once per group and membership); subclasses override."""
        return None

    def _step(self, group: Group, layout: Any, step: int, meter: Meter) -> Future[None]:
        raise NotImplementedError(f"{self.name}: non-serial algorithms implement _step")

    def _prepare(self, group: Group, layout: Any, step: int, meter: Meter) -> Any:
        raise NotImplementedError(f"{self.name}: serial algorithms implement _prepare")

    def _finish(self, group: Group, layout: Any, step: int, meter: Meter, prepared: Any) -> None:
        raise NotImplementedError(f"{self.name}: serial algorithms implement _finish")

    # ------------------------------------------------------------------ one shard (sharded data parallel)

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter | None = None,
        layout: ShardLayout | None = None,
    ) -> Future[None]:  # fmt: skip
        """Average ``flat`` across ranks into ``out``, this rank's shard of the mean: ``flat`` holds
        ``world_size`` shards of ``out.numel()`` elements, rank-major (FSDP's reduce-scatter input, one per
        unit); the future completes once ``out`` is written. ``flat`` is the caller's scratch: it may be
        changed. ``meter`` counts the wire bytes against a plain fp32 reduce-scatter's. ``layout`` names the
        input and its tensors (per-name options, rows, per-unit state); without one the input is one unnamed
        tensor of rows of one element, keyed ``""``.

        Algorithms without a reduce-scatter form (a ``no_shards_reason`` in their record) raise a ValueError with
        it, naming those with one.
        """
        w = self.world_size
        reason = self.record.no_shards_reason
        if reason is not None:
            having = ", ".join(n for n, cls in self.registered.items() if cls.record.shards)
            raise ValueError(f"{self.name}: no reduce-scatter form ({reason}); algorithms with one: {having}")
        layout = self.check_reduce_scatter(flat, out, layout)
        meter = meter if meter is not None else Meter(w)
        meter.uncompressed(4 * flat.numel(), "reduce_scatter")
        return self._reduce_scatter(flat.reshape(-1), out, step, meter, layout)

    def check_reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, layout: ShardLayout | None = None
    ) -> ShardLayout:
        """A ValueError naming what does not fit a reduce-scatter of ``flat`` into ``out``; the layout (made
        where none is given)."""
        w = self.world_size
        if flat.numel() != w * out.numel():
            raise ValueError(
                f"{self.name}: reduce_scatter input has {flat.numel()} elements, expected world_size * "
                f"out.numel() = {w} * {out.numel()} = {w * out.numel()}"
            )
        if not (flat.dtype.is_floating_point and out.dtype.is_floating_point) or flat.device != out.device:
            raise ValueError(
                f"{self.name}: reduce_scatter takes floating-point input and output on one device, got "
                f"{flat.dtype} on {flat.device} and {out.dtype} on {out.device}"
            )
        if layout is None:
            layout = ShardLayout("", (Segment("", 0, out.numel()),))
        layout.check(out.numel(), self.name)
        return layout

    def _reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter, layout: ShardLayout
    ) -> Future[None]:
        raise NotImplementedError(f"{self.name}: algorithms with a reduce-scatter form implement _reduce_scatter")

    # ------------------------------------------------------------------ collectives with accounting

    def _all_reduce(self, t: torch.Tensor, meter: Meter) -> Future[Any]:
        meter.collective("all_reduce", t)
        return self.transport.all_reduce(t)

    def _reduce_scatter_wire(self, out: torch.Tensor, t: torch.Tensor, meter: Meter) -> Future[Any]:
        meter.collective("reduce_scatter", t)
        return self.transport.reduce_scatter(out, t)

    def _all_gather(self, out: torch.Tensor, t: torch.Tensor, meter: Meter) -> Future[Any]:
        meter.collective("all_gather", t)
        return self.transport.all_gather(out, t)

    def _all_to_all(self, out: torch.Tensor, t: torch.Tensor, meter: Meter) -> Future[Any]:
        meter.collective("all_to_all", t)
        return self.transport.all_to_all(out, t)

    def _raw_all_reduce(self, group: Group, meter: Meter) -> Future[Any] | None:
        """The group's raw members: one fused fp32 all-reduce of their means (None if there are none).

        Their non-finite values count towards the step's flag (a NaN in a bias skips the step too)."""
        raw = [m.tensor for m in group.raw]
        if not raw:
            return None
        flat = torch.cat([t.reshape(-1).float() for t in raw]).div_(self.world_size)

        def unpack(_: Future[Any]) -> None:
            self.guard.check(flat)
            fusion.unpack(flat, raw)

        return then(self._all_reduce(flat, meter), unpack)

    # ------------------------------------------------------------------ what the monitor reads and changes

    def residual_inner(self, name: str, other: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(||r||^2, <r, other>)`` for ``name``'s error-feedback residual ``r`` as it stands (with any update
        owed to it applied), device scalars (``<r, other>`` is 0 without ``other``); None where the algorithm
        keeps no residual for ``name``. Read by the monitor, never changed."""
        return None

    def forget(self, name: str) -> torch.Tensor | None:
        """Drop ``name``'s per-name state (it goes raw); return what its residual still owes (None: nothing),
        for the caller to send with its next gradient."""
        return None

    def relayout(self) -> None:
        """Rebuild every group's layout at its next step (per-name options changed)."""
        self._layouts.clear()

    def adapt(self, shape: tuple[int, ...], options: Mapping[str, Any], up: bool,
              floor: Mapping[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """The per-name options one level safer (``up``: more bytes, less error) or lighter (never below half
        of ``floor``'s setting) than ``options`` for a tensor of ``shape``; None where there is no such level
        (then the monitor sends a tensor that stays over its bound raw)."""
        return None

    def bytes_per_element(self, shape: tuple[int, ...], options: Mapping[str, Any]) -> float:
        """Payload bytes per element of a tensor of ``shape`` with ``options`` (for the monitor's budget): its
        compression rate's, at most 32x, where the shape sets it, else the record's
        :meth:`~sylvie_comm.algorithms.record.Record.payload_per_element`."""
        rate = self.compression_rate(shape, options)
        if math.isfinite(rate):
            return 4.0 / min(rate, 32.0)
        return self.record.payload_per_element({**self.options, **options})

    def report(self) -> dict[str, Any]:
        """What the integrations' ``stats()`` add beyond bytes and seconds: ``skipped_nonfinite``, the steps
        skipped because their input was not finite on some rank (``auto`` adds its choices)."""
        return {"skipped_nonfinite": self.guard.skipped()}

    # ------------------------------------------------------------------ state

    def persistent_tensors(self) -> list[torch.Tensor]:
        """Tensors kept between steps (residuals, factors, buffers)."""
        return []

    def memory_bytes(self) -> int:
        """Bytes of tensors kept between steps (with the guard's copies of what a step changes, where it keeps any)."""
        return sum(t.numel() * t.element_size() for t in self.persistent_tensors()) + self.guard.memory_bytes()

    def state_dict(self) -> dict[str, Any]:
        """Per-name state: ``{name: {key: tensor}}``."""
        return {}

    def state_spec(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """The per-name state this algorithm keeps for a compressed tensor of ``shape``: key -> shape (fp32)."""
        return {}

    def shard_state_spec(self, segment: Segment) -> dict[str, tuple[int, ...]]:
        """The per-name state the reduce-scatter form keeps for a compressed ``segment`` of a
        :class:`ShardLayout`: key -> shape (fp32), for ``self.world_size`` ranks (empty: none)."""
        return {}

    def check_state_dict(
        self, state: Any, tensors: Mapping[str, tuple[tuple[int, ...], Mapping[str, Any]]] | None, stepped: bool,
        *, shards: Mapping[str, Segment] | None = None,
    ) -> None:  # fmt: skip
        """Raise a ValueError naming the first field of ``state`` (from :meth:`state_dict`) that this algorithm
        could not resume from, before anything is loaded.

        Args:
            state: the per-name state.
            tensors: the shape and options of every tensor that compresses, by name (None where the names are
                not known: then the entries are checked against themselves only).
            stepped: whether the checkpoint was taken after a compressed step (every compressed tensor must then
                have its state).
            shards: the segments of the reduce-scatter form's layouts, by name, where the state is of that
                form: the compressed segments are then the expected names, each with
                :meth:`shard_state_spec`, and ``tensors`` is not read.
        """
        where = self.name
        if not isinstance(state, Mapping):
            raise ValueError(
                f"{where}: checkpoint state must be a mapping of parameter names, got {type(state).__name__}"
            )
        known: list[str] | None = None
        if shards is not None:
            known = [n for n, seg in shards.items() if seg.compress]
        elif tensors is not None:
            known = list(tensors)

        def spec_of(name: str) -> dict[str, tuple[int, ...]]:
            if shards is not None:
                return self.shard_state_spec(shards[name])
            assert tensors is not None
            return self.state_spec(*tensors[name])

        names = None if known is None else set(known)
        for name, entry in state.items():
            if not isinstance(name, str) or not isinstance(entry, Mapping):
                raise ValueError(f"{where}: checkpoint entry {name!r} must map a parameter name to a dict of tensors")
            if names is not None and name not in names:
                raise ValueError(
                    f"{where}: the checkpoint holds state for '{name}', which is not a compressed parameter of this "
                    "model (a parameter of another model, or one this configuration sends uncompressed)"
                )
            if names is not None:
                spec = spec_of(name)
            else:  # the tensor's shape unknown: take the residual's (every stateful algorithm keeps one)
                res = entry.get("residual")
                shape = tuple(res.shape) if isinstance(res, torch.Tensor) and res.dim() >= 1 else (1, 1)
                spec = self.state_spec(shape, self.options)
            check_entry(f"{where}: checkpoint entry '{name}'", entry, spec, self.record.legacy_state_keys)
        if known is not None and stepped:
            missing = [n for n in known if spec_of(n) and n not in state]
            if missing:
                raise ValueError(
                    f"{where}: the checkpoint has no state for '{missing[0]}'"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                    + ", which this configuration compresses: was it written for another model or configuration?"
                )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the per-name state by ``state`` (from :meth:`state_dict`, possibly of another grouping)."""
        if state:
            raise ValueError(f"{self.name}: this algorithm keeps no per-name state, got {len(state)} entries")

    def close(self) -> None:
        """Stop the communication thread once the groups already submitted are done (idempotent)."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        self.guard.settle()
