"""Distributed full-graph GNN training with one-bit halo exchange and bounded staleness.

Run on four processes (CPU, gloo):

    torchrun --nproc_per_node 4 examples/gnn_full_graph.py                       # fp32, synchronous
    torchrun --nproc_per_node 4 examples/gnn_full_graph.py --bits-fwd 1 --bits-bwd 1 --staleness 1
    torchrun --nproc_per_node 4 examples/gnn_full_graph.py --dataset ogbn-arxiv --root /data/ogb

Rank 0 partitions the graph (``bfs`` by default: plain torch; ``--partition metis`` with the
dgl extra) into a folder; every rank loads its own part. Each epoch prints loss, accuracy,
epoch time and the bytes rank 0 put on the wire for halos; the run ends with test accuracy and
the halo and weight-gradient bytes per epoch.

The workload is ``sylvie_comm.demo.gnn_full_graph`` (the one ``sylvie-comm demo``
runs); its ``train`` holds the whole integration:

    part = shared_partition(make_graph, rank, world, folder, "bfs")
    trainer = Trainer(part, TrainConfig(forward="q1", backward="q1", staleness=1, ...))
    for epoch in range(epochs):
        stats = trainer.train_epoch()

This script is its command line, the same as
``torchrun --nproc_per_node 4 -m sylvie_comm.demo.gnn_full_graph ...``.
"""

from sylvie_comm.demo import gnn_full_graph

if __name__ == "__main__":
    gnn_full_graph.main()
