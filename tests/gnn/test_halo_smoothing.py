"""The receiver's running average of halo feature rows (``smoothing``) and evaluation at another halo precision.

The reference is the average written out in plain torch: the rows each training exchange decodes without
smoothing (an exchanger of the same seed), folded in as ``a = m a + (1 - m) rows`` one exchange after another.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn.halo import HaloExchanger, HaloPipeline
from sylvie_comm.gnn.partition import partition
from tests.gnn import workloads as gw


def _parts(world: int = 2) -> list[Any]:
    g = gw.small_graph()
    return partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)


def _inputs(part: Any, steps: int, features: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + part.rank)
    return [torch.randn(part.n_inner, features, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("precision,feedback", [("fp32", False), ("q1", False), ("q1", True), ("q4", True)])
@pytest.mark.parametrize("staleness", [0, 1])
def test_smoothed_rows_are_the_running_average_of_the_decoded_rows(precision, feedback, staleness):
    m, steps = 0.6, 5
    parts = _parts()

    def rank(tr: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        part = parts[tr.rank]
        out = []
        for smoothing, transport in ((0.0, tr.fork()), (m, tr.fork())):
            pipe = HaloPipeline(HaloExchanger(part, transport, precision, precision, error_feedback=feedback,
                                              seed=7, smoothing=smoothing), staleness=staleness)  # fmt: skip
            rows = []
            for epoch, x in enumerate(_inputs(part, steps)):
                pipe.begin_epoch(epoch)
                rows.append(pipe.features(1, x).clone())
            pipe.close()
            out.append(rows)
        return out[0], out[1]

    for plain, smoothed in run_local(2, rank):
        # At staleness 1 epoch t uses epoch t-1's exchange (epoch 0's at epoch 0 and 1): the same average, late.
        made = [plain[0], *plain[2:]] if staleness else plain
        used = [smoothed[0], *smoothed[2:]] if staleness else smoothed
        avg = made[0].clone()
        assert torch.equal(used[0], avg)
        for rows, got in zip(made[1:], used[1:], strict=True):
            avg = m * avg + (1 - m) * rows
            torch.testing.assert_close(got, avg, rtol=1e-6, atol=1e-6)
        assert not torch.equal(used[-1], made[-1]), "nothing was averaged"


def test_evaluation_passes_are_not_smoothed_and_can_be_exact():
    parts = _parts()

    def rank(tr: Any) -> dict[str, torch.Tensor]:
        part = parts[tr.rank]
        exact = HaloPipeline(HaloExchanger(part, tr.fork(), "fp32", "fp32"))
        pipe = HaloPipeline(HaloExchanger(part, tr.fork(), "q1", "q1", seed=3, smoothing=0.9))
        xs = _inputs(part, 3)
        for epoch, x in enumerate(xs[:2]):
            pipe.begin_epoch(epoch)
            pipe.features(1, x)
        with pipe.evaluating("fp32"):
            fp32 = pipe.features(1, xs[2]).clone()
        with pipe.evaluating():
            q1 = pipe.features(1, xs[2]).clone()
        exact.begin_epoch(0)
        want = exact.features(1, xs[2]).clone()
        pipe.close()
        exact.close()
        return {"fp32": fp32, "q1": q1, "want": want}

    for r in run_local(2, rank):
        assert torch.equal(r["fp32"], r["want"])  # exact rows, no average of the training rows in them
        assert not torch.equal(r["q1"], r["want"])  # the training precision, by default
        assert (r["q1"] - r["want"]).abs().max() <= 2 * r["want"].abs().max() + 1e-6  # one fresh q1 exchange


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, True, "0.5", float("nan")])
def test_bad_smoothing_is_refused(bad):
    parts = _parts()

    def rank(tr: Any) -> None:
        with pytest.raises(ValueError, match=r"halo: smoothing must be a number in \[0, 1\)"):
            HaloExchanger(parts[tr.rank], tr, "q1", "q1", smoothing=bad)

    run_local(2, rank)


def test_bad_evaluation_precision_is_refused():
    parts = _parts()

    def rank(tr: Any) -> None:
        pipe = HaloPipeline(HaloExchanger(parts[tr.rank], tr, "q1", "q1"))
        with pytest.raises(ValueError, match="q3"), pipe.evaluating("q3"):
            pass
        assert not pipe._evaluating
        pipe.close()

    run_local(2, rank)


def test_the_demo_refuses_a_bad_evaluation_precision_before_it_trains(capsys):
    from sylvie_comm.demo import gnn_full_graph

    assert gnn_full_graph.parse_args([]).eval_halos == "fp32"
    assert gnn_full_graph.parse_args(["--eval-halos", "1"]).eval_halos == "q1"
    assert gnn_full_graph.parse_args(["--eval-halos", "train"]).eval_halos == "train"
    with pytest.raises(SystemExit):
        gnn_full_graph.parse_args(["--eval-halos", "q3"])
    assert "unknown halo precision 'q3'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [1.0, -0.5, True, "0.5"])
def test_a_bad_halo_smoothing_in_the_training_configuration_is_refused(bad):
    from sylvie_comm.gnn.train import TrainConfig

    with pytest.raises(ValueError, match=r"gnn: halo_smoothing must be a number in \[0, 1\)"):
        TrainConfig(halo_smoothing=bad).validated()


def test_smoothing_is_off_by_default_and_kept_as_given():
    from sylvie_comm.gnn.train import TrainConfig

    for forward in ("q1", "q4", "fp32"):
        assert TrainConfig(forward=forward).validated().halo_smoothing == 0.0
        assert TrainConfig(forward=forward, halo_smoothing=0.25).validated().halo_smoothing == 0.25
