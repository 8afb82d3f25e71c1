"""The DDP benchmark's model and measure under Horovod: ``horovodrun -np 2 python -m sylvie_comm.bench.horovod OUT``.

Same 17.9M-parameter MLP, batch and seed as :mod:`sylvie_comm.bench.ddp`; per step, the time of
``loss.backward()`` plus the optimizer's ``synchronize()`` (the wait for the averaged gradients,
as DDP's backward includes the wait for its hook), the encode + decode seconds and the bytes of
rank 0. Runs: Horovod's own ``DistributedOptimizer`` without compression (fp32) and with
``Compression.fp16`` and our ``Compression.acpsgd``, then ``sylvie_comm.horovod.DistributedOptimizer``
with each algorithm of the DDP benchmark. Rank 0 writes the JSON to ``OUT``.
:func:`run` launches it (``sylvie-comm bench ddp`` does, when Horovod is installed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sylvie_comm.bench.ddp import batch, mlp_17m

RUNS = ("hvd fp32", "hvd fp16", "hvd+acpsgd", "ours none", "ours acpsgd", "ours powersgd", "ours onebit")


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
        opts: dict[str, Any] = {"rank": rank_r} if codec in ("acpsgd", "powersgd") else {}
        opt = stats = sh.DistributedOptimizer(base, model.named_parameters(), codec, warmup_steps=warmup, **opts)
    x, y = batch(hvd.rank())
    times, enc_dec, sent = [], [], []
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
            times.append(dt)
            if stats is not None:
                last = stats.stats()["last_step"]
                enc_dec.append(last["encode_seconds"] + last["decode_seconds"])
                sent.append(last["bytes_sent"])
    if hasattr(opt, "close"):
        opt.close()
    return {
        "backward_s": statistics.median(times),
        "encode_decode_s": statistics.median(enc_dec) if enc_dec else None,
        "bytes_sent": statistics.median(sent) if sent else None,
    }


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
    launcher = shutil.which("horovodrun")
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
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
