"""DiLoCo's outer step through SparseLoCo (``codec="sparseloco"``), and DiLoCo's own defaults for qsgd."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms.sparseloco import row_bytes
from sylvie_comm.codecs.sparse import ChunkPlan
from sylvie_comm.collectives import wire_bytes
from sylvie_comm.collectives.local import run_local
from sylvie_comm.diloco import DiLoCo
from sylvie_comm.optim.diloco import OUTER_DEFAULTS
from tests.optim.test_diloco import LR, MOMENTUM, model_of, train

SPARSE = {"codec": "sparseloco", "density": 0.25, "chunk": 16}


@pytest.mark.parametrize("rounding", ["deterministic", "stochastic"])
def test_resume_is_bit_identical_and_every_rank_ends_alike(rounding: str) -> None:
    kw = {**SPARSE, "rounding": rounding, "sync_every": 4}
    straight = run_local(2, lambda t: train(t, 16, **kw))
    resumed = run_local(2, lambda t: train(t, 16, resume_at=6, **kw))
    for a, b in zip(straight, resumed, strict=True):
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
    # right after an outer step every replica holds the global parameters
    for n in straight[0]["params"]:
        assert torch.equal(straight[0]["params"][n], straight[1]["params"][n]), n


def residuals_in(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [v for k, v in state.items() if k == "residual" and isinstance(v, torch.Tensor)] + [
            r for v in state.values() for r in residuals_in(v)
        ]
    return []


def test_the_residual_carries_across_outer_steps() -> None:
    runs = run_local(2, lambda t: train(t, 8, sync_every=4, **SPARSE))
    res = residuals_in(runs[0]["state"]["fragments"][0]["session"])
    # one per parameter but the last bias: 3 values cost 10 bytes as a selection, 12 raw (a rate under
    # min_compression_rate, 2): it travels raw
    assert len(res) == len(list(model_of(0).parameters())) - 1
    assert all(bool(r.abs().sum() > 0) for r in res)
    assert runs[0]["stats"]["outer_steps"] == 2


def test_bytes_are_the_all_gather_of_each_rank_selection() -> None:
    h, steps = 4, 8
    runs = run_local(2, lambda t: train(t, steps, sync_every=h, **SPARSE))
    model = model_of(0)
    plans = [ChunkPlan.of(p.numel(), 16, 0.25) for p in model.parameters()]
    stats = runs[0]["stats"]
    assert stats["bytes_sent"] == (steps // h) * wire_bytes("all_gather", row_bytes(plans), 2)
    assert stats["reduction_vs_ddp"] > h  # fewer bytes than fp32 DiLoCo's H-fold saving


def session_options(**kwargs: Any) -> dict[str, Any]:
    def body(t: Any) -> dict[str, Any]:
        model = model_of(0)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        with DiLoCo(model, opt, sync_every=4, transport=t, **kwargs) as dl:
            session = dl.fragments[0].session
            assert session is not None
            return dict(session.algorithm.options)

    return run_local(1, body)[0]


def test_qsgd_takes_diloco_defaults_beneath_what_is_named() -> None:
    assert OUTER_DEFAULTS["qsgd"] == {"bits": 2, "block": 2048}
    opts = session_options(codec="qsgd")
    assert (opts["bits"], opts["block"]) == (2, 2048)
    opts = session_options(codec="qsgd", bits=4, block=1)  # named: kept
    assert (opts["bits"], opts["block"]) == (4, 1)
    opts = session_options(codec="topk")  # other codecs: their own defaults
    assert "block" not in opts
