"""Thin adapters from training frameworks to the algorithms, codecs and collectives.

This folder installs as ``sylvie_comm.integrations`` (``pip install .`` and
``pip install -e .`` alike): ``sylvie_comm.integrations.ddp`` (PyTorch DDP comm
hooks, also ``sylvie_comm.ddp``), ``sylvie_comm.integrations.dgl`` (DGL message
passing for the GNN layers, partitions from ``dgl.distributed.partition_graph``).
Each is imported on demand; optional frameworks are probed in
:mod:`sylvie_comm._deps` and never imported by ``import sylvie_comm``.
"""
