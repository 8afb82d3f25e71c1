"""What tests/integrations/test_lightning.py runs: a script that Lightning's own launcher starts on 2 CPU processes.

``python lightning_worker.py OUT``: rank 0 runs the script, ``Trainer(accelerator="cpu", devices=2)`` starts rank 1
as a second copy of it (``_SubprocessScriptLauncher``), and every later ``Trainer`` of the script joins the same
two processes. Each rank writes ``OUT/rank{r}.pt`` with what it saw:

- ``ddp``: ``CompressedDDPStrategy("acpsgd")`` for 4 epochs straight; 2 epochs (a ``ModelCheckpoint`` file at the
  end of epoch 2, and ``trainer.save_checkpoint`` after ``fit``) then a new Trainer resuming from that file to 4;
  our own loop (DDP + ``sylvie_comm.ddp.register``) over the same data; the hook's state right after the resume
  against the one saved; the statistics of the straight and the resumed fit.
- ``fsdp``: the same with ``CompressedModelParallelStrategy("onebit")`` (FSDP2 ``fully_shard``) against our own
  FSDP2 loop (``sylvie_comm.fsdp.register``), resuming from a distributed checkpoint.
- ``ddp-adapt``: ``ddp``'s straight and resumed fits (no own loop) with the compression monitor adapting.
- ``skip``: how many times a plain ``DDPStrategy(ddp_comm_hook=...)`` hook ran on the CPU, and the error of
  ``CommHookCheck`` on such a trainer; the errors of the strategies' refused arguments.
- ``resize``: what the DDP strategy's resume says of that 2-rank checkpoint in a world of one.

The compression monitor runs in every fit, and a check of it falls after the checkpoint (step 8 of 16): ``ddp``'s
every 5 compressed steps (steps 7 and 12, the second's figures taken on steps 8-12), ``fsdp``'s at its defaults
(compressed step 10: step 12, its figures taken on steps 7-12, across the checkpoint); ``ddp-adapt``'s as ``ddp``'s
with patience 1 and a bound every lag exceeds, so the check at step 7, the last before the checkpoint, and the one at
step 12 change the ranks (2 -> 4, then raw), the first's decisions applied at the resumed fit's first step.

Deterministic: fixed seeds, no dropout; the data order is that of the DistributedSampler Lightning puts in the
training loader (it shuffles, seed 0, whatever the loader's ``shuffle``), which our own loop uses too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import sylvie_comm
import sylvie_comm.lightning as sl

EPOCHS, FIRST = 4, 2  # straight run; the interrupted run stops after FIRST and resumes to EPOCHS
BATCH = 8
DDP_OPTIONS = {"rank": 2, "warmup_steps": 2, "monitor": {"period": 5, "sample": 1}}
FSDP_OPTIONS = {"warmup_steps": 2}
ADAPT_OPTIONS = {**DDP_OPTIONS, "monitor": {"period": 5, "sample": 1, "adapt": True, "max_lag": 0.05, "patience": 1}}


def data() -> TensorDataset:
    """64 points of 16 features, 4 classes from a fixed linear teacher."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def loader() -> DataLoader:
    # Lightning puts a DistributedSampler in it, shuffling (seed 0, set_epoch every epoch) whatever shuffle says.
    return DataLoader(data(), batch_size=BATCH, shuffle=False)


