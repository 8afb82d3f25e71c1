"""Partition a graph for distributed full-graph training.

Each rank owns the *inner* nodes of its partition and computes their
representations. To aggregate over all in-neighbours it needs the rows of
*halo* nodes: in-neighbours of inner nodes owned by other ranks. A partition
records, for every peer, which of its inner rows that peer needs
(``send_idx``) and how many halo rows come from it (``halo_counts``), in one
agreed order: halo rows are grouped by owner, then sorted by global id, and an
owner sends exactly those rows in that order. The local block has sources
``[inner; halo]`` and destinations ``inner``, and holds every in-edge of every
inner node, so neighbour means and sums equal the full graph's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sylvie_comm import _deps
from sylvie_comm.gnn.data import symmetrize

METHODS = ("metis", "random")


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

    def save(self, folder: str | Path) -> Path:
        """Write ``part{rank}.pt`` (and ``meta.json`` if missing) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = folder / "meta.json"
        if not meta.exists():
            meta.write_text(json.dumps({"num_parts": self.num_parts, "num_nodes": self.num_nodes, "format": 1}))
        path = folder / f"part{self.rank}.pt"
        torch.save(self.state(), path)
        return path


def save_partitions(parts: list[Partition], folder: str | Path) -> Path:
    """Write every partition; each rank later loads only its own with :func:`load_partition`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(
        json.dumps({"num_parts": len(parts), "num_nodes": parts[0].num_nodes, "format": 1})
    )
    for p in parts:
        p.save(folder)
    return folder


def load_partition(folder: str | Path, rank: int) -> Partition:
    """Load one rank's partition from a folder written by :func:`save_partitions`."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"partition: {folder} has no meta.json; write it with save_partitions()")
    meta = json.loads(meta_path.read_text())
    if not 0 <= rank < meta["num_parts"]:
        raise ValueError(f"partition: rank {rank} is outside the {meta['num_parts']} partitions in {folder}")
    state = torch.load(folder / f"part{rank}.pt", weights_only=True)
    return Partition(**state)


def _edges_of(graph: Any, num_nodes: int | None) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, torch.Tensor]]:
    if isinstance(graph, tuple) and len(graph) == 2:
        src, dst = graph
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            raise TypeError("partition: expected (src, dst) edge tensors or a DGLGraph")
        if src.dtype.is_floating_point or dst.dtype.is_floating_point or src.dtype == torch.bool:
            raise TypeError(f"partition: expected integer edge tensors, got {src.dtype} and {dst.dtype}")
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(f"partition: src and dst must be 1-D of equal length, got {tuple(src.shape)}, "
                             f"{tuple(dst.shape)}")  # fmt: skip
        if num_nodes is None:
            num_nodes = int(max(src.max().item(), dst.max().item())) + 1 if src.numel() else 0
        return src.long(), dst.long(), num_nodes, {}
    if hasattr(graph, "edges") and hasattr(graph, "num_nodes"):
        src, dst = graph.edges()
        ndata = {k: v for k, v in graph.ndata.items() if isinstance(v, torch.Tensor)}
        return src.long(), dst.long(), int(graph.num_nodes()), ndata
    raise TypeError(f"partition: expected (src, dst) edge tensors or a DGLGraph, got {type(graph).__name__}")


def assign_random(num_nodes: int, num_parts: int, seed: int = 0) -> torch.Tensor:
    """Balanced random assignment: part sizes differ by at most one node."""
    perm = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed))
    assign = torch.empty(num_nodes, dtype=torch.int64)
    assign[perm] = torch.arange(num_nodes) % num_parts
    return assign


def assign_metis(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, num_parts: int) -> torch.Tensor:
    """METIS (edge-cut minimizing) assignment: through DGL when it imports, else the pymetis wheel."""
    if num_parts == 1:
        return torch.zeros(num_nodes, dtype=torch.int64)
    s, d = symmetrize(src, dst, num_nodes)
    if _deps.with_dgl():
        dgl = _deps.import_dgl()
        g = dgl.graph((s, d), num_nodes=num_nodes)
        return canonical_labels(dgl.metis_partition_assignment(g, num_parts).long(), num_parts)
    if not _deps.WITH_PYMETIS:
        raise ImportError("partition: method='metis' requires 'dgl' or 'pymetis': pip install 'sylvie-comm[dgl]'")
    import numpy as np
    import pymetis

    xadj = torch.zeros(num_nodes + 1, dtype=torch.int64)
    xadj[1:] = torch.bincount(s, minlength=num_nodes).cumsum(0)
    _, membership = pymetis.part_graph(num_parts, xadj=xadj.numpy(), adjncy=d.numpy())
    return canonical_labels(torch.from_numpy(np.asarray(membership, dtype=np.int64)), num_parts)


def canonical_labels(assign: torch.Tensor, num_parts: int) -> torch.Tensor:
    """Renumber parts by their smallest node id.

    METIS through DGL returns the same parts under different labels from one
    process to the next, so ranks partitioning on their own would disagree on
    who owns what; canonical labels make every rank's call identical.
    """
    first = torch.full((num_parts,), assign.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, assign, torch.arange(assign.numel()), reduce="amin")
    relabel = torch.empty(num_parts, dtype=torch.int64)
    relabel[torch.argsort(first)] = torch.arange(num_parts)
    return relabel[assign]


