"""The two message-passing operations the GNN layers need, behind one interface per backend.

A layer never sums over neighbours itself: it asks its graph for the
:class:`EdgeOps` of a backend (:func:`edge_ops`) and calls :meth:`EdgeOps.sum`
(SAGE, GCN) or :meth:`EdgeOps.attend` (GAT). Every backend computes the same
function over the same edges; they differ only in float rounding.

- ``"torch"`` (:class:`TorchEdges`, here): a sparse CSR product and index
  operations, no dependency beyond torch.
- ``"dgl"`` (:class:`sylvie_comm.integrations.dgl.DGLEdges`): DGL's fused
  kernels on a block, imported only when asked for.

A new backend is one class with ``sum`` and ``attend`` and one line in
:data:`GRAPH_BACKENDS` (``"module:Class"``, imported on first use so the core
never imports an optional framework).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Protocol

import torch
import torch.nn.functional as F


class EdgeOps(Protocol):
    """Message passing over a fixed set of edges ``src -> dst`` (sources ``n_src`` rows, destinations ``n_dst``)."""

    def sum(self, h_src: torch.Tensor) -> torch.Tensor:
        """``out[v] = sum_{u -> v} h_src[u]``, shape ``(n_dst, *h_src.shape[1:])``."""
        ...

    def attend(self, el: torch.Tensor, er: torch.Tensor, z: torch.Tensor, slope: float) -> torch.Tensor:
        """Graph attention: ``alpha_uv = softmax_v(LeakyReLU_slope(el[u] + er[v]))`` over the in-edges of ``v``,
        ``out[v] = sum_u alpha_uv z[u]``. ``el``: ``(n_src, heads)``, ``er``: ``(n_dst, heads)``,
        ``z``: ``(n_src, heads, F)``; returns ``(n_dst, heads, F)``."""
        ...


class TorchEdges:
    """:class:`EdgeOps` in plain torch: a sparse CSR product for sums, a segment softmax for attention."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, n_src: int, n_dst: int) -> None:
        self.src, self.dst, self.n_src, self.n_dst = src, dst, n_src, n_dst
        self._adjacency: torch.Tensor | None = None

    def sum(self, h_src: torch.Tensor) -> torch.Tensor:
        # A sparse (CSR) product never materializes per-edge messages (an edges x features tensor:
        # gigabytes on a 200k-node graph).
        if self._adjacency is None or self._adjacency.device != h_src.device:
            # Built once, where the edges live (the trainer puts them on the features' device).
            indices = torch.stack([self.dst, self.src])
            values = torch.ones(self.src.numel(), device=self.src.device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch flags sparse CSR as beta
                adjacency = torch.sparse_coo_tensor(indices, values, (self.n_dst, self.n_src))
                self._adjacency = adjacency.coalesce().to_sparse_csr().to(h_src.device)
        return self._adjacency.to(h_src.dtype) @ h_src

    def attend(self, el: torch.Tensor, er: torch.Tensor, z: torch.Tensor, slope: float) -> torch.Tensor:
        src, dst = self.src.to(z.device), self.dst.to(z.device)
        heads = el.shape[1]
        logits = F.leaky_relu(el[src] + er[dst], slope)
        # Segment softmax; the per-destination maximum only keeps exp() finite (constant: no gradient).
        peak = torch.full((self.n_dst, heads), float("-inf"), dtype=logits.dtype, device=logits.device)
        peak = peak.scatter_reduce(0, dst[:, None].expand(-1, heads), logits.detach(), "amax")
        weight = (logits - peak[dst]).exp()
        total = torch.zeros(self.n_dst, heads, dtype=weight.dtype, device=weight.device).index_add(0, dst, weight)
        alpha = weight / total[dst]
        out = torch.zeros(self.n_dst, *z.shape[1:], dtype=z.dtype, device=z.device)
        return out.index_add(0, dst, alpha.unsqueeze(-1) * z[src])


# Backend name -> "module:Class" of its EdgeOps (imported on first use).
GRAPH_BACKENDS: dict[str, str] = {
    "torch": "sylvie_comm.gnn.graphops:TorchEdges",
    "dgl": "sylvie_comm.integrations.dgl:DGLEdges",
}


def edge_ops(backend: str, src: torch.Tensor, dst: torch.Tensor, n_src: int, n_dst: int) -> EdgeOps:
    """The :class:`EdgeOps` of ``backend`` over the edges ``src -> dst``."""
    where = GRAPH_BACKENDS.get(backend)
    if where is None:
        raise ValueError(f"gnn: backend must be one of {sorted(GRAPH_BACKENDS)}, got {backend!r}")
    module, _, name = where.partition(":")
    cls = getattr(importlib.import_module(module), name)
    ops: EdgeOps = cls(src, dst, n_src, n_dst)
    return ops
