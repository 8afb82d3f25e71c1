"""Full-graph GraphSAGE (mean), GCN and GAT on a partition's local block.

Each layer first completes its input with the halo rows (``[inner; halo]``,
through :func:`~sylvie_comm.gnn.halo_pipeline.halo_exchange`) and then aggregates over
the local block, which holds every in-edge of every inner node. GCN uses the
global degrees stored in the partition, so its normalization equals the full
graph's. The ReLU between two layers writes its output straight into the next
layer's ``[inner; halo]`` buffer (``relu=True`` of the exchange), so no layer's
rows are copied to be completed; with dropout on in training, the dropped-out rows
are copied in once. The first layer can start from a precompute of the fixed
input instead (each layer class's ``first_aggregate``).

One model, two aggregation backends. The layers own their parameters
(``nn.Linear``) and compute the same function in the same order whichever
backend passes the messages (:mod:`sylvie_comm.gnn.graphops`): ``"torch"`` (a
sparse CSR product, no DGL needed) or ``"dgl"`` (DGL's fused kernels on a block,
:mod:`sylvie_comm.integrations.dgl`). With the
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

import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm import _deps
from sylvie_comm.gnn.graphops import GRAPH_BACKENDS, EdgeOps, edge_ops
from sylvie_comm.gnn.halo_checks import as_device
from sylvie_comm.gnn.halo_pipeline import HaloPipeline, halo_exchange
from sylvie_comm.gnn.partition import Partition

BACKENDS = ("auto", *sorted(GRAPH_BACKENDS))


class LocalGraph:
    """A partition's block, its degree normalizers and (with several ranks) its halo pipeline.

    Args:
        part: this rank's partition (on the host).
        pipeline: the halo pipeline (needed when the partition has halo nodes).
        device: where the edges and normalizers live, the features' device (default: the pipeline's,
            else the CPU). They are copied there once; the partition stays where it is.
    """

    def __init__(
        self, part: Partition, pipeline: HaloPipeline | None = None, device: torch.device | str | None = None
    ) -> None:
        if pipeline is None and part.n_halo:
            raise ValueError(f"LocalGraph: partition {part.rank} has {part.n_halo} halo nodes but no halo pipeline")
        if device is None:
            self.device = pipeline.device if pipeline is not None else torch.device("cpu")
        else:
            self.device = as_device(device, "LocalGraph")
        if pipeline is not None and pipeline.device != self.device:
            raise ValueError(
                f"LocalGraph: device {str(self.device)!r} but the halo pipeline exchanges rows on "
                f"{str(pipeline.device)!r}; expected one device for both"
            )
        self.part = part
        self.pipeline = pipeline
        self.n_inner, self.n_halo = part.n_inner, part.n_halo
        self.src, self.dst = part.src.to(self.device), part.dst.to(self.device)
        self.in_degree = part.in_degree.to(self.device).clamp(min=1).float()
        self.in_norm = self.in_degree.pow(-0.5)
        self.out_norm = part.out_degree.to(self.device).clamp(min=1).float().pow(-0.5)
        self._ops: dict[tuple[str, bool], EdgeOps] = {}
        self._loops: tuple[torch.Tensor, torch.Tensor] | None = None

    def ops(self, backend: str, self_loops: bool = False) -> EdgeOps:
        """The backend's message passing over the local edges (``self_loops``: plus a self-loop for every
        inner node that has none, as attention needs)."""
        key = (backend, self_loops)
        if key not in self._ops:
            src, dst = self.edges_with_self_loops() if self_loops else (self.src, self.dst)
            self._ops[key] = edge_ops(backend, src, dst, self.n_inner + self.n_halo, self.n_inner)
        return self._ops[key]

    def edges_with_self_loops(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The local edges plus a self-loop for every inner node without one (sources, destinations)."""
        if self._loops is None:
            # Once, on the host (nonzero reads how many there are), then placed on the graph's device.
            src, dst = self.part.src.to("cpu"), self.part.dst.to("cpu")
            has_loop = torch.zeros(self.n_inner, dtype=torch.bool)
            has_loop[dst[src == dst]] = True
            loops = torch.nonzero(~has_loop).view(-1).to(src.dtype)
            self._loops = (torch.cat([src, loops]).to(self.device), torch.cat([dst, loops]).to(self.device))
        return self._loops

    def exchange(self, layer: int, h_inner: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """``[h_inner; halo]`` for ``layer`` (``relu``: of ``relu(h_inner)``, written straight into the layer's
        buffer, see :func:`~sylvie_comm.gnn.halo_pipeline.halo_exchange`); ``h_inner`` itself without halo."""
        if self.pipeline is None:
            return F.relu(h_inner) if relu else h_inner
        out: torch.Tensor = halo_exchange(h_inner, self.pipeline, layer, relu)  # compiler-disabled: typed Any
        return out

    def sum_neighbors(self, h_src: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """Sum of ``h_src`` (rows ``[inner; halo]``) over the in-neighbours of every inner node.

        Args:
            h_src: ``(n_inner + n_halo, F)``.
            backend: ``"torch"`` or ``"dgl"``; the two differ only in float rounding.
        """
        if h_src.shape[0] != self.n_inner + self.n_halo:
            raise ValueError(
                f"LocalGraph: expected {self.n_inner + self.n_halo} source rows (inner + halo), got {h_src.shape[0]}"
            )
        return self.ops(backend).sum(h_src)

    def mean_neighbors(self, h_src: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """Mean over in-neighbours (zero for a node without any): the sum over the global in-degree."""
        return self.sum_neighbors(h_src, backend) / self.in_degree[:, None].to(h_src)

    def first_aggregate(self, model: str, x_full: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """The first layer's precompute of the (fixed) input rows ``[inner; halo]``, computed once: the first
        layer then needs no halo exchange at all. Each layer class owns what it precomputes
        (``first_aggregate`` of :class:`SAGELayer`, :class:`GCNLayer`, :class:`GATLayer`); ``model`` names
        the class in :data:`LAYERS`."""
        layer_cls = LAYERS.get(model)
        if layer_cls is None:
            raise ValueError(f"gnn: model must be one of {sorted(LAYERS)}, got {model!r}")
        return layer_cls.first_aggregate(self, x_full, backend)


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

    @staticmethod
    def first_aggregate(g: LocalGraph, x_full: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """The neighbour mean of the input rows ``[inner; halo]``, what :meth:`forward_first` takes."""
        return g.mean_neighbors(x_full, backend)

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

    @staticmethod
    def first_aggregate(g: LocalGraph, x_full: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """``D_in^-1/2 A D_out^-1/2 X`` of the input rows ``[inner; halo]`` (global degrees), what
        :meth:`forward_first` takes: the weight applies after the aggregation, which is linear."""
        return g.sum_neighbors(x_full * g.out_norm[:, None], backend) * g.in_norm[:, None]

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

    The attention itself is the backend's :meth:`~sylvie_comm.gnn.graphops.EdgeOps.attend` over those
    edges: a segment softmax with index operations (``"torch"``) or ``dgl.ops`` on a block (``"dgl"``).
    Attention depends on the parameters, so the first layer's precomputed "aggregate" is the input rows
    ``[inner; halo]`` themselves, exchanged once exactly.

    Args:
        in_dim: input feature width.
        out_dim: output feature width (divisible by ``heads`` unless ``last``).
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

    @staticmethod
    def first_aggregate(g: LocalGraph, x_full: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """The input rows ``[inner; halo]`` themselves: attention depends on the weights, so only the exchange
        is saved."""
        return x_full

    def forward_first(self, g: LocalGraph, x: torch.Tensor, x_full: torch.Tensor) -> torch.Tensor:
        """The same layer from the input rows ``[inner; halo]`` exchanged once (:meth:`first_aggregate`)."""
        return self.forward(g, x_full)

    def forward(self, g: LocalGraph, h_full: torch.Tensor) -> torch.Tensor:
        n, heads = g.n_inner, self.heads
        z = self.fc(h_full).view(-1, heads, self.head_dim)
        el = (z * self.attn_l).sum(-1)  # source term of every row, (n_inner + n_halo, heads)
        er = (z[:n] * self.attn_r).sum(-1)  # destination term of the inner rows
        out = g.ops(self.backend, self_loops=True).attend(el, er, z, 0.2)
        out = out + self.bias.view(heads, self.head_dim)
        return out.mean(1) if self.last else out.reshape(n, heads * self.head_dim)


# Layer classes by model name: (in_dim, out_dim, backend, last) -> a module with forward(g, h_full),
# and forward_first(g, x, cls.first_aggregate(g, x_full)) (a static method: the layer's own precompute).
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
        in_dim: input feature width.
        hidden: hidden feature width.
        out_dim: output feature width (the number of classes).
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
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
            raise ValueError(f"gnn: dropout must be a probability in [0, 1], got {dropout!r}")
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
        relu = False  # h still needs the ReLU between layers: the exchange writes it into the layer's buffer
        for i, layer in enumerate(self.layers):
            if i == 0 and first_aggregate is not None:
                h = layer.forward_first(g, x, first_aggregate)  # type: ignore[operator]
            else:
                h = layer(g, g.exchange(i, h, relu))
            relu = False
            if i + 1 < len(self.layers):
                if self.training and self.dropout:
                    h = F.dropout(F.relu(h), self.dropout, True)  # then the exchange copies its rows in
                else:
                    relu = True  # dropout off: F.dropout would hand h back as it is
        return h
