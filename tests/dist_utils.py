"""Run a function on several processes joined by a gloo process group, with a timeout.

The workers start from a fork server that has imported torch and sylvie_comm once (``forkserver``): a spawned
worker imports them again, about two seconds a process on a small machine, and the suite starts hundreds of
workers. Each worker still gets the caller's environment and working directory as they are at the call, and
unpickles its function as a spawned one would. ``start="spawn"`` gives a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import io
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the fork server imports before it forks any worker: nothing here starts a thread at import.
PRELOAD = ("torch", "torch.distributed", "numpy", "sylvie_comm", "tests.dist_utils")
STARTS = ("forkserver", "spawn")


def _context(start: str) -> Any:
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts, once per test session
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    queue: Any,
    args: tuple[Any, ...],
    backend: str,
    env: dict[str, str],
) -> None:
    # The fork server's environment is the one of its start; the worker takes the caller's of now.
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Serialized to bytes: tensors sent through the queue would share memory with a process that exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # A forked worker leaves through os._exit, which skips the atexit handlers a spawned one runs at
        # its exit (sylvie_comm's among them): run them here, as that exit would, in both cases.
        atexit._run_exitfuncs()


def _start(
    fn: Callable[..., Any], world: int, args: tuple[Any, ...], backend: str = "gloo", start: str = "forkserver"
) -> tuple[Any, list[Any]]:
    """Start ``world`` workers joined on a free port; return the queue they report on and the processes."""
    ctx = _context(start)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, queue, args, backend, env), daemon=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    return queue, procs


def _raise_errors(errors: dict[int, str]) -> None:
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))


def run_distributed(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    start: str = "forkserver",
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes joined by ``backend``; returns the results by rank.

    A worker that raises fails the caller with its traceback; workers that do not
    finish within ``timeout`` seconds are killed and the caller fails (no hang).
    """
    queue, procs = _start(fn, world, args, backend, start)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead and all(r not in errors for r in dead):
                    raise AssertionError(f"rank(s) {dead} died without reporting (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})") from None  # fmt: skip
                if time.monotonic() > deadline:
                    done = sorted(results) + sorted(errors)
                    raise AssertionError(f"distributed run timed out after {timeout}s (ranks done: {done})") from None
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    _raise_errors(errors)
    return [results[r] for r in range(world)]


def run_distributed_losing(
    fn: Callable[..., Any], world: int, *args: Any, lost: tuple[int, ...] = (1,), timeout: float = 120.0
) -> dict[int, Any]:
    """Like :func:`run_distributed`, but the ranks in ``lost`` are expected to die or hang (``fn`` makes them).

    Returns the results of the surviving ranks, by rank. Fails if a survivor raises, dies without
    reporting or does not report within ``timeout`` seconds, or if a lost rank reports anything.
    Lost ranks still running once the survivors have reported are killed.
    """
    if not lost or any(not 0 <= r < world for r in lost) or len(set(lost)) == world:
        raise ValueError(f"lost must name some but not all of the ranks 0..{world - 1}, got {lost}")
    queue, procs = _start(fn, world, args)
    survivors = [r for r in range(world) if r not in lost]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < len(survivors):
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                silent = [r for r in survivors if r not in results and r not in errors]
                dead = [r for r in silent if procs[r].exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"surviving rank(s) {dead} died without reporting (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})") from None  # fmt: skip
                if time.monotonic() > deadline:
                    raise AssertionError(f"surviving rank(s) {silent} did not report within {timeout}s") from None
                continue
            if rank in lost:
                what = payload if status == "error" else "a result"
                raise AssertionError(f"rank {rank} was to be lost but reported {status}:\n{what}")
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for r in lost:
            if procs[r].is_alive():
                procs[r].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    _raise_errors(errors)
    return results
