"""A Trainer on a process group other than the default one keeps every collective inside that group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.gnn import workloads as gw

pytestmark = pytest.mark.multiprocess

CONFIG = {"model": "sage", "hidden": 16, "layers": 3, "backend": "torch"}
EPOCHS = 3


def _subgroup_worker(rank: int, world: int, config: dict[str, Any], epochs: int) -> dict[str, Any] | None:
    """Global ranks 1 and 2 train the two partitions of one graph on their own group; rank 0 takes no part."""
    from sylvie_comm.gnn.partition import partition
    from sylvie_comm.gnn.train import TrainConfig, Trainer

    g = gw.small_graph()
    parts = partition((g.src, g.dst), 2, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)
    group = dist.new_group(ranks=[1, 2])  # every process enters new_group, members or not
    everyone = dist.new_group(ranks=[0, 1, 2])  # for the final barrier only
    if rank == 0:
        with pytest.raises(ValueError, match="not a member of the process_group"):
            Trainer(parts[0], TrainConfig(**config), process_group=group)
        # Rank 0 hosts the store the trainers' groups rendezvous through: it stays until they are done, but
        # joins no collective of the default group, so a trainer collective issued there would never finish.
        dist.barrier(group=everyone)
        return None
    tr = Trainer(parts[dist.get_rank(group)], TrainConfig(**config), process_group=group)
    logits: list[torch.Tensor] = []
    tr.model.register_forward_hook(lambda module, inputs, out: logits.append(out.detach().clone()))
    history = [tr.train_epoch() for _ in range(epochs)]
    evaluation = tr.evaluate()
    tr.close()
    dist.barrier(group=everyone)
    return {"ids": tr.part.inner.clone(), "logits": logits[-1], "history": history, "eval": evaluation,
            "train_count": tr.train_count}  # fmt: skip


def test_trainer_on_a_subgroup_matches_single_process_training():
    """Losses, accuracies and logits of ranks {1, 2} of 3 equal single-process full-graph training's."""
    ref = gw.single_process(CONFIG, EPOCHS)
    results = run_distributed(_subgroup_worker, 3, CONFIG, EPOCHS, timeout=120)
    assert results[0] is None
    members = results[1:]
    logits = torch.full_like(ref["logits"], float("nan"))
    for r in members:
        logits[r["ids"]] = r["logits"]
    # evaluate() ran after EPOCHS steps, where the reference took its snapshot.
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    g = gw.small_graph()
    for r in members:
        assert r["train_count"] == float(g.ndata["train_mask"].sum())
        for mine, theirs in zip(r["history"], ref["history"], strict=True):
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5
            assert mine["train_acc"] == pytest.approx(theirs["train_acc"], abs=1e-9)
        assert abs(r["eval"]["loss"] - ref["eval"]["loss"]) <= 1e-5
        for k in ("train_acc", "val_acc", "test_acc"):
            assert r["eval"][k] == pytest.approx(ref["eval"][k], abs=1e-9)
