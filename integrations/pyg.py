"""PyG models in the partitioned trainer: a user's ``torch_geometric`` model trained on one partition per rank.

A model whose layers are PyG message-passing convolutions (``SAGEConv``, ``GCNConv``, ``GATConv``, called in its
``forward(x, edge_index)``) runs in :class:`~sylvie_comm.gnn.train.Trainer` (``Trainer(part, config,
model=...)``) unchanged: :func:`bind` wraps it in a :class:`PyGModel`, whose forward calls the user's
``forward(x_inner, edge_index_local)``. While that forward runs, every conv is intercepted: called with the
inner nodes' rows, it completes them with the halo rows (:func:`~sylvie_comm.gnn.halo_pipeline.halo_exchange`,
one layer index per conv call, in call order, so precisions and bounded staleness apply per conv), runs the
user's conv on the local block's edges over ``[inner; halo]`` and returns the inner rows. The local block holds
every in-edge of every inner node, so each conv's output rows equal the full graph's:

- ``SAGEConv``: a bipartite call ``((x_full, x_inner), edges, size=(n_inner + n_halo, n_inner))``; no self-loop
  is added (PyG adds none), the graph's own loops are in the block. Any permutation-invariant aggregation
  (:data:`EXACT_AGGREGATIONS`); order-dependent ones (``"lstm"``, ...) are refused.
- ``GATConv``: ``conv(x_full, edges)``; PyG's own self-loop handling (remove every loop, add one per node) gives
  every inner node exactly the loop the full-graph call gives it; the halo rows' outputs are dropped.
- ``GCNConv`` (``normalize=True``): its symmetric normalization needs the GLOBAL degree of both ends, and a
  halo node has no in-edges in the block. :func:`bind` computes the normalized edge weights once, as PyG's
  ``gcn_norm`` does (its own ``add_remaining_self_loops``, one weight per edge, the in-degree with the loop)
  but with each halo node's degree exchanged once, exactly, from its owner; each call then runs the conv
  with ``normalize`` off and those weights (the user's module is back as it was after the call: its
  ``cached`` normalization is neither used nor filled). ``normalize=False``: a plain sum over the block.

Convs the adapter cannot run exactly (other classes, subclasses, ``flow="target_to_source"``, edge weights or
edge features, ``return_attention_weights``) and modules that mix rows of different nodes outside a conv
(batch or graph normalization over nodes, pooling aggregations) raise ValueError naming the class; so does a
conv called on another ``edge_index`` than the model's (edges changed inside ``forward``).

The user's module is only changed while :class:`PyGModel` runs it (an instance ``forward`` on each conv, removed
after), so it can be deep-copied, saved and called on the full graph as usual. Its parameters keep their
names; in the trainer's checkpoint they carry the prefix ``module.``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from sylvie_comm.collectives import Transport, agree
from sylvie_comm.gnn.models import LocalGraph

try:
    from torch_geometric.nn import aggr as pyg_aggr
    from torch_geometric.nn.conv import GATConv, GCNConv, MessagePassing, SAGEConv
    from torch_geometric.utils import add_remaining_self_loops, scatter
except ImportError as exc:  # pragma: no cover - the [pyg] extra is part of the dev install
    raise ImportError(
        "sylvie_comm.integrations.pyg requires 'torch_geometric': pip install 'sylvie-comm[pyg]'"
    ) from exc

__all__ = ["CONVS", "EXACT_AGGREGATIONS", "PyGModel", "bind", "describe", "instantiate"]

# A module, or a zero-argument factory that builds one (called under the trainer's seeded lock).
ModelLike = nn.Module | Callable[[], nn.Module]

# Aggregations whose result depends only on the multiset of a node's messages, so edge order cannot matter.
EXACT_AGGREGATIONS: tuple[type[nn.Module], ...] = (
    pyg_aggr.SumAggregation,
    pyg_aggr.MeanAggregation,
    pyg_aggr.MaxAggregation,
    pyg_aggr.MinAggregation,
    pyg_aggr.MulAggregation,
    pyg_aggr.VarAggregation,
    pyg_aggr.StdAggregation,
    pyg_aggr.SoftmaxAggregation,
    pyg_aggr.PowerMeanAggregation,
)

# Per-node normalizations of torch_geometric.nn.norm (every other class there mixes the rows of many nodes).
_ROW_NORMS = ("MessageNorm",)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_aggregation(where: str, module: nn.Module) -> None:
    if isinstance(module, pyg_aggr.MultiAggregation):
        for sub in module.aggrs:
            _check_aggregation(where, sub)
    elif type(module) not in EXACT_AGGREGATIONS:
        raise ValueError(
            f"pyg: {where} aggregates with {type(module).__name__}, whose result depends on the order of a "
            f"node's edges (the partition's local edges come in another order); expected one of "
            f"{sorted(c.__name__ for c in EXACT_AGGREGATIONS)} or a MultiAggregation of them"
        )


class _Sage:
    """``SAGEConv``: a bipartite call, sources ``[inner; halo]``, destinations the inner rows."""

    @staticmethod
    def check(where: str, conv: Any) -> None:
        _check_aggregation(where, conv.aggr_module)

    @staticmethod
    def run(model: PyGModel, conv: Any, forward: Callable[..., Any], x: torch.Tensor, x_full: torch.Tensor) -> Any:
        return forward((x_full, x), model.edge_index, size=(x_full.shape[0], x.shape[0]))


class _Gat:
    """``GATConv``: its own self-loops over ``[inner; halo]`` (one per node, as on the full graph)."""

    @staticmethod
    def check(where: str, conv: Any) -> None:
        pass  # every option computes per destination from its in-edges and its own row

    @staticmethod
    def run(model: PyGModel, conv: Any, forward: Callable[..., Any], x: torch.Tensor, x_full: torch.Tensor) -> Any:
        return forward(x_full, model.edge_index)[: x.shape[0]]


class _Gcn:
    """``GCNConv``: the precomputed globally normalized weights (see :meth:`PyGModel._gcn_weights`)."""

    @staticmethod
    def check(where: str, conv: Any) -> None:
        pass  # normalize=False is a plain sum; normalize=True uses the weights bind() computed

    @staticmethod
    def run(model: PyGModel, conv: Any, forward: Callable[..., Any], x: torch.Tensor, x_full: torch.Tensor) -> Any:
        n = x.shape[0]
        if not conv.normalize:
            return forward(x_full, model.edge_index)[:n]
        key = (bool(conv.add_self_loops), bool(conv.improved))
        if key not in model.gcn_weights:
            raise ValueError(f"pyg: GCNConv {conv!r} was changed after the trainer was built (normalize, "
                             "add_self_loops or improved); build the trainer with the model as it trains")  # fmt: skip
        edges, weights = model.gcn_weights[key]
        conv.normalize = False  # for this call only: the weights are normalized already
        try:
            return forward(x_full, edges, weights.to(x_full.dtype))[:n]
        finally:
            conv.normalize = True


# The convs the adapter runs exactly, by exact class (a subclass may change the math: refused).
CONVS: dict[type, type[_Sage] | type[_Gat] | type[_Gcn]] = {SAGEConv: _Sage, GCNConv: _Gcn, GATConv: _Gat}


def instantiate(model: ModelLike) -> nn.Module:
    """The module itself, or what the zero-argument factory ``model`` returns (call it under a seeded lock).

    A factory's exception comes back as a ValueError (so :func:`~sylvie_comm.collectives.agree` tells every rank).
    """
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TypeError(f"pyg: model must be a torch.nn.Module or a zero-argument factory returning one, got "
                        f"{type(model).__name__}")  # fmt: skip
    try:
        built = model()
    except (ValueError, TypeError, ImportError):
        raise
    except Exception as exc:
        raise ValueError(f"pyg: the model factory {model!r} raised {exc!r}") from exc
    if not isinstance(built, nn.Module):
        raise TypeError(f"pyg: the model factory returned a {type(built).__name__}; expected a torch.nn.Module")
    return built


def check_model(module: nn.Module) -> list[tuple[str, MessagePassing]]:
    """The module's message-passing layers ``(name, conv)``; ValueError for anything not partition-exact."""
    convs: list[tuple[str, MessagePassing]] = []
    for name, m in module.named_modules():
        where = f"{type(m).__name__} '{name or '<model>'}'"
        if any(name != c and name.startswith(f"{c}." if c else "") for c, _ in convs):
            continue  # a conv's own parts (its Linear layers, its aggregation): checked with the conv
        if isinstance(m, MessagePassing):
            kind = CONVS.get(type(m))
            if kind is None:
                raise ValueError(
                    f"pyg: {_name(type(m))} ('{name}') cannot run exactly on a partition; expected one of "
                    f"{sorted(c.__name__ for c in CONVS)} (exactly these classes, not subclasses)"
                )
            if m.flow != "source_to_target":
                raise ValueError(f"pyg: {where} has flow={m.flow!r}; a partition holds the in-edges of its nodes, "
                                 "so expected flow='source_to_target'")  # fmt: skip
            kind.check(where, m)
            convs.append((name, m))
        elif isinstance(m, pyg_aggr.Aggregation):
            raise ValueError(f"pyg: {where} outside a conv aggregates over all nodes (pooling), which a partition "
                             "only sees a part of; expected node-wise layers between the convs")  # fmt: skip
        elif isinstance(m, nn.modules.batchnorm._NormBase) or (
            type(m).__module__.startswith("torch_geometric.nn.norm")
            and type(m).__name__ not in _ROW_NORMS
            and getattr(m, "mode", None) != "node"
        ):
            raise ValueError(f"pyg: {where} normalizes over many nodes, which a partition only sees a part of; "
                             "expected per-node layers (torch.nn.LayerNorm, PyG LayerNorm(mode='node'))")  # fmt: skip
    for pname, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"pyg: parameter '{pname}' is lazy (in_channels=-1); give its input width, so every "
                             "rank builds the same initialized weights")  # fmt: skip
    return convs


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    return None


