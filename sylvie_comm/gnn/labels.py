"""The node data a :class:`~sylvie_comm.gnn.train.Trainer` trains on, checked: features, integer labels and the
training mask on each partition, and every training label a class index of the model on every rank.

Each rank sends the smallest and largest of its training labels once (:func:`label_ranges`), so that a label the
model cannot take fails on every rank with the same ValueError (:func:`check_width`), not as an IndexError in one
rank's loss while the others wait.
"""

from __future__ import annotations

from typing import Any

import torch

from sylvie_comm.collectives import Transport
from sylvie_comm.gnn.part import Partition


def check_node_data(part: Partition, world: int) -> None:
    """ValueError unless ``part`` holds node data ``feat``, integer ``label`` and ``train_mask`` of the labels'
    shape, and is one of ``world`` partitions."""
    if part.ndata.get("feat") is None or "label" not in part.ndata or "train_mask" not in part.ndata:
        raise ValueError("gnn: the partition needs node data 'feat', 'label' and 'train_mask'")
    if part.num_parts != world:
        raise ValueError(f"gnn: {part.num_parts} partitions for {world} ranks; they must match")
    label = part.ndata["label"]
    if label.dim() != 1 or label.dtype.is_floating_point or label.dtype.is_complex or label.dtype == torch.bool:
        raise ValueError(f"gnn: node data 'label' must hold integer class indices (a 1-D integer tensor, "
                         f"one per inner node), got a {label.dtype} tensor of shape {tuple(label.shape)} on "
                         f"partition {part.rank}; convert it with label.long()")  # fmt: skip
    if part.ndata["train_mask"].shape != label.shape:
        raise ValueError(f"gnn: node data 'train_mask' of shape {tuple(part.ndata['train_mask'].shape)} on "
                         f"partition {part.rank}; expected the labels' shape {tuple(label.shape)}")  # fmt: skip


def label_ranges(part: Partition, transport: Transport | None) -> list[dict[str, Any]]:
    """Each rank's ``classes`` (1 + its largest label of any node, 0 without nodes) and the smallest and largest
    label of its training nodes, ``(label, global node id)`` each (None without training nodes), by rank: gathered
    over ``transport`` (a collective), or this rank's alone without one."""
    labels, rows = part.ndata["label"], torch.nonzero(part.ndata["train_mask"]).view(-1)  # host tensors
    mine: dict[str, Any] = {"classes": int(labels.max()) + 1 if labels.numel() else 0, "low": None, "high": None}
    if rows.numel():
        train = labels[rows].to("cpu", torch.int64)
        inner = part.inner.to("cpu")
        for key, at in (("low", torch.argmin(train)), ("high", torch.argmax(train))):  # their first rows
            mine[key] = (int(train[at]), int(inner[rows[at]]))
    if transport is not None:
        return list(transport.all_gather_object(mine))
    return [mine]


def check_width(ranges: list[dict[str, Any]], classes: int) -> None:
    """ValueError unless every rank's training labels (:func:`label_ranges`) are in ``[0, classes)``: the same on
    every rank, which all hold every rank's ranges (no collective)."""
    for rank, found_ranges in enumerate(ranges):
        for found in (found_ranges["low"], found_ranges["high"]):
            if found is not None and not 0 <= found[0] < classes:
                label, node = found
                raise ValueError(f"gnn: node {node} (partition {rank}) has the training label {label}; expected "
                                 f"a class index in [0, {classes}) for the model's {classes} outputs (every "
                                 "training label must be one of the model's classes)")  # fmt: skip


__all__ = ["check_node_data", "check_width", "label_ranges"]
