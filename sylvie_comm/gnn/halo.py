"""Halo exchange: boundary rows to the peers that need them, gradients back to their owners.

Per layer, forward: gather this rank's boundary rows (the union of what any
peer needs) once, encode them once (Sylvie's low-bit module: per-row min/max
stochastic quantization, or fp32/bf16/fp16), send each peer its rows in one
all-to-all with per-peer splits, decode into the halo buffer. Backward mirrors
it: halo-row gradients go back to their owners, who add them into their inner
rows. :class:`HaloPipeline` (the bounded-staleness adaptor) runs the exchanges
on one communication thread and decides which epoch's data each layer uses.

Both have ``state_dict()``/``load_state_dict()``: the exchanger holds the
error-feedback residuals and the noise offsets of its q-bit codecs, the
pipeline the exchanges still queued for later epochs (by value), so a run
restarted from a checkpoint continues bit for bit.

Devices: the exchanger's index tensors, receive buffers and decoded rows live on
its ``device`` (the features' device); the per-peer row counts of the all-to-all
come from the partition, on the host, at set-up, so no step reads a value back
from the device. On CUDA the pipeline's communication thread runs its kernels on
a side stream of its own, ordered by events (see :meth:`HaloPipeline._submit`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from sylvie_comm.codecs import Codec, ErrorFeedback, QBitCodec, get_codec
from sylvie_comm.collectives import ProcessGroupTransport, SerialExecutor, Transport
from sylvie_comm.gnn.partition import Partition
from sylvie_comm.registry import HALO_FORMS, unknown

PRECISIONS = tuple(HALO_FORMS)
_ALIASES = {"none": "fp32", 32: "fp32", 16: "bf16", 8: "q8", 4: "q4", 2: "q2", 1: "q1", "32": "fp32", "16": "bf16"}


def parse_precision(value: str | int) -> str:
    """``fp32``, ``bf16``, ``fp16`` or ``q1``/``q2``/``q4``/``q8``; ints 32, 16 (bf16), 8, 4, 2, 1 also work."""
    p = _ALIASES.get(value, value) if not isinstance(value, bool) else value
    if isinstance(p, str) and p.isdigit():
        p = _ALIASES.get(int(p), p)
    if p not in PRECISIONS:
        raise unknown(value, "halo", extra=" (or 32, 16, 8, 4, 2, 1 bits)")
    return str(p)


class RowFormat:
    """How rows of ``features`` values travel: a fixed number of bytes per row, laid out by a codec.

    q-bit rows use :class:`~sylvie_comm.codecs.QBitCodec` (per-row scale and
    minimum, then the packed values), ``bf16``/``fp16`` the cast codecs, ``fp32``
    the identity codec; :meth:`Codec.to_rows <sylvie_comm.codecs.base.Codec.to_rows>`
    gives each encoded row its own bytes, so rows can be picked per peer.
    """

    def __init__(self, precision: str, features: int, meta_dtype: str = "fp32", seed: int = 0) -> None:
        self.precision = precision
        self.features = features
        name, options = HALO_FORMS[precision]
        if name == "qbit":
            options = {**options, "seed": seed, "meta_dtype": meta_dtype}
        self.codec: Codec = get_codec(name, **options)
        self.row_bytes = self.codec.row_bytes(features)

    @property
    def stateful(self) -> bool:
        """Whether the codec has state to checkpoint (the noise offset of q-bit rows)."""
        return isinstance(self.codec, QBitCodec)

    def encode(self, x: torch.Tensor, feedback: ErrorFeedback | None = None, name: str = "") -> torch.Tensor:
        """fp32 rows -> uint8 rows of ``row_bytes``.

        With ``feedback`` (q-bit only) the rows are encoded with range-bounded error feedback under ``name``:
        the compensated rows are clamped into each row's own [min, max] before quantizing, so the quantizer
        range never grows with the residual. Plain error feedback diverges with 1-bit stochastic rounding (its
        error can reach the whole range, which then widens the next range); bounded, it behaves like a
        first-order sigma-delta modulator and the residual stays within a few quantization steps.
        """
        if feedback is not None and self.stateful:
            return self.codec.to_rows(feedback.encode(self.codec, name, x, bound_rows=True))
        return self.codec.to_rows(self.codec.encode(x))

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """uint8 rows -> fp32 rows."""
        return self.codec.decode(self.codec.from_rows(wire, self.features))


def as_device(value: Any, what: str = "halo") -> torch.device:
    """``value`` (a :class:`torch.device` or a string such as ``"cpu"``, ``"cuda:1"``, ``"meta"``) as a device.

    ``"cuda"`` without an index means the current CUDA device (when CUDA is available), so that devices
    compare equal to the ``tensor.device`` of the tensors made there.
    """
    if not isinstance(value, (str, torch.device)):
        raise ValueError(f"{what}: device must be a torch.device or a string such as 'cpu' or 'cuda:0', got {value!r}")
    try:
        device = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(
            f"{what}: device must be a torch.device or a string such as 'cpu' or 'cuda:0', got {value!r} ({exc})"
        ) from exc
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # CUDA-only
    return device


def uses_nccl(backend: str | None) -> bool:
    """Whether a process group's backend (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``) sends CUDA tensors
    over NCCL."""
    return backend is not None and any(b.rpartition(":")[2] == "nccl" for b in backend.split(","))


def cuda_aware(transport: Transport) -> bool:
    """Whether ``transport``'s futures for CUDA tensors are CUDA-aware: ``wait()`` makes the waiter's stream wait
    for the collective. So are NCCL's work futures, which the process-group transport chains; the in-process and
    Horovod transports complete plain futures once their copies are queued on the completing thread's stream."""
    return isinstance(transport, ProcessGroupTransport) and uses_nccl(str(dist.get_backend(transport.group)))


