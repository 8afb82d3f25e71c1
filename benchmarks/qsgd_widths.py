"""QSGD at 2, 4 and 8 bits next to plain DDP on the digits task: ``python benchmarks/qsgd_widths.py``.

The task and settings of the hooks' convergence test (``tests/integrations/test_ddp.py``): two gloo ranks,
scikit-learn's digits (1400 training / 397 test images), MLP 64-256-256-10, batch 64 per rank, 300 steps,
default options; mean test accuracy over seeds 0-2 under SGD momentum 0.9, plain SGD and Adam, and how many
times fewer bytes than an fp32 all-reduce each width sends. About 4 minutes on two cores.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl

SEEDS = (0, 1, 2)
WIDTHS = (2, 4, 8)


def worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in wl.OPTIMIZERS:
        out[f"{opt}/none"] = [wl.train_digits(rank, world, "none", {}, opt, seed=s) for s in SEEDS]
        for bits in WIDTHS:
            out[f"{opt}/q{bits}"] = [wl.train_digits(rank, world, "qsgd", {"bits": bits}, opt, seed=s) for s in SEEDS]
    return out


def main() -> None:
    res = run_distributed(worker, 2, timeout=1500)[0]
    cols = ["none"] + [f"q{b}" for b in WIDTHS]
    print(f"{'test accuracy %':16s}" + "".join(f"{c:>10s}" for c in ["none"] + [f"qsgd {b}" for b in WIDTHS]))
    for opt in wl.OPTIMIZERS:
        accs = [sum(r["accuracy"] for r in res[f"{opt}/{c}"]) / len(SEEDS) for c in cols]
        print(f"{opt:16s}" + "".join(f"{a:10.2f}" for a in accs))
    for label, key in (("x fewer bytes", None), ("  after warm-up", "last_step")):
        stats = [res[f"sgd_momentum/{c}"][0]["stats"] for c in cols[1:]]
        ratios = [(s[key] if key else s)["compression_ratio"] for s in stats]
        print(f"{label:16s}{'':10s}" + "".join(f"{r:9.1f}x" for r in ratios))


if __name__ == "__main__":
    main()
