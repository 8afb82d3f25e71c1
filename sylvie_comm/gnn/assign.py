"""Assign every node of a graph to a part: the methods :func:`sylvie_comm.gnn.partition.partition` names.

``METHODS`` lists them: ``"metis"`` (:func:`assign_metis`: pymetis, seeded),
``"random"`` (:func:`assign_random`: balanced) and ``"bfs"``
(:func:`assign_bfs`: balanced BFS region growing and boundary refinement in
plain torch). Each returns one part id (int64) per node and is a pure function
of the graph, the number of parts and the seed; :func:`canonical_labels`
numbers parts by their smallest node, so the same parts are one assignment.
"""

from __future__ import annotations

import math

import torch

from sylvie_comm import _deps
from sylvie_comm.gnn.data import symmetrize

METHODS = ("metis", "random", "bfs")


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


BFS_ROUNDS = 16  # refinement passes of the "bfs" partitioner
BFS_STEP = 0.05  # the fraction of its frontier a growing part takes per iteration
BFS_IMBALANCE = 0.03  # how far (as a fraction of n / parts) its refinement may take a part from its target size


def _neighbours(nodes: torch.Tensor, rowptr: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Every neighbour of every node in ``nodes`` (a CSR ``rowptr``/``col``), with repeats."""
    starts, counts = rowptr[nodes], rowptr[nodes + 1] - rowptr[nodes]
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return col[torch.repeat_interleave(starts, counts) + offsets]


def _allowed_moves(wanted: torch.Tensor, sizes: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """How many of the ``wanted[a, b]`` moves from part a to part b to make, sizes kept in [lo, hi]:
    pairs of opposite moves (swaps) first, then one-way moves while both parts stay in bounds."""
    allowed = torch.minimum(wanted, wanted.T)
    extra = (wanted - allowed).tolist()
    size = sizes.tolist()
    k = len(size)
    for a in range(k):
        for b in range(k):
            n = min(extra[a][b], size[a] - lo, hi - size[b])
            if n > 0:
                allowed[a, b] += n
                size[a] -= n
                size[b] += n
    return allowed


def _stable_order(*keys: torch.Tensor) -> torch.Tensor:
    """The permutation sorting by ``keys[0]``, then ``keys[1]``, ... (each ascending; ties keep their order)."""
    order = torch.arange(keys[0].numel())
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    return order


def _grow(
    rowptr: torch.Tensor, col: torch.Tensor, target: torch.Tensor, order: torch.Tensor, prio: torch.Tensor, step: float
) -> torch.Tensor:
    """Greedy region growing: part after part, each from a seed next to the previous part, each iteration
    taking the ``step`` fraction of the frontier with the most edges into the part (ties: priority)."""
    n, k = int(prio.numel()), int(target.numel())
    assign = torch.full((n,), -1, dtype=torch.int64)
    degree = rowptr[1:] - rowptr[:-1]
    seeds, at = order[degree[order] > 0], 0  # connected nodes in priority order
    inward = torch.zeros(n, dtype=torch.int64)  # edges into the part being grown, of its frontier nodes
    empty = torch.zeros(0, dtype=torch.int64)
    boundary = empty
    for p in range(k):
        room, frontier = int(target[p]), empty
        inward.zero_()
        while room > 0:
            if frontier.numel() == 0:
                near = boundary[assign[boundary] < 0]
                if near.numel():  # next to the previous part: what is left of the graph stays in one piece
                    take = near[torch.argmin(prio[near])].view(1)
                else:
                    while at < seeds.numel():
                        free = torch.nonzero(assign[seeds[at : at + 4096]] < 0)
                        if free.numel():
                            at += int(free[0])
                            break
                        at += 4096
                    if at >= seeds.numel():
                        break  # only isolated nodes are left
                    take = seeds[at].view(1)
            else:
                count = min(room, max(1, math.ceil(frontier.numel() * step)))
                take = frontier[_stable_order(-inward[frontier], prio[frontier])[:count]]
            assign[take] = p
            room -= int(take.numel())
            reached = _neighbours(take, rowptr, col)
            reached = reached[assign[reached] < 0]
            inward.index_add_(0, reached, torch.ones_like(reached))
            frontier = torch.unique(torch.cat([frontier[assign[frontier] < 0], reached]))
        boundary = frontier
    rest = order[assign[order] < 0]  # isolated nodes, small components: the parts' remaining room
    spare = target - torch.bincount(assign[assign >= 0], minlength=k)
    assign[rest] = torch.repeat_interleave(torch.arange(k), spare)
    return assign


def _refine(
    s: torch.Tensor, d: torch.Tensor, assign: torch.Tensor, prio: torch.Tensor, target: torch.Tensor,
    rounds: int, gen: torch.Generator,
) -> torch.Tensor:  # fmt: skip
    """Balanced label propagation: ``rounds`` passes moving boundary nodes (a random half per pass) to the
    part most of their neighbours are in when that cuts fewer edges; returns the best assignment seen."""
    n, k = int(assign.numel()), int(target.numel())
    hi = max(int(target.max()), int(n / k * (1 + BFS_IMBALANCE)))
    lo = max(1, min(int(target.min()), math.ceil(n / k * (1 - BFS_IMBALANCE))))
    best, best_cut = assign.clone(), int((assign[s] != assign[d]).sum())
    for _ in range(rounds):
        key, count = torch.unique(s * k + assign[d], return_counts=True)  # edges from each node into each part
        node, part = key // k, key % k
        own = part == assign[node]
        inside = torch.zeros(n, dtype=torch.int64)
        inside[node[own]] = count[own]
        score = torch.where(own, -1, count * k + (k - 1 - part))  # most edges, then the lowest part id
        top = torch.full((n,), -1, dtype=torch.int64).scatter_reduce_(0, node, score, "amax")
        gain = top // k - inside
        coin = torch.randint(0, 2, (n,), generator=gen) == 1
        cand = torch.nonzero((top >= 0) & (gain > 0) & coin).view(-1)
        if cand.numel() == 0:
            continue
        b = (k - 1) - top[cand] % k
        pair = assign[cand] * k + b
        by = _stable_order(pair, -gain[cand], prio[cand])  # per (from, to): the largest gains first
        cand, b, pair = cand[by], b[by], pair[by]
        wanted = torch.bincount(pair, minlength=k * k)
        allowed = _allowed_moves(wanted.view(k, k), torch.bincount(assign, minlength=k), lo, hi).view(-1)
        rank_in_pair = torch.arange(cand.numel()) - (wanted.cumsum(0) - wanted)[pair]
        take = rank_in_pair < allowed[pair]
        assign[cand[take]] = b[take]
        cut = int((assign[s] != assign[d]).sum())
        if cut < best_cut:
            best, best_cut = assign.clone(), cut
    return best


def assign_bfs(
    src: torch.Tensor,
    dst: torch.Tensor,
    num_nodes: int,
    num_parts: int,
    seed: int = 0,
    rounds: int = BFS_ROUNDS,
    step: float = BFS_STEP,
) -> torch.Tensor:
    """Balanced greedy BFS region growing, then balanced boundary refinement: a partitioner in plain torch.

    The parts grow one after the other over the symmetrized graph, each from a
    seed next to the previous part (the first from a random node) up to its
    size (``num_nodes // num_parts``, the first ``num_nodes % num_parts``
    parts one more): each iteration adds the ``step`` fraction of the frontier
    with the most edges into the part (a breadth-first search that follows
    dense regions). Nodes no growth reaches (isolated ones, small components)
    fill the parts' remaining room. Then ``rounds`` passes of balanced label
    propagation move boundary nodes (a seeded random half per pass) to the part
    most of their neighbours are in when that cuts fewer edges, every part
    kept within ``BFS_IMBALANCE`` of ``num_nodes / num_parts``; the assignment
    with the fewest cut edges is kept.

    Deterministic: integer arithmetic, sorts and random choices from a
    ``torch.Generator`` seeded with ``seed``, so the same graph and seed give
    the same parts on every machine, whatever the number of threads. Cuts far
    fewer edges than ``"random"`` on graphs with locality, more than METIS.
    """
    n, k = num_nodes, num_parts
    if k == 1:
        return torch.zeros(n, dtype=torch.int64)
    s, d = symmetrize(src, dst, n)  # sorted by (s, d): a CSR
    rowptr = torch.zeros(n + 1, dtype=torch.int64)
    rowptr[1:] = torch.bincount(s, minlength=n).cumsum(0)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen)
    prio = torch.empty(n, dtype=torch.int64)
    prio[order] = torch.arange(n)
    target = torch.full((k,), n // k, dtype=torch.int64)
    target[: n % k] += 1
    assign = _grow(rowptr, d, target, order, prio, step)
    return canonical_labels(_refine(s, d, assign, prio, target, rounds, gen), k)


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
