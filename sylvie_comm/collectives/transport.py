"""The transport seam: torch.distributed process groups behind one small interface.

Every collective the algorithms issue goes through a :class:`Transport`: the
process-group transport here, the in-process one (:mod:`.local`) in tests; callers
count what they send with :func:`~sylvie_comm.collectives.accounting.wire_bytes`.
Multi-phase algorithms (PowerSGD's P then Q, the one-bit all-to-all then
all-gather) run on a :class:`SerialExecutor`: one
thread per algorithm that issues collectives in submission order, so every rank
issues the same collectives in the same order (launching the second phase from
future callbacks, as PyTorch's ``powerSGD_hook`` does, lets different ranks
interleave buckets differently and gloo aborts with a size mismatch).

A collective that fails (a peer died, or did not answer within the transport's
``timeout``) completes its future with a :class:`CollectiveError` naming the
collective, never with the half-written buffer.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import re
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

# all_gather_single and reduce_scatter_single replace the *_tensor forms (deprecated) where torch has them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Future = torch.futures.Future


@runtime_checkable
class Transport(Protocol):
    """What an algorithm needs from the ranks it talks to; every collective is asynchronous.

    A collective returns a future that completes once the output is written
    (``wait()`` and ``value()`` raise if the collective failed). Every rank must
    issue the same collectives in the same order, on tensors of the same size.
    """

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` in place across ranks."""
        ...

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` (``world_size * out.numel()`` elements, rank-major shards) across ranks; rank ``r``'s
        ``out`` gets shard ``r`` of the sum."""
        ...

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Gather every rank's ``t`` into ``out`` (``world_size * t.numel()`` elements, rank-major)."""
        ...

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Equal-split all-to-all along the first dimension."""
        ...

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Future[Any]:
        """All-to-all with per-peer row counts: rows ``in_splits[j]`` of ``t`` go to rank ``j``."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Blocking gather of a picklable object from every rank (set-up only)."""
        ...

    def fork(self) -> Transport:
        """A new transport over the same ranks whose collectives never pair with this one's.

        Two threads that issue collectives at the same time (a halo exchange
        pipelined under compute, and the gradient average) each need their own:
        on one transport their collectives would be ordered differently on
        different ranks. A collective call: every rank forks in the same order.
        """
        ...


# How long a collective on a transport's own group may wait for its peers. Long enough for a rank-0-only
# evaluation or checkpoint between two steps; short enough that a hung peer fails the job in minutes
# (torch's gloo default is 30 minutes).
DEFAULT_TIMEOUT_S = 600.0


def check_reduce_scatter(out: torch.Tensor, t: torch.Tensor, world_size: int) -> None:
    """A reduce-scatter's buffers, checked before anything is issued (every transport's): a ValueError names
    what does not fit."""
    if t.numel() != world_size * out.numel():
        raise ValueError(
            f"reduce_scatter: the input has {t.numel()} elements, expected world_size * out.numel() = "
            f"{world_size} * {out.numel()} = {world_size * out.numel()}"
        )
    if t.dtype != out.dtype or t.device != out.device:
        raise ValueError(
            f"reduce_scatter: input and output must share dtype and device, got {t.dtype} on {t.device} and "
            f"{out.dtype} on {out.device}"
        )
    if not (t.is_contiguous() and out.is_contiguous()):
        raise ValueError("reduce_scatter: input and output must be contiguous")


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer is gone (it died or closed its connection) or did not answer in time."""


# A CollectiveError's words inside the RuntimeError torch raises where a ``then()`` callback re-raised it.
_COLLECTIVE_ERROR = re.compile(r"(?<!\w)CollectiveError: (.*?)(?:\n\nAt:|$)", re.DOTALL)


def wait(fut: Any) -> Any:
    """``fut.wait()``, a failed collective raising its :class:`CollectiveError`: where a ``then()`` callback
    re-raised it (an algorithm's decode after its collective), torch hands a RuntimeError on with only the
    error's words (and the callback's traceback), which ``except CollectiveError`` would miss."""
    try:
        return fut.wait()
    except CollectiveError:
        raise
    except RuntimeError as exc:
        found = _COLLECTIVE_ERROR.search(str(exc))
        if found is None:
            raise
        raise CollectiveError(found.group(1).strip()) from exc


def _timeout_seconds(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"sylvie_comm: timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return float(seconds)


class ProcessGroupTransport:
    """Asynchronous collectives among the ranks of a ``torch.distributed`` process group.

    With ``dedicated`` (the default) the transport talks on a new group of the
    same ranks, created here (a collective call: every rank must construct it).
    Its collectives then never interleave with anyone else's: DDP itself
    all-reduces on its group (the unused-parameter map with
    ``find_unused_parameters=True``), and a second thread issuing collectives on
    that group would pair them differently on different ranks and hang.

    Every collective returns a future that completes with the collective's
    result or, if it failed, with a :class:`CollectiveError` (``wait()`` and
    ``value()`` raise it). :meth:`close` destroys the dedicated group;
    ``dist.destroy_process_group()`` and interpreter exit release it too.

    Args:
        process_group: the ranks to talk among (default: the default group).
        dedicated: talk on a new group of those ranks (default) or on ``process_group`` itself.
        timeout: seconds (or a ``timedelta``) a collective on the dedicated group may wait for its
            peers before it fails (default ``DEFAULT_TIMEOUT_S``, 600 s); a group that is not
            dedicated keeps its own timeout.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        dedicated: bool = True,
        timeout: float | timedelta | None = None,
    ) -> None:
        self.timeout = _timeout_seconds(timeout)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "sylvie_comm: torch.distributed is not initialized; call dist.init_process_group() first"
            )
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.dedicated = dedicated
        self._process_group = process_group
        self._closed = False
        self._failure: CollectiveError | None = None  # the first collective that failed
        self._futureless: set[str] = set()  # the collectives whose work has no future (gloo's reduce-scatter)
        group = process_group
        if dedicated:
            parent = process_group or dist.group.WORLD
            ranks = dist.get_process_group_ranks(parent)
            # The parent's backend (NCCL for CUDA tensors, gloo for CPU ones), whatever the default group's.
            backend = dist.get_backend(parent)
            group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=self.timeout), backend=backend)
        # Borrowed, never owned: torch.distributed's registry owns the group and drops it in
        # destroy_process_group(), on the calling thread. Future callbacks run on the group's own
        # worker threads and hold whoever issued the collective (a hook state, and through it this
        # transport); were the group owned here, its last reference could go on one of those threads,
        # and its destructor would join the thread it runs on ("Resource deadlock avoided", abort).
        self._group_ref = weakref.ref(group) if group is not None else None
        if dedicated and group is not None:
            _DEDICATED_GROUPS.add(group)
        # NCCL's futures are CUDA-aware (their consumers' streams wait for the collective); gloo's are not.
        self.backend = str(dist.get_backend(group))
        self._cuda_aware = "nccl" in self.backend

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the collectives run on (``None``: the default group)."""
        if self._closed:
            raise RuntimeError(f"sylvie_comm: the transport of rank {self.rank} is closed; it issues no collectives")
        if self._group_ref is None:
            return None
        group = self._group_ref()
        if group is None:
            raise RuntimeError(
                f"sylvie_comm: the process group of the transport of rank {self.rank} was destroyed "
                "(dist.destroy_process_group()); build a new hook or exchanger after init_process_group()"
            )
        return group

    def _error(self, what: str, exc: BaseException) -> CollectiveError:
        """The error a failed collective completes with: which collective, where, why, and the backend's words."""
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        if "timed out" in detail.lower() or "timeout" in detail.lower():
            reason = f"no answer within {self.timeout:g} s: a peer is gone or hanging"
        else:
            reason = "a peer is gone or failed"
        where = f"on rank {self.rank} (world {self.world_size})"
        return CollectiveError(f"sylvie_comm: {what} {where} failed: {reason} ({detail})")

    def _fail(self, error: CollectiveError) -> CollectiveError:
        if self._failure is None:
            self._failure = error
        return error

    def _issue(self, kind: str, t: torch.Tensor, start: Callable[[dist.ProcessGroup | None], Any]) -> Future[Any]:
        what = f"{kind} of {t.numel() * t.element_size()} bytes"
        group = self.group
        done: Future[Any] = torch.futures.Future()
        if self._failure is not None:
            # The group is broken: a new collective would only wait out the timeout again.
            where = f"on rank {self.rank} (world {self.world_size})"
            earlier = str(self._failure).removeprefix("sylvie_comm: ")
            done.set_exception(CollectiveError(f"sylvie_comm: {what} {where} not issued: an earlier {earlier}"))
            return done
        try:
            work = start(group)
        except dist.DistError as exc:  # e.g. the connection to a peer is already broken
            raise self._fail(self._error(what, exc)) from exc
        if t.is_cuda and self._cuda_aware:
            # NCCL's work future is CUDA-aware: a then() callback runs on a stream that waits for the
            # collective, and the future it returns makes its consumer's stream wait (as torch's own DDP hooks
            # return fut.then(...)). A fresh Future completed from here would record its events before the
            # collective ran.
            def checked(f: Future[Any]) -> Any:
                try:
                    return f.value()
                except Exception as exc:
                    raise self._fail(self._error(what, exc)) from exc

            chained: Future[Any] = work.get_future().then(checked)
            return chained
        if t.is_cuda:
            # CUDA tensors on gloo: its future completes while the copy back to the device is still queued on
            # gloo's stream, and only wait() orders the current stream after it. So wait here (the host blocks
            # for the collective: gloo with CUDA tensors is not a fast path), then hand on a CUDA-aware future
            # whose events follow that wait.
            try:
                work.wait()
                result = work.get_future().value() if kind != "reduce_scatter" else None  # gloo's has none
            except Exception as exc:
                raise self._fail(self._error(what, exc)) from exc
            ready: Future[Any] = torch.futures.Future(devices=[t.device])
            ready.set_result(result)
            return ready

        def complete(result_of: Callable[[], Any]) -> None:
            # Only a successful collective hands its buffers on.
            try:
                result = result_of()
            except Exception as exc:
                done.set_exception(self._fail(self._error(what, exc)))
            else:
                done.set_result(result)

        fut = None
        if kind not in self._futureless:
            try:
                fut = work.get_future()
            except RuntimeError:  # gloo's reduce-scatter has none (asked once: the refusal is an exception)
                self._futureless.add(kind)
        if fut is None:
            # Waited for here, on the caller's thread, as torch's synchronous collectives are: its one caller, the
            # sharded reduce-scatter, waits for it at once (FSDP's comm returns with its output written), and a
            # thread that waited for it instead cost every call two thread hops.
            complete(work.wait)
            return done
        fut.add_done_callback(lambda f: complete(f.value))  # on the group's worker thread
        return done

    def all_reduce(self, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` in place across ranks; the future completes when it is done."""
        return self._issue("all_reduce", t, lambda g: dist.all_reduce(t, group=g, async_op=True))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` across ranks; rank ``r``'s ``out`` gets shard ``r`` of it (``t`` holds ``world_size``
        shards of ``out.numel()`` elements, rank-major)."""
        check_reduce_scatter(out, t, self.world_size)

        def start(g: dist.ProcessGroup | None) -> Any:
            return _reduce_scatter_single(out, t, op=dist.ReduceOp.SUM, group=g, async_op=True)

        return self._issue("reduce_scatter", t, start)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Gather every rank's ``t`` into ``out`` (``world_size * t.numel()`` elements, rank-major)."""
        return self._issue("all_gather", t, lambda g: _all_gather_single(out, t, group=g, async_op=True))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Equal-split all-to-all: block ``j`` of ``t`` goes to rank ``j``; block ``i`` of ``out`` came from ``i``."""
        return self._issue("all_to_all", t, lambda g: dist.all_to_all_single(out, t, group=g, async_op=True))

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Future[Any]:
        """All-to-all with per-peer row counts: rows ``in_splits[j]`` of ``t`` go to rank ``j``."""

        def start(g: dist.ProcessGroup | None) -> Any:
            return dist.all_to_all_single(out, t, out_splits, in_splits, group=g, async_op=True)

        return self._issue("all_to_all_v", t, start)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Blocking gather of a picklable object from every rank (set-up only)."""
        out: list[Any] = [None] * self.world_size
        group = self.group
        try:
            dist.all_gather_object(out, obj, group=group)
        except RuntimeError as exc:
            raise self._fail(self._error("all_gather_object", exc)) from exc
        return out

    def fork(self) -> ProcessGroupTransport:
        """A transport on a new dedicated group of the same ranks (see :meth:`Transport.fork`)."""
        return ProcessGroupTransport(self._process_group, dedicated=True, timeout=self.timeout)

    def close(self) -> None:
        """Destroy the dedicated group, here and now (every rank closes its own; idempotent).

        Call it once no collective of this transport is in flight (after the last backward pass).
        """
        if self._closed:
            return
        self._closed = True
        group = self._group_ref() if self._group_ref is not None else None
        self._group_ref = None
        if self.dedicated and group is not None:
            _destroy(group)


