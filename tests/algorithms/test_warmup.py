"""The adaptive warm-up (``warmup: auto``): each tensor travels raw until its gradient has settled.

In one process, N ranks as threads of the in-process transport, through the policy as every
integration calls it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, Policy, make_algorithm
from sylvie_comm.algorithms.warmup import MAX_STEPS, WINDOW, Warmup
from sylvie_comm.collectives import Meter, Stats
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config

SHAPES = {"fast": (16, 16), "calm": (16, 16), "b": (16,)}
SETTLES_AT = 3 * WINDOW  # 'fast' shrinks tenfold per window until then


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out["fast"] *= 10.0 ** (-min(step, SETTLES_AT) / WINDOW)
    return out


def run(world: int, steps: int, config: Config, state: Any = None, upto: int | None = None) -> list[dict[str, Any]]:
    """Per rank: outputs per step, the start steps, the warm-up state and the bytes sent by step."""

    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(config.codec, tr, config.options)
        policy = Policy(alg, config)
        stats = Stats()
        first = 0
        if state is not None:
            policy.load_state_dict(state[tr.rank]["warmup"])
            alg.load_state_dict(state[tr.rank]["params"])
            first = state[tr.rank]["step"]
        outs, saved, sent = [], None, []
        for step in range(first, steps):
            values = grads(tr.rank, step)
            members = [Member(n, values[n].clone(), compress=len(SHAPES[n]) > 1) for n in SHAPES]
            policy(Group(0, members), step, Meter(tr.world_size, stats, step)).wait()
            outs.append({m.name: m.tensor for m in members})
            sent.append(stats.step(step).bytes_sent)
            if upto is not None and step + 1 == upto:
                saved = {"warmup": policy.state_dict(), "params": alg.state_dict(), "step": upto}
        assert policy.warmup is not None
        started = {n: policy.warmup.started(n) for n in SHAPES}
        result = {"outs": outs, "started": started, "state": policy.state_dict(), "saved": saved,
                  "bytes": sent}  # fmt: skip
        policy.close()
        alg.close()
        return result

    return run_local(world, body)


def mean_grads(world: int, step: int) -> dict[str, torch.Tensor]:
    per = [grads(r, step) for r in range(world)]
    return {n: sum(p[n] for p in per) / world for n in SHAPES}  # type: ignore[misc]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("codec", ["onebit", "acpsgd", "topk"])
def test_each_tensor_starts_once_its_gradient_settles(world: int, codec: str) -> None:
    """'calm' (steady norm) starts after its second window, 'fast' only once its norm stops falling; until
    then each travels raw (the exact mean), and every rank decides the same."""
    config = Config(codec, warmup="auto", warmup_steps=2)
    res = run(world, SETTLES_AT + 4 * WINDOW, config)
    for r in res:
        assert r["started"] == res[0]["started"]
    calm, fast = res[0]["started"]["calm"], res[0]["started"]["fast"]
    assert calm == 2 + 2 * WINDOW  # two full windows, the second within 0.5 of the first
    assert fast is not None and SETTLES_AT < fast <= SETTLES_AT + 2 * WINDOW + 2
    for step in range(fast):
        ref = mean_grads(world, step)
        for r in res:
            assert torch.allclose(r["outs"][step]["fast"], ref["fast"], rtol=1e-5, atol=1e-7), step
    last = res[0]["outs"][-1]["calm"]  # compressed from its start on: no longer the exact mean
    assert not torch.allclose(last, mean_grads(world, SETTLES_AT + 4 * WINDOW - 1)["calm"], atol=1e-6)


def test_bytes_fall_once_tensors_start_and_the_decisions_are_counted() -> None:
    config = Config("onebit", warmup="auto")
    sent = run(2, SETTLES_AT + 4 * WINDOW, config)[0]["bytes"]
    assert sent[2] > 4 * sent[-1]  # both matrices raw, then both one-bit
    assert sent[2 + WINDOW] > sent[2 + WINDOW - 1]  # a window closes: its sums are averaged (counted)


def test_the_latest_start_bounds_the_warm_up() -> None:
    """A tensor that never settles compresses from a tenth of total_steps (or MAX_STEPS after the warm-up)."""
    w = Warmup.__new__(Warmup)
    for total, latest in ((None, 2 + MAX_STEPS), (300, 30), (10, 2)):
        Warmup.__init__(w, _NoChannel(), 2, total)
        assert w.latest == latest and w.compressing("x", latest) and not w.compressing("x", latest - 1)


class _NoChannel:
    world_size = 1

    def fork(self) -> _NoChannel:
        return self


def test_resume_starts_every_tensor_at_the_same_step_with_the_same_values() -> None:
    config = Config("onebit", warmup="auto")
    steps, cut = SETTLES_AT + 3 * WINDOW, SETTLES_AT + 5  # mid-window, 'calm' compressing, 'fast' warming
    whole = run(2, steps, config, upto=cut)
    state = [r["saved"] for r in whole]
    assert state[0]["warmup"]["fast"]["started"] is None and state[0]["warmup"]["calm"]["started"] is not None
    resumed = run(2, steps, config, state=state)
    for a, b in zip(whole, resumed, strict=True):
        assert a["started"] == b["started"]
        for x, y in zip(a["outs"][cut:], b["outs"], strict=True):
            assert all(torch.equal(x[n], y[n]) for n in SHAPES)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"total": -1.0, "count": 1, "previous": None, "started": None}, "total must be a finite float >= 0"),
        ({"total": 1.0, "count": WINDOW + 1, "previous": None, "started": None}, "count must be an integer in"),
        ({"total": 1.0, "count": 1, "previous": float("nan"), "started": None}, "previous must be a finite"),
        ({"total": 1.0, "count": 1, "previous": None, "started": -3}, "started must be an integer >= 0"),
        ({"total": 1.0}, "must have total, count, previous and started"),
    ],
)
def test_a_bad_warm_up_state_is_refused_naming_the_field(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Warmup.check_state({"w": entry})


def test_config_checks_the_warm_up_fields() -> None:
    with pytest.raises(ValueError, match="warmup must be 'auto' or 'fixed', got 'slow'"):
        Config("onebit", warmup="slow")
    with pytest.raises(ValueError, match="total_steps must be an integer >= 1 or None, got 0"):
        Config("onebit", total_steps=0)
    assert Config.from_dict({"codec": "onebit", "warmup": "auto", "total_steps": 500}).total_steps == 500
