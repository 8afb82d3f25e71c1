"""The byte budget: the dynamic program against brute force, the ladders, and the monitor choosing every tensor's
setting within the budget (same decisions on every rank, a resume that decides as the straight run)."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms.budget import RAW, ladder, level_bytes, solve
from sylvie_comm.algorithms.registry import ALGORITHMS
from sylvie_comm.collectives.local import LocalGroup
from sylvie_comm.config import check_monitor

from .test_monitor import SHAPES, Config, mean, run


def brute(costs: list[list[int]], errors: list[list[float]], capacity: int) -> float:
    best = math.inf
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        if sum(c[j] for c, j in zip(costs, pick, strict=True)) <= capacity:
            best = min(best, sum(e[j] for e, j in zip(errors, pick, strict=True)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_dp_finds_the_brute_force_optimum_within_the_capacity(seed: int) -> None:
    rng = random.Random(seed)
    items = rng.randint(1, 5)
    costs = [[rng.randint(0, 9) for _ in range(rng.randint(1, 4))] for _ in range(items)]
    errors = [[rng.choice([rng.random(), 0.5, 0.25]) for _ in c] for c in costs]
    capacity = rng.randint(min(c for row in costs for c in row) * items, sum(max(c) for c in costs))
    if brute(costs, errors, capacity) == math.inf:
        with pytest.raises(ValueError, match="no choice"):
            solve(costs, errors, capacity)
        return
    choice, curve = solve(costs, errors, capacity)
    assert sum(c[j] for c, j in zip(costs, choice, strict=True)) <= capacity
    got = sum(e[j] for e, j in zip(errors, choice, strict=True))
    assert got == pytest.approx(brute(costs, errors, capacity), abs=1e-12)
    for b in range(capacity + 1):  # the curve: the least error at each capacity
        want = brute(costs, errors, b)
        assert curve[b] == (math.inf if want == math.inf else pytest.approx(want, abs=1e-12)), b


def test_ties_go_to_the_cheaper_level_and_the_smallest_total() -> None:
    """Two levels of one error: the cheaper one; equal errors across items: the smallest total, every time."""
    choice, _ = solve([[1, 2, 3], [2, 4]], [[0.5, 0.5, 0.0], [0.0, 0.0]], 10)
    assert choice == [2, 0]
    choice, _ = solve([[1, 2], [1, 2]], [[1.0, 0.0], [0.0, 0.0]], 3)
    assert choice == [1, 0]
    again = [solve([[1, 2], [1, 2], [1, 2]], [[0.3, 0.1], [0.3, 0.1], [0.3, 0.1]], 4)[0] for _ in range(3)]
    assert again[0] == again[1] == again[2] == [1, 0, 0]  # room for one upgrade: the first item's, always


def test_a_capacity_nothing_fits_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="capacity of 1"):
        solve([[2, 3]], [[1.0, 0.0]], 1)
    with pytest.raises(ValueError, match="one error per cost"):
        solve([[2, 3]], [[1.0]], 5)


TOPK = [0.1 / 2**k for k in (6, 5, 4, 3, 2, 1, 0)] + [0.2, 0.25]  # halved 6 times, doubled up to a quarter


@pytest.mark.parametrize(("codec", "base", "want"), [
    ("acpsgd", {"rank": 4}, [{"rank": 2**k} for k in range(8)]),  # rank 128: 2.7x, over min_rate 2
    ("qsgd", {"bits": 4}, [{"bits": b} for b in (2, 4, 8)]),
    ("topk", {"ratio": 0.1}, [{"ratio": r} for r in TOPK]),
])  # fmt: skip
def test_the_ladder_walks_the_algorithms_levels_cheapest_first(codec: str, base: dict[str, Any],
                                                               want: list[dict[str, Any]]) -> None:  # fmt: skip
    alg = ALGORITHMS[codec](LocalGroup(1).transport(0), base)
    got = ladder(alg, (256, 512), base, 2.0)
    assert [{k: pytest.approx(v) for k, v in g.items()} for g in got] == want  # type: ignore[misc]
    sizes = [level_bytes(alg, (256, 512), g) for g in got]
    assert sizes == sorted(sizes) and sizes[-1] < 4.0 * 256 * 512


@pytest.mark.parametrize(("monitor", "match"), [
    ({"target_ratio": 1.0}, "target_ratio must be a finite number > 1"),
    ({"target_ratio": "8"}, "target_ratio must be a finite number"),
    ({"target_bytes": 0}, "target_bytes must be a finite number > 0"),
    ({"target_ratio": 8, "target_bytes": 100}, "not both"),
])  # fmt: skip
def test_bad_targets_are_refused_by_name(monitor: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_monitor(monitor)


def test_an_algorithm_whose_levels_cannot_be_measured_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no codec whose levels"):
        run(1, 2, Config("auto", monitor={"target_ratio": 4}))


def _bytes(codec: str, report: dict[str, Any], options: dict[str, Any]) -> float:
    """Payload bytes per step of the settings in ``report`` (the bias raw)."""
    alg = ALGORITHMS[codec](LocalGroup(1).transport(0), options)
    total = 4.0 * math.prod(SHAPES["b"])
    for n in ("w1", "w2"):
        s = report["tensors"][n]["setting"]
        numel = math.prod(SHAPES[n])
        total += 4.0 * numel if s == RAW else level_bytes(alg, SHAPES[n], {**options, **s})
    return total


@pytest.mark.parametrize(("codec", "options"), [("acpsgd", {"rank": 1}), ("qsgd", {"bits": 2}), ("topk", {})])
@pytest.mark.parametrize("target", [2.5, 6.0])
def test_the_settings_fit_the_budget_and_every_rank_takes_the_same(codec: str, options: dict[str, Any],
                                                                   target: float) -> None:  # fmt: skip
    """At a target ratio, every rank reports the same choice; the bytes per step the settings send stay within
    what the budget left (within a level's rounding), and a looser target buys less error."""
    config = Config(codec, warmup_steps=0, options=options, monitor={"period": 3, "target_ratio": target})
    res = run(2, 24, config)
    mon = res[0]["stats"]["monitor"]
    assert mon == res[1]["stats"]["monitor"]
    budget = mon["budget"]
    assert budget["chosen_bytes"] <= max(budget["budget_bytes"], budget["curve"][0][0]) + 1e-6
    fp32 = 4.0 * sum(math.prod(s) for s in SHAPES.values())
    assert _bytes(codec, mon, options) <= fp32 / target * 1.6  # the settings in force, against the target
    curve = budget["curve"]
    assert [b for b, _ in curve] == sorted(b for b, _ in curve)
    assert all(e1 > e2 for (_, e1), (_, e2) in itertools.pairwise(curve))  # each point buys less error
    assert budget["counted_ratio"] >= target * 0.9


def test_a_loose_budget_sends_raw_and_the_average_is_exact() -> None:
    """With room for everything raw (a target just over 1), the DP sends every tensor raw: exact averages."""
    config = Config("acpsgd", warmup_steps=0, options={"rank": 1}, monitor={"period": 2, "target_ratio": 1.01})
    res = run(2, 16, config)
    mon = res[0]["stats"]["monitor"]
    assert all(mon["tensors"][n]["setting"] == RAW for n in ("w1", "w2")), mon["adapted"]
    for n in ("w1", "w2"):
        torch.testing.assert_close(res[0]["outs"][15][n], mean(2, 15)[n], rtol=0, atol=1e-6)


def test_a_tight_budget_keeps_the_cheapest_levels_and_never_raw() -> None:
    config = Config("qsgd", warmup_steps=0, options={"bits": 8}, monitor={"period": 2, "target_ratio": 30})
    mon = run(2, 16, config)[0]["stats"]["monitor"]
    assert [mon["tensors"][n]["setting"] for n in ("w1", "w2")] == [{"bits": 2}, {"bits": 2}]


def test_target_bytes_sets_the_bytes_per_step() -> None:
    """target_bytes: the settings' bytes per step at most the target (the bias's fp32 included)."""
    config = Config("acpsgd", warmup_steps=0, options={"rank": 4}, monitor={"period": 3, "target_bytes": 900})
    mon = run(2, 24, config)[0]["stats"]["monitor"]
    assert _bytes("acpsgd", mon, {"rank": 4}) <= 900 * 1.3
    assert mon["budget"]["target_bytes"] == 900.0


@pytest.mark.parametrize("codec", ["acpsgd", "qsgd", "onebit"])
def test_a_resume_decides_as_the_straight_run(codec: str) -> None:
    """Saved at every step of a run whose budget changes settings, resumed in two buckets: the outputs, the
    decisions and the budget's state are the straight run's, bit for bit."""
    config = Config(codec, warmup_steps=1, options={"rank": 1} if codec == "acpsgd" else {},
                    monitor={"period": 3, "target_ratio": 3.0})  # fmt: skip
    steps = 14
    straight = run(2, steps, config, buckets=2)
    assert straight[0]["stats"]["monitor"]["adapted"], "the budget must change a setting in this test"
    for save_at in range(1, steps):
        saved = run(2, save_at, config, save_at=save_at, buckets=2)
        resumed = run(2, steps, config, state=[r["saved"] for r in saved], buckets=2)
        for a, b in zip(straight, resumed, strict=True):
            for s, out in enumerate(b["outs"]):
                for n in SHAPES:
                    assert torch.equal(a["outs"][save_at + s][n], out[n]), (save_at, s, n)
            assert a["stats"]["monitor"]["adapted"] == b["stats"]["monitor"]["adapted"], save_at
            assert a["end"]["monitor"]["budget"] == b["end"]["monitor"]["budget"], save_at


def test_a_budget_checkpoint_needs_a_budget() -> None:
    config = Config("qsgd", warmup_steps=0, monitor={"period": 2, "target_ratio": 4})
    saved = run(2, 6, config, save_at=6)
    with pytest.raises(RuntimeError, match="target_ratio"):
        run(2, 8, Config("qsgd", warmup_steps=0, monitor={"period": 2}), state=[r["saved"] for r in saved])
