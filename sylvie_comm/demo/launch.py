"""Start the demo's workloads: torchrun (or horovodrun) on the launching side, the ranks on the worker side.

Nothing here imports torch at module level: the launching process only starts
``torch.distributed.run`` and reads the JSON that rank 0 wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(module: str, nproc: int, args: Sequence[str], timeout: float | None = None) -> dict[str, Any]:
    """Run ``python -m module *args`` on ``nproc`` processes under torchrun; return rank 0's JSON results.

    The module must accept ``--no-progress`` and ``--json-out PATH``. Each
    process runs one intra-op thread (the processes share the machine's cores).
    A failure raises RuntimeError with the end of the processes' output.
    """
    with tempfile.TemporaryDirectory(prefix="sylvie-comm-") as tmp:
        out = Path(tmp) / "result.json"
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        cmd = [*launcher, f"--master_port={free_port()}", "-m", module, *args, "--no-progress", "--json-out", str(out)]
        return _launch(cmd, out, timeout)


def under_horovodrun() -> bool:
    """Whether ``horovodrun`` started this process (its rank variables are set, torchrun's are not)."""
    return "HOROVOD_RANK" in os.environ and "RANK" not in os.environ


def horovodrun(module: str, nproc: int, args: Sequence[str], timeout: float | None = None) -> dict[str, Any]:
    """Run ``python -m module *args`` on ``nproc`` processes under ``horovodrun`` (gloo); rank 0's JSON results.

    The same contract as :func:`torchrun`; the module sees Horovod's rank variables
    (:func:`under_horovodrun`) and uses Horovod for its collectives.
    """
    launcher = shutil.which("horovodrun")
    if launcher is None:
        raise RuntimeError("horovodrun is not installed (scripts/horovod.sh builds Horovod 0.28.1 with gloo)")
    with tempfile.TemporaryDirectory(prefix="sylvie-comm-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [launcher, "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo", sys.executable, "-m", module,
               *args, "--no-progress", "--json-out", str(out)]  # fmt: skip
        return _launch(cmd, out, timeout)


def _launch(cmd: list[str], out: Path, timeout: float | None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout} s") from exc
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{' '.join(cmd)} failed (exit status {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """The worker's ranks, released on exit: Horovod under ``horovodrun``, else the default gloo process group.

    Under torchrun it joins from the environment torchrun sets; under horovodrun
    it initializes Horovod (``hvd.init()``), and the trainer then uses Horovod for
    every collective; without either, it is a group of one process. A group (or
    Horovod) that is already initialized is used as it is and left alone.
    """
    if under_horovodrun():
        import horovod.torch as hvd

        if hvd.is_initialized():
            yield
            return
        hvd.init()
        try:
            yield
        finally:
            hvd.shutdown()
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the number of ranks, inside :func:`process_group`."""
    if under_horovodrun():
        import horovod.torch as hvd

        return int(hvd.rank()), int(hvd.size())
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def write_json(result: dict[str, Any], path: str | None) -> None:
    """Write ``result`` to ``path`` (no-op without a path)."""
    if path:
        Path(path).write_text(json.dumps(result))


def run_worker(
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], Any],
    train: Callable[[Any], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """A demo worker's ``main``: parse ``argv``, train in a process group (a new one unless one is
    initialized) with ``OMP_NUM_THREADS`` threads; rank 0 prints its report and writes the JSON."""
    import torch

    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with process_group():
        result = train(args)
        if rank_and_size()[0] == 0:
            print(report(result))
            write_json(result, args.json_out)
    return result


class WorkerMain(Protocol):
    """A demo worker module's ``main``."""

    def __call__(self, argv: list[str] | None = None) -> dict[str, Any]: ...


def worker_entry(
    parse_args: Callable[[list[str] | None], Any],
    train: Callable[[Any], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> WorkerMain:
    """A demo worker module's ``main(argv=None)``: :func:`run_worker` with its parser, training and report."""

    def main(argv: list[str] | None = None) -> dict[str, Any]:
        """Parse ``argv`` and train (in a new process group unless one is initialized); rank 0 reports."""
        return run_worker(argv, parse_args, train, report)

    return main
