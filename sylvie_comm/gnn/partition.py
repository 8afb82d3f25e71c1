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

Partitioning is a pure function of (graph, method, number of parts, seed): the
same inputs give the same partition in any process, on any run, whichever
optional libraries are installed (METIS always runs through ``pymetis`` with an
explicit seed; tested across processes). :func:`shared_partition` records a
digest of those inputs next to the parts and reuses a folder whose record
matches, so runs that compare settings train on the same partition.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sylvie_comm import _deps
from sylvie_comm.gnn.data import symmetrize

METHODS = ("metis", "random")
MAX_SEED = 2**31 - 1  # METIS keeps its seed in a 32-bit index on common builds
_PART_FILE = re.compile(r"part\d+\.pt")


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


def save_partitions(parts: list[Partition], folder: str | Path, inputs: Mapping[str, Any] | None = None) -> Path:
    """Write every partition; each rank later loads only its own with :func:`load_partition`.

    The files are written into a fresh folder next to ``folder`` that then takes
    its place in one rename, so a reader sees the previous complete partition or
    the new complete one, never a half-written mix (nor one left by a crash).
    An existing ``folder`` is replaced; it may hold only a partition's files
    (``meta.json``, ``part<r>.pt``), so nothing else is ever deleted.

    Args:
        parts: every rank's partition, as :func:`partition` returns them.
        folder: where to write.
        inputs: what the parts were made from (see :func:`partition_inputs`),
            recorded in ``meta.json`` for :func:`shared_partition` to compare.
    """
    if not parts:
        raise ValueError("save_partitions: expected at least one partition, got none")
    folder = Path(folder)
    _check_only_partition_files(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.writing-", dir=folder.parent))
    try:
        meta: dict[str, Any] = {"num_parts": len(parts), "num_nodes": parts[0].num_nodes, "format": 1}
        if inputs is not None:
            meta["inputs"] = dict(inputs)
        (staging / "meta.json").write_text(json.dumps(meta))
        for p in parts:
            p.save(staging)
        _publish(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _check_only_partition_files(folder: Path) -> None:
    if not folder.exists():
        return
    if not folder.is_dir():
        raise NotADirectoryError(f"partition: {folder} exists and is not a folder; expected a partition folder")
    foreign = sorted(p.name for p in folder.iterdir() if p.name != "meta.json" and not _PART_FILE.fullmatch(p.name))
    if foreign:
        raise ValueError(
            f"partition: {folder} holds files that are not a partition's ({', '.join(foreign[:5])}); "
            "expected a new folder or one written by save_partitions (it is replaced as a whole)"
        )


def _publish(staging: Path, folder: Path) -> None:
    """Move the complete folder ``staging`` to ``folder`` (each step one atomic rename)."""
    while True:
        try:
            os.replace(staging, folder)  # succeeds when folder is missing or an empty folder
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        retired = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:12]}")
        try:
            os.replace(folder, retired)
        except FileNotFoundError:
            continue  # another writer moved it away first; try again
        shutil.rmtree(retired, ignore_errors=True)


def load_partition(folder: str | Path, rank: int) -> Partition:
    """Load one rank's partition from a folder written by :func:`save_partitions`."""
    folder = Path(folder)
    meta = _read_meta(folder)
    if not 0 <= rank < meta["num_parts"]:
        raise ValueError(f"partition: rank {rank} is outside the {meta['num_parts']} partitions in {folder}")
    state = torch.load(folder / f"part{rank}.pt", weights_only=True)
    return Partition(**state)


def _read_meta(folder: Path) -> dict[str, Any]:
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"partition: {folder} has no meta.json; write it with save_partitions()")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    return meta


def recorded_inputs(folder: str | Path) -> dict[str, Any] | None:
    """The inputs recorded in a complete partition folder, or None (no folder, no record, a part missing)."""
    folder = Path(folder)
    try:
        meta = _read_meta(folder)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    num_parts = meta.get("num_parts")
    if not isinstance(num_parts, int) or not all((folder / f"part{r}.pt").is_file() for r in range(num_parts)):
        return None
    inputs = meta.get("inputs")
    return inputs if isinstance(inputs, dict) else None


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


def assign_metis(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, num_parts: int, seed: int = 0) -> torch.Tensor:
    """METIS (edge-cut minimizing) assignment through pymetis, seeded.

    Deterministic: METIS gets the symmetrized graph as a sorted CSR (row by row,
    neighbours ascending) and ``seed`` for its random choices, so the same
    inputs give the same parts in every process. DGL's METIS is not used: the
    result must not depend on whether DGL is installed, and DGL's has been seen
    to return different parts in different processes.
    """
    if num_parts == 1:
        return torch.zeros(num_nodes, dtype=torch.int64)
    _deps.require("pymetis")
    import numpy as np
    import pymetis

    s, d = symmetrize(src, dst, num_nodes)  # unique (s, d) pairs in ascending order: a canonical CSR
    xadj = torch.zeros(num_nodes + 1, dtype=torch.int64)
    xadj[1:] = torch.bincount(s, minlength=num_nodes).cumsum(0)
    options = pymetis.Options(seed=seed)
    if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025.2; older ones take xadj/adjncy
        result = pymetis.part_graph(num_parts, pymetis.CSRAdjacency(xadj.numpy(), d.numpy()), options=options)
    else:
        result = pymetis.part_graph(num_parts, xadj=xadj.numpy(), adjncy=d.numpy(), options=options)
    membership = np.asarray(result[1], dtype=np.int64)
    return canonical_labels(torch.from_numpy(membership), num_parts)