def check_partitions(part: Partition, transport: Any) -> None:
    """Fail on every rank unless the ranks hold matching partitions of one graph (a collective call).

    Rank ``r`` must send rank ``p`` exactly as many rows as ``p`` expects from
    ``r``; partitions from different runs (or a METIS labelling that differs
    between processes) would otherwise pair messages of different sizes.
    """
    mine = {"rank": part.rank, "num_parts": part.num_parts, "num_nodes": part.num_nodes,
            "send": part.send_counts, "halo": list(part.halo_counts)}  # fmt: skip
    everyone = transport.all_gather_object(mine)
    for r, info in enumerate(everyone):
        if info["rank"] != r or info["num_parts"] != len(everyone) or info["num_nodes"] != everyone[0]["num_nodes"]:
            raise ValueError(
                f"halo: rank {r} holds partition {info['rank']} of {info['num_parts']} of a {info['num_nodes']}-node "
                f"graph; expected partition {r} of {len(everyone)} of a {everyone[0]['num_nodes']}-node graph"
            )
    for r, a in enumerate(everyone):
        for p, b in enumerate(everyone):
            if a["send"][p] != b["halo"][r]:
                raise ValueError(
                    f"halo: partitions disagree: rank {r} would send {a['send'][p]} rows to rank {p}, which expects "
                    f"{b['halo'][r]}; make the partitions once (partition() then save_partitions()) and load them"
                )


def partition_signature(part: Partition) -> dict[str, Any]:
    """What identifies a partition in a checkpoint: its place, its sizes and checksums of its node ids."""

    def ids(t: torch.Tensor) -> str:
        data = t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
        return f"{t.numel()} ids, crc32 {zlib.crc32(data):08x}"

    return {"num_parts": part.num_parts, "num_nodes": part.num_nodes, "rank": part.rank, "inner": ids(part.inner),
            "halo": ids(part.halo), "send_counts": part.send_counts, "halo_counts": list(part.halo_counts)}  # fmt: skip


