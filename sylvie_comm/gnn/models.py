"""Full-graph GraphSAGE (mean) and GCN on a partition's local block.

Each layer first completes its input with the halo rows (``[inner; halo]``,
through :func:`~sylvie_comm.gnn.halo.halo_exchange`) and then aggregates over
the local block, which holds every in-edge of every inner node. GCN uses the
global degrees stored in the partition, so its normalization equals the full
graph's. Two backends compute the same layers: ``"dgl"`` (DGL's SAGEConv and
GraphConv on a block) and ``"torch"`` (index_add aggregation, no DGL needed).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm import _deps
from sylvie_comm.gnn.halo import HaloPipeline, halo_exchange
from sylvie_comm.gnn.partition import Partition

MODELS = ("sage", "gcn")
BACKENDS = ("auto", "dgl", "torch")


class LocalGraph:
    """A partition's block, its degree normalizers and (with several ranks) its halo pipeline."""

    def __init__(self, part: Partition, pipeline: HaloPipeline | None = None) -> None:
        if pipeline is None and part.n_halo:
            raise ValueError(f"LocalGraph: partition {part.rank} has {part.n_halo} halo nodes but no halo pipeline")
        self.part = part
        self.pipeline = pipeline
        self.n_inner, self.n_halo = part.n_inner, part.n_halo
        self.src, self.dst = part.src, part.dst
        self.in_degree = part.in_degree.clamp(min=1).float()
        self.in_norm = self.in_degree.pow(-0.5)
        self.out_norm = part.out_degree.clamp(min=1).float().pow(-0.5)
        self._block: Any = None
        self._adjacency: torch.Tensor | None = None

    def exchange(self, layer: int, h_inner: torch.Tensor) -> torch.Tensor:
        if self.pipeline is None:
            return h_inner
        return halo_exchange(h_inner, self.pipeline, layer)

    def sum_neighbors(self, h_src: torch.Tensor) -> torch.Tensor:
        """Sum over in-neighbours: a sparse (CSR) product, which never materializes per-edge messages
        (an edges x features tensor: gigabytes on a 200k-node graph)."""
        if self._adjacency is None:
            indices = torch.stack([self.dst, self.src])
            values = torch.ones(self.src.numel())
            shape = (self.n_inner, self.n_inner + self.n_halo)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch flags sparse CSR as beta
                self._adjacency = torch.sparse_coo_tensor(indices, values, shape).coalesce().to_sparse_csr()
        return self._adjacency @ h_src

    def first_aggregate(self, model: str, x_full: torch.Tensor) -> torch.Tensor:
        """The neighbour aggregate of the (fixed) input features, computed once: the first layer then
        needs no halo exchange at all. SAGE: the neighbour mean; GCN: ``D_in^-1/2 A D_out^-1/2 X``."""
        if model == "sage":
            return self.sum_neighbors(x_full) / self.in_degree[:, None]
        return self.sum_neighbors(x_full * self.out_norm[:, None]) * self.in_norm[:, None]

    def block(self) -> Any:
        if self._block is None:
            dgl = _deps.import_dgl()
            self._block = dgl.create_block(
                (self.src, self.dst), num_src_nodes=self.n_inner + self.n_halo, num_dst_nodes=self.n_inner
            )
        return self._block


class SAGELayer(nn.Module):
    """``W_self h_v + W_neigh mean_{u -> v} h_u + b`` (GraphSAGE, mean aggregator)."""

    def __init__(self, in_dim: int, out_dim: int, backend: str) -> None:
        super().__init__()
        self.backend = backend
        if backend == "dgl":
            self.conv = _deps.import_dgl().nn.SAGEConv(in_dim, out_dim, "mean")
        else:
            self.fc_self = nn.Linear(in_dim, out_dim, bias=True)
            self.fc_neigh = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, g: LocalGraph, h_full: torch.Tensor) -> torch.Tensor:
        h_dst = h_full[: g.n_inner]
        if self.backend == "dgl":
            return self.conv(g.block(), (h_full, h_dst))  # type: ignore[no-any-return]
        mean = g.sum_neighbors(h_full) / g.in_degree[:, None]
        return self.fc_self(h_dst) + self.fc_neigh(mean)  # type: ignore[no-any-return]

    def forward_first(self, g: LocalGraph, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The same layer from a precomputed neighbour mean."""
        m = self.conv if self.backend == "dgl" else self
        return m.fc_self(x) + m.fc_neigh(mean)  # type: ignore[no-any-return]


class GCNLayer(nn.Module):
    """``D_in^-1/2 A D_out^-1/2 H W + b`` with global degrees (Kipf & Welling)."""

    def __init__(self, in_dim: int, out_dim: int, backend: str) -> None:
        super().__init__()
        self.backend = backend
        if backend == "dgl":
            dgl = _deps.import_dgl()
            self.conv = dgl.nn.GraphConv(in_dim, out_dim, norm="none", bias=False, allow_zero_in_degree=True)
        else:
            self.weight = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward_first(self, g: LocalGraph, x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        """The same layer from the precomputed normalized aggregate of the input."""
        if self.backend == "dgl":
            out: torch.Tensor = agg @ self.conv.weight + self.bias
            return out
        return self.weight(agg) + self.bias  # type: ignore[no-any-return]

    def forward(self, g: LocalGraph, h_full: torch.Tensor) -> torch.Tensor:
        hs = h_full * g.out_norm[:, None]
        if self.backend == "dgl":
            agg: torch.Tensor = self.conv(g.block(), (hs, hs[: g.n_inner]))
        else:
            agg = g.sum_neighbors(self.weight(hs))
        return agg * g.in_norm[:, None] + self.bias


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"gnn: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "dgl" if _deps.with_dgl() else "torch"
    if backend == "dgl":
        _deps.require("dgl")
    return backend


class FullGraphGNN(nn.Module):
    """A stack of full-graph layers with ReLU and dropout between them.

    Args:
        model: ``"sage"`` or ``"gcn"``.
        in_dim, hidden, out_dim: feature widths.
        num_layers: layers (>= 1); every layer exchanges halo rows.
        dropout: between layers.
        backend: ``"auto"`` (DGL when it imports), ``"dgl"`` or ``"torch"``.
    """

    def __init__(
        self,
        model: str,
        in_dim: int,
        hidden: int,
        out_dim: int,
        num_layers: int = 2,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"gnn: model must be one of {MODELS}, got {model!r}")
        if num_layers < 1:
            raise ValueError(f"gnn: num_layers must be >= 1, got {num_layers}")
        self.backend = resolve_backend(backend)
        layer_cls = SAGELayer if model == "sage" else GCNLayer
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(layer_cls(a, b, self.backend) for a, b in itertools.pairwise(dims))
        self.dropout = dropout

    def forward(self, g: LocalGraph, x: torch.Tensor, first_aggregate: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the inner nodes. With ``first_aggregate`` (see :meth:`LocalGraph.first_aggregate`)
        the first layer uses it instead of exchanging halo rows of the input."""
        if x.dim() != 2 or x.shape[0] != g.n_inner:
            raise ValueError(
                f"gnn: expected features of shape ({g.n_inner}, F) for the inner nodes, got {tuple(x.shape)}"
            )
        h = x
        for i, layer in enumerate(self.layers):
            if i == 0 and first_aggregate is not None:
                h = layer.forward_first(g, x, first_aggregate)  # type: ignore[operator]
            else:
                h = layer(g, g.exchange(i, h))
            if i + 1 < len(self.layers):
                h = F.relu(h)
                h = F.dropout(h, self.dropout, self.training)
        return h
