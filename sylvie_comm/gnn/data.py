"""Graphs for full-graph training: generated, shipped, and OGB from a local root.

* :func:`csbm`: a contextual stochastic block model generated on the fly: class
  means plus heavy feature noise, homophilous edges, so aggregating
  neighbours beats an MLP clearly. The embedded default.
* :func:`digits_knn`: a k-NN graph over scikit-learn's handwritten digits
  (the data ships inside scikit-learn), real labels.
* :func:`load_ogb`: OGB node-property data sets (``ogbn-arxiv``,
  ``ogbn-products``, ...) read with ``ogb`` from a local root, without
  downloads and without ogb 1.3.6's traps on current torch.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sylvie_comm import _deps

DATASETS = ("csbm", "digits", "ogbn-arxiv", "ogbn-products")


@dataclass
class GraphData:
    """Edges ``src -> dst`` and node data: ``feat``, ``label``, ``train_mask``, ``val_mask``, ``test_mask``."""

    name: str
    src: torch.Tensor
    dst: torch.Tensor
    num_nodes: int
    ndata: dict[str, torch.Tensor]
    num_classes: int

    @property
    def num_edges(self) -> int:
        return int(self.src.numel())


def _split_masks(n: int, gen: torch.Generator, train: float = 0.6, val: float = 0.2) -> dict[str, torch.Tensor]:
    perm = torch.randperm(n, generator=gen)
    a, b = int(train * n), int((train + val) * n)
    masks = {k: torch.zeros(n, dtype=torch.bool) for k in ("train_mask", "val_mask", "test_mask")}
    masks["train_mask"][perm[:a]] = True
    masks["val_mask"][perm[a:b]] = True
    masks["test_mask"][perm[b:]] = True
    return masks


def symmetrize(src: torch.Tensor, dst: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both directions of every edge, no self loops, no duplicates."""
    keep = src != dst
    s = torch.cat([src[keep], dst[keep]])
    d = torch.cat([dst[keep], src[keep]])
    key = torch.unique(s * n + d)
    return key // n, key % n


