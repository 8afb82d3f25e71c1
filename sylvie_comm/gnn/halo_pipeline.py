"""The bounded-staleness pipeline of the halo exchange, and the autograd function that calls it per layer.

:class:`HaloPipeline` (the bounded-staleness adaptor) runs the exchanges of a
:class:`~sylvie_comm.gnn.halo_exchanger.HaloExchanger` and decides which epoch's
data each layer uses: at staleness 0 on the calling thread (the layer waits for
every exchange, so a thread would have nothing to overlap), above it on one
communication thread. :func:`halo_exchange` returns ``[inner; halo]`` for one
layer, differentiable, so the gradients of halo rows flow back to their owners.

What one layer's rows cost (:meth:`HaloPipeline.complete`): the ``[inner; halo]``
rows live in the layer's buffer (:meth:`~sylvie_comm.gnn.halo_exchanger.HaloPlan.output`),
reused from call to call while nothing else holds it. The inner rows are written
there once, by what produces them: with ``relu=True`` (the activation between two
of our layers) the ReLU writes its output there, so no layer's rows are copied.
Otherwise they are copied in, once per call: a PyG conv's input, or the
dropped-out rows when dropout is on; an unchanged leaf (the model's input
features, when the first layer exchanges) stays in the buffer from one call to
the next and is not copied again. At staleness 0 the halo rows are decoded
straight into the buffer (fp32 rows are received there); above it they come from
an exchange made epochs before and are copied in. Backward: with ``relu=True``
the ReLU's backward writes the inner rows' gradient (a new tensor, as
``torch.relu``'s makes) and the returned halo gradients, masked the same way, are
added into it; otherwise the inner rows' gradient is a view of the incoming one,
or a copy of it when returned halo gradients are added.

``state_dict()``/``load_state_dict()`` hold the exchanges still queued for later
epochs (by value) with the exchanger's state, so a run restarted from a
checkpoint continues bit for bit. On CUDA the communication thread runs its
kernels on a side stream of its own, ordered by events (see
:meth:`HaloPipeline._submit`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from sylvie_comm.collectives import SerialExecutor
from sylvie_comm.gnn.halo_checks import check_state, cuda_aware
from sylvie_comm.gnn.halo_exchanger import HaloExchanger
from sylvie_comm.gnn.halo_rows import parse_precision

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
    synchronous, so no epoch ever sees zeros or data older than S epochs. At staleness 0 every exchange runs
    on the calling thread as the layer calls it (it waits for the result: there is nothing to overlap, and
    nothing is queued); above it, all exchanges run in submission order on one thread, the same order on
    every rank. The two give the same bits (the same jobs, encoded in the same order). ``stats()`` reports the
    staleness actually observed.

    On CUDA that thread's kernels (the collective, the decoding) run on a side stream of the pipeline's own
    (:attr:`stream`), so they overlap the layers' compute; see :meth:`_submit` for how the two are ordered.
    Exchanges run inline stay on the caller's stream.
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
        self._eval_precision: str | None = None  # the halo precision of evaluation passes (None: the forward one)
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
        self.exchanger.step = epoch  # the accounting's step
        if self.is_sync(epoch):
            self.last_sync = epoch

    def _run(self, job: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run an exchange now, on the calling thread and its current stream (staleness 0: the caller waits for
        it either way). Its seconds count as waited for and as exchanging, as they would on the thread."""
        t0 = time.perf_counter()
        try:
            return job()
        finally:
            seconds = time.perf_counter() - t0
            self._wait_s += seconds
            with self._time_lock:
                self._exchange_s += seconds

    def _now(self, job: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A synchronous exchange outside the queues: inline at staleness 0, else on the communication thread,
        after the exchanges queued there (every rank issues its collectives in one order)."""
        if self.staleness == 0:
            return self._run(job)
        out: torch.Tensor = self._wait(self._submit(job))
        return out

    def _started(self) -> None:
        if self.epoch < 0:
            raise RuntimeError("halo: call begin_epoch(epoch) before the forward pass")

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
        self._started()
        pending = _Pending(self.epoch, self._submit(job), self.is_sync(self.epoch))
        self._queues[name].append(pending)
        return pending

    @contextlib.contextmanager
    def evaluating(self, precision: str | None = None) -> Iterator[None]:
        """Exchanges inside run synchronously, outside the pipeline and without error feedback.

        ``precision``: the halo precision of these exchanges (e.g. ``fp32``: the model judged on exact halo
        rows, as a single-process evaluation of the full graph would); None: the forward precision of training.
        """
        if precision is not None:
            precision = parse_precision(precision)
        self._evaluating, self._eval_precision = True, precision
        try:
            yield
        finally:
            self._evaluating, self._eval_precision = False, None

    def exchange_once(self, inner: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
        """One synchronous exchange outside the pipeline (e.g. the raw input features, once)."""
        return self._now(self.exchanger.features_job(inner.detach(), "once", feedback=False, precision=precision))

    @staticmethod
    def _into(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``rows``, or ``out`` once they are copied there (cast to its dtype)."""
        if out is None or rows is out:
            return rows
        return out.copy_(rows)

    def features(self, layer: int, inner: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Halo rows for this layer: fresh in a synchronous epoch, else from epoch max(t - S, last sync).

        With ``out`` (``(n_halo, F)``) the rows are written there and ``out`` is returned: decoded there at
        staleness 0, copied there from the exchange they come from otherwise (it stays queued for later epochs).
        """
        if self._evaluating:
            inline_out = out if self.staleness == 0 else None
            job = self.exchanger.features_job(inner.detach(), str(layer), feedback=False, out=inline_out,
                                              precision=self._eval_precision)  # fmt: skip
            return self._into(self._now(job), out)
        if self.staleness == 0:  # every epoch synchronous: nothing is queued, the rows go where they are read
            self._started()
            rows = self._run(self.exchanger.features_job(inner.detach(), str(layer), out=out))
            self._observed[0] += 1
            return rows
        return self._queued_features(layer, inner, out)

    def _queued_features(self, layer: int, inner: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exchange launched on the communication thread and queued; the rows of epoch max(t - S, last sync)."""
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
        rows = self._wait(target.future)
        self._trim(name, keep_from=max(self.epoch - self.staleness, self.last_sync))
        return self._into(rows, out)

    def gradients(self, layer: int, grad_halo: torch.Tensor) -> torch.Tensor | None:
        """Rows to add at ``exchanger.scatter_idx``: this epoch's if synchronous, else epoch t - S's (once)."""
        if self.staleness == 0:  # applied now and never again: nothing is queued
            self._started()
            rows = self._run(self.exchanger.gradients_job(grad_halo.detach(), str(layer)))
            self._observed[0] += 1
            return rows
        return self._queued_gradients(layer, grad_halo)

    def _queued_gradients(self, layer: int, grad_halo: torch.Tensor) -> torch.Tensor | None:
        """The exchange launched on the communication thread and queued; epoch t - S's rows, once."""
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

    def complete(self, layer: int, inner: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """``[inner; halo]`` for one layer, in the layer's buffer (see the module docstring for what is copied).

        ``relu``: the rows are ``relu(inner)``, written by the ReLU itself. Not differentiable: see
        :func:`halo_exchange`. The result is an alias of the plan's buffer, which a later call reuses only once
        nothing holds it any more.
        """
        self.exchanger.check_features(inner)
        n = inner.shape[0]
        plan = self.exchanger.plan("forward", str(layer), inner.shape[1])
        full, held = plan.output(inner, self.exchanger.part.n_halo)
        head = full[:n]
        if relu:
            torch.clamp_min(inner, 0, out=head)  # what torch.relu computes, written in place of a new tensor
        elif not held:
            head.copy_(inner)
        self.features(layer, head, out=full[n:])
        plan.written(None if relu else inner)
        return full

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
            "halo_error": self.exchanger.errors(),
        }

    def close(self) -> None:
        """Wait for the exchanges in flight, then stop the communication thread (also when one failed)."""
        try:
            self.drain()
        finally:
            self.executor.close()


class _HaloFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inner: torch.Tensor, pipeline: HaloPipeline, layer: int, relu: bool) -> torch.Tensor:
        full = pipeline.complete(layer, inner, relu)
        ctx.pipeline, ctx.layer, ctx.n_inner, ctx.relu = pipeline, layer, inner.shape[0], relu
        if relu:
            ctx.save_for_backward(full)  # the ReLU's output, its backward's mask (as torch.relu saves its result)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        n = ctx.n_inner
        returned = ctx.pipeline.gradients(ctx.layer, grad[n:])
        add = returned is not None and returned.numel() > 0
        scatter_idx = ctx.pipeline.exchanger.scatter_idx
        if ctx.relu:
            # relu's backward of (grad + returned rows at scatter_idx), the mask applied to each term: the same
            # bits (a masked element is +0 either way, the others add the same terms in the same order).
            (full,) = ctx.saved_tensors
            result = full[:n]
            grad_inner = torch.ops.aten.threshold_backward(grad[:n], result, 0)
            if add:
                back = torch.ops.aten.threshold_backward(returned.to(grad.dtype), result[scatter_idx], 0)
                grad_inner.index_add_(0, scatter_idx, back)
        else:
            grad_inner = grad[:n]
            if add:
                grad_inner = grad_inner.clone()
                grad_inner.index_add_(0, scatter_idx, returned.to(grad_inner.dtype))
        return grad_inner, None, None, None


# Opaque to torch.compile: the exchange talks to other ranks through threads and queues, which Dynamo cannot
# trace; a compiled model breaks its graph here and runs the exchange (and its backward) eagerly.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def halo_exchange(inner: torch.Tensor, pipeline: HaloPipeline, layer: int, relu: bool = False) -> torch.Tensor:
    """``[inner; halo]`` for one layer, differentiable: gradients of halo rows flow back to their owners.

    ``relu=True`` returns ``[relu(inner); halo of relu(inner)]`` with the gradient of ``relu`` included: the
    activation between two layers, written by the ReLU straight into the layer's buffer (see
    :meth:`HaloPipeline.complete`); forward and backward give the bits ``halo_exchange(torch.relu(inner), ...)``
    gives.
    """
    return _HaloFn.apply(inner, pipeline, layer, relu)  # type: ignore[no-any-return,no-untyped-call]
