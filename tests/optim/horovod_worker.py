"""CompressedAdamW (or CompressedSGD, or DiLoCo) over Horovod, run on every rank under ``horovodrun``.

    horovodrun -np 2 --gloo python -m tests.optim.horovod_worker OUT_DIR [adamw|sgd|diloco]

Each rank writes its result (or its traceback) to ``OUT_DIR/rank<r>.pt``; ``tests/optim/test_horovod.py`` launches
it and compares with the same run in one process (:func:`train`, on the in-process transport).
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
HYPER: dict[str, dict[str, Any]] = {"adamw": {"lr": 3e-3}, "sgd": {"lr": 0.2, "momentum": 0.9, "nesterov": True}}
# diloco: tests.optim.test_diloco's run on Horovod's transport, streaming, 2-bit outer steps with error feedback
DILOCO: dict[str, Any] = {"sync_every": 8, "fragments": 2, "delay": 1, "codec": "qsgd", "bits": 2}
DILOCO_STEPS = 24


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


def horovod_run(rank: int, optimizer: str = "adamw") -> dict[str, Any]:
    import sylvie_comm.horovod as sh

    if optimizer == "diloco":
        from sylvie_comm.collectives.horovod import HorovodTransport
        from tests.optim.test_diloco import train as train_diloco

        return train_diloco(HorovodTransport(), DILOCO_STEPS, **DILOCO)

    adapter = {"adamw": sh.compressed_adamw, "sgd": sh.compressed_sgd}[optimizer]
    return train(rank, lambda model: adapter(model, **HYPER[optimizer], codec=CODEC, warmup=ow.WARMUP))


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[1:] not in ([], ["adamw"], ["sgd"], ["diloco"]):
        print("usage: horovod_worker OUT_DIR [adamw|sgd|diloco]", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    try:
        result: Any = {"ok": horovod_run(rank, *argv[1:])}
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(argv[0], f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