def _destroy(group: dist.ProcessGroup) -> None:
    _DEDICATED_GROUPS.discard(group)
    if dist.is_initialized():
        # Already gone if dist.destroy_process_group() ran first (it destroys every group).
        with contextlib.suppress(ValueError):
            dist.destroy_process_group(group)


T = TypeVar("T")


class ObjectGather(Protocol):
    """What :func:`agree` needs of a transport: the object all-gather."""

    def all_gather_object(self, obj: Any) -> list[Any]: ...


def agree(
    transport: ObjectGather, build: Callable[[], T], describe: Callable[[T], dict[str, Any]], what: str,
    subject: str = "configuration",
) -> T:  # fmt: skip
    """Build something on every rank and fail on every rank if any rank failed or they disagree.

    ``subject`` names what the descriptions describe in the messages (``checkpoint`` when ranks load one).

    ``build`` runs locally; its ValueError/TypeError/ImportError is caught so
    that this rank still takes part in the exchange of descriptions (a rank that
    raised early would leave the others waiting in the next collective). Then
    every rank sees every rank's outcome: the failing rank re-raises its error,
    the others raise one naming that rank; configurations that differ raise on
    every rank, naming the first differing field.
    """
    from sylvie_comm.config import differences

    obj: T | None = None
    try:
        obj = build()
        info: dict[str, Any] = {"error": None, "config": describe(obj)}
        failure: BaseException | None = None
    except (ValueError, TypeError, ImportError) as exc:
        info, failure = {"error": f"{type(exc).__name__}: {exc}", "config": None}, exc
    everyone = transport.all_gather_object(info)
    for rank, theirs in enumerate(everyone):
        if theirs["error"] is not None:
            if failure is not None:
                raise failure
            action = "set up" if subject == "configuration" else f"take its {subject}"
            raise ValueError(f"{what}: rank {rank} could not {action}: {theirs['error']}")
    reference = everyone[0]["config"]
    for rank, theirs in enumerate(everyone):
        diff = differences(reference, theirs["config"])
        if diff:
            field_, a, b = diff[0]
            advice = "use the same settings" if subject == "configuration" else f"load a {subject} of the same step"
            raise ValueError(
                f"{what}: ranks disagree on the {subject}: '{field_}' is {a!r} on rank 0 but {b!r} "
                f"on rank {rank}; every rank must {advice}"
            )
    assert obj is not None
    return obj


