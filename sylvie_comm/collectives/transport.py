"""The transport seam: torch.distributed process groups behind one small interface.

Every collective the integrations issue goes through a transport; callers count
what they send with :func:`wire_bytes`. Multi-phase algorithms (PowerSGD's P then
Q, the one-bit all-to-all then all-gather) run on a :class:`SerialExecutor`: one
thread per transport that issues collectives in submission order, so every rank
issues the same collectives in the same order (launching the second phase from
future callbacks, as PyTorch's ``powerSGD_hook`` does, lets different ranks
interleave buckets differently and gloo aborts with a size mismatch).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

# all_gather_single replaces all_gather_into_tensor (deprecated) where torch has it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wire_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective on ``nbytes`` of input (bandwidth-optimal algorithms).

    all-reduce (ring: reduce-scatter + all-gather) sends ``2 (w - 1) / w`` of the
    buffer; all-gather sends its ``nbytes`` to ``w - 1`` peers; all-to-all sends
    all but its own ``1 / w`` share. One rank alone sends nothing.
    """
    w = world_size
    if w <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (w - 1) * nbytes // w
    if kind == "all_gather":
        return (w - 1) * nbytes
    if kind == "all_to_all":
        return (w - 1) * nbytes // w
    raise ValueError(f"unknown collective kind {kind!r}; expected all_reduce, all_gather or all_to_all")


class ProcessGroupTransport:
    """Asynchronous collectives among the ranks of a ``torch.distributed`` process group.

    With ``dedicated`` (the default) the transport talks on a new group of the
    same ranks, created here (a collective call: every rank must construct it).
    Its collectives then never interleave with anyone else's: DDP itself
    all-reduces on its group (the unused-parameter map with
    ``find_unused_parameters=True``), and a second thread issuing collectives on
    that group would pair them differently on different ranks and hang.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, dedicated: bool = True) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "sylvie_comm: torch.distributed is not initialized; call dist.init_process_group() first"
            )
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if dedicated:
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self.group = dist.new_group(ranks=ranks)
        else:
            self.group = process_group

    def all_reduce(self, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Sum ``t`` in place across ranks; the future completes when it is done."""
        work = dist.all_reduce(t, group=self.group, async_op=True)
        assert work is not None
        return cast("torch.futures.Future[Any]", work.get_future())

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Gather every rank's ``t`` into ``out`` (``world_size * t.numel()`` elements, rank-major)."""
        work = _all_gather_single(out, t, group=self.group, async_op=True)
        assert work is not None
        return cast("torch.futures.Future[Any]", work.get_future())

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> torch.futures.Future[Any]:
        """Equal-split all-to-all: block ``j`` of ``t`` goes to rank ``j``; block ``i`` of ``out`` came from ``i``."""
        work = dist.all_to_all_single(out, t, group=self.group, async_op=True)
        assert work is not None
        return cast("torch.futures.Future[Any]", work.get_future())

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.futures.Future[Any]:
        """All-to-all with per-peer row counts: rows ``in_splits[j]`` of ``t`` go to rank ``j``."""
        work = dist.all_to_all_single(out, t, out_splits, in_splits, group=self.group, async_op=True)
        assert work is not None
        return cast("torch.futures.Future[Any]", work.get_future())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Blocking gather of a picklable object from every rank (set-up only)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


T = TypeVar("T")


def agree(
    transport: ProcessGroupTransport, build: Callable[[], T], describe: Callable[[T], dict[str, Any]], what: str
) -> T:
    """Build something on every rank and fail on every rank if any rank failed or they disagree.

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
            raise ValueError(f"{what}: rank {rank} could not set up: {theirs['error']}")
    reference = everyone[0]["config"]
    for rank, theirs in enumerate(everyone):
        diff = differences(reference, theirs["config"])
        if diff:
            field_, a, b = diff[0]
            raise ValueError(
                f"{what}: ranks disagree on the configuration: '{field_}' is {a!r} on rank 0 but {b!r} "
                f"on rank {rank}; every rank must use the same settings"
            )
    assert obj is not None
    return obj


class SerialExecutor:
    """One daemon thread that runs submitted jobs in submission order.

    A job is a callable run on the thread; its return value (or exception)
    completes the returned future. Jobs that issue collectives therefore issue
    them in one deterministic order on every rank.
    """

    def __init__(self, name: str = "sylvie-comm") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], torch.futures.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self._jobs.put((job, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            try:
                result = job()
            except BaseException as exc:  # delivered to whoever waits on the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
