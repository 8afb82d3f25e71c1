"""Partition a graph for distributed full-graph training.

Each rank owns the *inner* nodes of its partition and needs the rows of its
*halo* nodes (in-neighbours of inner nodes owned by other ranks) from their
owners; :class:`Partition` holds one rank's share, in the order the ranks
agree on (see :mod:`sylvie_comm.gnn.part`).

Partitioning is a pure function of (graph, method, number of parts, seed): the
same inputs give the same partition in any process, on any run, whichever
optional libraries are installed (METIS always runs through ``pymetis`` with an
explicit seed; ``"bfs"``, plain torch, needs nothing beyond torch; tested across
processes and thread counts). :func:`shared_partition` records a digest of
those inputs next to the parts and reuses a folder whose record matches, so
runs that compare settings train on the same partition.

A partition folder holds immutable versions and a pointer to the current one
(see :func:`save_partitions`); every part read back is checked, field by field,
against the invariants of :class:`Partition` and against the sizes and SHA-256 that
``meta.json`` records (:func:`load_partition`), so a damaged or tampered file
is a ValueError naming it, never out-of-range indices in the message passing.

This module turns a graph and an assignment into parts and is the front door:
it re-exports the partition API of the modules that hold the rest, so
``from sylvie_comm.gnn.partition import X`` works for every name in ``__all__``:

- :mod:`sylvie_comm.gnn.part`: the :class:`Partition` dataclass;
- :mod:`sylvie_comm.gnn.assign`: the node-assignment methods (``METHODS``,
  :func:`assign_metis`, :func:`assign_bfs`, :func:`assign_random`, :func:`canonical_labels`);
- :mod:`sylvie_comm.gnn.partition_check`: :func:`check_partition`, the field checks;
- :mod:`sylvie_comm.gnn.partition_store`: the folder (:func:`save_partitions`,
  :func:`load_partition`, :func:`recorded_inputs`, ``FORMAT``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from sylvie_comm.gnn import partition_store
from sylvie_comm.gnn.assign import (
    BFS_IMBALANCE,
    BFS_ROUNDS,
    BFS_STEP,
    METHODS,
    assign_bfs,
    assign_metis,
    assign_random,
    canonical_labels,
)
from sylvie_comm.gnn.part import Partition
from sylvie_comm.gnn.partition_check import check_partition
from sylvie_comm.gnn.partition_store import FORMAT, load_partition, recorded_inputs, save_partitions

__all__ = [
    "BFS_IMBALANCE",
    "BFS_ROUNDS",
    "BFS_STEP",
    "FORMAT",
    "MAX_SEED",
    "METHODS",
    "Partition",
    "assign_bfs",
    "assign_metis",
    "assign_random",
    "canonical_labels",
    "check_partition",
    "graph_digest",
    "load_partition",
    "partition",
    "partition_inputs",
    "recorded_inputs",
    "save_partitions",
    "shared_partition",
]

MAX_SEED = 2**31 - 1  # METIS keeps its seed in a 32-bit index on common builds


def _hash_tensor(h: Any, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous().reshape(-1)
    h.update(f"|{name}|{t.dtype}|{t.numel()}|".encode())
    h.update(t.view(torch.uint8).numpy().data)


def graph_digest(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, ndata: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the edges (as int64, in order), the node count and every node data tensor (name, dtype,
    shape and bytes)."""
    h = hashlib.sha256(f"nodes={num_nodes}".encode())
    _hash_tensor(h, "src", src.long())
    _hash_tensor(h, "dst", dst.long())
    for k in sorted(ndata):
        v = ndata[k]
        h.update(f"|shape={tuple(v.shape)}".encode())
        _hash_tensor(h, f"ndata/{k}", v)
    return h.hexdigest()


def partition_inputs(
    src: torch.Tensor,
    dst: torch.Tensor,
    num_nodes: int,
    ndata: Mapping[str, torch.Tensor],
    method: str,
    num_parts: int,
    seed: int,
) -> dict[str, Any]:
    """What a partition is a function of: the graph's digest, the method, the number of parts and the seed."""
    if not isinstance(method, str):
        raise TypeError(f"partition: a recorded partition needs a method name from {METHODS}, got {type(method)}")
    return {"graph": graph_digest(src, dst, num_nodes, ndata), "method": method, "num_parts": num_parts,
            "seed": seed}  # fmt: skip


