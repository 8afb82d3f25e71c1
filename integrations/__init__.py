"""Thin adapters from training frameworks to the algorithms, codecs and collectives.

This folder installs as ``sylvie_comm.integrations`` (``pip install .`` and
``pip install -e .`` alike): ``sylvie_comm.integrations.ddp`` (PyTorch DDP comm
hooks, also ``sylvie_comm.ddp``), ``fsdp`` (FSDP2 reduce-scatter comms and HSDP hooks,
also ``sylvie_comm.fsdp``), ``horovod`` and ``horovod_compression`` (also
``sylvie_comm.horovod``), ``average`` (the gradient average over any transport), ``optim``
(the compressed AdamW and SGD under DDP and Horovod), ``lightning`` and ``accelerate`` (also
``sylvie_comm.lightning`` and ``sylvie_comm.accelerate``), ``pyg`` (PyG models in the
partitioned GNN trainer) and ``dgl`` (DGL message passing for the GNN layers, partitions
from ``dgl.distributed.partition_graph``).
Each is imported on demand; optional frameworks are probed in
:mod:`sylvie_comm._deps` and never imported by ``import sylvie_comm``.
"""
