"""One model whatever the backend: same initial weights, same logits after training, same accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.models import LAYERS, FullGraphGNN, GATLayer, GCNLayer, LocalGraph, SAGELayer, resolve_backend
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer
from tests.gnn import workloads as gw

needs_dgl = pytest.mark.skipif(not _deps.with_dgl(), reason="DGL does not import")


def local_graph(graph: gdata.GraphData) -> LocalGraph:
    part = partition((graph.src, graph.dst), 1, "random", num_nodes=graph.num_nodes, ndata=graph.ndata)[0]
    return LocalGraph(part)


@needs_dgl
@pytest.mark.parametrize("model", ["sage", "gcn"])
def test_backends_start_from_the_same_documented_weights(model):
    """Same seed: the same parameter names and values; weights drawn as nn.Linear draws them
    (U(-1/sqrt(fan_in), 1/sqrt(fan_in))), biases as documented (SAGE: nn.Linear's, GCN: zero)."""
    states = {}
    for backend in ("torch", "dgl"):
        torch.manual_seed(3)
        states[backend] = FullGraphGNN(model, 32, 64, 5, num_layers=3, backend=backend).state_dict()
    assert list(states["torch"]) == list(states["dgl"])
    for name, value in states["torch"].items():
        assert torch.equal(value, states["dgl"][name]), name
    for name, value in states["torch"].items():
        if value.dim() == 2:
            bound = 1 / math.sqrt(value.shape[1])
            assert value.abs().max() <= bound and value.abs().max() > 0.95 * bound, name
        elif model == "gcn":
            assert torch.equal(value, torch.zeros_like(value)), name


def trained_logits(model: str, backend: str, precompute_first: bool, epochs: int = 6) -> torch.Tensor:
    g = gw.small_graph()
    part = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata)[0]
    tr = Trainer(part, TrainConfig(model=model, hidden=16, layers=3, lr=0.01, backend=backend,
                                   precompute_first=precompute_first))  # fmt: skip
    for _ in range(epochs):
        tr.train_epoch()
    tr.model.eval()
    with torch.no_grad():
        return tr.forward()