def describe(module: nn.Module) -> dict[str, Any]:
    """What every rank's model must agree on: its class, its parameters and buffers (dtype and shape by
    name) and each conv's class and plain options (``aggr``, ``heads``, ``normalize``, ...)."""
    convs = {}
    for name, m in module.named_modules():
        if isinstance(m, MessagePassing):
            opts = {k: _plain(v) for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
            convs[name] = {"class": _name(type(m)), **{k: v for k, v in opts.items() if v is not None}}
            if getattr(m, "aggr_module", None) is not None:
                convs[name]["aggr_module"] = repr(m.aggr_module)
    return {
        "class": _name(type(module)),
        "parameters": {n: [str(p.dtype), *p.shape] for n, p in module.named_parameters()},
        "buffers": {n: [str(b.dtype), *b.shape] for n, b in module.named_buffers()},
        "conv_options": convs,
    }


def _same_weights(module: nn.Module, transport: Transport) -> None:
    """Every rank takes rank 0's parameters and floating-point buffers (as DDP does): an exact all-reduce of
    rank 0's values and zeros elsewhere."""
    tensors = [p.data for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]
    with torch.no_grad():
        for t in tensors:
            mine = t.clone() if transport.rank == 0 else torch.zeros_like(t)
            transport.all_reduce(mine).wait()
            t.copy_(mine)


def _distinct_modules(module: nn.Module, transport: Transport) -> None:
    """ValueError on every rank where two ranks (threads of one process) hold the same module object."""
    everyone = transport.all_gather_object((os.getpid(), id(module)))
    for r, theirs in enumerate(everyone):
        first = everyone.index(theirs)
        if first != r:
            raise ValueError(f"pyg: ranks {first} and {r} were given the same module object; each rank needs a "
                             "model of its own: pass a factory (model=lambda: Net(...)) and every rank builds "
                             "one")  # fmt: skip


def bind(
    model: ModelLike,
    graph: LocalGraph,
    transport: Transport | None = None,
    *,
    seed: int = 0,
    lock: threading.Lock | None = None,
) -> PyGModel:
    """A user's PyG model on one partition, ready for the trainer (a collective call: every rank binds one).

    Every rank builds (a factory: under ``lock``, after ``torch.manual_seed(seed)``) and checks its model,
    then the ranks agree on :func:`describe` (a model that differs, or fails a check on one rank, raises
    ValueError on every rank naming the field), all start from rank 0's weights, and GCN weights are
    normalized with global degrees (one exchange of the degrees).

    Args:
        model: a ``torch.nn.Module`` whose ``forward(x, edge_index)`` calls PyG convs, or a zero-argument
            factory building one (every rank its own; the same seed gives every rank the same weights).
        graph: the partition's :class:`~sylvie_comm.gnn.models.LocalGraph` (its halo pipeline, with several
            ranks; its device is the model's).
        transport: the ranks (``None``: one process).
        seed: ``torch.manual_seed`` before a factory is called (default 0).
        lock: held while the factory runs (the trainer's: threads as ranks share torch's generator).
    """

    def build() -> tuple[nn.Module, list[tuple[str, MessagePassing]]]:
        if isinstance(model, nn.Module):
            module = model
        else:
            with lock if lock is not None else contextlib.nullcontext():
                torch.manual_seed(seed)
                module = instantiate(model)
        return module, check_model(module)

    if transport is not None:
        module, convs = agree(transport, build, lambda built: describe(built[0]), "pyg: Trainer(model=...)")
    else:
        module, convs = build()
    module.to(graph.device)
    if transport is not None and transport.world_size > 1:
        _distinct_modules(module, transport)
        _same_weights(module, transport)
    return PyGModel(module, graph, convs)


class PyGModel(nn.Module):
    """A bound PyG model (see :func:`bind`): ``forward(g, x, first_aggregate)`` as the trainer calls its models.

    Attributes:
        module: the user's model (trained in place).
        edge_index: the local block's edges ``(2, E)``: sources in ``[0, n_inner + n_halo)``, destinations in
            ``[0, n_inner)``; what the user's ``forward`` receives and must hand to every conv unchanged.
        gcn_weights: by ``(add_self_loops, improved)``, the GCN edges (with their self-loops) and weights.
    """

    def __init__(self, module: nn.Module, graph: LocalGraph, convs: list[tuple[str, MessagePassing]]) -> None:
        super().__init__()
        self.module = module
        self.graph = graph
        self.convs = convs
        self.edge_index = torch.stack([graph.src, graph.dst])
        self.gcn_weights: dict[tuple[bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        for key in sorted({(bool(c.add_self_loops), bool(c.improved)) for _, c in convs
                           if isinstance(c, GCNConv) and c.normalize}):  # fmt: skip
            self.gcn_weights[key] = self._gcn_weights(*key)  # the same order on every rank: a collective
        self._signatures = {type(c): inspect.signature(type(c).forward) for _, c in convs}
        self._calls = 0
        self._input: tuple[torch.Tensor, int, torch.Tensor | None] | None = None

    def _gcn_weights(self, self_loops: bool, improved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``gcn_norm``'s edges and weights for the inner nodes, with every degree the full graph's."""
        g = self.graph
        n, n_src = g.n_inner, g.n_inner + g.n_halo
        edges = self.edge_index
        if self_loops:
            # As gcn_norm calls it (without edge weights every loop weighs 1, whatever ``improved`` says).
            edges, _ = add_remaining_self_loops(edges, None, 2.0 if improved else 1.0, n_src)
            edges = edges[:, edges[1] < n]  # the halo nodes' loops: their outputs are not needed
        ones = torch.ones(edges.shape[1], device=edges.device)
        # Exact: the block holds every in-edge of an inner node; a halo node's degree comes from its owner.
        deg = scatter(ones, edges[1], dim=0, dim_size=n, reduce="sum")
        halo = g.pipeline.exchange_once(deg[:, None])[:, 0] if g.pipeline is not None else deg[:0]
        inv_sqrt = torch.cat([deg, halo.to(deg)]).pow_(-0.5)
        inv_sqrt.masked_fill_(inv_sqrt == float("inf"), 0)
        return edges, inv_sqrt[edges[0]] * ones * inv_sqrt[edges[1]]

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # the convs are swapped while it runs: eager, also compiled
    def forward(self, g: LocalGraph, x: torch.Tensor, first_aggregate: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the inner nodes: ``module(x, edge_index)`` with every conv completed by halo rows.
        ``first_aggregate``: ``[x; halo rows of x]`` (exchanged once), used by every conv called on ``x``."""
        if g is not self.graph:
            raise ValueError("pyg: this model was bound to another LocalGraph; call it with the one it was bound to")
        n, n_src = g.n_inner, g.n_inner + g.n_halo
        if x.dim() != 2 or x.shape[0] != n:
            raise ValueError(f"pyg: expected features of shape ({n}, F) for the inner nodes, got {tuple(x.shape)}")
        if first_aggregate is not None and tuple(first_aggregate.shape) != (n_src, x.shape[1]):
            raise ValueError(f"pyg: expected the input's rows [inner; halo] of shape ({n_src}, {x.shape[1]}), "
                             f"got {tuple(first_aggregate.shape)}")  # fmt: skip
        self._calls = 0
        self._input = (x, x._version, first_aggregate)
        try:
            with self._intercepting():
                out = self.module(x, self.edge_index)
        finally:
            self._input = None
        if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != n:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"pyg: the model's forward returned {got}; expected one row per inner node ({n}, ...)")
        return out

    @contextlib.contextmanager
    def _intercepting(self) -> Iterator[None]:
        """Each conv's ``forward`` is :meth:`_call` while the user's forward runs, and its own again after."""
        saved = []
        try:
            for name, conv in self.convs:
                own = conv.__dict__.get("forward")  # an instance forward of the user's (restored below)
                saved.append((conv, own))
                conv.forward = functools.partial(self._call, name, conv, conv.forward)
            yield
        finally:
            for conv, own in saved:
                if own is None:
                    del conv.forward
                else:
                    conv.forward = own

    def _call(self, name: str, conv: Any, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        where = f"{type(conv).__name__} '{name}'"
        try:
            bound = self._signatures[type(conv)].bind(conv, *args, **kwargs)
        except TypeError as exc:
            raise ValueError(f"pyg: {where} was called with arguments its forward does not take: {exc}") from exc
        given = dict(bound.arguments)
        given.pop("self", None)
        x, edge_index = given.pop("x", None), given.pop("edge_index", None)
        extra = sorted(k for k, v in given.items() if v is not None)
        if extra:
            raise ValueError(f"pyg: {where} was called with {extra}; on a partition a conv takes only "
                             "(x, edge_index): edge weights, edge features and sizes are not partitioned")  # fmt: skip
        if getattr(conv, "_explain", None):
            raise ValueError(f"pyg: {where} is in explain mode, whose edge masks are the full graph's")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"pyg: {where} got {type(x).__name__} node features (bipartite?); on a partition "
                             "expected one tensor of the inner nodes' rows")  # fmt: skip
        if edge_index is not self.edge_index:
            raise ValueError(f"pyg: {where} was called with another edge_index than the model's: the partitioned "
                             "trainer runs each conv on its partition's edges and cannot follow edges changed "
                             "inside forward (dropout_edge, to_undirected, ...); pass it unchanged")  # fmt: skip
        n = self.graph.n_inner
        if x.dim() != 2 or x.shape[0] != n:
            raise ValueError(f"pyg: {where} got features of shape {tuple(x.shape)}; expected the inner nodes' "
                             f"rows ({n}, F)")  # fmt: skip
        layer = self._calls
        self._calls += 1
        return CONVS[type(conv)].run(self, conv, forward, x, self._complete(layer, x))

    def _complete(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[x; halo rows of x]``: the input's, exchanged once, when ``x`` is the model's input unchanged;
        else through the halo pipeline as layer ``layer``."""
        assert self._input is not None
        given, version, full = self._input
        if full is not None and x is given and x._version == version:
            return full
        return self.graph.exchange(layer, x)
