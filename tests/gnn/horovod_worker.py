"""One horovodrun worker for the GNN tests: ``python -m tests.gnn.horovod_worker OUT RUNS_JSON``.

``RUNS_JSON`` is a list of ``[config, epochs]``; each runs :func:`tests.gnn.workloads.run` with Horovod for
every collective (the trainer given Horovod's transport, as the demo gives it), and rank ``r`` saves the list of
results to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(out: str, runs_json: str) -> None:
    import horovod.torch as hvd

    from sylvie_comm.gnn.train import horovod_transport
    from tests.gnn import workloads as gw

    torch.set_num_threads(1)
    hvd.init()
    try:
        runs = json.loads(runs_json)
        results = [gw.run(hvd.rank(), hvd.size(), config, epochs, transport=horovod_transport())
                   for config, epochs in runs]  # fmt: skip
        torch.save(results, os.path.join(out, f"rank{hvd.rank()}.pt"))
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
