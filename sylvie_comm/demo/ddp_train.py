"""Data-parallel training with a sylvie-comm gradient hook, on scikit-learn's digits.

Run on two processes (CPU, gloo)::

    torchrun --nproc_per_node 2 -m sylvie_comm.demo.ddp_train --codec acpsgd --rank 4
    torchrun --nproc_per_node 2 -m sylvie_comm.demo.ddp_train --config examples/configs/acpsgd.yaml

Without torchrun it trains in a single process. Each rank trains on its own
shard of the digits (1797 8x8 images; the data set ships inside scikit-learn).
Rank 0 prints the test accuracy and the bytes it put on the wire, beside what a
plain fp32 all-reduce of the same gradients would have sent, and with
``--json-out`` writes them as JSON. ``examples/ddp_train.py`` runs this module.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import sylvie_comm
import sylvie_comm.ddp
from sylvie_comm.demo.launch import rank_and_size, under_horovodrun, worker_entry

Split = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def load_digits_split(rank: int, world: int, seed: int = 0) -> Split:
    """(train shard of this rank, test set) of scikit-learn's digits, features scaled to [0, 1].

    The 360 test images and the shards are the same on every rank for a given ``seed``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = perm[:360], perm[360:]
    shard = train[rank::world]
    return (x[shard], y[shard]), (x[test], y[test])


def build_model(hidden: int, seed: int) -> nn.Module:
    """A 64 -> hidden -> hidden -> 10 MLP, initialized identically on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", default="acpsgd", help=f"hook: {', '.join(sorted(sylvie_comm.ddp.HOOKS))}")
    p.add_argument("--rank", type=int, default=None, help="low-rank hooks: factor rank (default 4)")
    p.add_argument("--config", default=None, help="YAML hook configuration (replaces --codec and --rank)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="rank 0 writes its results here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train on the initialized ranks (DDP and its hook, or Horovod and our optimizer under horovodrun);
    return this rank's results."""
    rank, world = rank_and_size()
    (xtr, ytr), (xte, yte) = load_digits_split(rank, world, args.seed)
    model = build_model(args.hidden, args.seed)
    config = sylvie_comm.Config.from_yaml(args.config) if args.config else None
    options = {"rank": args.rank} if args.rank is not None and not args.config else {}
    codec = None if args.config else args.codec
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    # The integration: one call.
    net: torch.nn.Module
    if under_horovodrun():
        from sylvie_comm.horovod import DistributedOptimizer

        opt = state = DistributedOptimizer(
            opt, model.named_parameters(), codec, config=config, bucket_cap_mb=args.bucket_mb, **options
        )
        net = model
    else:
        net = DDP(model, bucket_cap_mb=args.bucket_mb)
        state = sylvie_comm.ddp.register(net, codec, config=config, **options)

    try:
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
        bar = tqdm(range(args.steps), disable=rank != 0 or args.no_progress, desc=state.name, unit="step")
        start = time.perf_counter()
        for _ in bar:
            idx = torch.randint(0, len(xtr), (args.batch_size,), generator=gen)
            opt.zero_grad()
            loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        seconds = time.perf_counter() - start

        with torch.no_grad():
            accuracy = (model(xte).argmax(1) == yte).float().mean().item() * 100
        stats = state.stats()
    finally:
        state.close()
    return {
        "codec": state.name,
        "launcher": "horovodrun" if under_horovodrun() else "torchrun",
        "world_size": world,
        "steps": args.steps,
        "accuracy": accuracy,
        "seconds": seconds,
        "bytes_sent": stats["bytes_sent"],
        "bytes_uncompressed": stats["bytes_uncompressed"],
        "compression_ratio": stats["compression_ratio"],
        "encode_seconds": stats["encode_seconds"],
        "decode_seconds": stats["decode_seconds"],
    }


def report(result: dict[str, Any]) -> str:
    """Rank 0's closing line."""
    return (
        f"{result['codec']}: accuracy {result['accuracy']:.2f}% after {result['steps']} steps on "
        f"{result['world_size']} rank(s); rank 0 sent {result['bytes_sent'] / 1e6:.2f} MB vs "
        f"{result['bytes_uncompressed'] / 1e6:.2f} MB for a plain fp32 all-reduce "
        f"({result['compression_ratio']:.1f}x less); {result['seconds']:.1f} s"
    )


main = worker_entry(parse_args, train, report)  # main(argv=None): parse, train; rank 0 reports


if __name__ == "__main__":
    main()
