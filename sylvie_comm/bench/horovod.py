"""Horovod rows for the DDP benchmarks, on loopback and in the network lab.

Two uses:

* ``sylvie-comm bench ddp`` (no ``--link``): ``horovodrun -np 2 -H localhost:2 --gloo python -m
  sylvie_comm.bench.horovod OUT``. Same 17.9M-parameter MLP, batch and seed as
  :mod:`sylvie_comm.bench.ddp` (:func:`~sylvie_comm.bench.workloads.mlp_17m`,
  :func:`~sylvie_comm.bench.workloads.fixed_batch`); per step, the time of ``loss.backward()`` plus the optimizer's
  ``synchronize()`` (the wait for the averaged gradients, as DDP's backward includes the wait for
  its hook), the encode + decode seconds and the bytes of rank 0. Runs: Horovod's own
  ``DistributedOptimizer`` without compression (fp32) and with ``Compression.fp16`` and our
  ``Compression.acpsgd``, then ``sylvie_comm.horovod.DistributedOptimizer`` with each algorithm of
  the DDP benchmark. Rank 0 writes the JSON to ``OUT``. :func:`run` launches it.
* ``sylvie-comm bench ddp --link ...`` (:mod:`sylvie_comm.bench.link`): the rows of
  :data:`LAB_ROWS` on the lab's workers and link, started by ``horovodrun -H <addr0>:1,<addr1>:1,...
  --network-interface eth0`` from worker 0 (:meth:`~sylvie_comm.bench.lab.Lab.run` with
  ``launcher="horovodrun"``), running :func:`lab_worker_main` (``python -m sylvie_comm.bench.horovod
  --lab-worker CONFIG``). Same workload, batches, seeds and optimizer (SGD, momentum 0.9) as the DDP
  rows, and the same step (barrier, then ``zero_grad`` + forward + backward + ``optimizer.step()``,
  which waits for the averaged gradients) and figures (:mod:`sylvie_comm.bench.kit`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.algorithms.delegating import takes_rank
from sylvie_comm.bench.choices import unique_choices
from sylvie_comm.bench.kit import HOOK_WARMUP, LR, MOMENTUM, StepFigures, measure_steps, merge_rounds
from sylvie_comm.bench.workloads import WORKLOADS, fixed_batch, mlp_17m

RUNS = ("hvd fp32", "hvd fp16", "hvd+acpsgd", "ours none", "ours acpsgd", "ours powersgd", "ours onebit")

# The lab's Horovod rows (sylvie-comm bench ddp --link): name -> what it is, for the table.
LAB_ROWS: dict[str, str] = {
    "hvd-fp32": "Horovod DistributedOptimizer (fp32)",
    "hvd-fp16": "Horovod DistributedOptimizer, Compression.fp16",
    "hvd-acpsgd": "Horovod DistributedOptimizer, sylvie Compression.acpsgd",
    "hvd-sylvie-acpsgd": "sylvie_comm.horovod.DistributedOptimizer acpsgd",
    "hvd-sylvie-onebit": "sylvie_comm.horovod.DistributedOptimizer onebit",
    "hvd-sylvie-powersgd": "sylvie_comm.horovod.DistributedOptimizer powersgd",
}
DEFAULT_LAB_ROWS = ("hvd-fp32", "hvd-fp16", "hvd-acpsgd", "hvd-sylvie-acpsgd", "hvd-sylvie-onebit")
UNCOMPRESSED_LAB_ROWS = ("hvd-fp32", "hvd-fp16")  # no warm-up of plain gradients to leave unmeasured


def _ranked(codec: str) -> bool:
    """Whether ``codec`` is one of our algorithms that a ``rank`` option sets (Horovod's fp32 and fp16 are not)."""
    cls = ALGORITHMS.get(codec)
    return cls is not None and takes_rank(cls)


def _lab_codec(name: str) -> str:
    """The codec of a lab row: ``hvd-sylvie-X`` and ``hvd-X`` are X's (``hvd-acpsgd``: our compressor's)."""
    return name.removeprefix("hvd-sylvie-").removeprefix("hvd-")


def available() -> str | None:
    """Why the Horovod rows cannot run here (Horovod with its PyTorch part, and horovodrun), or None."""
    import importlib.util

    from sylvie_comm.bench.lab import horovodrun_executable

    try:
        if importlib.util.find_spec("horovod.torch") is None:
            return "Horovod is not installed (scripts/horovod.sh builds it with gloo)"
    except (ImportError, ValueError):
        return "Horovod is not installed (scripts/horovod.sh builds it with gloo)"
    if horovodrun_executable() is None:
        return "horovodrun not found"
    return None


def check_rows(rows: Sequence[str]) -> list[str]:
    """``rows`` without repeats; ValueError naming the bad one and listing :data:`LAB_ROWS` otherwise."""
    return unique_choices(rows, list(LAB_ROWS), "Horovod row", allow_empty=True)


def lab_label(name: str, rank: int) -> str:
    """What a lab row is, in words, for the table."""
    return LAB_ROWS[name] + (f" r{rank}" if _ranked(_lab_codec(name)) else "")


def _lab_row(name: str, cfg: dict[str, Any], progress: Callable[[], None]) -> dict[str, Any]:
    """One row on this rank: the figures :func:`sylvie_comm.bench.link._merge` expects from a DDP codec."""
    import horovod.torch as hvd

    import sylvie_comm.horovod as sh

    r = int(cfg["rank"])
    work = WORKLOADS[cfg["model"]]
    model = work.model(0)  # same weights as every DDP codec
    base = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    stats: Any = None
    opt: Any
    if name in ("hvd-fp32", "hvd-fp16", "hvd-acpsgd"):
        compression: Any = hvd.Compression.fp16 if name == "hvd-fp16" else hvd.Compression.none
        if name == "hvd-acpsgd":
            compression = stats = sh.Compression.acpsgd(model.named_parameters(), rank=r, warmup_steps=HOOK_WARMUP)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression)
    else:
        codec = _lab_codec(name)
        opts: dict[str, Any] = {"rank": r} if _ranked(codec) else {}
        opt = stats = sh.DistributedOptimizer(base, model.named_parameters(), codec, warmup_steps=HOOK_WARMUP,
                                              **opts)  # fmt: skip
    gen = torch.Generator().manual_seed(1000 + hvd.rank())  # the DDP rows' data
    try:
        return measure_steps(model, opt, work, gen, int(cfg["warmup"]), int(cfg["steps"]), hvd.barrier, stats,
                             progress)  # fmt: skip
    finally:
        if hasattr(opt, "close"):
            opt.close()