@needs_dgl
@pytest.mark.parametrize("model", ["sage", "gcn", "gat"])
def test_backends_train_the_same_model(model):
    """After 6 Adam steps the DGL and torch backends give the same logits, on the precomputed first layer
    (``forward_first``) and on the exchanging one, and the two first-layer paths agree with each other (a
    parameter that one path leaves out would get no gradient there and drift apart)."""
    logits = {(b, p): trained_logits(model, b, p) for b in ("torch", "dgl") for p in (True, False)}
    reference = logits[("torch", True)]
    moved = (reference - trained_logits(model, "torch", True, epochs=0)).abs().max()
    assert moved > 0.1  # training moved the logits: differences in any parameter would show
    for key, value in logits.items():
        torch.testing.assert_close(value, reference, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@needs_dgl
@pytest.mark.parametrize("model", ["sage", "gcn"])
def test_neighbour_aggregation_agrees_across_backends(model):
    graph = local_graph(gw.small_graph())
    x = torch.randn(graph.n_inner, 16, generator=torch.Generator().manual_seed(0))
    for fn in ("sum_neighbors", "mean_neighbors"):
        torch.testing.assert_close(getattr(graph, fn)(x, "dgl"), getattr(graph, fn)(x, "torch"), rtol=0, atol=1e-5)
    torch.testing.assert_close(graph.first_aggregate(model, x, "dgl"), graph.first_aggregate(model, x), rtol=0,
                               atol=1e-6)  # fmt: skip


def test_each_layer_class_owns_its_first_layer_precompute():
    """``first_aggregate`` is a static method of each layer class (SAGE: the neighbour mean; GCN: the
    normalized sum ``D_in^-1/2 A D_out^-1/2 X``; GAT: the rows themselves); the graph's ``first_aggregate``
    hands the call to the class its model names, and ``forward_first`` from it is ``forward`` on the rows
    (GCN's aggregates before its weight, ``forward`` after: equal up to float rounding)."""
    graph = local_graph(gw.small_graph())
    x = torch.randn(graph.n_inner, 16, generator=torch.Generator().manual_seed(0))
    want = {
        "sage": graph.sum_neighbors(x) / graph.in_degree[:, None],
        "gcn": graph.sum_neighbors(x * graph.out_norm[:, None]) * graph.in_norm[:, None],
        "gat": x,
    }
    assert set(LAYERS) == set(want)
    for model, cls in LAYERS.items():
        assert "first_aggregate" in vars(cls), model
        assert torch.equal(cls.first_aggregate(graph, x), want[model]), model
        assert torch.equal(graph.first_aggregate(model, x), want[model]), model
        torch.manual_seed(0)
        layer = cls(16, 8, "torch")
        first = layer.forward_first(graph, x, cls.first_aggregate(graph, x))
        torch.testing.assert_close(first, layer(graph, x), rtol=0, atol=1e-6, msg=model)
    assert SAGELayer.first_aggregate is not GCNLayer.first_aggregate
    with pytest.raises(ValueError, match=r"model must be one of \['gat', 'gcn', 'sage'\], got 'gin'"):
        graph.first_aggregate("gin", x)


def test_the_relu_between_layers_is_the_exchange_s_without_a_halo():
    """One process (no halo): the model's ReLU between layers, applied by the graph's exchange, gives the
    bits of a separate ReLU; dropout in training still draws its masks as before."""
    graph = local_graph(gw.small_graph())
    x = torch.randn(graph.n_inner, 16, generator=torch.Generator().manual_seed(1))
    for dropout in (0.0, 0.5):
        torch.manual_seed(0)
        model = FullGraphGNN("sage", 16, 8, 4, num_layers=3, dropout=dropout, backend="torch")
        torch.manual_seed(3)
        got = model(graph, x)
        torch.manual_seed(3)
        h = x
        for i, layer in enumerate(model.layers):
            h = layer(graph, h)
            if i + 1 < len(model.layers):
                h = torch.nn.functional.dropout(torch.relu(h), dropout, True)
        assert torch.equal(got, h), dropout
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\], got 1.5"):
        FullGraphGNN("sage", 16, 8, 4, dropout=1.5)


def test_sum_neighbors_rejects_bad_input():
    graph = local_graph(gw.small_graph())
    with pytest.raises(ValueError, match=r"backend must be one of \['dgl', 'torch'\], got 'cuda'"):
        graph.sum_neighbors(torch.zeros(graph.n_inner, 2), "cuda")
    with pytest.raises(ValueError, match=f"expected {graph.n_inner} source rows"):
        graph.sum_neighbors(torch.zeros(graph.n_inner + 1, 2))
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cupy")


def final_accuracy(backend: str) -> dict[str, float]:
    g = gdata.csbm(num_nodes=2000, num_classes=8, feat_dim=64, avg_degree=20)
    part = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata)[0]
    tr = Trainer(part, TrainConfig(model="sage", hidden=64, layers=3, lr=0.01, backend=backend))
    for _ in range(30):
        last = tr.train_epoch()
    return {"loss": last["loss"], **{k: v for k, v in tr.evaluate().items() if k.endswith("acc")}}


@pytest.mark.quality
def test_default_backend_is_as_accurate_as_torch():
    """The backend "auto" picks (DGL when it imports) reaches the torch backend's loss and accuracy
    (3-layer SAGE, 30 Adam epochs on a generated graph): it trains the same model."""
    default, reference = final_accuracy("auto"), final_accuracy("torch")
    assert reference["test_acc"] > 85, reference
    assert default["test_acc"] >= reference["test_acc"] - 1.0, (resolve_backend("auto"), default, reference)
    assert default["loss"] <= 2 * reference["loss"] + 1e-3, (resolve_backend("auto"), default, reference)


