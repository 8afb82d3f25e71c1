"""The Transport protocol on Horovod (``horovod.torch``): asynchronous collectives as torch futures.

Horovod hands out integer handles and matches collectives across ranks by
name, not by order. A :class:`HorovodTransport` names the ``n``-th collective it
issues ``sylvie.<transport>.<n>``, so every rank that issues the same
collectives in the same order (what the algorithms guarantee for every
transport) gives each the same name; :meth:`HorovodTransport.restart_names`
starts the count again between steps, when nothing is in flight, so the names
repeat from step to step and Horovod's response cache can serve them.

One waiter thread per transport waits on the handles in issue order
(``hvd.synchronize``), copies results that Horovod returns in a new tensor
(all-gather, all-to-all) into the caller's output, and completes each future
(with a :class:`~sylvie_comm.collectives.CollectiveError` if Horovod failed).
Future callbacks (the algorithms' decoding) therefore run on that thread.

Horovod is imported here, lazily: ``import sylvie_comm`` never imports it.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from sylvie_comm._deps import require
from sylvie_comm.collectives.transport import CollectiveError, check_reduce_scatter

Future = torch.futures.Future

_COUNTER = itertools.count()  # tells transports apart in collective names (created in the same order on every rank)


def import_horovod() -> Any:
    """``horovod.torch``, or an ImportError naming the extra that installs it."""
    require("horovod")
    import horovod.torch as hvd

    return hvd


def supports(kind: str, dtype: torch.dtype) -> bool:
    """Whether this Horovod build has a PyTorch op ``kind`` (``allreduce``, ``allgather``...) for ``dtype``.

    Horovod looks its ops up by the tensor's type name (``horovod_torch_allreduce_async_torch_FloatTensor``);
    0.28.1 has none for bfloat16.
    """
    import horovod.torch.mpi_ops as ops

    type_name = torch.empty(0, dtype=dtype).type().replace(".", "_")
    return hasattr(ops.mpi_lib, f"horovod_torch_{kind}_async_{type_name}")


class HorovodTransport:
    """Asynchronous collectives among all Horovod ranks (``hvd.init()`` must have run).

    Every collective returns a future that completes once its output is written,
    or with a :class:`CollectiveError` naming the collective if Horovod failed.
    An all-reduce of a type Horovod 0.28's PyTorch ops cannot reduce (bfloat16,
    int8 and uint8, int16) travels as an all-gather, added up on arrival: the
    same bytes as a ring all-reduce on two ranks, ``w / 2`` times as many on ``w``.

    Args:
        prefix: the first part of every collective's name (default ``sylvie.<n>``, ``n`` counting the
            transports this process created: equal on every rank that creates them in the same order).
    """

    def __init__(self, prefix: str | None = None) -> None:
        hvd = import_horovod()
        if not hvd.is_initialized():
            raise RuntimeError("sylvie_comm: Horovod is not initialized; call hvd.init() first")
        self._hvd = hvd
        self.rank: int = hvd.rank()
        self.world_size: int = hvd.size()
        self.prefix = prefix if prefix is not None else f"sylvie.{next(_COUNTER)}"
        self._count = 0
        self._forks = 0
        self._lock = threading.Lock()  # issuing: names and queue order must agree
        self._closed = False
        self._failure: CollectiveError | None = None
        self._allreduce_dtypes = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64}
        self._allreduce_fallback: dict[torch.dtype, bool] = {}
        self._jobs: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_wait_in_order, args=(hvd, self._jobs), name=f"{self.prefix}-waiter", daemon=True
        )
        self._thread.start()
        self._stop = weakref.finalize(self, self._jobs.put, None)

    # ------------------------------------------------------------------ issuing

    def fork(self) -> HorovodTransport:
        """A transport whose collectives have names of their own (``<prefix>.fork<k>``): Horovod never pairs
        them with this one's, whichever thread issues them first (see :meth:`Transport.fork`)."""
        with self._lock:
            k = self._forks
            self._forks += 1
        return HorovodTransport(prefix=f"{self.prefix}.fork{k}")

    def restart_names(self) -> None:
        """Name the next collective as the first one again (call between steps, with nothing in flight)."""
        with self._lock:
            self._count = 0

    def _where(self) -> str:
        return f"on rank {self.rank} (world {self.world_size})"

    def _issue(
        self, kind: str, t: torch.Tensor, start: Callable[[str], Any], finish: Callable[[Any], None]
    ) -> Future[Any]:
        what = f"{kind} of {t.numel() * t.element_size()} bytes ({t.dtype})"
        done: Future[Any] = torch.futures.Future()
        if self._closed:
            raise RuntimeError(f"sylvie_comm: the Horovod transport of rank {self.rank} is closed; it issues no more")
        if self._failure is not None:
            earlier = str(self._failure).removeprefix("sylvie_comm: ")
            done.set_exception(CollectiveError(f"sylvie_comm: {what} {self._where()} not issued: an earlier {earlier}"))
            return done
        with self._lock:
            name = f"{self.prefix}.{self._count}"
            self._count += 1
            try:
                handle = start(name)
            except Exception as exc:  # a bad tensor type, or Horovod already shut down
                raise self._error(what, name, exc) from exc
            self._jobs.put(_Pending(self, handle, done, finish, what, name))
        return done

    def _error(self, what: str, name: str, exc: BaseException) -> CollectiveError:
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        error = CollectiveError(
            f"sylvie_comm: {what} '{name}' {self._where()} failed: a peer is gone or failed ({detail})"
        )
        if self._failure is None:
            self._failure = error
        return error

    # ------------------------------------------------------------------ the protocol

    def all_reduce(self, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` in place across ranks; the future completes when it is done."""
        hvd = self._hvd
        if t.dtype not in self._allreduce_dtypes:
            if t.dtype not in self._allreduce_fallback:
                self._allreduce_fallback[t.dtype] = supports("allreduce", t.dtype)
            if not self._allreduce_fallback[t.dtype]:
                return self._gather_and_add(t)
            self._allreduce_dtypes.add(t.dtype)
        return self._issue("all_reduce", t, lambda name: hvd.allreduce_async_(t, op=hvd.Sum, name=name), _ignore)

    def _gather_and_add(self, t: torch.Tensor) -> Future[Any]:
        """An all-reduce of a type Horovod cannot reduce (bfloat16, int8): gather, then add up here.

        Floats add up in fp32 and are rounded once; integers add up in their own type, as gloo's do.
        """
        hvd, w = self._hvd, self.world_size
        flat = t.reshape(-1)
        words = flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat
        if words.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                               torch.float32, torch.float64):  # fmt: skip
            raise TypeError(f"all_reduce: Horovod cannot carry tensors of type {t.dtype}")

        def add_up(gathered: Any) -> None:
            rows = gathered.view(t.dtype).view(w, -1)
            t.view(-1).copy_(rows.float().sum(0) if t.dtype.is_floating_point else rows.sum(0, dtype=t.dtype))

        return self._issue("all_reduce", t, lambda name: hvd.allgather_async(words, name=name), add_up)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Gather every rank's ``t`` into ``out`` (``world_size * t.numel()`` elements, rank-major)."""
        if out.numel() != self.world_size * t.numel():
            raise ValueError(
                f"all_gather: out has {out.numel()} elements, expected world_size * {t.numel()} = "
                f"{self.world_size * t.numel()}"
            )
        flat = t.reshape(-1)
        hvd = self._hvd
        return self._issue("all_gather", t, lambda name: hvd.allgather_async(flat, name=name), _into(out))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Sum ``t`` across ranks; rank ``r``'s ``out`` gets shard ``r`` (``hvd.reducescatter`` with ``op=Sum``
        on the flat input: Horovod splits its first dimension evenly when it divides by the world size)."""
        check_reduce_scatter(out, t, self.world_size)
        if not supports("reducescatter", t.dtype):
            raise TypeError(f"reduce_scatter: this Horovod build has no reduce-scatter of {t.dtype} tensors")
        hvd, flat = self._hvd, t.reshape(-1)
        return self._issue(
            "reduce_scatter", t, lambda name: hvd.reducescatter_async(flat, name=name, op=hvd.Sum), _into(out)
        )

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        """Equal-split all-to-all along the first dimension: block ``j`` of ``t`` goes to rank ``j``."""
        w = self.world_size
        if t.dim() == 0 or t.shape[0] % w:
            raise ValueError(f"all_to_all: the first dimension of t (shape {tuple(t.shape)}) must divide by {w}")
        if out.numel() != t.numel():
            raise ValueError(f"all_to_all: out has {out.numel()} elements, t has {t.numel()}; expected equal")
        hvd = self._hvd
        return self._issue("all_to_all", t, lambda name: hvd.alltoall_async(t, name=name), _into(out, first=True))

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Future[Any]:
        """All-to-all with per-peer row counts: rows ``in_splits[j]`` of ``t`` go to rank ``j``."""
        w = self.world_size
        for label, splits, rows in (("in_splits", in_splits, t.shape[0]), ("out_splits", out_splits, out.shape[0])):
            if len(splits) != w or any(s < 0 for s in splits) or sum(splits) != rows:
                raise ValueError(
                    f"all_to_all_v: {label} {list(splits)} must be {w} counts >= 0 adding up to {rows} rows"
                )
        send_splits = torch.tensor(in_splits, dtype=torch.int32)  # Horovod requires int32 splits
        hvd = self._hvd

        def start(name: str) -> Any:
            return hvd.alltoall_async(t, splits=send_splits, name=name)

        return self._issue("all_to_all_v", t, start, _into(out, first=True))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Blocking gather of a picklable object from every rank (set-up only)."""
        with self._lock:
            name = f"{self.prefix}.object.{self._count}"
            self._count += 1
        try:
            return list(self._hvd.allgather_object(obj, name=name))
        except Exception as exc:
            raise self._error("all_gather_object", name, exc) from exc

    def close(self) -> None:
        """Let the waiter thread finish the collectives in flight, then stop it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop()
        if self._thread is not threading.current_thread():
            self._thread.join(10.0)


@dataclasses.dataclass(slots=True)
class _Pending:
    """One collective in flight: its handle, the future to complete and how to finish its output."""

    transport: HorovodTransport
    handle: Any
    done: Future[Any]
    finish: Callable[[Any], None]
    what: str
    name: str


def _ignore(_: Any) -> None:
    return None


def _into(out: torch.Tensor, first: bool = False) -> Callable[[Any], None]:
    """Copy a result Horovod returned in a new tensor (an all-to-all's is ``(output, received_splits)``)."""

    def copy(result: Any) -> None:
        tensor = result[0] if first else result
        if tensor.numel() != out.numel():
            raise ValueError(f"received {tensor.numel()} elements where {out.numel()} were expected")
        out.view(-1).copy_(tensor.reshape(-1))

    return copy


def _wait_in_order(hvd: Any, jobs: queue.SimpleQueue[_Pending | None]) -> None:
    while (job := jobs.get()) is not None:
        try:
            result = hvd.synchronize(job.handle)
            job.finish(result)
        except Exception as exc:
            error = job.transport._error(job.what, job.name, exc)
            job.done.set_exception(error)
        else:
            job.done.set_result(None)
        del job  # not kept until the next one arrives: it pins the buffers and the callbacks' closures


__all__ = ["HorovodTransport", "import_horovod", "supports"]
