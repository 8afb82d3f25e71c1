"""DiLoCo over Horovod's transport, run on every rank under ``horovodrun``.

    horovodrun -np 2 --gloo python -m tests.optim.horovod_diloco_worker OUT_DIR

Each rank writes its result (or its traceback) to ``OUT_DIR/rank<r>.pt``; ``tests/optim/test_horovod.py`` compares
it with the same run in one process (``tests.optim.test_diloco.train`` on the in-process transport).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

KWARGS: dict[str, Any] = {"sync_every": 8, "fragments": 2, "delay": 1, "codec": "qsgd", "bits": 2}
STEPS = 24


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: horovod_diloco_worker OUT_DIR", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import horovod.torch as hvd

    from sylvie_comm.collectives.horovod import HorovodTransport
    from tests.optim.test_diloco import train

    hvd.init()
    rank = hvd.rank()
    try:
        result: Any = {"ok": train(HorovodTransport(), STEPS, **KWARGS)}
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(argv[0], f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
