"""Full-graph GraphSAGE (mean) and GCN on a partition's local block.

Each layer first completes its input with the halo rows (``[inner; halo]``,
through :func:`~sylvie_comm.gnn.halo.halo_exchange`) and then aggregates over
the local block, which holds every in-edge of every inner node. GCN uses the
global degrees stored in the partition, so its normalization equals the full
graph's.

One model, two aggregation backends. The layers own their parameters
(``nn.Linear``) and compute the same function in the same order whichever
backend sums over the neighbours: ``"torch"`` (a sparse CSR product, no DGL
needed) or ``"dgl"`` (DGL's fused sparse-dense kernel on a block). With the
same seed both backends start from the same weights and, step after step, give
the same logits up to float rounding (tested).

Initialization (one, for both backends): every weight matrix and the SAGE bias
as ``torch.nn.Linear`` initializes them (Kaiming-uniform with ``a=sqrt(5)``,
i.e. ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``), the GCN bias zero. DGL's own
``SAGEConv`` uses Xavier-uniform with gain ``sqrt(2)`` instead, which trains a
different (and on our generated graphs much worse) model under Adam; that is why
DGL is used for the aggregation only.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
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
        self._adjacency: torch.Tensor | None = None
        self._block: Any = None
        self._sums: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "torch": self._sum_torch,
            "dgl": self._sum_dgl,
        }

    def exchange(self, layer: int, h_inner: torch.Tensor) -> torch.Tensor:
        if self.pipeline is None:
            return h_inner
        return halo_exchange(h_inner, self.pipeline, layer)

    def sum_neighbors(self, h_src: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """Sum of ``h_src`` (rows ``[inner; halo]``) over the in-neighbours of every inner node.

        Args:
            h_src: ``(n_inner + n_halo, F)``.
            backend: ``"torch"`` or ``"dgl"``; the two differ only in float rounding.
        """
        if backend not in self._sums:
            raise ValueError(f"LocalGraph: backend must be one of {sorted(self._sums)}, got {backend!r}")
        if h_src.shape[0] != self.n_inner + self.n_halo:
            raise ValueError(
                f"LocalGraph: expected {self.n_inner + self.n_halo} source rows (inner + halo), got {h_src.shape[0]}"
            )
        return self._sums[backend](h_src)

    def _sum_torch(self, h_src: torch.Tensor) -> torch.Tensor:
        # A sparse (CSR) product never materializes per-edge messages (an edges x features tensor:
        # gigabytes on a 200k-node graph).
        if self._adjacency is None or self._adjacency.device != h_src.device:
            indices = torch.stack([self.dst, self.src])
            values = torch.ones(self.src.numel())
            shape = (self.n_inner, self.n_inner + self.n_halo)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch flags sparse CSR as beta
                adjacency = torch.sparse_coo_tensor(indices, values, shape).coalesce().to_sparse_csr()
                self._adjacency = adjacency.to(h_src.device)
        return self._adjacency.to(h_src.dtype) @ h_src

    def _sum_dgl(self, h_src: torch.Tensor) -> torch.Tensor:
        block = self.block()
        if block.device != h_src.device:
            block = self._block = block.to(h_src.device)
        out: torch.Tensor = _deps.import_dgl().ops.copy_u_sum(block, h_src)
        return out

    def mean_neighbors(self, h_src: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """Mean over in-neighbours (zero for a node without any): the sum over the global in-degree."""
        return self.sum_neighbors(h_src, backend) / self.in_degree[:, None].to(h_src)

    def first_aggregate(self, model: str, x_full: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """The neighbour aggregate of the (fixed) input features, computed once: the first layer then
        needs no halo exchange at all. SAGE: the neighbour mean; GCN: ``D_in^-1/2 A D_out^-1/2 X``."""
        if model == "sage":
            return self.mean_neighbors(x_full, backend)
        return self.sum_neighbors(x_full * self.out_norm[:, None], backend) * self.in_norm[:, None]

    def block(self) -> Any:
        """The local block as a DGL graph (sources ``[inner; halo]``, destinations inner)."""
        if self._block is None:
            dgl = _deps.import_dgl()
            self._block = dgl.create_block(
                (self.src, self.dst), num_src_nodes=self.n_inner + self.n_halo, num_dst_nodes=self.n_inner
            )
        return self._block


class SAGELayer(nn.Module):
    """``W_self h_v + b + W_neigh mean_{u -> v} h_u`` (GraphSAGE, mean aggregator).

    ``b`` lives in ``fc_self`` on every backend, so the precomputed first layer
    (:meth:`forward_first`) and the exchanging one (:meth:`forward`) use the same
    parameters.
    """

    def __init__(self, in_dim: int, out_dim: int, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.fc_self = nn.Linear(in_dim, out_dim, bias=True)
        self.fc_neigh = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, g: LocalGraph, h_full: torch.Tensor) -> torch.Tensor:
        return self.forward_first(g, h_full[: g.n_inner], g.mean_neighbors(h_full, self.backend))

    def forward_first(self, g: LocalGraph, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The same layer from a precomputed neighbour mean."""
        return self.fc_self(x) + self.fc_neigh(mean)  # type: ignore[no-any-return]


class GCNLayer(nn.Module):
    """``D_in^-1/2 A D_out^-1/2 H W + b`` with global degrees (Kipf & Welling)."""

    def __init__(self, in_dim: int, out_dim: int, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.weight = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward_first(self, g: LocalGraph, x: torch.Tensor, agg: torch.Tensor) -> torch.Tensor:
        """The same layer from the precomputed normalized aggregate of the input."""
        return self.weight(agg) + self.bias  # type: ignore[no-any-return]

    def forward(self, g: LocalGraph, h_full: torch.Tensor) -> torch.Tensor:
        # Transform, then aggregate: the (usually narrower) output is what travels over the edges.
        hs = h_full * g.out_norm[:, None]
        return g.sum_neighbors(self.weight(hs), self.backend) * g.in_norm[:, None] + self.bias


def resolve_backend(backend: str) -> str:
    """``"auto"``: ``"dgl"`` when DGL imports, else ``"torch"`` (both compute the same model)."""
    if backend not in BACKENDS:
        raise ValueError(f"gnn: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "dgl" if _deps.with_dgl() else "torch"
    if backend == "dgl":
        _deps.require("dgl")
    return backend


class FullGraphGNN(nn.Module):
    """A stack of full-graph layers with ReLU and dropout between them.

    The backend chooses who sums over neighbours, not the model: parameters,
    their names, their initialization (see the module docstring) and the
    arithmetic around the aggregation are the same, so a state dict moves
    between backends unchanged.

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
