"""One rank's share of a partitioned graph: the :class:`Partition` dataclass.

Each rank owns the *inner* nodes of its partition and computes their
representations. To aggregate over all in-neighbours it needs the rows of
*halo* nodes: in-neighbours of inner nodes owned by other ranks. A partition
records, for every peer, which of its inner rows that peer needs
(``send_idx``) and how many halo rows come from it (``halo_counts``), in one
agreed order: halo rows are grouped by owner, then sorted by global id, and an
owner sends exactly those rows in that order. The local block has sources
``[inner; halo]`` and destinations ``inner``, and holds every in-edge of every
inner node, so neighbour means and sums equal the full graph's.

:func:`sylvie_comm.gnn.partition.partition` makes the parts (and that module
re-exports this class), :mod:`sylvie_comm.gnn.partition_check` checks their
fields, :mod:`sylvie_comm.gnn.partition_store` writes and reads partition folders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Partition:
    """One rank's share of a partitioned graph (see the module docstring)."""

    rank: int
    num_parts: int
    num_nodes: int
    inner: torch.Tensor  # global ids of inner nodes, ascending
    halo: torch.Tensor  # global ids of halo nodes, grouped by owner, ascending within an owner
    halo_counts: list[int]  # halo rows received from each rank (0 for this rank)
    send_idx: list[torch.Tensor]  # local inner indices sent to each rank (empty for this rank)
    src: torch.Tensor  # block edges: sources in [0, n_inner + n_halo)
    dst: torch.Tensor  # block edges: destinations in [0, n_inner)
    in_degree: torch.Tensor  # global in-degree of inner nodes
    out_degree: torch.Tensor  # global out-degree of block sources (inner then halo)
    ndata: dict[str, torch.Tensor] = field(default_factory=dict)  # inner rows of node data

    @property
    def n_inner(self) -> int:
        return int(self.inner.numel())

    @property
    def n_halo(self) -> int:
        return int(self.halo.numel())

    @property
    def send_counts(self) -> list[int]:
        return [int(t.numel()) for t in self.send_idx]

    def state(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def record(self) -> dict[str, Any]:
        """The sizes :func:`save_partitions` records for this part in ``meta.json`` (checked at load)."""
        return {"n_inner": self.n_inner, "n_halo": self.n_halo, "n_edges": int(self.src.numel()),
                "halo_counts": [int(c) for c in self.halo_counts], "send_counts": self.send_counts,
                "ndata": {k: {"dtype": str(v.dtype), "shape": list(v.shape[1:])}
                          for k, v in sorted(self.ndata.items())}}  # fmt: skip

    def save(self, folder: str | Path) -> Path:
        """Write ``part{rank}.pt`` into ``folder`` and return its path (one file; :func:`save_partitions`
        writes a whole partition folder, with the ``meta.json`` that :func:`load_partition` needs)."""
        path = Path(folder) / f"part{self.rank}.pt"
        torch.save(self.state(), path)
        return path
