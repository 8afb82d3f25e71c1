"""The halo exchange's measured error: what every receiver decodes against what was encoded, no communication."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn.halo import HaloExchanger
from sylvie_comm.gnn.partition import partition
from tests.gnn import workloads as gw


def _exchange(precision: str, every: int, calls: int) -> list[dict[str, Any]]:
    g = gw.small_graph()
    parts = partition((g.src, g.dst), 2, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)

    def body(tr: Any) -> dict[str, Any]:
        part = parts[tr.rank]
        ex = HaloExchanger(part, tr, precision, precision, monitor_every=every)
        x = part.ndata["feat"].float()
        got = []
        for i in range(calls):
            inner = x * (1 + i)
            got.append(ex.features_job(inner, "layer0")())
            ex.gradients_job(torch.ones(part.n_halo, x.shape[1]) * (i + 1), "layer0")()
        return {"errors": ex.errors(), "halo": got, "part": part}

    return run_local(2, body)


@pytest.mark.parametrize("precision", ["q1", "q4", "bf16"])
def test_the_error_is_what_the_peer_decodes_against_what_was_encoded(precision: str) -> None:
    """Every 2nd of 5 exchanges (calls 1, 3, 5) measured; the mean equals the error recomputed from the halo
    rows the peer received (each rank's halo rows are the other's boundary rows)."""
    res = _exchange(precision, every=2, calls=5)
    for rank in (0, 1):
        peer = res[1 - rank]
        mine = res[rank]
        want = []
        for i in (0, 2, 4):
            # The rows this rank sent its peer, in the peer's halo order, against their encoding's decode.
            order = mine["part"].send_idx[1 - rank]
            decoded = peer["halo"][i]
            truth = mine["part"].ndata["feat"].float()[order] * (1 + i)
            assert decoded.shape == truth.shape
            want.append(float((decoded - truth).norm() / truth.norm()))
        got = mine["errors"]["forward/layer0"]
        # The measured error is over every boundary row this rank encoded (sent to every peer: here one).
        assert got == pytest.approx(sum(want) / 3, rel=1e-4)
        assert "backward/layer0" in mine["errors"]
    if precision == "q1":
        assert res[0]["errors"]["forward/layer0"] > 0.2
    if precision == "bf16":
        assert res[0]["errors"]["forward/layer0"] < 2**-7


def test_off_measures_nothing() -> None:
    assert _exchange("q4", every=0, calls=3)[0]["errors"] == {}


def test_a_bad_period_is_refused() -> None:
    g = gw.small_graph()
    parts = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)
    with pytest.raises(RuntimeError, match=r"monitor_every must be an integer >= 0 \(0: no error measured\), got -1"):
        run_local(1, lambda tr: HaloExchanger(parts[0], tr, "q4", "q4", monitor_every=-1))
