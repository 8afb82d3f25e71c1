"""Low-communication training: DiLoCo with the outer step compressed.

Run on two processes (CPU, gloo):

    torchrun --nproc_per_node 2 examples/diloco_train.py --sync-every 16 --codec qsgd --bits 2

Each process is a replica training on its own shard of scikit-learn's handwritten digits (plain, no DDP); every
``--sync-every`` optimizer steps the replicas average their pseudo-gradients (2-bit, with error feedback, here)
and a Nesterov outer step moves the global model. The integration is the ``with`` line around the loop:

    with DiLoCo(model, opt, sync_every=16, codec="qsgd", bits=2) as diloco:
        ...  # the training loop, unchanged

The last line reports rank 0's test accuracy and the bytes this rank sent, beside what plain data-parallel
training (an fp32 all-reduce of the gradients every step) would have sent for the same steps.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sylvie_comm.demo.ddp_train import build_model, load_digits_split
from sylvie_comm.diloco import DiLoCo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sync-every", type=int, default=16, help="inner steps between outer steps (H)")
    p.add_argument("--codec", default="qsgd", help="the outer step's algorithm (none: fp32)")
    p.add_argument("--bits", type=int, default=2, help="qsgd's bits")
    p.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's fragments")
    p.add_argument("--delay", type=int, default=0, help="inner steps an average travels before it is applied")
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's (the inner optimizer)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--json-out", default=None, help="rank 0 writes its results here")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (xtr, ytr), (xte, yte) = load_digits_split(rank, world, 0)
    model = build_model(args.hidden, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    options = {"bits": args.bits} if args.codec == "qsgd" else {}
    gen = torch.Generator().manual_seed(rank)
    with DiLoCo(model, opt, sync_every=args.sync_every, codec=args.codec, fragments=args.fragments,
                delay=args.delay, **options) as diloco:  # fmt: skip
        for _ in range(args.steps):
            idx = torch.randint(0, len(xtr), (args.batch_size,), generator=gen)
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    stats = diloco.stats()
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item() * 100
    return {"codec": args.codec, "sync_every": args.sync_every, "steps": args.steps, "world_size": world,
            "accuracy": accuracy, "outer_steps": stats["outer_steps"], "bytes_sent": stats["bytes_sent"],
            "ddp_bytes": stats["ddp_bytes"], "reduction_vs_ddp": stats["reduction_vs_ddp"]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = train(args)
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
        print(
            f"DiLoCo[{result['codec']}], H={result['sync_every']}: accuracy {result['accuracy']:.2f}% after "
            f"{result['steps']} steps on {result['world_size']} replicas; rank 0 sent {result['bytes_sent'] / 1e6:.2f} "
            f"MB in {result['outer_steps']} outer steps vs {result['ddp_bytes'] / 1e6:.1f} MB for plain data parallel "
            f"({result['reduction_vs_ddp']:.0f}x less)"
        )
    return result


if __name__ == "__main__":
    main()
