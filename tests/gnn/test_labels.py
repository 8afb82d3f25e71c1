"""Training labels the model cannot take fail on EVERY rank, naming the label, its node and partition.

A training label outside ``[0, classes)`` (or labels of a non-integer dtype) used to raise ``IndexError`` in the
loss of the one rank that holds it while the other ranks waited in their next collective forever. The ranks
(threads here, with the in-process transport: the same construction-time collective a process group runs)
now agree when the trainer is built; a PyG model's width is its logits', checked at its first forward against
the label range the ranks agreed on then.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.part import Partition
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer

FEAT, CLASSES = 8, 4
CONFIG = TrainConfig(hidden=8, backend="torch")
TIMEOUT = 30.0  # a rank left waiting (the old behaviour) fails the test as a TimeoutError after this


def parts() -> list[Partition]:
    g = gdata.csbm(num_nodes=120, num_classes=CLASSES, feat_dim=FEAT, avg_degree=4, seed=0)
    return partition((g.src, g.dst), 2, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)


def with_ndata(part: Partition, **ndata: torch.Tensor) -> Partition:
    return dataclasses.replace(part, ndata={**part.ndata, **ndata})


def bad_training_label(part: Partition, value: int) -> tuple[Partition, int]:
    """``part`` with its first training node's label set to ``value``; also that node's global id."""
    row = int(torch.nonzero(part.ndata["train_mask"])[0])
    label = part.ndata["label"].clone()
    label[row] = value
    return with_ndata(part, label=label), int(part.inner[row])


class Net(nn.Module):
    """Two PyG SAGE convs: ``CLASSES`` outputs."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.convs = nn.ModuleList([SAGEConv(FEAT, 8), SAGEConv(8, CLASSES)])

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.convs[1](F.relu(self.convs[0](x, edge_index)), edge_index)  # type: ignore[no-any-return]


def outcomes(ps: list[Partition], model: Any = None, evaluate_first: bool = False) -> list[str]:
    """What each rank (a thread) ends with: ``"trained ..."`` or the error it raised (caught: a rank that
    failed alone leaves the others waiting, which run_local reports as a TimeoutError)."""

    def body(tr: Any) -> str:
        try:
            trainer = Trainer(ps[tr.rank], CONFIG, transport=tr, model=model)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            if evaluate_first:
                trainer.evaluate()
            h = trainer.train_epoch()
            return f"trained, loss {h['loss']:.4f}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            trainer.close()

    return run_local(len(ps), body, timeout=TIMEOUT)


def assert_bad_label_everywhere(said: list[str], value: int, node: int, part: int, classes: int) -> None:
    for rank, msg in enumerate(said):
        assert msg.startswith("ValueError: "), (rank, msg)
        assert f"node {node} (partition {part}) has the training label {value}" in msg, (rank, msg)
        assert f"[0, {classes})" in msg, (rank, msg)


def test_a_negative_label_fails_on_every_rank_when_our_layers_are_built():
    ps = parts()
    ps[1], node = bad_training_label(ps[1], -3)
    said = outcomes(ps)
    assert_bad_label_everywhere(said, -3, node, 1, CLASSES)
    assert all("when the Trainer was built" not in s for s in said)  # raised by the constructor itself


def test_the_ignored_index_minus_100_is_refused_too():
    """cross_entropy would skip -100 silently while counting the node in the loss's mean."""
    ps = parts()
    ps[0], node = bad_training_label(ps[0], -100)
    assert_bad_label_everywhere(outcomes(ps), -100, node, 0, CLASSES)


def test_a_label_beyond_a_pyg_models_width_fails_on_every_rank():
    pytest.importorskip("torch_geometric")
    ps = parts()
    ps[1], node = bad_training_label(ps[1], CLASSES + 3)
    said = outcomes(ps, model=Net)
    assert_bad_label_everywhere(said, CLASSES + 3, node, 1, CLASSES)
    assert all("the model's 4 outputs" in s for s in said), said


def test_a_pyg_models_first_evaluate_checks_too():
    pytest.importorskip("torch_geometric")
    ps = parts()
    ps[0], node = bad_training_label(ps[0], CLASSES)
    assert_bad_label_everywhere(outcomes(ps, model=Net, evaluate_first=True), CLASSES, node, 0, CLASSES)


def test_a_negative_label_with_a_pyg_model_fails_when_built():
    pytest.importorskip("torch_geometric")
    ps = parts()
    ps[1], node = bad_training_label(ps[1], -1)
    assert_bad_label_everywhere(outcomes(ps, model=Net), -1, node, 1, CLASSES)


def test_a_rank_without_training_nodes_takes_part_in_the_check():
    ps = parts()
    ps[0] = with_ndata(ps[0], train_mask=torch.zeros_like(ps[0].ndata["train_mask"]))
    said = outcomes(ps)
    assert all(re.fullmatch(r"trained, loss \d+\.\d+", s) for s in said), said  # a valid setting trains
    ps[1], node = bad_training_label(ps[1], -2)
    assert_bad_label_everywhere(outcomes(ps), -2, node, 1, CLASSES)


def test_labels_of_a_float_dtype_on_one_rank_fail_on_every_rank():
    ps = parts()
    ps[0] = with_ndata(ps[0], label=ps[0].ndata["label"].float())
    said = outcomes(ps)
    for rank, msg in enumerate(said):
        assert msg.startswith("ValueError: "), (rank, msg)
        assert "'label' must hold integer class indices" in msg and "torch.float32" in msg, (rank, msg)
    assert said[1].startswith("ValueError: sylvie_comm.gnn: rank 0 could not set up"), said[1]


def test_labels_outside_the_training_set_are_not_checked():
    """Nodes outside the training mask may be unlabelled (-1, as load_ogb writes for ogbn-papers100M)."""
    ps = parts()
    label = ps[1].ndata["label"].clone()
    label[~ps[1].ndata["train_mask"]] = -1
    ps[1] = with_ndata(ps[1], label=label)
    assert all(s.startswith("trained") for s in outcomes(ps))


def one_part() -> Partition:
    g = gdata.csbm(num_nodes=60, num_classes=CLASSES, feat_dim=FEAT, avg_degree=4, seed=0)
    return partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata)[0]


def test_one_process_without_a_transport_raises_the_same_error():
    part, node = bad_training_label(one_part(), -5)
    with pytest.raises(ValueError, match=rf"node {node} \(partition 0\) has the training label -5; .*\[0, 4\)"):
        Trainer(part, CONFIG)


def test_one_process_with_a_pyg_model_raises_at_its_first_epoch():
    pytest.importorskip("torch_geometric")
    part, node = bad_training_label(one_part(), 9)
    trainer = Trainer(part, CONFIG, model=Net)
    try:
        with pytest.raises(ValueError, match=rf"node {node} \(partition 0\) has the training label 9; .*\[0, 4\)"):
            trainer.train_epoch()
    finally:
        trainer.close()
