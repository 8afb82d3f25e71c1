"""What tests/integrations/test_accelerate_diloco.py runs on each of 2 CPU processes that ``accelerate launch`` starts.

``sylvie_comm.accelerate.diloco`` (the data loader prepared, the model and its optimizer not) at SGD momentum 0.9,
2-bit outer steps in two fragments: 2 epochs straight; 1 epoch and ``save_state`` (a fragment's average in flight
there); a new Accelerator that ``load_state``s and trains the 2nd epoch; our own loop (``DiLoCo`` over the batches
Accelerate hands each process: batch ``b`` of the sequential loader to process ``b % 2``); the refusals. Each rank
writes ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import sylvie_comm.accelerate
from sylvie_comm.demo.ddp_train import build_model, load_digits_split
from sylvie_comm.diloco import DiLoCo

EPOCHS, BATCH, HIDDEN = 2, 32, 32
KW: dict[str, Any] = {"sync_every": 6, "codec": "qsgd", "bits": 2, "fragments": 2, "delay": 2}


def weights(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def train(epochs: int, save: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    acc = Accelerator(cpu=True)
    (x, y), _ = load_digits_split(0, 1)
    net = build_model(HIDDEN, seed=0).to(acc.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = acc.prepare(DataLoader(TensorDataset(x, y), batch_size=BATCH, drop_last=True))
    run = sylvie_comm.accelerate.diloco(acc, net, opt, **KW)
    first = 0
    if resume is not None:
        acc.load_state(str(resume))
        first = 1
    for _ in range(first, epochs):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
    if save is not None:
        acc.save_state(str(save))
    out = {"weights": weights(net), "stats": run.stats(), "inner_steps": run.inner_step}
    run.close()
    return out


def own_loop(rank: int, world: int) -> dict[str, torch.Tensor]:
    (x, y), _ = load_digits_split(0, 1)
    net = build_model(HIDDEN, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with DiLoCo(net, opt, **KW):
        for _ in range(EPOCHS):
            for b in range(len(x) // BATCH):
                if b % world != rank:
                    continue
                opt.zero_grad()
                F.cross_entropy(net(x[b * BATCH : (b + 1) * BATCH]), y[b * BATCH : (b + 1) * BATCH]).backward()
                opt.step()
        return weights(net)


def refusals() -> dict[str, str]:
    out = {}
    acc = Accelerator(cpu=True)
    net = build_model(8, seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    prepared_model, prepared_opt = acc.prepare(build_model(8, seed=0), torch.optim.SGD(net.parameters(), lr=0.1))
    for name, args in {"model": (prepared_model, opt), "optimizer": (net, prepared_opt)}.items():
        try:
            sylvie_comm.accelerate.diloco(acc, *args, sync_every=4)
            out[name] = "accepted"
        except TypeError as exc:
            out[name] = str(exc)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    result: dict[str, Any] = {
        "straight": train(EPOCHS),
        "first": train(1, save=out / "ckpt"),
        "resumed": train(EPOCHS, resume=out / "ckpt"),
    }
    rank, world = dist.get_rank(), dist.get_world_size()
    result["own"] = own_loop(rank, world)
    result["refused"] = refusals()
    result["world"] = world
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
