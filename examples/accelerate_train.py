"""Data-parallel training with Hugging Face Accelerate and a sylvie-comm gradient hook.

Run on two CPU processes:

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu --codec acpsgd --rank 4

(``accelerate launch --cpu --num_processes 2`` starts one process, not two: with ``--cpu`` Accelerate 1.16 takes
its single-process launcher. ``--multi_gpu`` takes torchrun's, and ``Accelerator(cpu=True)`` keeps the model on
the CPU; ``torchrun --nproc_per_node 2 examples/accelerate_train.py --cpu`` does the same.) On GPUs drop ``--cpu``.

Checkpoints: ``--save-dir D`` writes ``accelerator.save_state(D/epoch<N>)`` after every epoch, and
``--resume D/epoch<N>`` continues from one, bit for bit as if the run had not stopped (same number of processes).

The integration is one call after ``prepare``::

    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = sylvie_comm.accelerate.register(accelerator, model, "acpsgd", rank=4)

which is ``sylvie_comm.ddp.register(model, ...)`` on the prepared DDP model plus
``sylvie_comm.accelerate.checkpoint_with(accelerator, PerRankState(state))``: the hook's state is per rank, so
``save_state`` gathers every rank's into one file of the checkpoint folder (``sylvie_comm_state.pt``) and
``load_state`` gives each rank its own back, read with ``weights_only=True``. (This example's own ``Progress``
counter goes through Accelerate's ``register_for_checkpointing``, which loads with ``weights_only=False``: a
checkpoint folder is trusted input, see ``docs/integrations/accelerate.md``.) The data set is scikit-learn's
handwritten digits; the last line reports test accuracy and the bytes this rank sent beside a plain fp32
all-reduce's.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import sylvie_comm.accelerate
from sylvie_comm.demo.ddp_train import build_model, load_digits_split


class Progress:
    """Epochs done, checkpointed with the rest (``accelerator.register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="acpsgd", help="hook (sylvie_comm.ddp.HOOKS), default acpsgd")
    parser.add_argument("--rank", type=int, default=4, help="low-rank codecs: the rank (default 4)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="plain fp32 averaging for the first steps")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even where GPUs are")
    parser.add_argument("--save-dir", default=None, help="save_state(SAVE_DIR/epoch<N>) after every epoch")
    parser.add_argument("--resume", default=None, help="a folder save_state wrote: continue from it")
    parser.add_argument("--json-out", default=None, help="write the main process's result here")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train; returns the main numbers and, under ``weights``, the final parameters."""
    accelerator = Accelerator(cpu=args.cpu)
    (x, y), (x_test, y_test) = load_digits_split(0, 1)  # every process sees the whole set; prepare() shards it
    # drop_last: every process gets the same number of full batches, none padded by wrapping around.
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False, drop_last=True)
    model = build_model(args.hidden, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    options: dict[str, Any] = {"warmup_steps": args.warmup_steps}
    if args.codec in ("acpsgd", "powersgd"):
        options["rank"] = args.rank
    state = sylvie_comm.accelerate.register(accelerator, model, args.codec, **options)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)  # model, optimizer, RNG, every rank's own hook state, progress

    logged: dict[str, float] = {}
    for epoch in range(progress.epoch, args.epochs):
        model.train()
        for xb, yb in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(xb), yb))
            opt.step()
        progress.epoch = epoch + 1
        # The compression's figures (ratio, the monitor's per-tensor error) to the accelerator's trackers.
        logged = sylvie_comm.accelerate.log(accelerator, state, step=epoch + 1)
        if args.save_dir:
            accelerator.save_state(os.path.join(args.save_dir, f"epoch{epoch + 1}"))

    net = accelerator.unwrap_model(model)
    with torch.no_grad():
        net.eval()
        accuracy = (net(x_test.to(accelerator.device)).argmax(1).cpu() == y_test).float().mean().item()
    stats = state.stats()
    state.close()
    return {
        "codec": args.codec, "epochs": args.epochs, "world_size": accelerator.num_processes,
        "rank": accelerator.process_index, "accuracy": accuracy, "bytes_sent": stats["bytes_sent"],
        "bytes_uncompressed": stats["bytes_uncompressed"], "steps": stats["steps"], "logged": logged,
        "monitor": stats.get("monitor"),
        "weights": {n: p.detach().cpu().clone() for n, p in net.named_parameters()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = train(args)
    if result["rank"] == 0:
        print(f"{result['codec']}: accuracy {result['accuracy']:.3f} after {result['epochs']} epochs on "
              f"{result['world_size']} processes; rank 0 sent {result['bytes_sent']:,} bytes "
              f"({result['bytes_uncompressed']:,} as a plain fp32 all-reduce)")  # fmt: skip
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({k: v for k, v in result.items() if k != "weights"}, f)
    return result


if __name__ == "__main__":
    main()