def check_state(what: str, state: Any, keys: set[str]) -> Mapping[str, Any]:
    """``state`` as a mapping with exactly ``keys``, or a ValueError naming what is missing or unexpected."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{what}: expected a state dict (a mapping), got {type(state).__name__}")
    missing, extra = sorted(keys - set(state)), sorted(set(state) - keys, key=str)
    if missing or extra:
        wrong = ([f"lacks {missing}"] if missing else []) + ([f"has unexpected {extra}"] if extra else [])
        raise ValueError(f"{what}: the state dict {' and '.join(wrong)}; expected the keys {sorted(keys)}")
    return state


def _differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Dotted fields where two nested settings differ, in the order of ``mine`` (its most telling first)."""
    out: list[tuple[str, Any, Any]] = []
    for key, here in mine.items():
        there = theirs.get(key)
        if isinstance(here, Mapping) and isinstance(there, Mapping):
            out += _differences(here, there, f"{prefix}{key}.")
        elif here != there:
            out.append((f"{prefix}{key}", here, there))
    return out + [(f"{prefix}{key}", None, theirs[key]) for key in theirs if key not in mine]


def check_settings(what: str, mine: Mapping[str, Any], theirs: Any) -> None:
    """Fail, naming the first differing field, unless a checkpoint's settings equal this run's."""
    if not isinstance(theirs, Mapping):
        raise ValueError(f"{what}: the checkpoint's 'settings' must be a mapping, got {type(theirs).__name__}")
    diff = _differences(mine, theirs)
    if diff:
        field, here, there = diff[0]
        raise ValueError(
            f"{what}: the checkpoint's '{field}' is {there!r} but this run's is {here!r}; resume with the "
            "configuration, world size and partition that wrote the checkpoint (each rank loads its own)"
        )