def canonical_labels(assign: torch.Tensor, num_parts: int) -> torch.Tensor:
    """Renumber parts by their smallest node id.

    The same parts under different labels are then one assignment: rank r owns
    the part that holds the r-th smallest "first node", whatever number the
    partitioner gave it.
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
        method: ``"metis"`` (pymetis, seeded), ``"random"`` (balanced), or
            an explicit assignment tensor of one part id per node.
        num_nodes: node count for edge tensors (default: largest id + 1).
        ndata: node data (features, labels, masks: first dimension = nodes)
            to split with the nodes.
        seed: in ``[0, 2**31)``, default 0: the random choices of ``"metis"``
            and ``"random"``. The same graph, method, ``num_parts`` and seed
            give the same partition in every process and on every run.
    """
    src, dst, n, graph_ndata = _edges_of(graph, num_nodes)
    data = {**graph_ndata, **(dict(ndata) if ndata else {})}
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

    if isinstance(method, torch.Tensor):
        assign = method.long()
        if assign.shape != (n,) or (n and (assign.min() < 0 or assign.max() >= num_parts)):
            raise ValueError(f"partition: an assignment needs one part id in [0, {num_parts}) per node")
    elif method == "random":
        assign = assign_random(n, num_parts, seed)
    elif method == "metis":
        assign = assign_metis(src, dst, n, num_parts, seed)
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
    transport: Any = None,
) -> Partition:
    """Partition on rank 0 unless ``folder`` already holds this partition; every rank loads its own part.

    A collective among the ranks of ``transport`` (any
    :class:`~sylvie_comm.collectives.Transport`: a process group's, Horovod's), or
    of the default process group when none is given and one is initialized;
    ``rank`` must be the process's rank there. Rank 0 builds the graph with ``make_graph()``
    (a :class:`~sylvie_comm.gnn.data.GraphData`, or anything with ``src``,
    ``dst``, ``num_nodes`` and ``ndata``; no other rank calls it), computes
    :func:`partition_inputs` and compares them with those recorded in
    ``folder``. Equal: the folder is reused as it is. Different or missing: it
    partitions and replaces the folder (atomically, see :func:`save_partitions`).
    If that fails, every rank raises. Otherwise rank 0 broadcasts the inputs
    and every rank loads its part and checks that the folder still records them
    (another run writing the same folder with other inputs raises instead of
    mixing partitions).

    Args:
        make_graph: builds the graph (rank 0 only).
        rank, num_parts: this process's part and the number of parts (= ranks).
        folder: where the parts live between runs.
        method: ``"metis"`` or ``"random"``.
        seed: the partitioner's seed (see :func:`partition`).
        transport: the ranks (default: the default process group, if any).
    """
    folder = Path(folder)
    gather, my_rank = _object_gather(transport)
    distributed = gather is not None
    if distributed and my_rank != rank:
        raise ValueError(f"shared_partition: rank {rank} is not this process's rank {my_rank}")
    inputs: dict[str, Any] | None = None
    failure: BaseException | None = None
    if rank == 0:
        try:
            g = make_graph()
            inputs = partition_inputs(g.src, g.dst, g.num_nodes, g.ndata, method, num_parts, seed)
            if recorded_inputs(folder) != inputs:
                parts = partition((g.src, g.dst), num_parts, method, num_nodes=g.num_nodes, ndata=g.ndata, seed=seed)
                save_partitions(parts, folder, inputs)
                del parts
            del g
        except Exception as exc:  # tell the other ranks instead of leaving them waiting
            failure = exc
    if gather is not None:
        sent = gather(inputs if failure is None else f"{type(failure).__name__}: {failure}")[0]
        if isinstance(sent, str) and rank != 0:
            raise RuntimeError(f"shared_partition: rank 0 could not make the partition ({sent})")
        inputs = sent
    if failure is not None:
        raise failure
    part: Partition | None = None
    error: BaseException | None = None
    try:
        part = load_partition(folder, rank)
        if inputs is not None and recorded_inputs(folder) != inputs:
            raise RuntimeError(
                f"shared_partition: {folder} was replaced with a partition of other inputs while rank {rank} "
                "loaded it; give concurrent runs with different inputs different folders"
            )
    except Exception as exc:
        error = exc
    if gather is not None:
        # Every rank has loaded its part before any returns: rank 0's next call may rewrite the folder.
        statuses = gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if error is None and failed:
            r, s = failed[0]
            raise RuntimeError(f"shared_partition: rank {r} could not load its part ({s})")
    if error is not None:
        raise error
    assert part is not None
    return part


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