# A torch_geometric Data's node data -> ours (the trainer reads 'feat' and 'label').
PYG_NODE_DATA = {"x": "feat", "y": "label", "train_mask": "train_mask", "val_mask": "val_mask",
                 "test_mask": "test_mask"}  # fmt: skip


def _is_pyg_data(graph: Any) -> bool:
    """A torch_geometric ``Data`` or ``HeteroData``, known by its class (PyG is not imported here)."""
    return any(c.__module__.startswith("torch_geometric.data") and c.__name__ in ("Data", "HeteroData")
               for c in type(graph).__mro__)  # fmt: skip


def _pyg_graph(data: Any) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, torch.Tensor]]:
    """Edges ``edge_index[0] -> edge_index[1]`` and node data (:data:`PYG_NODE_DATA`) of a PyG ``Data``."""
    expected = "expected a torch_geometric.data.Data with edge_index, x (node features) and y (node labels)"
    if not any(c.__name__ == "Data" for c in type(data).__mro__):
        raise TypeError(f"partition: got a {type(data).__name__} (a heterogeneous graph); {expected}")
    for key in ("edge_index", "x", "y"):
        if getattr(data, key, None) is None:
            raise ValueError(f"partition: the Data has no '{key}'; {expected}")
    edge_index = data.edge_index
    if not isinstance(edge_index, torch.Tensor):
        raise TypeError(f"partition: the Data's edge_index is a {type(edge_index).__name__}; expected a (2, E) "
                        "integer tensor")  # fmt: skip
    edge_index = edge_index.as_subclass(torch.Tensor)  # an EdgeIndex is a tensor of its own class
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"partition: the Data's edge_index has shape {tuple(edge_index.shape)}; expected (2, E)")
    if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
        raise TypeError(f"partition: the Data's edge_index is {edge_index.dtype}; expected integers")
    n = int(data.num_nodes)
    ndata = {}
    for key, name in PYG_NODE_DATA.items():
        value = getattr(data, key, None)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != n:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"partition: the Data's '{key}' has shape {got}; expected one row per node ({n}, ...)")
        ndata[name] = value
    return edge_index[0].long(), edge_index[1].long(), n, ndata


def _edges_of(graph: Any, num_nodes: int | None) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, torch.Tensor]]:
    if _is_pyg_data(graph):
        src, dst, n, ndata = _pyg_graph(graph)
        if num_nodes is not None and num_nodes != n:
            raise ValueError(f"partition: num_nodes={num_nodes} but the Data has {n} nodes; leave num_nodes out")
        return src, dst, n, ndata
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
    raise TypeError(f"partition: expected (src, dst) edge tensors, a DGLGraph or a torch_geometric Data, got "
                    f"{type(graph).__name__}")  # fmt: skip


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
        graph: a DGLGraph (its ``ndata`` is carried along), a ``torch_geometric.data.Data`` (edges
            ``edge_index[0] -> edge_index[1]``; ``x``, ``y`` and the masks carried along as ``feat``,
            ``label``, ``train_mask``, ``val_mask``, ``test_mask``; ``x`` and ``y`` required) or
            ``(src, dst)`` integer edge tensors (edge ``src -> dst``: ``dst`` aggregates ``src``).
        num_parts: partitions (ranks), 1 <= num_parts <= number of nodes.
        method: ``"metis"`` (pymetis, seeded), ``"bfs"`` (plain torch, seeded:
            see :func:`assign_bfs`), ``"random"`` (balanced), or an explicit
            assignment tensor of one part id per node.
        num_nodes: node count for edge tensors (default: largest id + 1).
        ndata: node data (features, labels, masks: first dimension = nodes)
            to split with the nodes.
        seed: in ``[0, 2**31)``, default 0: the random choices of ``"metis"``,
            ``"bfs"`` and ``"random"``. The same graph, method, ``num_parts`` and seed
            give the same partition in every process and on every run.
    """
    src, dst, n, graph_ndata = _edges_of(graph, num_nodes)
    data = {**graph_ndata, **(dict(ndata) if ndata else {})}
    _check_inputs(src, dst, n, data, num_parts, seed)
    assign = _assignment(method, src, dst, n, num_parts, seed)
    return _split(src, dst, n, data, assign, num_parts)


def _check_inputs(
    src: torch.Tensor, dst: torch.Tensor, n: int, data: Mapping[str, torch.Tensor], num_parts: Any, seed: Any
) -> None:
    """ValueError unless ``num_parts``, ``seed``, the edges' endpoints and the node data fit ``n`` nodes."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"partition: num_parts must be a positive integer, got {num_parts!r}")
    if num_parts > n:
        raise ValueError(f"partition: cannot split {n} nodes into {num_parts} non-empty partitions")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"partition: seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    if src.numel() and (min(src.min().item(), dst.min().item()) < 0 or max(src.max().item(), dst.max().item()) >= n):
        raise ValueError(f"partition: edge endpoints must lie in [0, {n}), got ids outside it")
    for k, v in data.items():
        if v.shape[0] != n:
            raise ValueError(f"partition: node data '{k}' has {v.shape[0]} rows, expected one per node ({n})")


