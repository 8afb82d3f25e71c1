"""What tests/integrations/test_accelerate.py runs on each of 2 CPU processes that ``accelerate launch`` starts.

``python -m accelerate.commands.launch --multi_gpu --num_processes 2 accelerate_worker.py OUT``: the training is
examples/accelerate_train.py's ``train`` (``sylvie_comm.accelerate.register`` after ``accelerator.prepare``):
2 epochs straight; 1 epoch and ``save_state``; a new Accelerator that ``load_state``s and trains the 2nd epoch;
then our own loop (DDP + ``sylvie_comm.ddp.register``) over the batches Accelerate gives each process (batch
``b`` of the sequential loader to process ``b % 2``); and what ``DistributedDataParallelKwargs(comm_hook=...)``
does with a hook that is not its enum. Each rank writes ``OUT/rank{r}.pt``.

The compression monitor runs in the example at its defaults: checks at compressed steps 10 and 30 (steps 12 and 32
of 44), the second after the checkpoint (22). ``adapting``: the example's training on 512 samples (8 steps an epoch)
with the monitor adapting (:data:`ADAPT_MONITOR`), 2 epochs straight, and 1, ``save_state``, a new Accelerator that
``load_state``s and trains the 2nd: checks at steps 7 and 12, the first the last step before the checkpoint (its
decisions, the ranks 2 -> 4, apply at the resumed run's first step), the second after it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sylvie_comm
import sylvie_comm.accelerate
from sylvie_comm.demo.ddp_train import build_model, load_digits_split

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("accelerate_train", ROOT / "examples" / "accelerate_train.py")
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

EPOCHS, BATCH, HIDDEN = 2, 32, 32
# Checks every 5 compressed steps, patience 1 and a bound every lag exceeds: each check adapts.
ADAPT_MONITOR = {"first": 5, "period": 5, "adapt": True, "max_lag": 0.05, "patience": 1}
ADAPT_SAMPLES = 512  # 16 batches of 32: 8 steps an epoch on each of 2 processes


def own_loop(rank: int, world: int) -> dict[str, torch.Tensor]:
    """DDP + sylvie_comm.ddp.register on the batches Accelerate hands this process, same model and optimizer."""
    (x, y), _ = load_digits_split(0, 1)
    net = build_model(HIDDEN, seed=0)
    ddp = nn.parallel.DistributedDataParallel(net)
    state = sylvie_comm.ddp.register(ddp, "acpsgd", rank=2, warmup_steps=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        for b in range(len(x) // BATCH):  # drop_last
            if b % world != rank:
                continue
            opt.zero_grad()
            F.cross_entropy(ddp(x[b * BATCH : (b + 1) * BATCH]), y[b * BATCH : (b + 1) * BATCH]).backward()
            opt.step()
    state.close()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def adapting_train(epochs: int, save: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    """The example's training on ADAPT_SAMPLES samples with the monitor adapting: ``epochs`` epochs, from the
    ``save_state`` folder ``resume`` (which holds 1 epoch) if given, saving to ``save`` at the end if given."""
    accelerator = Accelerator(cpu=True)
    (x, y), _ = load_digits_split(0, 1)
    loader = DataLoader(TensorDataset(x[:ADAPT_SAMPLES], y[:ADAPT_SAMPLES]), batch_size=BATCH, shuffle=False,
                        drop_last=True)  # fmt: skip
    model = build_model(HIDDEN, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = sylvie_comm.accelerate.register(accelerator, model, "acpsgd", rank=2, warmup_steps=2,
                                            monitor=ADAPT_MONITOR)  # fmt: skip
    if resume is not None:
        accelerator.load_state(str(resume))
    for _ in range(0 if resume is None else 1, epochs):
        for xb, yb in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(xb), yb))
            opt.step()
    if save is not None:
        accelerator.save_state(str(save))
    stats, net = state.stats(), accelerator.unwrap_model(model)
    out = {"steps": stats["steps"], "monitor": stats["monitor"], "saved": state.state_dict()["monitor"],
           "weights": {n: p.detach().clone() for n, p in net.named_parameters()}}  # fmt: skip
    state.close()
    return out


def adapting(out: Path) -> dict[str, Any]:
    return {
        "straight": adapting_train(2),
        "first": adapting_train(1, save=out / "adapting"),
        "resumed": adapting_train(2, resume=out / "adapting"),
    }


CALLS: list[int] = []


def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    CALLS.append(1)
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def traps() -> dict[str, Any]:
    """A hook Accelerate drops, one it registers itself, a model it did not wrap: what happens, what we say."""
    out: dict[str, Any] = {}
    acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=counting_hook)])
    model = acc.prepare(build_model(8, seed=0))
    F.cross_entropy(model(torch.randn(4, 64)), torch.tensor([0, 1, 2, 3])).backward()
    out["dropped"] = {"registered": len(model._comm_hooks), "calls": len(CALLS)}
    hooks: dict[str, Any] = {"function": counting_hook, "string": "fp16", "enum": DDPCommunicationHookType.FP16}
    for name, hook in hooks.items():
        acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=hook)])
        model = acc.prepare(build_model(8, seed=0))
        try:
            sylvie_comm.accelerate.register(acc, model, "acpsgd")
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    try:
        sylvie_comm.accelerate.register(Accelerator(cpu=True), build_model(8, seed=0), "acpsgd")
        out["unwrapped"] = "accepted"
    except TypeError as exc:
        out["unwrapped"] = str(exc)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    common = ["--cpu", "--codec", "acpsgd", "--rank", "2", "--batch-size", str(BATCH), "--hidden", str(HIDDEN)]
    result: dict[str, Any] = {
        "straight": example.train(example.parse_args([*common, "--epochs", str(EPOCHS)])),
        "first": example.train(example.parse_args([*common, "--epochs", "1", "--save-dir", str(out / "ckpt")])),
    }
    resume = ["--epochs", str(EPOCHS), "--resume", str(out / "ckpt" / "epoch1")]
    result["resumed"] = example.train(example.parse_args([*common, *resume]))
    rank, world = dist.get_rank(), dist.get_world_size()
    result["own"] = own_loop(rank, world)
    result["traps"] = traps()
    result["adapting"] = adapting(out)
    result["world"] = world
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
