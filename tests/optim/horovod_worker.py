"""CompressedAdamW over Horovod, run on every rank under ``horovodrun``.

    horovodrun -np 2 --gloo python -m tests.optim.horovod_worker OUT_DIR

Each rank writes its result (or its traceback) to ``OUT_DIR/rank<r>.pt``; ``tests/optim/test_horovod.py``
launches it and compares with the same run in one process (:func:`train`, on the in-process transport).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

from tests.integrations import workloads as wl
from tests.optim import workloads as ow

CODEC = "onebit"
LR = 3e-3


def train(rank: int, make: Any, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The fixed-batch run of :mod:`tests.optim.workloads` with ``make(model)`` as the optimizer (on ``model``,
    by default ``wl.mlp()``: threads pass copies of one made beforehand, as the global generator is shared)."""
    model = model if model is not None else wl.mlp()
    opt = make(model)
    res = ow.train_fixed_batch(rank, model, opt, model)
    res.pop("before")
    res["phase"] = opt.phase
    opt.close()
    return res


def horovod_run(rank: int) -> dict[str, Any]:
    import sylvie_comm.horovod as sh

    return train(rank, lambda model: sh.compressed_adamw(model, lr=LR, codec=CODEC, warmup=ow.WARMUP))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: horovod_worker OUT_DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    try:
        result: Any = {"ok": horovod_run(rank)}
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(argv[0], f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