# Method name -> its assignment: (src, dst, num_nodes, num_parts, seed) -> one part id per node.
_ASSIGN: dict[str, Callable[[torch.Tensor, torch.Tensor, int, int, int], torch.Tensor]] = {
    "metis": lambda src, dst, n, parts, seed: assign_metis(src, dst, n, parts, seed),
    "bfs": lambda src, dst, n, parts, seed: assign_bfs(src, dst, n, parts, seed),
    "random": lambda src, dst, n, parts, seed: assign_random(n, parts, seed),
}


def _assignment(
    method: str | torch.Tensor, src: torch.Tensor, dst: torch.Tensor, n: int, num_parts: int, seed: int
) -> torch.Tensor:
    """One part id per node, every part non-empty: ``method``'s (:data:`METHODS`) or the caller's tensor."""
    if isinstance(method, torch.Tensor):
        assign = method.long()
        if assign.shape != (n,) or (n and (assign.min() < 0 or assign.max() >= num_parts)):
            raise ValueError(f"partition: an assignment needs one part id in [0, {num_parts}) per node")
    elif isinstance(method, str) and method in _ASSIGN:
        assign = _ASSIGN[method](src, dst, n, num_parts, seed)
    else:
        raise ValueError(f"partition: unknown method {method!r}; expected one of {METHODS} or an assignment tensor")
    sizes = torch.bincount(assign, minlength=num_parts)
    if (sizes == 0).any():
        empty = torch.nonzero(sizes == 0).flatten().tolist()
        raise ValueError(f"partition: part(s) {empty} received no nodes; use fewer parts or method='random'")
    return assign


def _split(
    src: torch.Tensor, dst: torch.Tensor, n: int, data: Mapping[str, torch.Tensor], assign: torch.Tensor,
    num_parts: int,
) -> list[Partition]:  # fmt: skip
    """The :class:`Partition` of every part of ``assign``: its inner nodes (ascending), its halo (by owner, then
    id), its block of edges in local ids and what it sends each peer."""
    # Position of every node inside its owner's inner list (inner lists are ascending).
    order = torch.argsort(assign * n + torch.arange(n))
    local_id = torch.empty(n, dtype=torch.int64)
    starts = torch.zeros(num_parts + 1, dtype=torch.int64)
    starts[1:] = torch.bincount(assign, minlength=num_parts).cumsum(0)
    local_id[order] = torch.arange(n) - starts[assign[order]]
    halos, blocks = [], []
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
        blocks.append((inner, g2l[e_src], local_id[e_dst]))
    in_deg, out_deg = torch.bincount(dst, minlength=n), torch.bincount(src, minlength=n)
    parts = []
    for r, ((inner, lsrc, ldst), halo) in enumerate(zip(blocks, halos, strict=True)):
        # What rank r sends to rank p: p's halo rows owned by r, in p's order.
        send_idx = [local_id[halos[p][assign[halos[p]] == r]] if p != r else torch.zeros(0, dtype=torch.int64)
                    for p in range(num_parts)]  # fmt: skip
        halo_counts = torch.bincount(assign[halo], minlength=num_parts).tolist()
        parts.append(Partition(rank=r, num_parts=num_parts, num_nodes=n, inner=inner, halo=halo,
                               halo_counts=[int(c) for c in halo_counts], send_idx=send_idx, src=lsrc, dst=ldst,
                               in_degree=in_deg[inner], out_degree=out_deg[torch.cat([inner, halo])],
                               ndata={k: v[inner] for k, v in data.items()}))  # fmt: skip
    return parts


