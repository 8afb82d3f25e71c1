"""``auto``'s trial: a candidate that needs the monitor never averages the model's gradients before it is judged.

On a slow link ACP-SGD is the fastest candidate; it runs on copies in the probe (plain averaging carries the real
gradients) and beside the fastest candidate that needs no monitor for the trial's steps; it is taken only where its
measured lag is within the monitor's bound, every rank deciding the same, and a run resumed mid-trial is the
straight run's to the bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, make_algorithm
from sylvie_comm.algorithms.auto import AutoAlgorithm
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import UNCOMPRESSED, Rule
from sylvie_comm.config import Config as _Config
from tests.algorithms.test_auto import SlowLink

SHAPES = {"w1": (256, 256), "w2": (128, 256), "b": (256,)}
CANDIDATES = ["none", "qsgd", "acpsgd"]  # on the slow link: acpsgd fastest, then qsgd, then none
PROBE = 3  # one step of each candidate
TRIAL = 4  # the monitor's `first`: the trial's steps; `window` 2 of them measured


def Config(max_lag: float) -> _Config:
    return _Config("auto", warmup_steps=0, options={"candidates": CANDIDATES, "probe_steps": 1},
                   rules=(Rule("b", UNCOMPRESSED),),
                   monitor={"first": TRIAL, "window": 2, "period": 50, "max_lag": max_lag})  # fmt: skip


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4099 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def run(max_lag: float, steps: int, *, save_at: int | None = None, state: Any = None, buckets: int = 1,
        ) -> list[dict[str, Any]]:  # fmt: skip
    """Per rank: the averaged tensors and auto's choice per step, its report, the checkpoint at ``save_at`` and the
    candidates' residuals at the end. ``buckets=2``: ``w1`` and the rest as two groups, the second launched before
    the first is waited for (as DDP launches its buckets)."""

    def body(tr: Any) -> dict[str, Any]:
        session = Session("test", Config(max_lag), SlowLink(tr, seconds_per_mb=0.3))
        alg = session.algorithm
        assert isinstance(alg, AutoAlgorithm)
        first = 0 if state is None else session.load_state_dict(state[tr.rank], list(SHAPES.items()))
        outs, choices, saved = [], [], None
        for step in range(first, steps):
            session.step = step
            values = grads(tr.rank, step)
            members = [Member(n, values[n].clone(), *session.policy.member_options(n, SHAPES[n])) for n in SHAPES]
            groups = [Group(0, members)] if buckets == 1 else [Group(0, members[:1]), Group(1, members[1:])]
            for fut in [session.run(g) for g in groups]:
                fut.wait()
            outs.append({m.name: m.tensor for m in members})
            choices.append(alg.choices().get(0))
            session.step = step + 1
            if save_at is not None and step + 1 == save_at:
                saved = session.state_dict()
        report = alg.report()["auto"]
        held = {c: {n: r for n in SHAPES if (r := a.forget(n)) is not None} for c, a in alg.candidates.items()}
        result = {"outs": outs, "choices": choices, "report": report, "saved": saved, "held": held,
                  "first": first}  # fmt: skip
        session.close()
        return result

    return run_local(2, body, timeout=300)


def alone(name: str, steps: int) -> list[list[dict[str, torch.Tensor]]]:
    """Per step, ``name`` alone on the same gradients (its state carried from step to step), per rank."""

    def body(tr: Any) -> list[dict[str, torch.Tensor]]:
        alg = make_algorithm(name, tr, {})
        out = []
        for step in range(steps):
            values = grads(tr.rank, step)
            members = [Member(n, values[n].clone(), n != "b") for n in SHAPES]
            alg(Group(0, members), step).wait()
            out.append({m.name: m.tensor for m in members})
        alg.close()
        return out

    return run_local(2, body, timeout=120)


def mean(step: int) -> dict[str, torch.Tensor]:
    per = [grads(r, step) for r in range(2)]
    return {n: (per[0][n] + per[1][n]) / 2 for n in SHAPES}


def test_a_candidate_over_the_bound_never_averages_the_models_gradients() -> None:
    """ACP-SGD is timed fastest but cannot meet a bound of 0.01: its probe step is plain averaging's exact mean, the
    trial's steps are qsgd's (the carrier), and the group keeps qsgd; the report holds ACP-SGD's judged lag."""
    res = run(max_lag=0.01, steps=PROBE + TRIAL + 2)
    assert res[0]["choices"] == res[1]["choices"]
    assert res[0]["choices"][PROBE:] == ["qsgd"] * (TRIAL + 2)
    judged = res[0]["report"]["judged"][0]
    assert set(judged) == {"acpsgd"} and judged["acpsgd"] > 0.01, judged
    assert res[0]["report"]["judged"] == res[1]["report"]["judged"]
    acpsgd_probe = CANDIDATES.index("acpsgd")
    for r in res:
        for n in SHAPES:
            assert torch.equal(r["outs"][acpsgd_probe][n], mean(acpsgd_probe)[n]), n
    # After the probe qsgd averaged every step: from there on its outputs are those of qsgd alone, its residual
    # carried from its own probe step: compare the steps after the probe with a qsgd run that saw the same steps.
    assert "acpsgd" not in {c for c in res[0]["choices"] if c is not None}
    assert not res[0]["held"].get("acpsgd"), "the trial's residuals are dropped"