def csbm(
    num_nodes: int = 4000,
    num_classes: int = 8,
    feat_dim: int = 64,
    avg_degree: float = 20.0,
    homophily: float = 0.6,
    signal: float = 0.3,
    communities: int = 0,
    locality: float = 0.9,
    seed: int = 0,
) -> GraphData:
    """A contextual stochastic block model.

    Each node gets a class, features ``signal * mu_class + N(0, I)`` (the class
    means are random unit-variance vectors scaled so a single node is hard to
    classify), and about ``avg_degree`` undirected edges, each joining two nodes
    of the same class with probability ``homophily``. With ``communities > 0``
    the nodes also fall into that many equal blocks of consecutive ids and a
    fraction ``locality`` of the edges stays inside a block (whatever the
    classes), as in real graphs with community structure: METIS then finds
    small edge cuts, where on a pure block model every partition's halo is most
    of the graph.
    """
    if num_nodes < num_classes or num_classes < 2:
        raise ValueError(f"csbm: need num_classes >= 2 and num_nodes >= num_classes, got {num_nodes}, {num_classes}")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"csbm: homophily must be in [0, 1], got {homophily}")
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    y[:num_classes] = torch.arange(num_classes)  # every class present
    means = torch.randn(num_classes, feat_dim, generator=gen) / feat_dim**0.25
    x = signal * means[y] + torch.randn(num_nodes, feat_dim, generator=gen)
    m = int(num_nodes * avg_degree / 2)
    src = torch.randint(0, num_nodes, (m,), generator=gen)
    same = torch.rand(m, generator=gen) < homophily
    # Nodes sorted by class: a same-class partner is a random position inside the class's range.
    by_class = torch.argsort(y)
    counts = torch.bincount(y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    cls = y[src]
    partner = by_class[starts[cls] + (torch.rand(m, generator=gen) * counts[cls]).long().clamp(max=counts[cls] - 1)]
    dst = torch.where(same, partner, torch.randint(0, num_nodes, (m,), generator=gen))
    if communities > 0:
        size = -(-num_nodes // communities)
        block_start = (src // size) * size
        local = block_start + (torch.rand(m, generator=gen) * size).long()
        inside = (torch.rand(m, generator=gen) < locality) & (local < num_nodes)
        dst = torch.where(inside, local, dst)
    src, dst = symmetrize(src, dst, num_nodes)
    ndata = {"feat": x.float(), "label": y, **_split_masks(num_nodes, gen)}
    return GraphData("csbm", src, dst, num_nodes, ndata, num_classes)


def digits_knn(k: int = 10, seed: int = 0) -> GraphData:
    """A symmetric k-nearest-neighbour graph over scikit-learn's 1797 handwritten digits (64 features)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    dist = torch.cdist(x, x)
    dist.fill_diagonal_(float("inf"))
    nbr = dist.topk(k, largest=False).indices
    src = nbr.reshape(-1)
    dst = torch.arange(len(x)).repeat_interleave(k)
    src, dst = symmetrize(src, dst, len(x))
    gen = torch.Generator().manual_seed(seed)
    return GraphData("digits", src, dst, len(x), {"feat": x, "label": y, **_split_masks(len(x), gen)}, 10)


@contextlib.contextmanager
def _ogb_compat() -> Iterator[None]:
    """Run ogb 1.3.6 quietly on current torch.

    * It asks on stdin whether to re-download when ``RELEASE_v1.txt`` is
      missing: answer no (keep the local data).
    * It reloads ``processed/data_processed`` and ``split_dict.pt`` with
      ``torch.load``, whose ``weights_only`` default rejects its pickles: load
      those with ``weights_only=False`` (files ogb itself wrote from the local
      raw data).
    """
    original_input, original_load = builtins.input, torch.load

    def no_update(prompt: object = "") -> str:
        return "n"

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("weights_only", False)
        return original_load(*args, **kwargs)

    builtins.input = no_update
    torch.load = load
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        builtins.input = original_input
        torch.load = original_load


def load_ogb(name: str, root: str | os.PathLike[str], to_undirected: bool = True) -> GraphData:
    """An OGB node-property data set from ``root`` (its extracted folder, e.g. ``root/ogbn_arxiv``).

    Nothing is downloaded: a missing folder is an error that says where the
    data must be. ``processed/`` is created if missing (ogb 1.3.6 writes into it
    without creating it). Labels are flattened; splits become masks; with
    ``to_undirected`` (default) edges are symmetrized, as is usual for
    ogbn-arxiv.
    """
    _deps.require("ogb")
    from ogb.nodeproppred import NodePropPredDataset

    folder = Path(root) / name.replace("-", "_")
    raw, processed = folder / "raw", folder / "processed"
    if not (processed / "data_processed").exists() and not (raw / "edge.csv.gz").exists():
        raise FileNotFoundError(
            f"load_ogb: no {name} data under {folder} (expected raw/edge.csv.gz or processed/data_processed); "
            "download and extract it there first (this loader never downloads)"
        )
    processed.mkdir(exist_ok=True)
    with _ogb_compat():
        ds = NodePropPredDataset(name=name, root=str(root))
        split = ds.get_idx_split()
    graph, labels = ds[0]
    n = int(graph["num_nodes"])
    src = torch.as_tensor(graph["edge_index"][0], dtype=torch.int64)
    dst = torch.as_tensor(graph["edge_index"][1], dtype=torch.int64)
    if to_undirected:
        src, dst = symmetrize(src, dst, n)
    ndata: dict[str, torch.Tensor] = {
        "feat": torch.as_tensor(graph["node_feat"], dtype=torch.float32),
        "label": torch.as_tensor(labels, dtype=torch.int64).reshape(-1),
    }
    for key, mask in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.as_tensor(split[key], dtype=torch.int64)] = True
        ndata[mask] = m
    return GraphData(name, src, dst, n, ndata, int(ds.num_classes))


def load_dataset(name: str, root: str | None = None, **options: Any) -> GraphData:
    """By name: ``csbm`` (options: see :func:`csbm`), ``digits``, or an OGB name with ``root``."""
    if name == "csbm":
        return csbm(**options)
    if name == "digits":
        return digits_knn(**options)
    if name.startswith("ogbn-"):
        if root is None:
            raise ValueError(f"load_dataset: {name} needs root= (the folder holding its extracted data)")
        return load_ogb(name, root, **options)
    raise ValueError(f"load_dataset: unknown data set {name!r}; expected one of {DATASETS} (or another ogbn-*)")
