"""Data-parallel training with a sylvie-comm gradient hook.

Run on two processes (CPU, gloo):

    torchrun --nproc_per_node 2 examples/ddp_train.py --codec acpsgd --rank 4
    torchrun --nproc_per_node 2 examples/ddp_train.py --config examples/configs/acpsgd.yaml

The data set is scikit-learn's handwritten digits (it ships inside the
package); each rank trains on its own shard. The last line reports test
accuracy and the bytes this rank put on the wire, beside what a plain fp32
all-reduce of the same gradients would have sent.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import sylvie_comm


def load_digits_split(rank: int, world: int, seed: int = 0):
    """(train shard of this rank, test set) of scikit-learn's digits, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = perm[:360], perm[360:]
    shard = train[rank::world]
    return (x[shard], y[shard]), (x[test], y[test])


def build_model(hidden: int, seed: int) -> nn.Module:
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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("gloo")
        else:  # a single process
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()

    (xtr, ytr), (xte, yte) = load_digits_split(rank, world, args.seed)
    model = build_model(args.hidden, args.seed)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)

    # The integration: one call.
    if args.config:
        state = sylvie_comm.ddp.register(ddp, config=sylvie_comm.Config.from_yaml(args.config))
    else:
        options = {"rank": args.rank} if args.rank is not None else {}
        state = sylvie_comm.ddp.register(ddp, args.codec, **options)

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    bar = tqdm(range(args.steps), disable=rank != 0 or args.no_progress, desc=state.name, unit="step")
    start = time.perf_counter()
    for _ in bar:
        idx = torch.randint(0, len(xtr), (args.batch_size,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    seconds = time.perf_counter() - start

    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item() * 100
    stats = state.stats()
    result = {
        "codec": state.name,
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
    if rank == 0:
        print(
            f"{state.name}: accuracy {accuracy:.2f}% after {args.steps} steps on {world} rank(s); "
            f"rank 0 sent {stats['bytes_sent'] / 1e6:.2f} MB vs {stats['bytes_uncompressed'] / 1e6:.2f} MB "
            f"for a plain fp32 all-reduce ({stats['compression_ratio']:.1f}x less); {seconds:.1f} s"
        )
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
    state.close()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