class SerialExecutor:
    """One daemon thread that runs submitted jobs in submission order.

    A job is a callable run on the thread; its return value (or exception)
    completes the returned future (``wait()`` raises the job's exception).
    Jobs that issue collectives therefore issue them in one deterministic order
    on every rank. The thread stops on :meth:`close`, when the executor is
    garbage collected, and at interpreter exit.
    """

    def __init__(self, name: str = "sylvie-comm") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], Any] | None] = queue.SimpleQueue()
        # The thread holds the queue, not the executor, so dropping the executor stops the thread.
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()
        self._stop = weakref.finalize(self, self._jobs.put, None)
        _LIVE_EXECUTORS.add(self)

    def submit(self, job: Callable[[], Any], stream: Any = None) -> Future[Any]:
        """Run ``job`` on the thread. With a CUDA ``stream`` (the submitter's current one), the job runs with
        it current, so its kernels follow the work that produced its inputs, and the returned future is
        CUDA-aware: its consumer's stream waits for the job's kernels, not the host."""
        if not self._stop.alive:
            raise RuntimeError(f"sylvie_comm: the executor {self.name!r} is closed; it runs no more jobs")
        fut: Future[Any] = (
            torch.futures.Future(devices=[stream.device]) if stream is not None else torch.futures.Future()
        )
        self._jobs.put((job, fut, stream))
        return fut

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread once the jobs already submitted have run; wait up to ``timeout`` s (idempotent)."""
        self._stop()
        _LIVE_EXECUTORS.discard(self)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], Any] | None]) -> None:
    while (item := jobs.get()) is not None:
        _run(*item)
        # Not kept until the next job arrives: it would pin the job's closure (a hook state, its buffers).
        del item


def _run(job: Callable[[], Any], fut: Future[Any], stream: Any = None) -> None:
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        try:
            result = job()
        except Exception as exc:  # delivered to whoever waits on the future
            fut.set_exception(exc)
        except BaseException as exc:  # e.g. SystemExit: still complete the future, or its waiter hangs
            fut.set_exception(RuntimeError(f"sylvie_comm: a job of the executor raised {type(exc).__name__}: {exc}"))
            raise
        else:
            fut.set_result(result)  # on the job's stream: a CUDA-aware future records its events there


# What is still running at interpreter exit, whether or not its owner was closed or dropped.
_DEDICATED_GROUPS: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
_LIVE_EXECUTORS: weakref.WeakSet[SerialExecutor] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Stop the executors' threads, then destroy the dedicated groups still alive, on the main thread.

    Left to interpreter teardown, a group would be destroyed while its worker threads may still be
    finishing a future callback, which needs the interpreter that is being torn down.
    """
    for executor in list(_LIVE_EXECUTORS):
        executor.close()
    for group in list(_DEDICATED_GROUPS):
        _destroy(group)