class HaloExchanger:
    """The two halo transfers of one partition, with per-direction precision and optional error feedback.

    Args:
        part: this rank's partition.
        transport: the ranks (a :class:`~sylvie_comm.collectives.Transport`: process group, Horovod or in-process).
        forward, backward: precision of features and of gradients (see :func:`parse_precision`).
        meta_dtype: ``fp32`` or ``bf16`` for the per-row scale and minimum of q-bit rows.
        error_feedback: keep the quantization error of each sent row and add it next time.
        seed: noise seed of the stochastic rounding (offset by rank, layer and direction).
        device: where the features (and so the index tensors, buffers and decoded rows) live; default
            the CPU. The partition itself stays on the host: its row counts are the all-to-all splits.
    """

    def __init__(
        self,
        part: Partition,
        transport: Transport,
        forward: str | int = "fp32",
        backward: str | int = "fp32",
        meta_dtype: str = "fp32",
        error_feedback: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.device = torch.device("cpu") if device is None else as_device(device)
        check_partitions(part, transport)
        self.part = part
        self.transport = transport
        self.forward_precision = parse_precision(forward)
        self.backward_precision = parse_precision(backward)
        if meta_dtype not in ("fp32", "bf16"):
            raise ValueError(f"halo: meta_dtype must be 'fp32' or 'bf16', got {meta_dtype!r}")
        self.meta_dtype = meta_dtype
        self.error_feedback = error_feedback
        self.seed = seed
        self.feedback = ErrorFeedback()
        self._formats: dict[tuple[str, int, str], RowFormat] = {}
        # Each boundary row is encoded once; every peer's rows are picked from that encoding. Computed on the
        # host from the partition (set-up), then placed on the features' device once.
        sends = [s.to("cpu") for s in part.send_idx]  # one (possibly empty) list per rank
        scatter_idx = torch.cat(sends)
        boundary = torch.unique(scatter_idx)
        pick = torch.cat([torch.searchsorted(boundary, s) for s in sends])
        self.scatter_idx = scatter_idx.to(self.device)  # where returned gradient rows land among the inner rows
        self.boundary = boundary.to(self.device)
        self.pick = pick.to(self.device)
        self.send_counts = part.send_counts
        self.halo_counts = list(part.halo_counts)
        self.bytes_sent = {"forward": 0, "backward": 0}

    def _format(self, direction: str, features: int, key: str) -> RowFormat:
        fkey = (direction, features, key)
        fmt = self._formats.get(fkey)
        if fmt is None:
            fmt = self._formats[fkey] = self._new_format(direction, features, key)
        return fmt

    def _new_format(self, direction: str, features: int, key: str) -> RowFormat:
        precision = self.forward_precision if direction == "forward" else self.backward_precision
        # Distinct noise streams per rank, direction and layer.
        seed = zlib.crc32(f"{self.seed}/{self.part.rank}/{direction}/{key}".encode())
        return RowFormat(precision, features, self.meta_dtype, seed)

    def _encode(self, fmt: RowFormat, rows: torch.Tensor, ef_key: str) -> torch.Tensor:
        return fmt.encode(rows, self.feedback if self.error_feedback else None, ef_key)

    def _check_device(self, what: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(
                f"halo: {what} are on {t.device} but this exchanger's index tensors are on {self.device}; "
                f"build the HaloExchanger with device={str(t.device)!r}"
            )

    def _receive(self, send: torch.Tensor, rows: int, row_bytes: int) -> torch.Tensor:
        """A receive buffer on the exchanger's device, made on the stream the job runs on."""
        if send.is_cuda:
            # CUDA-only: the job's stream reads ``send``, which the training stream allocated; without this the
            # caching allocator could hand its memory out again while the collective still reads it.
            send.record_stream(torch.cuda.current_stream(send.device))
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=self.device)

    def features_job(
        self, inner: torch.Tensor, key: str, feedback: bool = True, precision: str | None = None
    ) -> Callable[[], torch.Tensor]:
        """Encode boundary rows now; the returned job sends them and returns the decoded halo rows.

        ``feedback=False`` leaves the error-feedback residuals alone (evaluation
        passes); ``precision`` overrides the forward precision (one-off exchanges).
        """
        if inner.dim() != 2 or inner.shape[0] != self.part.n_inner:
            raise ValueError(
                f"halo: expected features of shape ({self.part.n_inner}, F) for this partition's inner nodes, "
                f"got {tuple(inner.shape)}"
            )
        self._check_device("features", inner)
        fmt = (
            self._format("forward", inner.shape[1], key)
            if precision is None
            else RowFormat(parse_precision(precision), inner.shape[1], self.meta_dtype, self.seed)
        )
        rows = inner[self.boundary].float()
        wire = self._encode(fmt, rows, f"forward/{key}") if feedback else fmt.encode(rows)
        send = wire[self.pick]
        self.bytes_sent["forward"] += (send.shape[0] - self.send_counts[self.part.rank]) * fmt.row_bytes

        def job() -> torch.Tensor:
            recv = self._receive(send, self.part.n_halo, fmt.row_bytes)
            self.transport.all_to_all_v(recv, send, self.halo_counts, self.send_counts).wait()
            return fmt.decode(recv)

        return job

    def gradients_job(self, grad_halo: torch.Tensor, key: str) -> Callable[[], torch.Tensor]:
        """Encode halo-row gradients now; the job returns the rows peers sent back for our boundary rows
        (``len(scatter_idx)`` rows, to be added at ``scatter_idx``)."""
        self._check_device("gradients", grad_halo)
        fmt = self._format("backward", grad_halo.shape[1], key)
        send = self._encode(fmt, grad_halo.float(), f"backward/{key}")
        self.bytes_sent["backward"] += send.shape[0] * fmt.row_bytes

        def job() -> torch.Tensor:
            recv = self._receive(send, sum(self.send_counts), fmt.row_bytes)
            self.transport.all_to_all_v(recv, send, self.send_counts, self.halo_counts).wait()
            return fmt.decode(recv)

        return job

    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this exchanger is only valid for."""
        return {"world_size": self.transport.world_size, "forward": self.forward_precision,
                "backward": self.backward_precision, "meta_dtype": self.meta_dtype,
                "error_feedback": self.error_feedback, "seed": self.seed,
                "partition": partition_signature(self.part)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals, the noise offset of every q-bit codec (by direction, layer key and
        width) and the byte counters. Local: no collectives."""
        codecs = [{"direction": d, "key": k, "features": f, "codec": fmt.codec.state_dict()}
                  for (d, f, k), fmt in self._formats.items() if fmt.stateful]  # fmt: skip
        return {"settings": self.settings(), "feedback": self.feedback.state_dict(), "codecs": codecs,
                "bytes_sent": dict(self.bytes_sent)}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a checkpoint of other settings or another partition raises
        ValueError naming the field, and nothing is changed then."""
        what = "halo: HaloExchanger.load_state_dict"
        state = check_state(what, state, {"settings", "feedback", "codecs", "bytes_sent"})
        check_settings(what, self.settings(), state["settings"])
        if not isinstance(state["codecs"], list):
            raise ValueError(f"{what}: 'codecs' must be a list, got {type(state['codecs']).__name__}")
        # Codecs are built aside and replace the live ones only once everything has loaded.
        formats: dict[tuple[str, int, str], RowFormat] = {}
        for i, rec in enumerate(state["codecs"]):
            rec = check_state(f"{what}: codecs[{i}]", rec, {"direction", "key", "features", "codec"})
            direction, key, features = rec["direction"], rec["key"], rec["features"]
            if direction not in ("forward", "backward") or not isinstance(key, str):
                raise ValueError(f"{what}: codecs[{i}] has direction {direction!r} and key {key!r}; expected "
                                 "'forward' or 'backward' and a string")  # fmt: skip
            if isinstance(features, bool) or not isinstance(features, int) or features < 0:
                raise ValueError(f"{what}: codecs[{i}] has features {features!r}; expected an integer >= 0")
            fmt = formats[(direction, features, key)] = self._new_format(direction, features, key)
            if not fmt.stateful:
                raise ValueError(f"{what}: codecs[{i}] holds q-bit state for {direction} halos, which this "
                                 f"exchanger sends as {fmt.precision}")  # fmt: skip
            fmt.codec.load_state_dict(rec["codec"])
        bytes_sent = state["bytes_sent"]
        if not isinstance(bytes_sent, Mapping) or set(bytes_sent) != {"forward", "backward"}:
            raise ValueError(f"{what}: 'bytes_sent' must map 'forward' and 'backward' to byte counts")
        self.feedback.load_state_dict(state["feedback"])  # validates before it replaces anything
        self._formats = formats
        self.bytes_sent = {k: int(v) for k, v in bytes_sent.items()}


# Queue names: "f<layer>" holds feature exchanges, "g<layer>" gradient exchanges.
_QUEUE_KINDS = {"f": "features", "g": "gradients"}


@dataclasses.dataclass
class _Pending:
    epoch: int
    future: torch.futures.Future[Any]
    sync: bool
    applied: bool = False


class HaloPipeline:
    """The Bounded Staleness Adaptor.

    ``staleness=0``: every exchange is synchronous. ``staleness=S >= 1``: each
    layer launches this epoch's exchange in the background and uses halo
    features from epoch ``t - S`` (or from the last synchronous epoch, if that
    is newer); halo gradients sent at an asynchronous epoch ``u`` are added at
    epoch ``u + S``, unless that epoch is synchronous and adds its own fresh
    ones instead (every backward adds at most one set). Epoch 0 and every ``sync_every``-th epoch are
    synchronous, so no epoch ever sees zeros or data older than S epochs. All
    exchanges run in submission order on one thread, the same order on every
    rank. ``stats()`` reports the staleness actually observed.

    On CUDA that thread's kernels (the collective, the decoding) run on a side stream of the pipeline's own
    (:attr:`stream`), so they overlap the layers' compute; see :meth:`_submit` for how the two are ordered.
    """

    def __init__(self, exchanger: HaloExchanger, staleness: int = 0, sync_every: int = 0) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"halo: staleness must be an integer >= 0, got {staleness!r}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 0:
            raise ValueError(f"halo: sync_every must be an integer >= 0 (0: never), got {sync_every!r}")
        self.exchanger = exchanger
        self.staleness = staleness
        self.sync_every = sync_every
        self.executor = SerialExecutor("sylvie-comm-halo")
        self.device = exchanger.device
        # CUDA-only: the communication thread's stream, where the transport's futures are CUDA-aware (NCCL).
        # Elsewhere (in-process, Horovod) a future completes once its copies are queued on the stream of the
        # thread that completed it, ordered with nothing else: the exchange then stays on the caller's stream
        # (the default stream, which all threads share unless they set another).
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda" and cuda_aware(exchanger.transport):
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.epoch = -1
        self.last_sync = 0
        self._queues: dict[str, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        self._observed: collections.Counter[int] = collections.Counter()
        self._evaluating = False
        # Seconds the caller waited for exchanges (exposed communication), and seconds the communication
        # thread spent in exchanges (exposed or hidden under compute); see timings().
        self._wait_s = 0.0
        self._exchange_s = 0.0
        self._time_lock = threading.Lock()

    def is_sync(self, epoch: int) -> bool:
        return self.staleness == 0 or epoch == 0 or (self.sync_every > 0 and epoch % self.sync_every == 0)

    def begin_epoch(self, epoch: int) -> None:
        if epoch <= self.epoch:
            raise ValueError(f"halo: epochs must increase, got {epoch} after {self.epoch}")
        self.epoch = epoch
        if self.is_sync(epoch):
            self.last_sync = epoch

    def _submit(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """Run an exchange job on the communication thread; on CUDA, ordered with the caller's stream by events.

        The job was made after its input rows were encoded on the caller's current stream: an event recorded
        there now marks them done, and the job's stream waits for it before the collective reads them. The
        job's future is CUDA-aware (:meth:`SerialExecutor.submit` with a stream): it records an event on the
        job's stream when the job returns its decoded rows, and ``wait()`` makes the consumer's current stream
        wait for that event (and records the rows' memory as used there), so no one reads them early.
        """
        timed = self._timed(job)
        if self.device.type != "cuda":
            return self.executor.submit(timed)
        # CUDA-only from here to the end of the method.
        producer = torch.cuda.current_stream(self.device)
        stream = self.stream if self.stream is not None else producer
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(producer)

        def run() -> torch.Tensor:
            stream.wait_event(ready)  # the exchange waits for the layer's input
            return timed()

        return self.executor.submit(run, stream)  # and the consumer, through the future, for its output

    def _launch(self, name: str, job: Callable[[], torch.Tensor]) -> _Pending:
        if self.epoch < 0:
            raise RuntimeError("halo: call begin_epoch(epoch) before the forward pass")
        pending = _Pending(self.epoch, self._submit(job), self.is_sync(self.epoch))
        self._queues[name].append(pending)
        return pending

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Exchanges inside run synchronously, outside the pipeline and without error feedback."""
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    def exchange_once(self, inner: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
        """One synchronous exchange outside the pipeline (e.g. the raw input features, once)."""
        job = self.exchanger.features_job(inner.detach(), "once", feedback=False, precision=precision)
        out: torch.Tensor = self._wait(self._submit(job))
        return out

    def features(self, layer: int, inner: torch.Tensor) -> torch.Tensor:
        """Halo rows for this layer: fresh in a synchronous epoch, else from epoch max(t - S, last sync)."""
        if self._evaluating:
            job = self.exchanger.features_job(inner.detach(), str(layer), feedback=False)
            fresh: torch.Tensor = self._wait(self._submit(job))
            return fresh
        name = f"f{layer}"
        mine = self._launch(name, self.exchanger.features_job(inner.detach(), str(layer)))
        if mine.sync:
            target = mine
        else:
            want = max(self.epoch - self.staleness, self.last_sync)
            queue = self._queues[name]
            while queue[0].epoch < want:
                self._wait(queue.popleft().future)
            target = queue[0]
        self._observed[self.epoch - target.epoch] += 1
        out: torch.Tensor = self._wait(target.future)
        self._trim(name, keep_from=max(self.epoch - self.staleness, self.last_sync))
        return out

    def gradients(self, layer: int, grad_halo: torch.Tensor) -> torch.Tensor | None:
        """Rows to add at ``exchanger.scatter_idx``: this epoch's if synchronous, else epoch t - S's (once)."""
        name = f"g{layer}"
        mine = self._launch(name, self.exchanger.gradients_job(grad_halo.detach(), str(layer)))
        if mine.sync:
            # Applied now and never again: keep it out of the queue (it would pin its rows forever).
            self._queues[name].pop()
            mine.applied = True
            return self._applied(mine)
        queue = self._queues[name]
        want = self.epoch - self.staleness
        while queue and queue[0].epoch < want:
            self._wait(queue.popleft().future)
        if queue and queue[0].epoch == want and not queue[0].applied:
            entry = queue.popleft()
            entry.applied = True
            return self._applied(entry)
        return None

    def _applied(self, entry: _Pending) -> torch.Tensor:
        self._observed[self.epoch - entry.epoch] += 1
        out: torch.Tensor = self._wait(entry.future)
        return out

    def _trim(self, name: str, keep_from: int) -> None:
        queue = self._queues[name]
        while len(queue) > 1 and queue[0].epoch < keep_from:
            self._wait(queue.popleft().future)

    def _timed(self, job: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return job()
            finally:
                with self._time_lock:
                    self._exchange_s += time.perf_counter() - t0

        return run

    def _wait(self, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return fut.wait()
        finally:
            self._wait_s += time.perf_counter() - t0

    def timings(self) -> dict[str, float]:
        """Cumulative seconds: ``wait_s`` the training thread waited for exchanges (communication it
        could not hide), ``exchange_s`` the communication thread spent exchanging (hidden or not)."""
        with self._time_lock:
            return {"wait_s": self._wait_s, "exchange_s": self._exchange_s}

    def drain(self) -> None:
        """Wait for every exchange in flight (call before tearing the process group down)."""
        for queue in self._queues.values():
            for entry in queue:
                entry.future.wait()
            queue.clear()

    def pending(self) -> int:
        """Exchanges held in the queues (at most about ``2 (S + 1)`` per layer)."""
        return sum(len(q) for q in self._queues.values())

    def state_dict(self) -> dict[str, Any]:
        """The epoch counters, the observed staleness, the exchanger's state and, by layer, every exchange
        still queued for later epochs (its epoch and decoded rows). Call it between epochs.

        Each queued exchange is waited for and captured by value, so the checkpoint does not depend on how far
        the communication thread has got. Local: the peers' threads complete their half of these
        exchanges on their own.
        """
        queued: dict[str, dict[int, list[dict[str, Any]]]] = {"features": {}, "gradients": {}}
        for name, queue in sorted(self._queues.items()):
            if queue:
                queued[_QUEUE_KINDS[name[0]]][int(name[1:])] = [
                    {"epoch": e.epoch, "sync": e.sync, "rows": e.future.wait().detach().clone()} for e in queue
                ]
        return {"staleness": self.staleness, "sync_every": self.sync_every, "epoch": self.epoch,
                "last_sync": self.last_sync, "observed": dict(self._observed), **queued,
                "exchanger": self.exchanger.state_dict()}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into a pipeline that has not run an epoch yet.

        A checkpoint with another staleness, ``sync_every``, precision, world size or partition raises
        ValueError naming the field; nothing is changed then.
        """
        what = "halo: HaloPipeline.load_state_dict"
        if self.epoch != -1 or self.pending():
            raise ValueError(f"{what}: load a checkpoint before the first epoch (this pipeline is at epoch "
                             f"{self.epoch}); build a fresh trainer to resume")  # fmt: skip
        keys = {"staleness", "sync_every", "epoch", "last_sync", "observed", "features", "gradients", "exchanger"}
        state = check_state(what, state, keys)
        for field in ("staleness", "sync_every"):
            if state[field] != getattr(self, field):
                raise ValueError(f"{what}: the checkpoint's '{field}' is {state[field]!r} but this run's is "
                                 f"{getattr(self, field)!r}; resume with the configuration that wrote it")  # fmt: skip
        epoch, last_sync = state["epoch"], state["last_sync"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, last_sync)):
            raise ValueError(f"{what}: 'epoch' and 'last_sync' must be integers, got {epoch!r} and {last_sync!r}")
        if not -1 <= last_sync <= max(epoch, 0):
            raise ValueError(f"{what}: 'last_sync' {last_sync} is not an epoch up to 'epoch' {epoch}")
        rows_expected = {"features": self.exchanger.part.n_halo, "gradients": int(self.exchanger.scatter_idx.numel())}
        queues: dict[str, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        for prefix, kind in _QUEUE_KINDS.items():
            if not isinstance(state[kind], Mapping) or not all(isinstance(v, list) for v in state[kind].values()):
                raise ValueError(f"{what}: '{kind}' must map layers to lists of exchanges")
            for layer, entries in state[kind].items():
                for e in entries:
                    e = check_state(f"{what}: {kind}[{layer}]", e, {"epoch", "sync", "rows"})
                    rows = e["rows"]
                    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != rows_expected[kind]:
                        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
                        raise ValueError(f"{what}: {kind}[{layer}] rows must be a ({rows_expected[kind]}, F) "
                                         f"tensor for this partition, got {got}")  # fmt: skip
                    if not isinstance(e["epoch"], int) or not 0 <= e["epoch"] <= epoch:
                        raise ValueError(f"{what}: {kind}[{layer}] holds epoch {e['epoch']!r}; expected 0..{epoch}")
                    done = self._completed(rows)
                    queues[f"{prefix}{int(layer)}"].append(_Pending(e["epoch"], done, bool(e["sync"])))
        observed = state["observed"]
        if not isinstance(observed, Mapping):
            raise ValueError(f"{what}: 'observed' must map staleness to counts, got {type(observed).__name__}")
        self.exchanger.load_state_dict(state["exchanger"])  # validates before it changes anything
        self.epoch, self.last_sync = epoch, last_sync
        self._queues = queues
        self._observed = collections.Counter({int(k): int(v) for k, v in observed.items()})

    def _completed(self, rows: torch.Tensor) -> torch.futures.Future[Any]:
        """A future already holding a copy of ``rows`` on the pipeline's device (a checkpoint's queued rows)."""
        # CUDA-only: a future holding CUDA tensors must be CUDA-aware, so its consumers' streams wait for the copy.
        devices: list[int | str | torch.device] | None = [self.device] if self.device.type == "cuda" else None
        done: torch.futures.Future[Any] = torch.futures.Future(devices=devices)
        done.set_result(rows.detach().to(self.device, copy=True))
        return done

    def stats(self) -> dict[str, Any]:
        total = sum(self._observed.values())
        return {
            "staleness_bound": self.staleness,
            "observed_staleness": dict(sorted(self._observed.items())),
            "max_observed_staleness": max(self._observed, default=0),
            "mean_observed_staleness": sum(k * v for k, v in self._observed.items()) / total if total else 0.0,
            "bytes_sent": dict(self.exchanger.bytes_sent),
        }

    def close(self) -> None:
        """Wait for the exchanges in flight, then stop the communication thread (also when one failed)."""
        try:
            self.drain()
        finally:
            self.executor.close()


class _HaloFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inner: torch.Tensor, pipeline: HaloPipeline, layer: int) -> torch.Tensor:
        halo = pipeline.features(layer, inner)
        ctx.pipeline, ctx.layer, ctx.n_inner = pipeline, layer, inner.shape[0]
        return torch.cat([inner, halo.to(inner.dtype)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        n = ctx.n_inner
        grad_inner = grad[:n].clone()
        returned = ctx.pipeline.gradients(ctx.layer, grad[n:])
        if returned is not None and returned.numel():
            grad_inner.index_add_(0, ctx.pipeline.exchanger.scatter_idx, returned.to(grad_inner.dtype))
        return grad_inner, None, None


def halo_exchange(inner: torch.Tensor, pipeline: HaloPipeline, layer: int) -> torch.Tensor:
    """``[inner; halo]`` for one layer, differentiable: gradients of halo rows flow back to their owners."""
    return _HaloFn.apply(inner, pipeline, layer)  # type: ignore[no-any-return,no-untyped-call]
