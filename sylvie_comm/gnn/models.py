"""Full-graph GraphSAGE (mean), GCN and GAT on a partition's local block.

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

Initialization (one, for both backends): SAGE and GCN weight matrices and the SAGE bias
as ``torch.nn.Linear`` initializes them (Kaiming-uniform with ``a=sqrt(5)``,
i.e. ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``), the GCN bias zero; GAT as DGL's
``GATConv`` (see :class:`GATLayer`). DGL's own
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
        needs no halo exchange at all. SAGE: the neighbour mean; GCN: ``D_in^-1/2 A D_out^-1/2 X``; GAT: the
        rows ``[inner; halo]`` themselves (its attention depends on the weights: only the exchange is saved)."""
        if model == "sage":
            return self.mean_neighbors(x_full, backend)
        if model == "gat":
            return x_full
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

    # ``last`` (every layer class takes it, see LAYERS) changes nothing here: one output per node either way.

    def __init__(self, in_dim: int, out_dim: int, backend: str, last: bool = False) -> None:
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

    # ``last`` (every layer class takes it, see LAYERS) changes nothing here: one output per node either way.

    def __init__(self, in_dim: int, out_dim: int, backend: str, last: bool = False) -> None:
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


class GATLayer(nn.Module):
    """Multi-head graph attention over ``[inner; halo]`` rows (Veličković et al. 2018, as DGL's ``GATConv``).

    Per head ``k``: ``z = W_k h``, logits ``e_uv = LeakyReLU_0.2(a_l . z_u + a_r . z_v)`` on every edge
    ``u -> v`` and a self-loop ``v -> v`` for every inner node that has none (so a node attends to itself),
    ``alpha_uv`` the softmax of ``e_uv`` over the in-edges of ``v``, and ``out_v = sum_u alpha_uv z_u + b_k``.
    Hidden layers concatenate the heads (``out_dim / heads`` features each, so the width stays ``out_dim``);
    the last layer averages them (``out_dim`` features each). Initialization as DGL's ``GATConv``:
    Xavier-normal with the ReLU gain for ``W`` and the attention vectors, zero bias.

    Backends: ``"torch"`` computes a segment softmax over the local edges with index operations (per-edge
    tensors of ``edges x heads x features``); ``"dgl"`` uses ``dgl.ops`` (``u_add_v``, ``edge_softmax``,
    ``u_mul_e_sum``) on the block with the same edges. Attention depends on the parameters, so the first
    layer's precomputed "aggregate" is the input rows ``[inner; halo]`` themselves, exchanged once exactly.

    Args:
        in_dim, out_dim: feature widths (``out_dim`` divisible by ``heads`` unless ``last``).
        backend: ``"torch"`` or ``"dgl"``.
        last: average the heads instead of concatenating them (the output layer).
        heads: attention heads (default 4).
    """

    def __init__(self, in_dim: int, out_dim: int, backend: str, last: bool = False, heads: int = 4) -> None:
        super().__init__()
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"gat: heads must be an integer >= 1, got {heads!r}")
        if not last and out_dim % heads:
            raise ValueError(f"gat: a hidden width of {out_dim} does not split into {heads} heads; use a multiple")
        self.backend, self.last, self.heads = backend, last, heads
        self.head_dim = out_dim if last else out_dim // heads
        self.fc = nn.Linear(in_dim, heads * self.head_dim, bias=False)
        self.attn_l = nn.Parameter(torch.empty(1, heads, self.head_dim))
        self.attn_r = nn.Parameter(torch.empty(1, heads, self.head_dim))
        self.bias = nn.Parameter(torch.zeros(heads * self.head_dim))
        gain = nn.init.calculate_gain("relu")
        for w in (self.fc.weight, self.attn_l, self.attn_r):
            nn.init.xavier_normal_(w, gain=gain)
        self._graph: LocalGraph | None = None  # the graph the cached edges and block belong to
        self._cache: dict[str, Any] = {}

    def edges(self, g: LocalGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """The local edges plus a self-loop for every inner node without one (sources, destinations)."""
        if self._graph is not g:
            has_loop = torch.zeros(g.n_inner, dtype=torch.bool)
            has_loop[g.dst[g.src == g.dst]] = True
            loops = torch.nonzero(~has_loop).view(-1).to(g.src.dtype)
            self._graph = g
            self._cache = {"src": torch.cat([g.src, loops]), "dst": torch.cat([g.dst, loops])}
        return self._cache["src"], self._cache["dst"]

    def _block(self, g: LocalGraph, device: torch.device) -> Any:
        src, dst = self.edges(g)
        block = self._cache.get("block")
        if block is None or block.device != device:
            block = _deps.import_dgl().create_block((src, dst), num_src_nodes=g.n_inner + g.n_halo,
                                                    num_dst_nodes=g.n_inner).to(device)  # fmt: skip
            self._cache["block"] = block
        return block

    def forward_first(self, g: LocalGraph, x: torch.Tensor, x_full: torch.Tensor) -> torch.Tensor:
        """The same layer from the input rows ``[inner; halo]`` exchanged once (:meth:`LocalGraph.first_aggregate`)."""
        return self.forward(g, x_full)

    def forward(self, g: LocalGraph, h_full: torch.Tensor) -> torch.Tensor:
        n, heads = g.n_inner, self.heads
        z = self.fc(h_full).view(-1, heads, self.head_dim)
        el = (z * self.attn_l).sum(-1)  # source term of every row, (n_inner + n_halo, heads)
        er = (z[:n] * self.attn_r).sum(-1)  # destination term of the inner rows
        out: torch.Tensor
        if self.backend == "dgl":
            ops = _deps.import_dgl().ops
            block = self._block(g, h_full.device)
            alpha = ops.edge_softmax(block, F.leaky_relu(ops.u_add_v(block, el, er), 0.2))
            out = ops.u_mul_e_sum(block, z, alpha.unsqueeze(-1))
        else:
            src, dst = (t.to(h_full.device) for t in self.edges(g))
            logits = F.leaky_relu(el[src] + er[dst], 0.2)
            # Segment softmax; the per-destination maximum only keeps exp() finite (constant: no gradient).
            peak = torch.full((n, heads), float("-inf"), dtype=logits.dtype, device=logits.device)
            peak = peak.scatter_reduce(0, dst[:, None].expand(-1, heads), logits.detach(), "amax")
            weight = (logits - peak[dst]).exp()
            total = torch.zeros(n, heads, dtype=weight.dtype, device=weight.device).index_add(0, dst, weight)
            alpha = weight / total[dst]
            out = torch.zeros(n, heads, self.head_dim, dtype=z.dtype, device=z.device)
            out = out.index_add(0, dst, alpha.unsqueeze(-1) * z[src])
        out = out + self.bias.view(heads, self.head_dim)
        return out.mean(1) if self.last else out.reshape(n, heads * self.head_dim)


# Layer classes by model name: (in_dim, out_dim, backend, last) -> a module with forward(g, h_full),
# and forward_first(g, x, LocalGraph.first_aggregate(name, ...)).
LAYERS: dict[str, type[SAGELayer | GCNLayer | GATLayer]] = {"sage": SAGELayer, "gcn": GCNLayer, "gat": GATLayer}
MODELS = tuple(LAYERS)


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
        model: a name in :data:`LAYERS` (``"sage"``, ``"gcn"`` or ``"gat"``).
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
        if model not in LAYERS:
            raise ValueError(f"gnn: model must be one of {sorted(LAYERS)}, got {model!r}")
        if num_layers < 1:
            raise ValueError(f"gnn: num_layers must be >= 1, got {num_layers}")
        self.backend = resolve_backend(backend)
        layer_cls = LAYERS[model]
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(
            layer_cls(a, b, self.backend, last=i == num_layers - 1) for i, (a, b) in enumerate(itertools.pairwise(dims))
        )
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
