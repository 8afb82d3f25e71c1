"""What tests/integrations/test_lightning_diloco.py runs: ``DiLoCoStrategy`` in a real ``Trainer(accelerator="cpu",
devices=2)`` started by Lightning's own launcher (``python lightning_diloco_worker.py OUT``), against our own loop.

Each rank writes ``OUT/rank{r}.pt``: the weights after 3 epochs straight; after 2 epochs (a ``ModelCheckpoint``
file written at the end of epoch 2, a fragment's average in flight there) and a new Trainer resuming from it to 3;
after our own loop (the plain module, ``sylvie_comm.diloco.DiLoCo`` over the default group, the same data order);
the statistics; the strategy's refusals. The model, data and loader are ``lightning_worker.py``'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
import lightning_worker as lw

import sylvie_comm.lightning as sl
from sylvie_comm.diloco import DiLoCo

EPOCHS, FIRST = 3, 2  # 4 steps an epoch: 12 steps; the first run stops at step 8, mid-cycle
SCHEDULE: dict[str, Any] = {"fragments": 2, "delay": 1}  # a fragment every 3 steps, started 1 step before
SYNC_EVERY, CODEC, OPTIONS = 6, "qsgd", {"bits": 2}


def strategy() -> sl.DiLoCoStrategy:
    return sl.DiLoCoStrategy(SYNC_EVERY, CODEC, options=OPTIONS, **SCHEDULE)


def own_loop(rank: int) -> dict[str, torch.Tensor]:
    net = lw.Net()
    opt = lw.optimizer(net)
    sampler = DistributedSampler(lw.data(), num_replicas=2, rank=rank, shuffle=True, seed=0)  # as Lightning's
    with DiLoCo(net, opt, sync_every=SYNC_EVERY, codec=CODEC, **OPTIONS, **SCHEDULE):
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in DataLoader(lw.data(), batch_size=lw.BATCH, sampler=sampler):
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
        return lw.weights(net)


def run(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s, net = strategy(), lw.Net()
    lw.trainer(s, EPOCHS, root / "straight").fit(net, lw.loader())
    out["straight"], out["stats"] = lw.weights(net), s.compression_state.stats()

    s, net = strategy(), lw.Net()
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), filename="first-{epoch}", save_top_k=1)
    lw.trainer(s, FIRST, root / "first", callbacks=[ckpt]).fit(net, lw.loader())
    out["first"] = lw.weights(net)
    s, net = strategy(), lw.Net()
    lw.trainer(s, EPOCHS, root / "resumed").fit(net, lw.loader(), ckpt_path=ckpt.best_model_path)
    out["resumed"] = lw.weights(net)
    out["own"] = own_loop(dist.get_rank())
    refused = {}
    for kw in (
        {"sync_every": 6, "fragments": 4},
        {"sync_every": 6, "bucket_cap_mb": 1},
        {"sync_every": 6, "codec": "x"},
    ):
        try:
            sl.DiLoCoStrategy(**kw)
            refused[str(kw)] = "accepted"
        except (ValueError, TypeError) as exc:
            refused[str(kw)] = str(exc)
    out["refused"] = refused
    return out


def main() -> None:
    root = Path(sys.argv[1])
    result = run(root)
    rank = dist.get_rank()
    result["world"] = dist.get_world_size()
    torch.save(result, root / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
