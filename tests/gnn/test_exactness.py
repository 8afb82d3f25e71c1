"""Partitioned full-graph training on in-process ranks: exactness, compression error, staleness, failures.

The ranks are threads of this process joined by the in-process transport
(:func:`sylvie_comm.collectives.local.run_local`), the trainer's own collectives (agreement, halo exchange,
loss and accuracy sums) run over it, and the weight gradients are averaged by ``GradientAverage`` after
backward. Nothing here depends on processes; the DDP path (a process group, the model wrapped in DDP) is
tested once, in ``test_training.py``. Every rank builds its weights under the trainer's seeded lock, so
every rank starts from the same weights and the runs are deterministic.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.collectives import Transport
from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.part import Partition
from sylvie_comm.gnn.partition import partition
from sylvie_comm.gnn.train import TrainConfig, Trainer
from tests.gnn import workloads as gw

# A rank left waiting (a rank that failed alone) fails its test with a TimeoutError after this many seconds.
TIMEOUT = 30.0


def assert_matches_single_process(config: dict[str, Any], world: int, epochs: int = 3) -> None:
    ref = gw.single_process(config, epochs)
    gw.assert_matches_single_process(gw.run_in_process(world, config, epochs, "random", timeout=60), ref)


@pytest.mark.parametrize("model", ["sage", "gcn", "gat"])
@pytest.mark.parametrize("world", [2, 4])
def test_synchronous_fp32_reproduces_single_process(model, world):
    """Staleness 0 + fp32 halos: logits, loss and weight gradients equal full-graph training after 3 epochs."""
    assert_matches_single_process({"model": model, "hidden": 16, "layers": 3, "backend": "torch"}, world)


@pytest.mark.parametrize("model", ["sage", "gat"])
def test_synchronous_fp32_reproduces_single_process_with_an_exchanging_first_layer(model):
    """Without the precomputed first layer the input's halo rows travel every epoch, also exactly in fp32."""
    config = {"model": model, "hidden": 16, "layers": 2, "backend": "torch", "precompute_first": False}
    assert_matches_single_process(config, 2)


@pytest.mark.skipif(not _deps.with_dgl(), reason="DGL does not import")
@pytest.mark.parametrize("model", ["sage", "gcn", "gat"])
def test_synchronous_fp32_reproduces_single_process_with_dgl_layers(model):
    assert_matches_single_process({"model": model, "hidden": 16, "layers": 2, "backend": "dgl"}, 2)


def test_quantized_halos_error_is_bounded():
    """8-bit halos move logits by about a quantization step; 1-bit halos stay finite and trainable."""
    base = {"model": "sage", "hidden": 16, "layers": 2, "backend": "torch"}
    ref = gw.single_process(base, 0)
    res8 = gw.run_in_process(2, {**base, "forward": "q8", "backward": "q8"}, 0)
    err8 = (gw.gather_logits(res8, ref["logits"]) - ref["logits"]).abs().max().item()
    res1 = gw.run_in_process(2, {**base, "forward": "q1", "backward": "q1"}, 0)
    err1 = (gw.gather_logits(res1, ref["logits"]) - ref["logits"]).abs().max().item()
    scale = ref["logits"].abs().max().item()
    assert 0 < err8 < 0.02 * scale
    assert err8 < err1 < float("inf")


def small_parts(world: int, **kwargs: Any) -> list[Partition]:
    g = gw.small_graph()
    return partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, **kwargs)


@pytest.mark.parametrize("staleness", [0, 2])
def test_pipeline_holds_a_bounded_number_of_exchanges(staleness):
    """Nothing accumulates epoch after epoch (a synchronous run once kept every gradient exchange)."""
    parts = small_parts(2)

    def body(transport: Transport) -> list[int]:
        tr = Trainer(parts[transport.rank], TrainConfig(hidden=8, layers=3, backend="torch", staleness=staleness),
                     transport=transport)  # fmt: skip
        sizes = []
        try:
            for _ in range(8):
                tr.train_epoch()
                sizes.append(tr.pipeline.pending())
        finally:
            tr.close()
        return sizes

    for sizes in run_local(2, body, timeout=60):
        assert max(sizes) <= 2 * 2 * (staleness + 1), sizes
        assert sizes[-1] == sizes[-2], sizes


def test_staleness_is_bounded_and_recorded():
    cfg = {"model": "sage", "hidden": 16, "layers": 2, "backend": "torch", "forward": "q2", "backward": "q2",
           "staleness": 2, "sync_every": 4}  # fmt: skip
    for r in gw.run_in_process(2, cfg, 9):
        st = r["stats"]
        assert st["staleness_bound"] == 2 and st["max_observed_staleness"] <= 2
        assert st["observed_staleness"].get(0, 0) > 0 and st["observed_staleness"].get(2, 0) > 0
        halo_bytes = [h["halo_bytes"] for h in r["history"]]
        assert all(b > 0 for b in halo_bytes)


