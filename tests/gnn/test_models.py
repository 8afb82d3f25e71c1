"""One model whatever the backend: same initial weights, same logits after training, same accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.models import FullGraphGNN, LocalGraph, resolve_backend
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
@pytest.mark.parametrize("model", ["sage", "gcn"])
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


@pytest.mark.slow
def test_default_backend_is_as_accurate_as_torch():
    """The backend "auto" picks (DGL when it imports) reaches the torch backend's loss and accuracy
    (3-layer SAGE, 30 Adam epochs on a generated graph): it trains the same model."""
    default, reference = final_accuracy("auto"), final_accuracy("torch")
    assert reference["test_acc"] > 85, reference
    assert default["test_acc"] >= reference["test_acc"] - 1.0, (resolve_backend("auto"), default, reference)
    assert default["loss"] <= 2 * reference["loss"] + 1e-3, (resolve_backend("auto"), default, reference)