def partition(
    graph: Any,
    num_parts: int,
    method: str | torch.Tensor = "metis",
    *,
    num_nodes: int | None = None,
    ndata: Mapping[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> list[Partition]:
    """Split a graph into ``num_parts`` partitions, one per rank.

    Args:
        graph: a DGLGraph (its ``ndata`` is carried along) or ``(src, dst)``
            integer edge tensors (edge ``src -> dst``: ``dst`` aggregates ``src``).
        num_parts: partitions (ranks), 1 <= num_parts <= number of nodes.
        method: ``"metis"`` (DGL, else pymetis), ``"random"`` (balanced), or
            an explicit assignment tensor of one part id per node.
        num_nodes: node count for edge tensors (default: largest id + 1).
        ndata: node data (features, labels, masks: first dimension = nodes)
            to split with the nodes.
        seed: for ``"random"``.
    """
    src, dst, n, graph_ndata = _edges_of(graph, num_nodes)
    data = {**graph_ndata, **(dict(ndata) if ndata else {})}
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"partition: num_parts must be a positive integer, got {num_parts!r}")
    if num_parts > n:
        raise ValueError(f"partition: cannot split {n} nodes into {num_parts} non-empty partitions")
    if src.numel() and (min(src.min().item(), dst.min().item()) < 0 or max(src.max().item(), dst.max().item()) >= n):
        raise ValueError(f"partition: edge endpoints must lie in [0, {n}), got ids outside it")
    for k, v in data.items():
        if v.shape[0] != n:
            raise ValueError(f"partition: node data '{k}' has {v.shape[0]} rows, expected one per node ({n})")

    if isinstance(method, torch.Tensor):
        assign = method.long()
        if assign.shape != (n,) or (n and (assign.min() < 0 or assign.max() >= num_parts)):
            raise ValueError(f"partition: an assignment needs one part id in [0, {num_parts}) per node")
    elif method == "random":
        assign = assign_random(n, num_parts, seed)
    elif method == "metis":
        assign = assign_metis(src, dst, n, num_parts)
    else:
        raise ValueError(f"partition: unknown method {method!r}; expected one of {METHODS} or an assignment tensor")
    sizes = torch.bincount(assign, minlength=num_parts)
    if (sizes == 0).any():
        empty = torch.nonzero(sizes == 0).flatten().tolist()
        raise ValueError(f"partition: part(s) {empty} received no nodes; use fewer parts or method='random'")

    # Position of every node inside its owner's inner list (inner lists are ascending).
    order = torch.argsort(assign * n + torch.arange(n))
    local_id = torch.empty(n, dtype=torch.int64)
    starts = torch.zeros(num_parts + 1, dtype=torch.int64)
    starts[1:] = sizes.cumsum(0)
    local_id[order] = torch.arange(n) - starts[assign[order]]

    in_deg = torch.bincount(dst, minlength=n)
    out_deg = torch.bincount(src, minlength=n)
    halos, pieces = [], []
    for r in range(num_parts):
        inner = order[starts[r] : starts[r + 1]]
        mine = assign[dst] == r
        e_src, e_dst = src[mine], dst[mine]
        remote = torch.unique(e_src[assign[e_src] != r])
        halo = remote[torch.argsort(assign[remote] * n + remote)]  # by owner, then id
        g2l = torch.full((n,), -1, dtype=torch.int64)
        g2l[inner] = torch.arange(inner.numel())
        g2l[halo] = inner.numel() + torch.arange(halo.numel())
        halos.append(halo)
        pieces.append((inner, g2l[e_src], local_id[e_dst]))

    parts = []
    for r in range(num_parts):
        inner, lsrc, ldst = pieces[r]
        halo = halos[r]
        owners = assign[halo]
        halo_counts = torch.bincount(owners, minlength=num_parts).tolist()
        # What rank r sends to rank p: p's halo rows owned by r, in p's order.
        send_idx = [local_id[halos[p][assign[halos[p]] == r]] if p != r else torch.zeros(0, dtype=torch.int64)
                    for p in range(num_parts)]  # fmt: skip
        parts.append(
            Partition(
                rank=r,
                num_parts=num_parts,
                num_nodes=n,
                inner=inner,
                halo=halo,
                halo_counts=[int(c) for c in halo_counts],
                send_idx=send_idx,
                src=lsrc,
                dst=ldst,
                in_degree=in_deg[inner],
                out_degree=out_deg[torch.cat([inner, halo])],
                ndata={k: v[inner] for k, v in data.items()},
            )
        )
    return parts


def shared_partition(
    make_graph: Callable[[], Any],
    rank: int,
    num_parts: int,
    folder: str | Path,
    method: str = "metis",
    seed: int = 0,
) -> Partition:
    """Partition once on rank 0, then every rank loads its own part (a collective: uses a barrier).

    ``make_graph()`` returns a :class:`~sylvie_comm.gnn.data.GraphData` (or
    anything with ``src``, ``dst``, ``num_nodes`` and ``ndata``); only rank 0
    calls it. Partitioning on every rank separately is fragile: METIS through
    DGL does not always return the same parts in different processes.
    """
    import torch.distributed as dist

    folder = Path(folder)
    if rank == 0:
        g = make_graph()
        parts = partition((g.src, g.dst), num_parts, method, num_nodes=g.num_nodes, ndata=g.ndata, seed=seed)
        save_partitions(parts, folder)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return load_partition(folder, rank)
