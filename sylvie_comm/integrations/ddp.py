"""PyTorch DistributedDataParallel communication hooks.

Three lines::

    import sylvie_comm
    model = DDP(net)
    state = sylvie_comm.ddp.register(model, codec="acpsgd", rank=4)

or, lower level, ``state, hook = sylvie_comm.ddp.make_hook("acpsgd", model=model, rank=4)``
then ``model.register_comm_hook(state, hook)``. Every hook is the plain function
:func:`hook` applied to a state object; the state holds the configuration, the
per-parameter compression state (keyed by parameter name, so it survives DDP's
bucket rebuild and checkpoints) and the statistics.

Integrations own no math: a hook is bucket -> policy (which tensors compress)
-> codec or low-rank step -> collective -> decode -> bucket. Every hook returns
its future without waiting, so the next bucket is compressed while this one is
on the wire.
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.codecs import ErrorFeedback, lowrank
from sylvie_comm.codecs.base import Encoded
from sylvie_comm.codecs.cast import Bf16Codec, CastCodec, Fp16Codec
from sylvie_comm.codecs.onebit import OneBitCodec, RowLayout, row_layout
from sylvie_comm.codecs.sign import SignCodec
from sylvie_comm.codecs.topk import TopKCodec, topk_count
from sylvie_comm.collectives import ProcessGroupTransport, SerialExecutor, agree, wire_bytes
from sylvie_comm.config import UNCOMPRESSED, Config, differences

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket

Future = torch.futures.Future
T = TypeVar("T")

# ---------------------------------------------------------------------------- statistics


@dataclass
class StepStats:
    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    collectives: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add(self, other: StepStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_uncompressed += other.bytes_uncompressed
        self.collectives += other.collectives
        self.encode_seconds += other.encode_seconds
        self.decode_seconds += other.decode_seconds

    def as_dict(self) -> dict[str, float]:
        ratio = self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else float("nan")
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "compression_ratio": ratio,
            "collectives": self.collectives,
            "encode_seconds": self.encode_seconds,
            "decode_seconds": self.decode_seconds,
        }


# ---------------------------------------------------------------------------- bucket plans


@dataclass
class Entry:
    """One parameter of a bucket: where its gradient lives and how it is sent."""

    name: str
    offset: int  # into the flat bucket buffer
    shape: torch.Size
    numel: int
    compress: bool
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """How a bucket is sent; rebuilt when DDP rebuilds its buckets."""

    signature: tuple[str, ...]
    entries: list[Entry]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def compressed(self) -> list[Entry]:
        return [e for e in self.entries if e.compress]

    @property
    def raw(self) -> list[Entry]:
        return [e for e in self.entries if not e.compress]


def _grad(bucket: GradBucket, e: Entry) -> torch.Tensor:
    return bucket.buffer()[e.offset : e.offset + e.numel].view(e.shape)


# ---------------------------------------------------------------------------- base state


class HookState:
    """Configuration, per-parameter state and statistics of one hook.

    Subclasses implement :meth:`_compressed_step` for one bucket of a
    compressed step and declare ``serial = True`` when a bucket needs more than
    one dependent collective (those then run in order on one thread).
    """

    name: ClassVar[str]
    serial: ClassVar[bool] = False
    error_feedback: ClassVar[bool] = False
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        config: Config,
        transport: ProcessGroupTransport,
        named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
    ) -> None:
        # hyperparameters (no collectives here: make_state() agrees across ranks around this)
        self.config = config
        self.options = self._validate_options(dict(config.options))
        if self.error_feedback and config.warmup_steps < 2:
            raise ValueError(
                f"ddp[{self.name}]: warmup_steps must be >= 2 with error feedback (got {config.warmup_steps}), "
                "because DDP rebuilds its buckets after the first iteration and the hook's per-bucket "
                "buffers should be laid out once the buckets are final"
            )
        self.transport = transport
        self.world_size = self.transport.world_size
        # internal state
        self.step = 0
        self._names: dict[int, str] = {}
        self._auto_names = named_parameters is None
        if named_parameters is not None:
            self.bind(named_parameters)
        self._plans: dict[int, Plan] = {}
        self._executor: SerialExecutor | None = SerialExecutor(f"sylvie-comm-{self.name}") if self.serial else None
        # stats
        self._lock = threading.Lock()
        self._total = StepStats()
        self._per_step: dict[int, StepStats] = {}

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on."""
        return {"hook": self.name, **self.config.to_dict()}

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            valid = ", ".join(sorted(self.option_defaults)) or "none"
            raise ValueError(f"ddp[{self.name}]: unknown option(s) {', '.join(unknown)}; valid: {valid}")
        return {**self.option_defaults, **options}

    def bind(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Name the parameters (state is keyed by these names)."""
        self._names = {id(p): n for n, p in named_parameters}
        self._auto_names = False

    def _name_of(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            if not self._auto_names:
                raise ValueError(
                    f"ddp[{self.name}]: a parameter of shape {tuple(p.shape)} in a DDP bucket is not among the "
                    "named parameters given to register()/make_hook(); pass the model DDP wraps"
                )
            # Without a model, name parameters by first appearance: DDP's first buckets are deterministic.
            name = f"param.{len(self._names)}"
            self._names[id(p)] = name
        return name

    def _plan(self, bucket: GradBucket) -> Plan:
        params = bucket.parameters()
        names = tuple(self._name_of(p) for p in params)
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.signature == names:
            return plan
        entries = []
        offset = 0
        for name, p in zip(names, params, strict=True):
            rule = self.config.rule_for(name)
            options = {**self.options, **(rule.options if rule else {})}
            compress = not (rule is not None and rule.codec == UNCOMPRESSED) and self._compressible(p.shape, options)
            entries.append(Entry(name, offset, p.shape, p.numel(), compress, options))
            offset += p.numel()
        plan = Plan(names, entries)
        self._build_plan(plan, bucket)
        self._plans[bucket.index()] = plan
        return plan

    def _compressible(self, shape: torch.Size, options: Mapping[str, Any]) -> bool:
        return True

    def _build_plan(self, plan: Plan, bucket: GradBucket) -> None:
        """Allocate per-bucket buffers; subclasses override."""

    # ------------------------------------------------------------------ the hook

    def communicate(self, bucket: GradBucket) -> Future[torch.Tensor]:
        step = self.step
        if bucket.is_last():
            self.step += 1
        uncompressed = wire_bytes("all_reduce", 4 * bucket.buffer().numel(), self.world_size)
        self._add(step, bytes_uncompressed=uncompressed)
        if step < self.config.warmup_steps:
            return self._plain_allreduce(bucket, step)
        if self._executor is not None:
            plan = self._plan(bucket)
            prepared = self._timed(step, "encode", lambda: self._prepare(plan, bucket, step))
            return self._then(self._executor.submit(lambda: self._finish(plan, bucket, step, prepared)), Future.value)
        return self._compressed_step(self._plan(bucket), bucket, step)

    def _plain_allreduce(self, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        buf = bucket.buffer()
        buf.div_(self.world_size)
        fut = self._all_reduce(buf, step)
        return self._then(fut, lambda f: buf)

    def _compressed_step(self, plan: Plan, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        raise NotImplementedError

    def _prepare(self, plan: Plan, bucket: GradBucket, step: int) -> Any:
        """Serial hooks: local work before the collectives (runs on the autograd thread)."""
        raise NotImplementedError

    def _finish(self, plan: Plan, bucket: GradBucket, step: int, prepared: Any) -> torch.Tensor:
        """Serial hooks: collectives and decoding (runs on the communication thread)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ collectives with accounting

    def _then(self, futs: Future[Any] | list[Future[Any]], fn: Callable[[Future[Any]], T]) -> Future[T]:
        """``fut.then(fn)`` (``collect_all(futs).then(fn)`` for a list) that runs ``fn`` only after success.

        torch runs a ``then`` callback even when its future failed; this one first reads every value,
        so a failed collective's :class:`~sylvie_comm.collectives.CollectiveError` fails the returned
        future (and DDP's backward pass) and its buffer is never decoded. Every future a hook hands
        DDP comes from here: DDP reads a future completed with ``set_exception`` as a result, not as
        an error, and fails to cast it to a tensor.
        """
        group = futs if isinstance(futs, list) else [futs]

        def checked(f: Future[Any]) -> T:
            for g in group:
                g.value()  # raises the collective's error
            return fn(f)

        return (group[0] if len(group) == 1 else torch.futures.collect_all(group)).then(checked)

    def _account(self, step: int, kind: str, t: torch.Tensor) -> None:
        self._add(step, bytes_sent=wire_bytes(kind, t.numel() * t.element_size(), self.world_size), collectives=1)

    def _all_reduce(self, t: torch.Tensor, step: int) -> Future[Any]:
        self._account(step, "all_reduce", t)
        return self.transport.all_reduce(t)

    def _all_gather(self, out: torch.Tensor, t: torch.Tensor, step: int) -> Future[Any]:
        self._account(step, "all_gather", t)
        return self.transport.all_gather(out, t)

    def _all_to_all(self, out: torch.Tensor, t: torch.Tensor, step: int) -> Future[Any]:
        self._account(step, "all_to_all", t)
        return self.transport.all_to_all(out, t)

    def _add(self, step: int, **amounts: float) -> None:
        with self._lock:
            s = self._per_step.get(step)
            if s is None:
                s = self._per_step[step] = StepStats()
                # Keep the last few steps apart; fold older ones into the total.
                for old in sorted(self._per_step)[:-4]:
                    self._total.add(self._per_step.pop(old))
            for k, v in amounts.items():
                setattr(s, k, getattr(s, k) + v)

    def _timed(self, step: int, what: str, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        out = fn()
        self._add(step, **{f"{what}_seconds": time.perf_counter() - t0})
        return out

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, Any]:
        """Cumulative wire bytes, the plain fp32 all-reduce equivalent, their ratio and
        encode/decode seconds; ``last_step`` holds the same for the last completed step."""
        with self._lock:
            total = StepStats()
            total.add(self._total)
            for s in self._per_step.values():
                total.add(s)
            last = self._per_step.get(self.step - 1, StepStats())
            return {"steps": self.step, **total.as_dict(), "last_step": last.as_dict()}

    def memory_bytes(self) -> int:
        """Bytes of tensors the hook keeps between steps (residuals, factors, buffers)."""
        return sum(t.numel() * t.element_size() for t in self._persistent_tensors())

    def _persistent_tensors(self) -> list[torch.Tensor]:
        return []

    def state_dict(self) -> dict[str, Any]:
        """Step counter and per-parameter state, keyed by parameter name."""
        return {
            "hook": self.name,
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "step": self.step,
            "params": self._param_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("hook") != self.name:
            raise ValueError(f"ddp[{self.name}]: checkpoint is for hook {state.get('hook')!r}, not {self.name!r}")
        diff = differences(self.config.to_dict(), state.get("config", {}))
        if diff:
            f, mine, theirs = diff[0]
            raise ValueError(
                f"ddp[{self.name}]: checkpoint config differs: '{f}' is {theirs!r}, this hook has {mine!r}"
            )
        if state.get("world_size") != self.world_size:
            raise ValueError(
                f"ddp[{self.name}]: checkpoint was written with world size {state.get('world_size')}, "
                f"this run has {self.world_size}"
            )
        self.step = int(state["step"])
        self._load_param_state(state.get("params", {}))

    def _param_state(self) -> dict[str, Any]:
        return {}

    def _load_param_state(self, params: Mapping[str, Any]) -> None:
        if params:
            raise ValueError(f"ddp[{self.name}]: this hook keeps no per-parameter state, got {len(params)} entries")

    def close(self) -> None:
        """Stop the communication thread and destroy the hook's process group, now, on this thread.

        Call it on every rank after the last backward pass (before ``dist.destroy_process_group()``,
        or instead of relying on it and on interpreter exit, which release both too). Idempotent;
        the hook issues no collectives afterwards.
        """
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        self.transport.close()


def hook(state: HookState, bucket: GradBucket) -> Future[torch.Tensor]:
    """The DDP communication hook of every sylvie_comm algorithm."""
    return state.communicate(bucket)


# DDP checks the hook's annotations at run time; this module's are strings (PEP 563).
hook.__annotations__ = {
    "state": HookState,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


# ---------------------------------------------------------------------------- all-reduce codecs


class PlainState(HookState):
    """Uncompressed fp32 all-reduce (the baseline; same as DDP's default)."""

    name = "none"

    def _compressed_step(self, plan: Plan, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        return self._plain_allreduce(bucket, step)


class CastState(HookState):
    """fp16 / bf16 all-reduce; values are divided by the world size before the cast against overflow."""

    codec_cls: ClassVar[type[CastCodec]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.codec = self.codec_cls(divide_by=float(self.world_size))

    def _compressed_step(self, plan: Plan, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        buf = bucket.buffer()
        enc = self._timed(step, "encode", lambda: self.codec.encode(buf))
        (wire,) = enc.payload

        def decode(_: Future[Any]) -> torch.Tensor:
            # Each rank sent x / w, so the summed wire tensor already holds the mean: cast it back.
            return self._timed(step, "decode", lambda: buf.copy_(wire))

        return self._then(self._all_reduce(wire, step), decode)


class Fp16State(CastState):
    name = "fp16"
    codec_cls = Fp16Codec


class Bf16State(CastState):
    name = "bf16"
    codec_cls = Bf16Codec


class _FeedbackState(HookState):
    """Hooks with a per-parameter error-feedback residual."""

    error_feedback = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.feedback = ErrorFeedback()
        super().__init__(*args, **kwargs)

    def _persistent_tensors(self) -> list[torch.Tensor]:
        return [r for r in (self.feedback.residual(n) for n in self.feedback) if r is not None]

    def _param_state(self) -> dict[str, Any]:
        return {n: {"residual": r.clone()} for n, r in self.feedback.state_dict()["residuals"].items()}

    def _load_param_state(self, params: Mapping[str, Any]) -> None:
        self.feedback.load_state_dict({"residuals": {n: s["residual"] for n, s in params.items()}})

    def _raw_allreduce(self, plan: Plan, bucket: GradBucket, step: int) -> Future[Any] | None:
        """Parameters a rule marks uncompressed: one fused fp32 all-reduce (None if there are none)."""
        raw = plan.raw
        if not raw:
            return None
        flat = torch.cat([_grad(bucket, e).reshape(-1).float() for e in raw]).div_(self.world_size)

        def scatter(_: Future[Any]) -> None:
            start = 0
            for e in raw:
                _grad(bucket, e).copy_(flat[start : start + e.numel].view(e.shape))
                start += e.numel

        return self._then(self._all_reduce(flat, step), scatter)


class SignState(_FeedbackState):
    """Sign-SGD with majority vote and error feedback: int8 votes and per-row scales, summed.

    One scale per row of each weight (see :class:`~sylvie_comm.codecs.sign.SignCodec`): with one
    scale per parameter, error feedback on the quiet rows overshoots (on the digits MLP of the tests,
    5 points below plain DDP at SGD momentum 0.9).
    """

    name = "sign"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.world_size > 127:
            raise ValueError(f"ddp[sign]: int8 votes hold world sizes up to 127, got {self.world_size}")
        self.codec = SignCodec()

    def _compressed_step(self, plan: Plan, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        entries = plan.compressed

        def encode() -> tuple[list[Encoded], torch.Tensor, torch.Tensor]:
            encs = [self.feedback.encode(self.codec, e.name, _grad(bucket, e)) for e in entries]
            signs = torch.cat([enc.payload[0] for enc in encs]) if encs else torch.zeros(0, dtype=torch.int8)
            scales = torch.cat([enc.payload[1] for enc in encs]) if encs else torch.zeros(0)
            return encs, signs, scales

        encs, signs, scales = self._timed(step, "encode", encode)
        raw = self._raw_allreduce(plan, bucket, step)
        futs = [self._all_reduce(signs, step), self._all_reduce(scales, step)] + ([raw] if raw else [])

        def decode(_: Future[Any]) -> torch.Tensor:
            def run() -> None:
                start = at = 0
                scales.div_(self.world_size)
                for e, enc in zip(entries, encs, strict=True):
                    k = enc.payload[1].numel()
                    summed = Encoded((signs[start : start + e.numel], scales[at : at + k]), enc.ctx)
                    self.codec.decode(summed, out=_grad(bucket, e))
                    start += e.numel
                    at += k

            self._timed(step, "decode", run)
            return bucket.buffer()

        return self._then(futs, decode)


class TopKState(_FeedbackState):
    """Top-k of each parameter with error feedback; values and int32 indices of a bucket all-gathered at once.

    Selection is per parameter (``ceil(ratio * numel)`` each), so what is sent
    does not depend on how DDP groups parameters into buckets.
    """

    name = "topk"
    option_defaults: ClassVar[dict[str, Any]] = {"ratio": 0.1}

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._validate_options(options)
        self.codec = TopKCodec(ratio=options["ratio"])
        return options

    def _compressed_step(self, plan: Plan, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        entries = plan.compressed
        counts = [topk_count(e.numel, self.codec.ratio) for e in entries]
        k = sum(counts)

        def encode() -> torch.Tensor:
            encs = [self.feedback.encode(self.codec, e.name, _grad(bucket, e)) for e in entries]
            values = [enc.payload[0].float().view(torch.int32) for enc in encs]
            return torch.cat(values + [enc.payload[1] for enc in encs]) if encs else torch.zeros(0, dtype=torch.int32)

        packed = self._timed(step, "encode", encode)
        gathered = torch.empty(self.world_size * packed.numel(), dtype=torch.int32)
        futs = [self._all_gather(gathered, packed, step)]
        raw = self._raw_allreduce(plan, bucket, step)
        if raw is not None:
            futs.append(raw)

        def decode(_: Future[Any]) -> torch.Tensor:
            def run() -> None:
                rows = gathered.view(self.world_size, 2 * k)
                start = 0
                for e, ki in zip(entries, counts, strict=True):
                    values = rows[:, start : start + ki].reshape(-1).view(torch.float32)
                    idx = rows[:, k + start : k + start + ki].reshape(-1).long()
                    dense = torch.zeros(e.numel, dtype=torch.float32).index_add_(0, idx, values)
                    _grad(bucket, e).copy_(dense.div_(self.world_size).view(e.shape))
                    start += ki

            self._timed(step, "decode", run)
            return bucket.buffer()

        return self._then(futs, decode)


# ---------------------------------------------------------------------------- one-bit (two phases)


@dataclass
class _Slot:
    """Where one parameter sits in a one-bit row: ``per_rank`` units of its layout per rank."""

    entry: Entry
    layout: RowLayout
    per_rank: int  # rank j owns units [j * per_rank, (j + 1) * per_rank)
    scales_at: int  # fp32 scales before this parameter's, in a row
    bits_at: int  # bytes of sign bits before this parameter's, in a row's bit section

    @property
    def n_scales(self) -> int:
        return self.per_rank * self.layout.nchunks

    @property
    def n_bytes(self) -> int:
        return self.per_rank * self.layout.width // 8


class OneBitState(_FeedbackState):
    """Error-compensated one-bit all-reduce in two phases (1-bit Adam's compressed all-reduce).

    Each parameter is cut into the units of its
    :class:`~sylvie_comm.codecs.onebit.RowLayout` (a weight's rows, a vector's
    ``world_size`` pieces) and the units are dealt out in ``world_size`` equal
    parts. A worker adds its residual, sign-compresses every part with one
    scale per row (per chunk of a long row) and sends part ``j`` to rank ``j``
    (all-to-all); rank ``j`` averages what it received for its part, adds its
    server residual, compresses again and all-gathers. A rank sends about
    ``2 (w - 1) / w * d / 8`` bytes plus the scales. Parts and scales are cut
    per parameter, so what is sent, and both residuals, do not depend on DDP's
    buckets.

    Scales are taken per row because a scale shared by rows of different
    magnitude (flat chunks) sends the quiet rows noise the size of the loud
    ones and leaves the loud ones most of their gradient: error feedback then
    carries a residual many times the gradient, released steps later, which
    momentum amplifies into overshoot (on the digits MLP of the tests, flat
    2048-element chunks end more than 20 points below plain DDP at SGD
    momentum 0.9).
    """

    name = "onebit"
    serial = True
    option_defaults: ClassVar[dict[str, Any]] = {"chunk_size": 2048, "scale": "mean"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.server_feedback = ErrorFeedback()
        super().__init__(*args, **kwargs)
        self._norm = self.options["scale"] == "norm"

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._validate_options(options)
        OneBitCodec(chunk_size=options["chunk_size"], scale=options["scale"])  # validates both
        return options

    def _build_plan(self, plan: Plan, bucket: GradBucket) -> None:
        w, limit = self.world_size, self.options["chunk_size"]
        slots, scales, bits = [], 0, 0
        for e in plan.compressed:
            layout = row_layout(e.shape, limit, pieces=w)
            if not layout.units:
                continue  # an empty tensor: nothing to send
            slot = _Slot(e, layout, math.ceil(layout.units / w), scales, bits)
            slots.append(slot)
            scales += slot.n_scales
            bits += slot.n_bytes
        row = 4 * scales + bits
        plan.extra.update(slots=slots, scale_bytes=4 * scales, bit_bytes=bits, row_bytes=row + (-row) % 4)

    def _sections(self, rows: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales (fp32) and bits (uint8) views of (n, row_bytes) rows: scales first, 4-byte aligned."""
        sb = plan.extra["scale_bytes"]
        return rows[:, :sb].view(torch.float32), rows[:, sb : sb + plan.extra["bit_bytes"]]

    def _encode_into(
        self, slot: _Slot, units: torch.Tensor, first: int, scales: torch.Tensor, bits: torch.Tensor
    ) -> torch.Tensor:
        """Encode ``units`` (the parameter's units from ``first`` on, one part per row of ``scales``
        and ``bits``) into the slot's columns; return the local decode with its padding zeroed."""
        layout = slot.layout
        packed, s = layout.encode_units(units, self._norm, first)
        n = scales.shape[0]
        scales[:, slot.scales_at : slot.scales_at + slot.n_scales] = s.view(n, -1)
        bits[:, slot.bits_at : slot.bits_at + slot.n_bytes] = packed.view(n, -1)
        return layout.zero_padding_(layout.decode_units(packed, s, units.shape[0]), first)

    def _decode_from(self, slot: _Slot, scales: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """Decode the slot's columns of every row: (rows * per_rank, width) units, padding not zeroed."""
        n = scales.shape[0]
        s = scales[:, slot.scales_at : slot.scales_at + slot.n_scales].reshape(-1)
        b = bits[:, slot.bits_at : slot.bits_at + slot.n_bytes].reshape(-1)
        return slot.layout.decode_units(b, s, n * slot.per_rank)

    def _prepare(self, plan: Plan, bucket: GradBucket, step: int) -> Any:
        w = self.world_size
        send = torch.zeros(w, plan.extra["row_bytes"], dtype=torch.uint8)
        scales, bits = self._sections(send, plan)
        for slot in plan.extra["slots"]:
            e, layout = slot.entry, slot.layout
            comp = self.feedback.compensate(e.name, _grad(bucket, e))
            local = self._encode_into(slot, layout.to_units(comp, w * slot.per_rank), 0, scales, bits)
            self.feedback.update(e.name, comp, layout.from_units(local).view(e.shape))
        return send

    def _finish(self, plan: Plan, bucket: GradBucket, step: int, prepared: Any) -> torch.Tensor:
        send: torch.Tensor = prepared
        w, rank = self.world_size, self.transport.rank
        raw = self._raw_allreduce(plan, bucket, step)
        if plan.extra["slots"]:
            recv = torch.empty_like(send)
            self._all_to_all(recv, send, step).wait()

            def server() -> torch.Tensor:
                mine = torch.zeros(1, plan.extra["row_bytes"], dtype=torch.uint8)
                rs, rb = self._sections(recv, plan)
                ms, mb = self._sections(mine, plan)
                for slot in plan.extra["slots"]:
                    layout, first = slot.layout, rank * slot.per_rank
                    key = f"{slot.entry.name}@{rank}"
                    avg = self._decode_from(slot, rs, rb).view(w, slot.per_rank, layout.width).sum(0).div_(w)
                    comp = self.server_feedback.compensate(key, layout.zero_padding_(avg, first))
                    self.server_feedback.update(key, comp, self._encode_into(slot, comp, first, ms, mb))
                return mine

            mine = self._timed(step, "encode", server)
            gathered = torch.empty(w, plan.extra["row_bytes"], dtype=torch.uint8)
            self._all_gather(gathered.view(-1), mine.view(-1), step).wait()

            def decode() -> None:
                gs, gb = self._sections(gathered, plan)
                for slot in plan.extra["slots"]:
                    e = slot.entry
                    _grad(bucket, e).copy_(slot.layout.from_units(self._decode_from(slot, gs, gb)).view(e.shape))

            self._timed(step, "decode", decode)
        if raw is not None:
            raw.wait()
        return bucket.buffer()

    def _persistent_tensors(self) -> list[torch.Tensor]:
        server = [r for r in (self.server_feedback.residual(n) for n in self.server_feedback) if r is not None]
        return super()._persistent_tensors() + server

    def _param_state(self) -> dict[str, Any]:
        out = super()._param_state()
        rank = self.transport.rank
        for key, r in self.server_feedback.state_dict()["residuals"].items():
            name = key.rsplit("@", 1)[0]
            out.setdefault(name, {})[f"server_residual@{rank}"] = r
        return out

    def _load_param_state(self, params: Mapping[str, Any]) -> None:
        super()._load_param_state({n: s for n, s in params.items() if "residual" in s})
        rank = self.transport.rank
        server = {f"{n}@{rank}": s[f"server_residual@{rank}"] for n, s in params.items()
                  if f"server_residual@{rank}" in s}  # fmt: skip
        self.server_feedback.load_state_dict({"residuals": server})


# ---------------------------------------------------------------------------- low rank


class _LowRankState(HookState):
    """Per-parameter P, Q factors and residual E; fused per-bucket factor buffers."""

    error_feedback = True
    option_defaults: ClassVar[dict[str, Any]] = {"rank": 4}
    alternate: ClassVar[bool]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (P, Q), views into buffers
        self._residuals: dict[str, torch.Tensor] = {}
        self._loaded: dict[str, Mapping[str, torch.Tensor]] = {}
        super().__init__(*args, **kwargs)

    def _validate_options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._validate_options(options)
        rank = options["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"ddp[{self.name}]: rank must be an integer >= 1, got {rank!r}")
        return options

    def _compressible(self, shape: torch.Size, options: Mapping[str, Any]) -> bool:
        if len(shape) < 2:
            return False  # vectors cannot be factored: they travel raw in the fused buffer
        rate = lowrank.compression_rate(shape, options.get("rank", self.options["rank"]), alternate=self.alternate)
        return rate >= self.config.min_compression_rate

    def _init_factors(self, e: Entry) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = lowrank.matrix_shape(e.shape)
        r = lowrank.effective_rank(e.shape, e.options["rank"])
        # Seeded by the agreed seed and the parameter's name: identical on every rank, whatever the bucket.
        gen = lowrank.seeded_generator(self.config.seed * 1_000_003 + zlib.crc32(e.name.encode()))
        return lowrank.random_factor(n, r, gen), lowrank.random_factor(m, r, gen)

    def _build_plan(self, plan: Plan, bucket: GradBucket) -> None:
        """One P buffer and one Q buffer per bucket: [factors..., raw values...] (one collective each step)."""
        comp = plan.compressed
        sizes_p = [lowrank.matrix_shape(e.shape)[0] * lowrank.effective_rank(e.shape, e.options["rank"]) for e in comp]
        sizes_q = [lowrank.matrix_shape(e.shape)[1] * lowrank.effective_rank(e.shape, e.options["rank"]) for e in comp]
        raw = sum(e.numel for e in plan.raw)
        pbuf = torch.zeros(sum(sizes_p) + raw)
        qbuf = torch.zeros(sum(sizes_q) + raw)
        op = oq = 0
        for e, sp, sq in zip(comp, sizes_p, sizes_q, strict=True):
            n, m = lowrank.matrix_shape(e.shape)
            r = sp // n
            p, q = pbuf[op : op + sp].view(n, r), qbuf[oq : oq + sq].view(m, r)
            if e.name in self._factors:  # buckets rebuilt: carry the factors over
                old_p, old_q = self._factors[e.name]
                p.copy_(old_p)
                q.copy_(old_q)
            elif e.name in self._loaded:
                p.copy_(self._loaded[e.name]["p"])
                q.copy_(self._loaded[e.name]["q"])
            else:
                p0, q0 = self._init_factors(e)
                p.copy_(p0)
                q.copy_(q0)
            self._factors[e.name] = (p, q)
            if e.name not in self._residuals:
                loaded = self._loaded.get(e.name)
                self._residuals[e.name] = loaded["residual"].clone() if loaded else torch.zeros(n, m)
            op += sp
            oq += sq
        plan.extra.update(pbuf=pbuf, qbuf=qbuf, raw_p=op, raw_q=oq)

    def _fill_raw(self, plan: Plan, bucket: GradBucket, buf: torch.Tensor, at: int) -> None:
        for e in plan.raw:
            buf[at : at + e.numel].copy_(_grad(bucket, e).reshape(-1))
            at += e.numel

    def _read_raw(self, plan: Plan, bucket: GradBucket, buf: torch.Tensor, at: int) -> None:
        for e in plan.raw:
            _grad(bucket, e).copy_(buf[at : at + e.numel].view(e.shape).div_(self.world_size))
            at += e.numel

    def _matrix(self, bucket: GradBucket, e: Entry) -> torch.Tensor:
        return _grad(bucket, e).view(lowrank.matrix_shape(e.shape))

    def _write_approx(self, bucket: GradBucket, e: Entry, p: torch.Tensor, q: torch.Tensor, scale: float) -> None:
        """grad <- scale * P Q^T, in fp32, written straight into the bucket when it is fp32.

        The scale multiplies the small factor, not the product: one pass over the gradient.
        """
        g = self._matrix(bucket, e)
        scaled_q = q * scale if scale != 1.0 else q
        if g.dtype == torch.float32:
            lowrank.reconstruct(p, scaled_q, out=g)
        else:
            g.copy_(lowrank.reconstruct(p, scaled_q))

    def _persistent_tensors(self) -> list[torch.Tensor]:
        bufs = [t for plan in self._plans.values() for t in (plan.extra.get("pbuf"), plan.extra.get("qbuf"))]
        return [t for t in bufs if t is not None] + list(self._residuals.values())

    def _param_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {n: {"p": p.clone(), "q": q.clone()} for n, (p, q) in self._factors.items()}
        for n, r in self._residuals.items():
            out.setdefault(n, {})["residual"] = r.clone()
        for n, s in self._loaded.items():  # loaded but not yet placed in a bucket
            out.setdefault(n, {k: v.clone() for k, v in s.items()})
        return out

    def _load_param_state(self, params: Mapping[str, Any]) -> None:
        for n, s in params.items():
            if not {"p", "q", "residual"} <= set(s):
                raise ValueError(f"ddp[{self.name}]: checkpoint entry '{n}' needs p, q and residual")
        self._loaded = {n: dict(s) for n, s in params.items()}
        # Rebuild the bucket buffers from the loaded state at the next step.
        self._plans.clear()
        self._factors.clear()
        self._residuals.clear()


class ACPSGDState(_LowRankState):
    """ACP-SGD: one factor per step, alternating P and Q, with error feedback.

    P step: ``Q <- orth(Q_sum of the last step)``, ``P <- (M + E) Q``,
    ``E <- M + E - P Q^T``, all-reduce P. Q step: ``P <- orth(P_sum)``,
    ``Q <- (M + E)^T P``, ``E <- M + E - P Q^T``, all-reduce Q. The gradient
    becomes ``P Q^T / w``. One collective per bucket per step: the factors and
    the raw 1-D/small tensors share a buffer.

    Each step projects on the subspace found the step before, so it keeps less
    of the gradient than PowerSGD at the same rank: with Adam, or plain SGD at a
    large learning rate, rank 8 is safer than the default 4 (see the README).
    """

    name = "acpsgd"
    alternate = True

    def _compressed_step(self, plan: Plan, bucket: GradBucket, step: int) -> Future[torch.Tensor]:
        p_step = (step - self.config.warmup_steps) % 2 == 0
        comp = plan.compressed

        def encode() -> torch.Tensor:
            fixed = [self._factors[e.name][1 if p_step else 0] for e in comp]
            lowrank.orthogonalize_(fixed)
            for e in comp:
                p, q = self._factors[e.name]
                res = self._residuals[e.name]
                res.add_(self._matrix(bucket, e))  # E <- M + E
                if p_step:
                    lowrank.p_step(res, q, out=p)
                else:
                    lowrank.q_step(res, p, out=q)
                res.addmm_(p, q.T, alpha=-1.0)  # E <- M + E - P Q^T
            buf: torch.Tensor = plan.extra["pbuf" if p_step else "qbuf"]
            self._fill_raw(plan, bucket, buf, plan.extra["raw_p" if p_step else "raw_q"])
            return buf

        buf = self._timed(step, "encode", encode)

        def decode(_: Future[Any]) -> torch.Tensor:
            def run() -> None:
                for e in comp:
                    p, q = self._factors[e.name]
                    self._write_approx(bucket, e, p, q, 1.0 / self.world_size)
                self._read_raw(plan, bucket, buf, plan.extra["raw_p" if p_step else "raw_q"])

            self._timed(step, "decode", run)
            return bucket.buffer()

        return self._then(self._all_reduce(buf, step), decode)


class PowerSGDState(_LowRankState):
    """PowerSGD (Vogels et al. 2019) with error feedback and warm start, two ordered collectives per bucket.

    ``P <- (M + E) Q``, all-reduce P (with the raw tensors), orthogonalize P
    (batched over same-shape factors), ``Q <- (M + E)^T P``,
    ``E <- M + E - P Q^T`` (this rank's Q), all-reduce Q, gradient
    ``P Q^T / w``; the averaged Q is kept for the next step (warm start).

    The residual is what this rank's ``M + E`` has outside the span of P, so
    ``||E|| <= ||M + E||``. Taking it against the averaged Q instead (as the
    paper and PyTorch's hook do) sums to the same over the ranks, hence gives
    the same updates, but leaves each rank its share of the ranks'
    disagreement, which grows without bound when the ranks' data differ (60x
    the gradient after 300 steps on the digits MLP of the tests).
    """

    name = "powersgd"
    serial = True
    alternate = False

    def _prepare(self, plan: Plan, bucket: GradBucket, step: int) -> Any:
        for e in plan.compressed:
            p, q = self._factors[e.name]
            res = self._residuals[e.name]
            res.add_(self._matrix(bucket, e))
            lowrank.p_step(res, q, out=p)
        self._fill_raw(plan, bucket, plan.extra["pbuf"], plan.extra["raw_p"])
        return None

    def _finish(self, plan: Plan, bucket: GradBucket, step: int, prepared: Any) -> torch.Tensor:
        comp = plan.compressed
        self._all_reduce(plan.extra["pbuf"], step).wait()

        def q_phase() -> None:
            lowrank.orthogonalize_([self._factors[e.name][0] for e in comp])
            for e in comp:
                p, q = self._factors[e.name]
                res = self._residuals[e.name]
                lowrank.q_step(res, p, out=q)
                res.addmm_(p, q.T, alpha=-1.0)  # E <- M + E - P Q^T, this rank's Q

        self._timed(step, "encode", q_phase)
        if comp:
            self._all_reduce(plan.extra["qbuf"], step).wait()

        def decode() -> None:
            for e in comp:
                p, q = self._factors[e.name]
                q.div_(self.world_size)  # the averaged Q: decoded gradient and next step's warm start
                self._write_approx(bucket, e, p, q, 1.0)
            self._read_raw(plan, bucket, plan.extra["pbuf"], plan.extra["raw_p"])

        self._timed(step, "decode", decode)
        return bucket.buffer()


# ---------------------------------------------------------------------------- registry and entry points

HOOKS: dict[str, type[HookState]] = {
    cls.name: cls
    for cls in (PlainState, Fp16State, Bf16State, SignState, TopKState, OneBitState, ACPSGDState, PowerSGDState)
}


def make_state(
    codec: str | None = None,
    *,
    config: Config | None = None,
    process_group: dist.ProcessGroup | None = None,
    model: nn.Module | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> HookState:
    """Build the state of a hook (a collective call: every rank must make it)."""
    transport = ProcessGroupTransport(process_group, timeout=timeout)  # a collective: every rank gets here
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    named = list(module.named_parameters()) if module is not None else None

    def build() -> HookState:
        cfg = config if config is not None else Config(codec=codec or "acpsgd")
        if config is not None and codec is not None and codec != config.codec:
            raise ValueError(f"ddp: codec {codec!r} given with a config for {config.codec!r}; pass one of them")
        opts = dict(options)
        extra: dict[str, Any] = {k: opts.pop(k) for k in ("warmup_steps", "min_compression_rate", "seed") if k in opts}
        if opts or extra:
            d = cfg.to_dict()
            d["options"] = {**d["options"], **opts}
            d.update(extra)
            cfg = Config.from_dict(d)
        cls = HOOKS.get(cfg.codec)
        if cls is None:
            raise ValueError(f"ddp: unknown hook {cfg.codec!r}; available: {', '.join(sorted(HOOKS))}")
        return cls(cfg, transport, named)

    try:
        return agree(transport, build, lambda state: state.describe(), "sylvie_comm.ddp")
    except BaseException:
        transport.close()  # no hook will use its group
        raise


def make_hook(
    codec: str | None = None,
    *,
    config: Config | None = None,
    process_group: dist.ProcessGroup | None = None,
    model: nn.Module | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> tuple[HookState, Callable[[HookState, GradBucket], Future[torch.Tensor]]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Pass ``model`` (the DDP model or the module it wraps) so per-parameter state
    is keyed by parameter name; without it parameters are named by their order
    of appearance in DDP's first buckets. ``timeout`` as in :func:`register`.
    """
    state = make_state(codec, config=config, process_group=process_group, model=model, timeout=timeout, **options)
    return state, hook


def register(
    ddp_model: nn.parallel.DistributedDataParallel,
    codec: str | None = None,
    *,
    config: Config | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> HookState:
    """Register a sylvie_comm hook on a DDP model and return its state.

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        codec: hook name (see ``HOOKS``): ``acpsgd`` (default), ``powersgd``,
            ``onebit``, ``topk``, ``sign``, ``fp16``, ``bf16``, ``none``.
        config: a :class:`~sylvie_comm.config.Config` (e.g. from YAML) instead of keywords.
        process_group: defaults to the default group (and DDP's).
        timeout: seconds (or a ``timedelta``) one of the hook's collectives may wait for the
            other ranks before the backward pass fails with a
            :class:`~sylvie_comm.collectives.CollectiveError` (default 600 s; the hook talks on a
            process group of its own, created with this timeout). A peer that dies fails it at once.
        **options: hook options (``rank``, ``chunk_size``, ``scale``, ``ratio``) and
            ``warmup_steps``, ``min_compression_rate``, ``seed``.

    Call ``state.close()`` on every rank after the last backward pass: it stops the hook's
    thread and destroys its process group.

    Example::

        state = sylvie_comm.ddp.register(model, "acpsgd", rank=4)
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"ddp.register: expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    state = make_state(codec, config=config, process_group=process_group, model=ddp_model, timeout=timeout, **options)
    try:
        ddp_model.register_comm_hook(state, hook)
    except BaseException:
        state.close()
        raise
    return state


__all__ = ["HOOKS", "Config", "HookState", "hook", "make_hook", "make_state", "register"]