@pytest.mark.parametrize("buckets", [1, 2])
def test_a_candidate_within_the_bound_is_taken_and_the_carriers_residual_goes_with_it(buckets: int) -> None:
    """With a bound ACP-SGD meets, it averages from the trial's end on; qsgd's residual travels with its first
    gradient, so over the run every rank received the mean of what every rank sent, less what ACP-SGD still owes
    (in two buckets too: what copies built is dropped, and what qsgd owed taken, at a step's first group only)."""
    steps = PROBE + TRIAL + 3
    res = run(max_lag=1e6, steps=steps, buckets=buckets)
    assert res[0]["choices"] == res[1]["choices"]
    assert res[0]["choices"][PROBE : PROBE + TRIAL] == ["qsgd"] * TRIAL
    assert res[0]["choices"][PROBE + TRIAL :] == ["acpsgd"] * 3
    for r in res:
        assert not r["held"].get("qsgd"), "qsgd's residual was sent with ACP-SGD's first gradient"
    for n in ("w1", "w2"):
        got = sum(res[0]["outs"][s][n] for s in range(steps))
        want = sum(mean(s)[n] for s in range(steps))
        owed = sum(r["held"]["acpsgd"][n] for r in res) / 2
        torch.testing.assert_close(got + owed, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("max_lag", [0.01, 1e6])
def test_a_run_resumed_in_the_trial_is_the_straight_run(max_lag: float) -> None:
    """Saved at each step of the trial (its figures half taken included) and resumed: the outputs and choices are
    the straight run's to the bit."""
    steps = PROBE + TRIAL + 2
    for save_at in range(PROBE + 1, PROBE + TRIAL + 1):
        straight = run(max_lag, steps, save_at=save_at)
        resumed = run(max_lag, steps, state=[r["saved"] for r in straight])
        for a, b in zip(straight, resumed, strict=True):
            assert b["first"] == save_at and a["choices"][save_at:] == b["choices"]
            assert a["report"]["judged"] == b["report"]["judged"]
            for s, out in enumerate(b["outs"]):
                for n in SHAPES:
                    assert torch.equal(a["outs"][save_at + s][n], out[n]), (save_at, s, n)


def test_a_bare_auto_without_a_monitor_runs_every_candidate_as_before() -> None:
    """No monitor hands it a bound (the algorithm used directly): no trial, the probe runs each candidate on the
    real gradients."""

    def body(tr: Any) -> tuple[int, bool]:
        alg = make_algorithm("auto", SlowLink(tr, 0.3), {"candidates": CANDIDATES, "probe_steps": 1})
        assert isinstance(alg, AutoAlgorithm)
        values = grads(tr.rank, 2)
        members = [Member(n, values[n].clone(), n != "b") for n in SHAPES]
        for step in range(3):
            alg(Group(0, members if step == 2 else [Member(n, t.clone(), n != "b") for n, t in values.items()]),
                step).wait()  # fmt: skip
        settles = alg.settles_after()
        alg.close()
        return settles, torch.equal(members[0].tensor, mean(2)["w1"])

    for settles, exact in run_local(2, body, timeout=120):
        assert settles == PROBE and not exact  # ACP-SGD's step averaged the real gradients: not the exact mean


def test_a_checkpoint_trial_that_does_not_fit_is_refused() -> None:
    def body(tr: Any) -> list[str]:
        alg = make_algorithm("auto", tr, {"candidates": CANDIDATES})
        good = {
            "carrier": "qsgd",
            "pending": ["acpsgd"],
            "start": 3,
            "steps": 4,
            "window": 2,
            "sums": {},
            "names": ["w1"],
        }
        out = []
        for bad in ({**good, "pending": ["threebit"]}, {**good, "steps": 0}, {**good, "sums": {"qsgd": {}}},
                    {k: v for k, v in good.items() if k != "window"}):  # fmt: skip
            state = {"auto": {"choices": {0: "qsgd"}, "timings": {}, "trials": {0: bad}}, "candidates": {}}
            try:
                alg.check_state_dict(state, None, stepped=True)
                out.append("ok")
            except ValueError as exc:
                out.append(str(exc))
        alg.check_state_dict({"auto": {"choices": {0: "qsgd"}, "timings": {}, "trials": {0: good}},
                              "candidates": {}}, None, stepped=True)  # fmt: skip
        alg.close()
        return out

    got = run_local(1, body)[0]
    assert "names candidates this run does not have" in got[0]
    assert "steps must be a non-negative integer" in got[1] or "steps must be" in got[1]
    assert "sums must map pending candidates" in got[2]
    assert "must hold" in got[3]


@pytest.mark.parametrize("fused", [True, False])
def test_a_copy_is_the_groups_gradients_in_storage_of_its_own(fused: bool) -> None:
    """A bucket's copy holds its values, as views of one buffer where the bucket has one; writing it leaves the
    bucket alone, and the next step's copy reuses the buffer."""
    from sylvie_comm.algorithms.auto_trial import Copies

    flat = torch.arange(10, dtype=torch.float32)
    members = [Member("a", flat[:6].view(2, 3)), Member("b", flat[6:], False)]
    group = Group(3, members, flat if fused else None)
    copies = Copies()
    copy = copies.of(group, "x")
    assert [m.name for m in copy.members] == ["a", "b"] and [m.compress for m in copy.members] == [True, False]
    assert all(torch.equal(c.tensor, m.tensor) for c, m in zip(copy.members, members, strict=True))
    assert (copy.flat is not None) == fused
    if fused:
        assert copy.members[0].tensor.data_ptr() == copy.flat.data_ptr()  # type: ignore[union-attr]
    copy.members[0].tensor.fill_(-1)
    assert torch.equal(flat, torch.arange(10, dtype=torch.float32))
    again = copies.of(group, "x")
    assert again.members[0].tensor.data_ptr() == copy.members[0].tensor.data_ptr()
    assert torch.equal(again.members[0].tensor, flat[:6].view(2, 3))
    assert copies.of(group, "y").members[0].tensor.data_ptr() != copy.members[0].tensor.data_ptr()
