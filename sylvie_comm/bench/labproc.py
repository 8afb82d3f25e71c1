"""The lab's processes: launchers, what a worker reports, and killing a process tree.

Helpers of :class:`~sylvie_comm.bench.lab.Lab` that need no namespace: the launchers it knows
(:data:`LAUNCHERS`), each worker's end (:class:`WorkerResult`), progress ticks and a clean exit
for the workers themselves (:class:`ProgressTicks`, :func:`leave_worker`), a worker's whole life
(:func:`serve_worker`), the driver's bar over those ticks (:class:`ProgressBar`), horovodrun's output split by rank,
and the process tree a launcher leaves (:func:`kill_tree`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

LAUNCHERS = ("plain", "torchrun", "horovodrun")
_HVD_LINE = re.compile(r"^\[(\d+)\]<(?:stdout|stderr)>:(.*)$")


class ProgressTicks:
    """A worker's ticks into the lab's progress file, one per finished step or epoch (only the worker
    given ``write`` writes; the others' ticks do nothing). Called with any arguments; ``close()`` once."""

    def __init__(self, path: str, write: bool) -> None:
        self._file = open(path, "a") if write else None  # noqa: SIM115 (closed by close())

    def __call__(self, *_: object) -> None:
        if self._file is not None:
            self._file.write(".")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ProgressBar:
    """The driver's side of :class:`ProgressTicks`: creates the progress file, and as a context manager gives
    a ``poll()`` (for :meth:`~sylvie_comm.bench.lab.Lab.run`) that moves a tqdm bar on stderr to the ticks
    written so far (at most ``total``); the bar goes when the block ends. ``enabled=False``: no bar."""

    def __init__(self, path: str | Path, total: int, desc: str, unit: str, *, enabled: bool = True) -> None:
        self.path = Path(path)
        self.path.touch()
        self.total = total
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)

    def poll(self) -> None:
        if self._bar is not None:
            done = min(self.total, self.path.stat().st_size)
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)

    def __enter__(self) -> Callable[[], None]:
        return self.poll

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def leave_worker(code: int = 0) -> NoReturn:
    """End a lab worker process now, without the interpreter's teardown (its results written, its groups closed).

    About one exit in 10-20 of a worker that trained with gloo aborted in ``Py_Finalize``
    ("terminate called without an active exception", SIGABRT): a gloo worker thread still alive
    there released a finished collective's work holding a Python tensor and needed the GIL that
    finalization no longer hands out. The launchers (torchrun's agent, the lab) report a worker
    that aborts as a failed run, after every figure was measured and written. Workers call this
    last, after ``destroy_process_group()`` and after flushing what they wrote.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_cli(module: str, doc: str | None, worker_main: Callable[[str], NoReturn],
               argv: Sequence[str] | None = None) -> NoReturn:  # fmt: skip
    """A lab benchmark's ``python -m MODULE --worker CONFIG`` entry point: run one worker (the lab starts it)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    parser.add_argument("--worker", metavar="CONFIG", required=True, help="run one worker (started by the lab)")
    worker_main(parser.parse_args(argv).worker)


def start_worker(config_path: str) -> tuple[dict[str, Any], int, int, ProgressTicks]:
    """A lab worker's start: its JSON configuration, one thread, the gloo group (with the configuration's
    ``collective_timeout``); ``(config, rank, world, progress)``, the ticks shown by rank 0."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["collective_timeout"]))
    rank = dist.get_rank()
    return cfg, rank, dist.get_world_size(), ProgressTicks(cfg["progress"], rank == 0)


def serve_worker(config_path: str, work: Callable[[dict[str, Any], int, int, ProgressTicks], Any]) -> NoReturn:
    """A lab worker from start to end: :func:`start_worker`, ``work(config, rank, world, progress)``, rank 0 writes
    what it returned to the configuration's ``result`` (JSON) and every rank waits for that write; the ticks and the
    process group are closed whatever happens, then :func:`leave_worker`."""
    import json

    import torch.distributed as dist

    cfg, rank, world, progress = start_worker(config_path)
    try:
        result = work(cfg, rank, world, progress)
        if rank == 0:
            Path(cfg["result"]).write_text(json.dumps(result))
        dist.barrier()  # the record is written: every rank may go (torchrun ends the others with the first to exit)
    finally:
        progress.close()
        dist.destroy_process_group()
    leave_worker(0)  # written and closed: skip the interpreter's teardown (see leave_worker)


def gather_ranks(mine: Any) -> list[Any]:
    """Every rank's ``mine`` (picklable), in rank order, on every rank of the default group."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


@dataclass
class WorkerResult:
    """How one worker ended: its rank, exit status and whole output (stdout and stderr together)."""

    rank: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def check_launcher(launcher: str) -> str:
    """``launcher`` if it names one of :data:`LAUNCHERS`; ValueError listing them otherwise."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    return launcher


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc; launchers start their workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def kill_tree(root: int) -> None:
    """SIGKILL ``root``'s process group and every process below it, with their groups."""
    for pid in process_tree(root):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a group leader's group (torchrun's and horovodrun's workers lead theirs)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def split_horovod_output(text: str, workers: int) -> list[str]:
    """horovodrun's output (lines ``[rank]<stdout>:...``) as each rank's own lines."""
    out: list[list[str]] = [[] for _ in range(workers)]
    for line in text.splitlines():
        m = _HVD_LINE.match(line)
        if m and int(m.group(1)) < workers:
            out[int(m.group(1))].append(m.group(2))
    return ["\n".join(lines) + ("\n" if lines else "") for lines in out]


def horovodrun_executable() -> str | None:
    """The ``horovodrun`` beside this Python (a virtual environment's), else the one on PATH; None without Horovod."""
    beside = Path(sys.executable).parent / "horovodrun"
    if beside.exists():
        return str(beside)
    return shutil.which("horovodrun")