def dense_gat_reference(layer: GATLayer, g: LocalGraph, h: torch.Tensor) -> torch.Tensor:
    """One GAT layer from its definition: a dense masked softmax per destination and head."""
    n, heads, d = g.n_inner, layer.heads, layer.head_dim
    z = (h @ layer.fc.weight.T).view(-1, heads, d)
    mask = torch.zeros(n, h.shape[0], dtype=torch.bool)
    mask[g.dst, g.src] = True
    mask[torch.arange(n), torch.arange(n)] = True  # every node attends to itself
    out = []
    for k in range(heads):
        el, er = z[:, k] @ layer.attn_l[0, k], z[:n, k] @ layer.attn_r[0, k]
        logits = torch.nn.functional.leaky_relu(er[:, None] + el[None, :], 0.2).masked_fill(~mask, float("-inf"))
        out.append(torch.softmax(logits, 1) @ z[:, k] + layer.bias.view(heads, d)[k])
    stacked = torch.stack(out, 1)
    return stacked.mean(1) if layer.last else stacked.reshape(n, heads * d)


@pytest.mark.parametrize("last", [False, True])
def test_gat_layer_is_multi_head_attention_over_in_edges_and_itself(last):
    graph = gdata.csbm(num_nodes=120, num_classes=3, feat_dim=8, avg_degree=5, seed=2)
    g = local_graph(graph)
    torch.manual_seed(0)
    layer = GATLayer(8, 12, "torch", last=last, heads=3)
    torch.nn.init.normal_(layer.bias)  # a nonzero bias, to check where it is added
    h = torch.randn(g.n_inner, 8)
    out = layer(g, h)
    assert out.shape == (g.n_inner, 12)
    torch.testing.assert_close(out, dense_gat_reference(layer, g, h), rtol=0, atol=1e-5)


@needs_dgl
def test_gat_backends_start_from_the_same_weights_and_give_the_same_logits():
    graph = gdata.csbm(num_nodes=300, num_classes=4, feat_dim=16, avg_degree=6, seed=1)
    g = local_graph(graph)
    x = g.part.ndata["feat"].float()
    models = {}
    for backend in ("torch", "dgl"):
        torch.manual_seed(5)
        models[backend] = FullGraphGNN("gat", 16, 16, 4, num_layers=3, backend=backend)
    state = models["torch"].state_dict()
    assert list(state) == list(models["dgl"].state_dict())
    for name, value in models["dgl"].state_dict().items():
        assert torch.equal(value, state[name]), name
        if name.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
    logits = {b: m(g, x) for b, m in models.items()}
    assert logits["torch"].abs().max() > 0.1
    torch.testing.assert_close(logits["dgl"], logits["torch"], rtol=0, atol=1e-5)


def test_gat_rejects_bad_settings():
    with pytest.raises(ValueError, match="hidden width of 10 does not split into 4 heads"):
        GATLayer(8, 10, "torch")
    with pytest.raises(ValueError, match="heads must be an integer >= 1, got 0"):
        GATLayer(8, 8, "torch", heads=0)
    with pytest.raises(ValueError, match=r"model must be one of \['gat', 'gcn', 'sage'\], got 'gin'"):
        FullGraphGNN("gin", 8, 8, 2)


def test_gat_trains_to_an_accuracy_near_sage_and_gcn():
    """3-layer GAT, 30 Adam epochs on a generated graph (SAGE: 90.5% test accuracy, GCN: 98.8% here)."""
    g = gdata.csbm(num_nodes=2000, num_classes=8, feat_dim=64, avg_degree=20)
    part = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata)[0]
    tr = Trainer(part, TrainConfig(model="gat", hidden=64, layers=3, lr=0.01, backend="torch"))
    assert tr.first_aggregate is not None and torch.equal(tr.first_aggregate, tr.x)  # one process: no halo
    for _ in range(30):
        tr.train_epoch()
    assert tr.evaluate()["test_acc"] > 90
