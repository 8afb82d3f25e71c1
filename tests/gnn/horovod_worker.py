"""One horovodrun worker for the GNN tests: ``python -m tests.gnn.horovod_worker OUT RUNS_JSON``.

``RUNS_JSON`` is a list of ``[config, epochs]``; each runs :func:`tests.gnn.workloads.run` with Horovod for
every collective (the trainer picks Horovod's transport by itself), and rank ``r`` saves the list of
results to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(out: str, runs_json: str) -> None:
    import horovod.torch as hvd

    from tests.gnn import workloads as gw

    torch.set_num_threads(1)
    hvd.init()
    try:
        results = [gw.run(hvd.rank(), hvd.size(), config, epochs) for config, epochs in json.loads(runs_json)]
        torch.save(results, os.path.join(out, f"rank{hvd.rank()}.pt"))
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