class Net(L.LightningModule):
    def __init__(self, shard: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_model(self) -> None:
        if self.shard:
            shard_net(self, self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def shard_net(model: Net, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in model.net:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def trainer(strategy: Any, epochs: int, root: Path, callbacks: list[Any] | None = None, **kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, callbacks=callbacks or [],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root), **kw,
    )  # fmt: skip


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters (an FSDP2 shard's DTensor gathered: a collective)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        out[n.removeprefix("module.")] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


class StateAtStart(L.Callback):
    """The hook's state as the first resumed step begins (after Lightning restored everything)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = trainer.strategy.compression_state.state_dict()


def own_loop(rank: int, shard: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Our plain loop: DDP (or fully_shard) + sylvie_comm's register, the same data split, order and optimizer."""
    net = Net()
    if shard:
        from torch.distributed.device_mesh import init_device_mesh

        shard_net(net, init_device_mesh("cpu", (2,)))
        model: nn.Module = net
        state = sylvie_comm.fsdp.register(net, "onebit", **FSDP_OPTIONS)
    else:
        model = nn.parallel.DistributedDataParallel(net)
        state = sylvie_comm.ddp.register(model, "acpsgd", **DDP_OPTIONS)
    opt = optimizer(model)
    sampler = DistributedSampler(data(), num_replicas=2, rank=rank, shuffle=True, seed=0)  # as Lightning's
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data(), batch_size=BATCH, sampler=sampler):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    stats = state.stats()
    state.close()
    return weights(net), stats


def run(kind: str, root: Path) -> dict[str, Any]:
    """Straight, interrupted + resumed, and our own loop, for one strategy."""
    shard = kind == "fsdp"

    def strategy() -> Any:
        if shard:
            return sl.CompressedModelParallelStrategy("onebit", options=FSDP_OPTIONS)
        return sl.CompressedDDPStrategy("acpsgd", options=ADAPT_OPTIONS if kind == "ddp-adapt" else DDP_OPTIONS)

    out: dict[str, Any] = {}
    s, net = strategy(), Net(shard)
    straight = trainer(s, EPOCHS, root / kind / "straight", callbacks=[sl.CompressionLog(every_n_steps=1)])
    straight.fit(net, loader())
    out["straight"], out["stats"] = weights(net), s.compression_state.stats()
    out["logged"] = {k: float(v) for k, v in straight.callback_metrics.items() if k.startswith("sylvie_comm/")}

    s, net = strategy(), Net(shard)
    ckpt = ModelCheckpoint(dirpath=str(root / kind / "ckpt"), filename="first-{epoch}", save_top_k=1)
    first = trainer(s, FIRST, root / kind / "first", callbacks=[ckpt] if not shard else [])
    first.fit(net, loader())
    out["saved"] = s.compression_state.state_dict()
    after_fit = root / kind / "after_fit.ckpt"
    first.save_checkpoint(after_fit)
    out["files"] = {"after_fit": str(after_fit)}
    resume_from = after_fit
    if not shard:
        out["files"]["epoch_end"] = ckpt.best_model_path
        resume_from = Path(ckpt.best_model_path)  # written during fit, by the live hook

    s, net, seen = strategy(), Net(shard), StateAtStart()
    trainer(s, EPOCHS, root / kind / "resumed", callbacks=[seen]).fit(net, loader(), ckpt_path=str(resume_from))
    out["resumed"], out["restored"] = weights(net), seen.state
    out["resumed_stats"] = s.compression_state.stats()
    if kind != "ddp-adapt":
        out["own"], out["own_stats"] = own_loop(dist.get_rank(), shard)
    return out


CALLS: list[int] = []


def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    CALLS.append(1)
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def skip(root: Path) -> dict[str, Any]:
    """Lightning's own DDPStrategy on the CPU: its ddp_comm_hook never runs; CommHookCheck says so."""
    out: dict[str, Any] = {}
    plain = trainer(DDPStrategy(ddp_comm_hook=counting_hook), 1, root / "skip", max_steps=2)
    plain.fit(Net(), loader())
    out["calls"], out["steps"] = len(CALLS), plain.global_step
    try:
        trainer(DDPStrategy(ddp_comm_hook=counting_hook), 1, root / "check", [sl.CommHookCheck()]).fit(Net(), loader())
        out["check"] = "no error"
    except RuntimeError as exc:
        out["check"] = str(exc)
    refused = {}
    for kw in ({"ddp_comm_hook": counting_hook}, {"ddp_comm_wrapper": counting_hook}, {"model_averaging_period": 4}):
        try:
            sl.CompressedDDPStrategy("acpsgd", **kw)  # type: ignore[arg-type]
            refused[next(iter(kw))] = "accepted"
        except ValueError as exc:
            refused[next(iter(kw))] = str(exc)
    try:
        sl.CompressedModelParallelStrategy("onebit", tensor_parallel_size=2)
        refused["tensor_parallel_size"] = "accepted"
    except ValueError as exc:
        refused["tensor_parallel_size"] = str(exc)
    out["refused"] = refused
    return out


def resize(checkpoint: Path) -> str:
    """The strategy's resume step on the 2-rank checkpoint, in a strategy that no launch attached (1 process)."""
    blob = torch.load(checkpoint, weights_only=True)["sylvie_comm"]
    strategy = sl.CompressedDDPStrategy("acpsgd", options=DDP_OPTIONS)
    loaded: list[Any] = []
    strategy._sylvie_state = type("State", (), {"load_state_dict": lambda self, s: loaded.append(s)})()
    strategy._sylvie_pending = blob
    try:
        strategy._sylvie_resume()
    except ValueError as exc:
        return f"world {strategy.world_size}, loaded {len(loaded)}: {exc}"
    return f"world {strategy.world_size}, loaded {len(loaded)}: no error"


def main() -> None:
    root = Path(sys.argv[1])
    result = {kind: run(kind, root) for kind in ("ddp", "fsdp", "ddp-adapt")}
    result["skip"] = skip(root)
    result["resize"] = resize(Path(result["ddp"]["files"]["after_fit"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    result["world"], result["threads"] = world, torch.get_num_threads()
    torch.save(result, root / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