def outcome_of_setup(per_rank: list[dict[str, Any]]) -> list[str]:
    """Each rank sets up training with its own extra options: the error it raised (``"Type: message"``,
    caught on its thread), or "no error"."""

    def body(transport: Transport) -> str:
        cfg = {"model": "sage", "hidden": 16, "backend": "torch", **per_rank[transport.rank]}
        try:
            gw.run(transport.rank, transport.world_size, cfg, 1, transport=transport)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    return run_local(len(per_rank), body, timeout=TIMEOUT)


def test_mismatched_options_fail_on_every_rank():
    msgs = outcome_of_setup([{"staleness": 1}, {"staleness": 2}])
    for rank, msg in enumerate(msgs):
        assert msg.startswith("ValueError: "), (rank, msg)
        assert "'staleness' is 1 on rank 0 but 2 on rank 1" in msg, (rank, msg)


def test_invalid_option_on_one_rank_fails_every_rank():
    msgs = outcome_of_setup([{"forward": "q1"}, {"forward": "q3"}])
    assert all(msg.startswith("ValueError: ") for msg in msgs), msgs
    assert "rank 1 could not set up" in msgs[0]
    assert "unknown halo precision" in msgs[1]


def test_features_of_the_wrong_shape():
    parts = small_parts(2)

    def body(transport: Transport) -> str:
        tr = Trainer(parts[transport.rank], TrainConfig(hidden=8, backend="torch"), transport=transport)
        try:
            tr.model(tr.graph, tr.x[:-1])
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            tr.close()
        return "no error"

    for rank, msg in enumerate(run_local(2, body, timeout=TIMEOUT)):
        assert msg.startswith("ValueError: ") and "expected features of shape" in msg, (rank, msg)


def test_inconsistent_partitions_fail_on_every_rank():
    # Each rank partitions with a different seed: the parts do not fit together.
    parts = [small_parts(2, seed=rank)[rank] for rank in range(2)]

    def body(transport: Transport) -> str:
        try:
            tr = Trainer(parts[transport.rank], TrainConfig(hidden=8, backend="torch"), transport=transport)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        tr.close()
        return "no error"

    for rank, msg in enumerate(run_local(2, body, timeout=TIMEOUT)):
        assert msg.startswith("ValueError: ") and "partitions disagree" in msg, (rank, msg)


def test_empty_halos_train():
    g = gdata.csbm(num_nodes=200, num_classes=4, feat_dim=8, seed=1)
    half = g.src < 100
    keep = half == (g.dst < 100)  # drop the edges between the halves: two components
    assign = (torch.arange(200) >= 100).long()
    parts = partition((g.src[keep], g.dst[keep]), 2, assign, num_nodes=200, ndata=g.ndata)
    assert [p.n_halo for p in parts] == [0, 0]

    def body(transport: Transport) -> dict[str, Any]:
        tr = Trainer(parts[transport.rank], TrainConfig(hidden=8, backend="torch", forward="q1", staleness=1),
                     transport=transport)  # fmt: skip
        try:
            hist = [tr.train_epoch() for _ in range(3)]
        finally:
            tr.close()
        return {"loss": hist[-1]["loss"], "halo": sum(h["halo_bytes"] for h in hist)}

    for r in run_local(2, body, timeout=60):
        assert r["halo"] == 0 and r["loss"] == r["loss"]


def test_each_epoch_reports_its_communication_breakdown():
    """compute + halo wait = the epoch; the exchange thread's time splits into waited-for and hidden parts.
    Synchronous epochs wait for every exchange; with staleness 1 some exchange time is hidden."""
    config = {"model": "sage", "hidden": 16, "layers": 3, "backend": "torch", "staleness": 1}
    for r in gw.run_in_process(2, config, 6, "random"):
        for h in r["history"]:
            assert min(h["compute_s"], h["halo_wait_s"], h["halo_exchange_s"], h["halo_hidden_s"]) >= 0
            assert h["compute_s"] + h["halo_wait_s"] == pytest.approx(h["seconds"], abs=1e-9)
            assert h["halo_hidden_s"] == pytest.approx(max(h["halo_exchange_s"] - h["halo_wait_s"], 0.0))
        # An exchange counts in the epoch during which it finishes: epoch 0 is synchronous and finishes all of
        # its own; a stale epoch whose exchanges all finish outside it (a loaded machine) reads 0.0.
        assert r["history"][0]["halo_exchange_s"] > 0
        # How much of the exchange time is waited for depends on the machine's load (on a loaded one every
        # exchange of a run finished before its layer asked, and the waits read 0.0): not asserted here.