def lab_worker_main(config_path: str) -> int:
    """One Horovod worker of the lab: every row of ``cfg["horovod"]`` in turn; rank 0 writes the merged record."""
    import horovod.torch as hvd

    from sylvie_comm.bench.lab import ProgressTicks

    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    progress = ProgressTicks(cfg["progress"], rank == 0)

    try:
        rows: dict[str, list[list[Any]]] = {name: [] for name in cfg["horovod"]}
        for _ in range(int(cfg["rounds"])):
            for name in cfg["horovod"]:
                rows[name].append(hvd.allgather_object(_lab_row(name, cfg, progress), name=f"bench.{name}"))
        batch, r = WORKLOADS[cfg["model"]].batch_size, int(cfg["rank"])
        merged = {name: merge_rounds(rows[name], world, batch, lab_label(name, r)) for name in cfg["horovod"]}
        if rank == 0:
            Path(cfg["result"]).write_text(json.dumps(merged))
    finally:
        progress.close()
        hvd.shutdown()
    return 0


def _measure(label: str, rank_r: int, steps: int, warmup: int) -> dict[str, Any]:
    import horovod.torch as hvd

    import sylvie_comm.horovod as sh

    model = mlp_17m()
    base = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same gradients
    stats: Any = None
    if label.startswith("hvd"):
        compression: Any = {"hvd fp32": sh.Compression.none, "hvd fp16": sh.Compression.fp16}.get(label)
        if label == "hvd+acpsgd":
            compression = stats = sh.Compression.acpsgd(model.named_parameters(), rank=rank_r, warmup_steps=warmup)
        opt: Any = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression)
    else:
        codec = label.split()[1]
        opts: dict[str, Any] = {"rank": rank_r} if _ranked(codec) else {}
        opt = stats = sh.DistributedOptimizer(base, model.named_parameters(), codec, warmup_steps=warmup, **opts)
    x, y = fixed_batch(hvd.rank())
    figures = StepFigures()
    for step in range(warmup + steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{label}.{step}")  # start together
        t0 = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.synchronize()
        dt = time.perf_counter() - t0
        with opt.skip_synchronize() if label.startswith("hvd") else contextlib.nullcontext():
            opt.step()
        if step >= warmup:
            figures.add(dt, stats)
    if hasattr(opt, "close"):
        opt.close()
    return figures.medians()


def main(out: str, rank_r: int, steps: int, warmup: int) -> None:
    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    try:
        res = {label: _measure(label, rank_r, steps, warmup) for label in RUNS}
        if hvd.rank() == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        hvd.shutdown()


def run(rank: int = 4, steps: int = 5, warmup: int = 2, world: int = 2) -> dict[str, Any] | None:
    """Launch :func:`main` under horovodrun; its results, or None where Horovod is not installed."""
    from sylvie_comm.bench.lab import horovodrun_executable

    launcher = horovodrun_executable()  # the one beside this Python (a venv's, not on PATH), else PATH's
    if launcher is None:
        return None
    with tempfile.TemporaryDirectory(prefix="sylvie-comm-bench-") as tmp:
        out = Path(tmp) / "horovod.json"
        cmd = [launcher, "-np", str(world), "-H", f"localhost:{world}", "--gloo", sys.executable, "-m",
               "sylvie_comm.bench.horovod", str(out), str(rank), str(steps), str(warmup)]  # fmt: skip
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=1800)  # fmt: skip
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    return result


def format_rows(res: dict[str, Any]) -> list[str]:
    """Table rows in the DDP benchmark's columns (backward s, enc+dec s, MB sent)."""
    rows = []
    for label in RUNS:
        h = res[label]
        ed = "-" if h["encode_decode_s"] is None else f"{h['encode_decode_s']:.4f}"
        sent = "-" if h["bytes_sent"] is None else f"{h['bytes_sent'] / 1e6:.2f}"
        rows.append(f"{label:<16}{h['backward_s']:>11.4f}{ed:>11}{'':>11}{'':>9}{sent:>9}")
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--lab-worker"]:
        sys.exit(lab_worker_main(sys.argv[2]))
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
