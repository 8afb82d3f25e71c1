"""Data-parallel training over Horovod with sylvie-comm compression, on scikit-learn's digits.

Run on two processes (CPU, gloo)::

    horovodrun -np 2 --gloo python examples/horovod_train.py --codec acpsgd
    horovodrun -np 2 --gloo python examples/horovod_train.py --style horovod --codec acpsgd --rank 4

``--style ours`` (default) wraps the optimizer in ``sylvie_comm.horovod.DistributedOptimizer``
(every codec: acpsgd, powersgd, onebit, topk, sign, qsgd, fp16, bf16, none)::

    opt = sylvie_comm.horovod.DistributedOptimizer(opt, model.named_parameters(), "acpsgd", rank=4)

``--style horovod`` keeps Horovod's own optimizer and passes one of our compressors
(acpsgd, fp16, none: what Horovod's all-reduce can carry)::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=sylvie_comm.horovod.Compression.acpsgd(model.named_parameters()))

Rank 0 prints the test accuracy (and, with ``--style ours``, the bytes it sent
beside a plain fp32 all-reduce's).
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import sylvie_comm.horovod as sh
from sylvie_comm.demo.ddp_train import build_model, load_digits_split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--style", choices=["ours", "horovod"], default="ours")
    p.add_argument("--codec", default="acpsgd")
    p.add_argument("--rank", type=int, default=4, help="low-rank codecs: factor rank")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = load_digits_split(hvd.rank(), hvd.size())
    model = build_model(256, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    low_rank = {"rank": args.rank} if args.codec in ("acpsgd", "powersgd") else {}
    if args.style == "ours":
        opt = sh.DistributedOptimizer(opt, model.named_parameters(), args.codec, **low_rank)
    else:
        stock = {"none": sh.Compression.none, "fp16": sh.Compression.fp16, "bf16": sh.Compression.bf16}
        if args.codec == "acpsgd":
            compression = sh.Compression.acpsgd(model.named_parameters(), rank=args.rank)
        elif args.codec in stock:
            compression = stock[args.codec]
        else:
            p.error(f"--style horovod takes --codec acpsgd, fp16, bf16 or none, got {args.codec!r}")
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)

    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(args.steps):
        idx = torch.randint(0, len(xtr), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    if hvd.rank() == 0:
        line = f"{args.style}/{args.codec}: test accuracy {acc:.1f}% after {args.steps} steps on {hvd.size()} ranks"
        if isinstance(opt, sh.DistributedOptimizer):
            s = opt.stats()
            line += f"; sent {s['bytes_sent'] / 2**20:.2f} MiB vs {s['bytes_uncompressed'] / 2**20:.2f} MiB fp32"
        print(line)
    if isinstance(opt, sh.DistributedOptimizer):
        opt.close()


if __name__ == "__main__":
    main()
