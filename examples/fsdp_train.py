"""Sharded data parallel (FSDP2 ``fully_shard``) with a compressed gradient reduce-scatter.

Run on two processes (CPU, gloo), or on GPUs (NCCL, one per process):

    torchrun --nproc_per_node 2 examples/fsdp_train.py --codec qsgd --bits 4
    torchrun --nproc_per_node 2 examples/fsdp_train.py --codec onebit --optimizer adam
    torchrun --nproc_per_node 2 examples/fsdp_train.py --codec none     # our plain reduce-scatter
    torchrun --nproc_per_node 2 examples/fsdp_train.py --plain          # FSDP2's own, for comparison
    torchrun --nproc_per_node 4 examples/fsdp_train.py --hsdp 2 --codec acpsgd  # 2 replicas of 2 shards

The data set is scikit-learn's handwritten digits, split as the demo splits it; each rank trains on its own
slice. The integration is
three lines after ``fully_shard``:

    state = sylvie_comm.fsdp.register(model, "qsgd", bits=4)
    ...                                   # train as usual
    state.close()

The last line reports test accuracy, the bytes this rank sent beside what FSDP's fp32 reduce-scatter (or,
with ``--hsdp``, the replica all-reduce) would have sent, the codec's state on this rank and the process's
peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sylvie_comm
from sylvie_comm.demo.ddp_train import build_model, load_digits_split


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="qsgd", help="qsgd (default), onebit, fp16, bf16, none; with --hsdp "
                        "any algorithm (acpsgd, powersgd too)")  # fmt: skip
    parser.add_argument("--bits", type=int, default=None, help="qsgd: bits per value (2, 4, 8)")
    parser.add_argument("--plain", action="store_true", help="FSDP2's own reduce-scatter (no codec)")
    parser.add_argument("--hsdp", type=int, default=0, metavar="R", help="R replicas of world/R shards")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="SGD momentum 0.9, or Adam")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json-out", default=None, help="write rank 0's result here")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh, replicas = None, None
    if args.hsdp:
        full = init_device_mesh(device.type, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
        mesh = full if args.plain else full["shard"]  # plain: FSDP2's own HSDP
        replicas = full["replicate"].get_group()
    model = build_model(256, seed=0).to(device)  # the demo's MLP 64-256-256-10, the same on every rank
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = None
    if not args.plain:
        options: dict[str, Any] = {"bits": args.bits} if args.bits is not None else {}
        state = sylvie_comm.fsdp.register(model, args.codec, replicas=replicas, **options)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if args.optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))  # fmt: skip
    (xtr, ytr), (xte, yte) = (tuple(t.to(device) for t in pair) for pair in load_digits_split(rank, world))
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        idx = torch.randint(0, len(xtr), (64,), generator=g).to(device)
        opt.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item() * 100
    result: dict[str, Any] = {"codec": "fsdp2" if args.plain else args.codec, "world_size": world,
                              "steps": args.steps, "accuracy": accuracy,
                              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip
    if state is not None:
        stats = state.stats()
        result.update(bytes_sent=stats["bytes_sent"], bytes_uncompressed=stats["bytes_uncompressed"],
                      codec_state_bytes=state.memory_bytes())  # fmt: skip
        state.close()
    if rank == 0:
        line = f"{result['codec']}: accuracy {accuracy:.2f}%, peak memory {result['peak_rss_mb']:.0f} MB"
        if state is not None:
            ratio = result["bytes_uncompressed"] / max(result["bytes_sent"], 1)
            line += (f", sent {result['bytes_sent'] / 1e6:.2f} MB ({ratio:.1f}x under fp32), codec state "
                     f"{result['codec_state_bytes'] / 1e3:.1f} kB")  # fmt: skip
        print(line)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