def shared_partition(
    make_graph: Callable[[], Any],
    rank: int,
    num_parts: int,
    folder: str | Path,
    method: str = "metis",
    seed: int = 0,
    transport: Any = None,
) -> Partition:
    """Partition on rank 0 unless ``folder`` already holds this partition; every rank loads its own part.

    A collective among the ranks of ``transport`` (any
    :class:`~sylvie_comm.collectives.Transport`: a process group's, Horovod's), or
    of the default process group when none is given and one is initialized;
    ``rank`` must be the process's rank there. Rank 0 builds the graph with ``make_graph()``
    (a :class:`~sylvie_comm.gnn.data.GraphData`, anything with ``src``,
    ``dst``, ``num_nodes`` and ``ndata``, or a ``torch_geometric.data.Data`` as
    :func:`partition` takes it; no other rank calls it), computes
    :func:`partition_inputs` and compares them with those recorded in
    ``folder`` (:func:`recorded_inputs`: only a complete folder, every part file
    of its recorded size and SHA-256, records any). Equal: the folder is reused
    as it is. Different, missing or damaged: it partitions and replaces the
    folder (atomically, see :func:`save_partitions`). If that fails, every rank
    raises. Otherwise rank 0 broadcasts the inputs and every rank loads (and
    checks, see :func:`load_partition`) its part and checks that the version it
    read records them (another run writing the same folder with other inputs
    raises instead of mixing partitions).

    Args:
        make_graph: builds the graph (rank 0 only).
        rank: this process's part.
        num_parts: the number of parts (= ranks).
        folder: where the parts live between runs.
        method: ``"metis"``, ``"bfs"`` or ``"random"``.
        seed: the partitioner's seed (see :func:`partition`).
        transport: the ranks (default: the default process group, if any).
    """
    folder = Path(folder)
    gather, my_rank = _object_gather(transport)
    if gather is not None and my_rank != rank:
        raise ValueError(f"shared_partition: rank {rank} is not this process's rank {my_rank}")
    inputs, failure = _publish(make_graph, folder, method, num_parts, seed) if rank == 0 else (None, None)
    if gather is not None:
        sent = gather(inputs if failure is None else _said(failure))[0]
        if isinstance(sent, str) and rank != 0:
            raise RuntimeError(f"shared_partition: rank 0 could not make the partition ({sent})")
        inputs = sent
    if failure is not None:
        raise failure
    part, error = _load_recorded(folder, rank, inputs)
    if gather is not None:
        # Every rank has loaded its part before any returns: rank 0's next call may rewrite the folder.
        statuses = gather(None if error is None else _said(error))
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if error is None and failed:
            r, s = failed[0]
            raise RuntimeError(f"shared_partition: rank {r} could not load its part ({s})")
    if error is not None:
        raise error
    assert part is not None
    return part


def _said(exc: BaseException) -> str:
    """An exception as the other ranks are told of it."""
    return f"{type(exc).__name__}: {exc}"


def _publish(
    make_graph: Callable[[], Any], folder: Path, method: str, num_parts: int, seed: int
) -> tuple[dict[str, Any] | None, BaseException | None]:
    """Rank 0's part of :func:`shared_partition`: the graph's :func:`partition_inputs`, its parts written to
    ``folder`` unless it records those inputs already; or the failure, to tell the other ranks instead of leaving
    them waiting."""
    try:
        g = make_graph()
        src, dst, n, ndata = _pyg_graph(g) if _is_pyg_data(g) else (g.src, g.dst, g.num_nodes, g.ndata)
        inputs = partition_inputs(src, dst, n, ndata, method, num_parts, seed)
        if recorded_inputs(folder) != inputs:
            parts = partition((src, dst), num_parts, method, num_nodes=n, ndata=ndata, seed=seed)
            save_partitions(parts, folder, inputs)
            del parts
        del g, src, dst, ndata
    except Exception as exc:
        return None, exc
    return inputs, None


def _load_recorded(
    folder: Path, rank: int, inputs: dict[str, Any] | None
) -> tuple[Partition | None, BaseException | None]:
    """This rank's part from ``folder``, which must record ``inputs`` (None: not checked); or the failure."""
    try:
        part, meta = partition_store._load(folder, rank)  # through the module: a test may replace it
        if inputs is not None and meta.get("inputs") != inputs:
            raise RuntimeError(
                f"shared_partition: {folder} was replaced with a partition of other inputs while rank {rank} "
                "loaded it; give concurrent runs with different inputs different folders"
            )
    except Exception as exc:
        return None, exc
    return part, None


def _object_gather(transport: Any) -> tuple[Callable[[Any], list[Any]] | None, int]:
    """The all-gather of picklable objects among ``transport``'s ranks (else the default process group's,
    else none: one process), and this process's rank there."""
    if transport is not None:
        return transport.all_gather_object, int(transport.rank)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, 0

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return gather, dist.get_rank()
