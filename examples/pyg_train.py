"""Full-graph training of a PyG model (two ``SAGEConv`` layers) with compressed halos and bounded staleness.

Run on two processes (CPU, gloo; needs the ``pyg`` extra):

    torchrun --nproc_per_node 2 examples/pyg_train.py                                 # 1-bit halos, staleness 1
    torchrun --nproc_per_node 2 examples/pyg_train.py --forward fp32 --backward fp32 --staleness 0   # exact

Rank 0 generates a graph as a ``torch_geometric.data.Data`` and partitions it into a folder (``bfs``: plain
torch); every rank loads its own part and trains the same ``Net``, built by every rank from the same seed.
Rank 0 prints each epoch's loss and accuracies and the halo bytes it sent; the run ends with the accuracies
of a synchronous evaluation. The whole integration:

    part = shared_partition(make_graph, rank, world, folder, method="bfs")
    trainer = Trainer(part, TrainConfig(forward="q1", backward="q1", staleness=1), model=lambda: Net(...))
    for epoch in range(epochs):
        stats = trainer.train_epoch()
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn import SAGEConv

from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.partition import shared_partition
from sylvie_comm.gnn.train import TrainConfig, Trainer


class Net(torch.nn.Module):
    """A plain PyG model: nothing in it knows about partitions."""

    def __init__(self, in_dim: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.conv1 = SAGEConv(in_dim, hidden)
        self.conv2 = SAGEConv(hidden, classes)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.conv1(x, edge_index).relu(), 0.5, self.training)
        return self.conv2(x, edge_index)  # type: ignore[no-any-return]


def make_graph(nodes: int, classes: int, feat_dim: int) -> Data:
    """Any ``Data`` with ``x``, ``y``, ``edge_index`` and train/val/test masks; here a generated one."""
    g = gdata.csbm(num_nodes=nodes, num_classes=classes, feat_dim=feat_dim)
    return Data(x=g.ndata["feat"], y=g.ndata["label"], edge_index=torch.stack([g.src, g.dst]),
                train_mask=g.ndata["train_mask"], val_mask=g.ndata["val_mask"],
                test_mask=g.ndata["test_mask"])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4000)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--feat-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--forward", default="q1", help="halo precision forward: fp32, bf16, fp16, q1, q2, q4, q8")
    p.add_argument("--backward", default="q1", help="halo precision backward (the same names)")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--parts-dir", default=None, help="partition folder (default: a new temporary one)")
    p.add_argument("--json-out", default=None, help="rank 0 writes the final metrics here")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = [args.parts_dir or (tempfile.mkdtemp(prefix="pyg-parts-") if rank == 0 else None)]
    dist.broadcast_object_list(folder)  # every rank reads rank 0's folder
    part = shared_partition(lambda: make_graph(args.nodes, args.classes, args.feat_dim), rank, world,
                            str(folder[0]), method="bfs")  # fmt: skip
    config = TrainConfig(lr=0.01, forward=args.forward, backward=args.backward, staleness=args.staleness)
    trainer = Trainer(part, config, model=lambda: Net(args.feat_dim, args.hidden, args.classes))
    for _ in range(args.epochs):
        s = trainer.train_epoch()
        if rank == 0:
            print(f"epoch {s['epoch']:3d}  loss {s['loss']:.4f}  train {s['train_acc']:.1f}%  "
                  f"val {s['val_acc']:.1f}%  halo {s['halo_bytes'] / 1e3:.1f} kB", flush=True)  # fmt: skip
    final = trainer.evaluate()
    if rank == 0:
        print(f"{args.forward}/{args.backward} S={args.staleness}: test accuracy {final['test_acc']:.2f}% "
              f"(val {final['val_acc']:.2f}%), world {world}")  # fmt: skip
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({**final, "world_size": world, "epochs": args.epochs}, f)
    trainer.close()
    dist.barrier()  # every rank has read its part
    if rank == 0 and args.parts_dir is None:
        shutil.rmtree(str(folder[0]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
