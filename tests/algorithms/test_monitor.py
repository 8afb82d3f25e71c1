"""The compression-error monitor: free per-step figures, the sampled exact check, warnings and adaptation.

In one process, N ranks as threads of the in-process transport, through the session as every integration
calls it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import MONITOR_DEFAULTS, UNCOMPRESSED, Rule
from sylvie_comm.config import Config as _Config

SHAPES = {"w1": (32, 24), "w2": (24, 16), "b": (16,)}


def Config(codec: str, **kw: Any) -> _Config:  # the config of these tests: the bias sent raw
    return _Config(codec, rules=(Rule("b", UNCOMPRESSED),), **kw)


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def run(world: int, steps: int, config: _Config, *, state: Any = None, save_at: int | None = None,
        hook: Any = None, buckets: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    """Per rank: the averaged tensors per step, stats(), the checkpoint at ``save_at`` and at the end.
    ``buckets=2``: ``w1`` and the rest as two groups, the second launched before the first is waited for (as
    DDP launches its buckets)."""

    def body(tr: Any) -> dict[str, Any]:
        session = Session("test", config, tr)
        first = 0
        if state is not None:
            first = session.load_state_dict(state[tr.rank], list(SHAPES.items()))
        outs, saved = [], None
        for step in range(first, steps):
            session.step = step
            values = grads(tr.rank, step)
            members = [Member(n, values[n].clone(), *session.policy.member_options(n, SHAPES[n])) for n in SHAPES]
            if buckets == 1:
                session.run(Group(0, members)).wait()
            else:
                futures = [session.run(Group(0, members[:1])), session.run(Group(1, members[1:]))]
                for f in futures:
                    f.wait()
            if hook is not None:
                hook(session, step, members)
            outs.append({m.name: m.tensor for m in members})
            session.step = step + 1
            if save_at is not None and step + 1 == save_at:
                saved = session.state_dict()
        result = {"outs": outs, "stats": session.stats(), "saved": saved, "end": session.state_dict()}
        session.close()
        return result

    return run_local(world, body)


def mean(world: int, step: int) -> dict[str, torch.Tensor]:
    per = [grads(r, step) for r in range(world)]
    return {n: sum(p[n] for p in per) / world for n in SHAPES}  # type: ignore[misc]


@pytest.mark.parametrize("codec", ["acpsgd", "powersgd", "onebit", "topk", "qsgd", "sign"])
def test_every_tensor_has_its_figures_and_every_rank_reads_the_same(codec: str) -> None:
    """Past the warm-up, every compressed tensor has a lag, an error and an exact check; the ranks agree on
    them to the bit; the exact check's bytes are counted."""
    config = Config(codec, warmup_steps=2, monitor={"period": 4, "sample": 2})
    res = run(2, 2 + 13, config)
    a, b = (r["stats"]["monitor"] for r in res)
    assert a == b
    assert a["checks"] == 3  # compressed steps 4, 8 and 12
    assert set(a["tensors"]) == {"w1", "w2"}
    for name, t in a["tensors"].items():
        assert t["lag"] is not None and t["lag"] > 0, name
        assert 0 < t["error"] <= 1.5, name
        assert t["exact_error"] is not None and t["exact_cos"] is not None, name  # 2 of 2 sampled each check
        assert t["setting"] == {}
    # Three checks of two tensors: the ranks' six figures per tensor, and exact windows of at most `share` of
    # the compressed bytes (all-reduced in fp32 over two ranks: 2 (w - 1) / w of the bytes). Whole tensors, as
    # the checks sent before the share, would be 3 * 4 * (32 * 24 + 24 * 16) = 13,824 bytes.
    figures = 3 * 2 * 6 * 4
    exact = a["bytes"] - figures
    assert 0 < exact <= MONITOR_DEFAULTS["share"] * res[0]["stats"]["bytes_sent"], (
        exact,
        res[0]["stats"]["bytes_sent"],
    )


def test_the_exact_check_compares_with_the_exact_average() -> None:
    """For fp16 the exact relative error is fp16's rounding (about 2**-11) and the cosine 1; recomputed here."""
    config = Config("fp16", warmup_steps=0, monitor={"period": 3, "sample": 3, "share": 1.0})  # whole tensors
    res = run(2, 7, config)  # checks at steps 3 and 6: the second reads the exact check of step 3
    t = res[0]["stats"]["monitor"]["tensors"]
    assert res[0]["stats"]["monitor"]["checks"] == 2
    exact = mean(2, 3)
    for name in ("w1", "w2"):
        # Recompute: the fp16 path's output at step 3 against the exact mean.
        out = res[0]["outs"][3][name]
        rel = float((out - exact[name]).norm() / exact[name].norm())
        assert t[name]["exact_error"] == pytest.approx(rel, rel=1e-4)
        assert 0 < t[name]["exact_error"] < 2**-10
        assert t[name]["exact_cos"] == pytest.approx(1.0, abs=1e-6)
        assert t[name]["lag"] is None  # no residual: no free figure


@pytest.mark.parametrize("codec", ["topk", "acpsgd", "powersgd"])
def test_the_lag_is_the_residual_over_the_gradient(codec: str) -> None:
    """At period 1 each check reads one step's figures: the lag of step s equals ||r_s|| / ||g_s|| computed
    from the algorithm's own residual (the owed low-rank update applied), averaged over the ranks."""
    lags: dict[int, dict[str, list[float]]] = {}

    def hook(session: Session, step: int, members: list[Member]) -> None:
        alg = session.algorithm
        for m in members:
            if m.name == "b":
                continue
            res = alg._residual(m.name) if hasattr(alg, "_residual") else alg.feedback.residual(m.name)
            g = grads(alg.transport.rank, step)[m.name]
            lags.setdefault(step, {}).setdefault(m.name, [0.0, 0.0])[alg.transport.rank] = float(res.norm() / g.norm())

    config = Config(codec, warmup_steps=0, monitor={"period": 1})
    seen: list[dict[str, Any]] = []

    def keep(session: Session, step: int, members: list[Member]) -> None:
        hook(session, step, members)
        if step >= 1:
            seen.append({n: t["lag"] for n, t in session.stats()["monitor"]["tensors"].items()})

    run(2, 5, config, hook=keep)
    # The check at step s reads the figures of step s - 1 (the steps since the last check).
    for s in range(1, 5):
        for name in ("w1", "w2"):
            want = sum(lags[s - 1][name]) / 2
            got = seen[2 * (s - 1)][name]  # two ranks append in turn; both read the same
            assert got == pytest.approx(want, rel=1e-4), (s, name)


def test_a_tensor_over_its_bound_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    config = Config("onebit", warmup_steps=1, monitor={"period": 2, "max_lag": 1e-3, "patience": 2})
    with caplog.at_level(logging.WARNING, logger="sylvie_comm"):
        res = run(2, 1 + 12, config)
    lines = [r.getMessage() for r in caplog.records if "over the bound" in r.getMessage()]
    # One warning per group (one here) and rank, naming each tensor once.
    assert len(lines) == 2 and all("2 tensors over the bound 0.001" in line for line in lines), lines
    assert sorted(n for line in lines for n in line.split("'")[1::2]) == ["w1", "w1", "w2", "w2"]
    assert "monitor adapt=True" in lines[0]
    assert res[0]["stats"]["monitor"]["adapted"] == []  # reported, nothing changed


def test_adaptation_doubles_the_rank_within_the_budget_then_sends_raw() -> None:
    """acpsgd with an unreachable bound: each tensor's rank doubles while the budget allows, then it goes
    raw, and from then on its average is exact (its owed residual sent along once)."""
    config = Config("acpsgd", warmup_steps=0, options={"rank": 2},
                    monitor={"period": 2, "max_lag": 1e-6, "patience": 1, "adapt": True, "budget": 2.0})  # fmt: skip
    res = run(2, 40, config)
    mon = res[0]["stats"]["monitor"]
    assert mon == res[1]["stats"]["monitor"]
    events = mon["adapted"]
    assert any("rank 2 -> 4" in e for e in events), events
    assert all(mon["tensors"][n]["setting"] == "raw" for n in ("w1", "w2")), mon["tensors"]
    raw_at = [i for i, e in enumerate(events) if e.endswith(": raw")]
    assert len(raw_at) == 2
    # The last steps are exact averages (fp32 all-reduce of the raw tensors).
    for step in (38, 39):
        exact = mean(2, step)
        for n in ("w1", "w2"):
            torch.testing.assert_close(res[0]["outs"][step][n], exact[n], rtol=0, atol=1e-6)


def test_a_tensor_that_goes_raw_sends_what_its_residual_owed() -> None:
    """Over the run, what every rank received sums to what every rank sent: the residual owed when the tensor
    went raw travels with its first raw gradient (nothing lost)."""
    config = Config("topk", warmup_steps=0, options={"ratio": 0.05},
                    monitor={"period": 3, "max_lag": 1e-6, "patience": 1, "adapt": True, "budget": 1.0})  # fmt: skip
    steps = 12
    res = run(2, steps, config)
    assert res[0]["stats"]["monitor"]["tensors"]["w1"]["setting"] == "raw"
    for n in ("w1", "w2"):
        got = sum(res[0]["outs"][s][n] for s in range(steps))
        want = sum(mean(2, s)[n] for s in range(steps))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _w1_events(config: _Config, steps: int = 40) -> tuple[list[str], Any]:
    mon = run(2, steps, config)[0]["stats"]["monitor"]
    return [e.split(": ", 1)[1] for e in mon["adapted"] if e.startswith("'w1'")], mon["tensors"]["w1"]


def test_a_tensor_well_under_its_bound_gets_lighter_down_to_half_its_start() -> None:
    """qsgd here: lag about 0.006 at 8 bits, 0.1 at 4, 0.6 at 2. From 8 bits under a bound of 0.2: 8 -> 4
    (well under), then it stays (4 is neither over nor well under, and 2 is below half of 8)."""
    monitor = {"period": 2, "max_lag": 0.2, "patience": 1, "adapt": True, "budget": 1.0}
    events, w1 = _w1_events(Config("qsgd", warmup_steps=0, options={"bits": 8}, monitor=monitor))
    assert events == ["bits 8 -> 4"]
    assert w1["setting"] == {"bits": 4}


def test_a_setting_that_was_over_the_bound_is_not_taken_again() -> None:
    """From 4 bits under a bound of 0.5: 4 -> 2 (well under), 2 is over -> 4, and 4 stays though well under."""
    monitor = {"period": 2, "max_lag": 0.5, "patience": 1, "adapt": True, "budget": 1.0}
    events, w1 = _w1_events(Config("qsgd", warmup_steps=0, options={"bits": 4}, monitor=monitor))
    assert events == ["bits 4 -> 2", "bits 2 -> 4"]
    assert w1["setting"] == {}
    assert w1["lag"] < 0.25 * 0.5


@pytest.mark.parametrize("codec", ["acpsgd", "qsgd", "onebit"])
def test_resume_decides_as_the_straight_run(codec: str) -> None:
    """Checkpoint between two checks, in the middle of adaptation: the resumed run's outputs and decisions are
    the straight run's, bit for bit."""
    config = Config(codec, warmup_steps=1, options={"rank": 1} if codec == "acpsgd" else {},
                    monitor={"period": 3, "max_lag": 0.05, "patience": 1, "adapt": True, "budget": 8.0})  # fmt: skip
    straight = run(2, 30, config, save_at=14)
    resumed = run(2, 30, config, state=[r["saved"] for r in straight])
    for a, b in zip(straight, resumed, strict=True):
        for s, out in enumerate(b["outs"]):
            for n in SHAPES:
                assert torch.equal(a["outs"][14 + s][n], out[n]), (s, n)
        assert a["stats"]["monitor"]["adapted"] == b["stats"]["monitor"]["adapted"]
        assert a["end"]["monitor"] == b["end"]["monitor"]
    assert straight[0]["stats"]["monitor"]["adapted"], "the bound must make something adapt in this test"


def test_a_checkpoint_with_monitor_state_needs_a_monitor() -> None:
    config = Config("topk", warmup_steps=0, monitor={"period": 2})
    res = run(1, 5, config, save_at=5)
    off = Config("topk", warmup_steps=0, monitor={"period": 0})
    with pytest.raises(RuntimeError, match="period"):
        run(1, 6, off, state=[res[0]["saved"]])


def test_an_older_checkpoint_without_the_monitor_loads() -> None:
    config = Config("topk", warmup_steps=0)
    res = run(1, 4, config, save_at=4)
    old = dict(res[0]["saved"])
    del old["monitor"]
    old["config"] = {k: v for k, v in old["config"].items() if k != "monitor"}
    again = run(1, 6, config, state=[old])
    assert len(again[0]["outs"]) == 2


def test_off_costs_nothing() -> None:
    config = Config("acpsgd", warmup_steps=0, monitor={"period": 0})
    res = run(2, 6, config)
    assert "monitor" not in res[0]["stats"]
    assert res[0]["end"]["monitor"] == {}


def test_the_monitor_changes_no_bit_of_what_is_averaged() -> None:
    """Without adaptation the monitor only reads: outputs equal a run with it off, bit for bit."""
    on = run(2, 12, Config("acpsgd", warmup_steps=1, monitor={"period": 2, "sample": 1}))
    off = run(2, 12, Config("acpsgd", warmup_steps=1, monitor={"period": 0}))
    for a, b in zip(on, off, strict=True):
        for s in range(12):
            for n in SHAPES:
                assert torch.equal(a["outs"][s][n], b["outs"][s][n])


@pytest.mark.parametrize("codec", ["acpsgd", "onebit"])
def test_a_check_in_a_step_of_several_buckets_leaves_the_step_alone(codec: str) -> None:
    """A check runs as each bucket of its step starts; the step's earlier buckets are in flight then and must
    neither be settled nor counted as skipped: the same bits as with the monitor off, no step skipped."""
    on = run(2, 12, Config(codec, warmup_steps=1, monitor={"period": 2, "first": 1}), buckets=2)
    off = run(2, 12, Config(codec, warmup_steps=1, monitor={"period": 0}), buckets=2)
    for a, b in zip(on, off, strict=True):
        assert a["stats"]["skipped_nonfinite"] == 0 and a["stats"]["monitor"]["checks"] > 0
        for s in range(12):
            for n in SHAPES:
                assert torch.equal(a["outs"][s][n], b["outs"][s][n]), (s, n)


@pytest.mark.parametrize(
    ("monitor", "match"),
    [
        ({"period": -1}, "period must be an integer >= 0, got -1"),
        ({"sample": 0}, "sample must be an integer >= 1"),
        ({"first": 0}, "first must be an integer >= 1, got 0"),
        ({"first": 2.5}, "first must be an integer >= 1, got 2.5"),
        ({"max_lag": 0}, "max_lag must be a finite number > 0"),
        ({"max_error": math.inf}, "max_error must be a finite number > 0"),
        ({"budget": 0.5}, "budget must be a finite number >= 1, got 0.5"),
        ({"adapt": "yes"}, "adapt must be true or false"),
        ({"periode": 3}, "unknown setting.*periode"),
        ("fast", "monitor must be a mapping"),
    ],
)
def test_bad_settings_are_refused_by_name(monitor: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _Config("acpsgd", monitor=monitor)


def test_defaults_fill_what_is_not_given() -> None:
    cfg = _Config("acpsgd", monitor={"adapt": True})
    assert cfg.monitor == {**MONITOR_DEFAULTS, "adapt": True}
    assert _Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("codec", ["onebit", "qsgd"])
def test_the_reduce_scatter_form_is_monitored_per_segment(codec: str) -> None:
    """FSDP2's form: each segment's lag from its residual, and the exact check (a plain fp32 reduce-scatter
    beside the compressed one) equal to the shard's error recomputed here."""
    from sylvie_comm.algorithms.base import Segment, ShardLayout

    world, shard = 2, 24
    layout = ShardLayout("unit", (Segment("a", 0, 16, row=4), Segment("b", 16, 8, row=1, compress=False)))
    config = _Config(codec, warmup_steps=0, monitor={"period": 2, "share": 100.0})  # the whole shard each check

    def flat_of(rank: int, step: int) -> torch.Tensor:
        return torch.randn(world * shard, generator=torch.Generator().manual_seed(31 * step + rank))

    def body(tr: Any) -> dict[str, Any]:
        session = Session("t", config, tr)
        outs = []
        for step in range(5):
            out = torch.empty(shard)
            session.reduce_scatter(flat_of(tr.rank, step), out, layout, step).wait()
            outs.append(out)
        stats = session.stats()
        session.close()
        return {"outs": outs, "stats": stats}

    res = run_local(world, body)
    mon = res[0]["stats"]["monitor"]
    assert mon == res[1]["stats"]["monitor"] and mon["checks"] == 2
    a = mon["tensors"]["a"]
    assert set(mon["tensors"]) == {"a"} and a["lag"] > 0
    # The exact check of step 2, read at step 4: each rank's shard of segment 'a' against the exact mean, the
    # ranks' relative errors averaged (every rank reads the same).
    mean = (flat_of(0, 2) + flat_of(1, 2)).view(world, shard) / world
    errors = [float((res[r]["outs"][2][:16] - mean[r, :16]).norm() / mean[r, :16].norm()) for r in range(world)]
    assert a["exact_error"] == pytest.approx(sum(errors) / world, rel=1e-4)


def test_the_same_adaptation_gives_the_same_rewritten_layout_object() -> None:
    """A unit whose segment adaptation changed is rewritten once per decision, not per step: the algorithm's
    row plan, found by the layout object's identity, is not planned again every step."""
    from sylvie_comm.algorithms.base import Segment, ShardLayout

    def body(tr: Any) -> list[bool]:
        session = Session("t", _Config("qsgd", warmup_steps=0, monitor={"period": 2}), tr)
        monitor = session.policy.monitor
        assert monitor is not None

        def layout() -> ShardLayout:  # a fresh object each step, equal to the last, as FSDP2 may hand over
            return ShardLayout("unit", (Segment("a", 0, 16, row=4), Segment("b", 16, 8, row=1)))

        plain = layout()
        out = [monitor.adaptation.rewrite_shards(plain, None) is plain]  # no decision: the layout itself
        monitor.overrides["a"] = {"bits": 8}
        first = monitor.adaptation.rewrite_shards(layout(), None)
        out.append(first.segments[0].options == {"bits": 8})
        out.append(monitor.adaptation.rewrite_shards(layout(), None) is first)
        monitor.overrides["a"] = {"bits": 2}
        other = monitor.adaptation.rewrite_shards(layout(), None)
        out += [other is not first, other.segments[0].options == {"bits": 2}]
        session.close()
        return out

    assert all(run_local(1, body)[0])


def _auto_run(config: _Config, steps: int, choice: str, state: Any = None, save_at: int | None = None,
              ) -> list[dict[str, Any]]:  # fmt: skip
    """auto on one bucket, its choice set to ``choice`` as if the probe had timed it fastest (qsgd next), for
    ``steps`` steps from the probe's end (where the monitor's checks start counting); ``save_at`` counts from there
    too."""

    def body(tr: Any) -> dict[str, Any]:
        session = Session("test", config, tr)
        alg = session.algorithm
        first = probe = alg.settles_after()
        if state is not None:
            first = session.load_state_dict(state[tr.rank], list(SHAPES.items()))
        else:
            alg.load_state_dict({"auto": {"choices": {0: choice}, "timings": {},
                                          "totals": {0: {"none": 3.0, "fp16": 2.0, "qsgd": 1.0, choice: 0.5}},
                                          "rejected": {}},
                                 "candidates": {}})  # fmt: skip
        outs, choices, saved = [], [], None
        for step in range(first, probe + steps):
            session.step = step
            values = grads(tr.rank, step)
            members = [Member(n, values[n].clone(), *session.policy.member_options(n, SHAPES[n])) for n in SHAPES]
            session.run(Group(0, members)).wait()
            outs.append({m.name: m.tensor for m in members})
            choices.append(alg.choices()[0])
            session.step = step + 1
            if save_at is not None and step + 1 == probe + save_at:
                saved = session.state_dict()
        result = {"outs": outs, "choices": choices, "stats": session.stats(), "saved": saved, "probe": probe}
        session.close()
        return result

    return run_local(2, body)


def test_auto_moves_a_bucket_off_a_candidate_over_the_bound_to_the_next_fastest() -> None:
    """auto on topk (timed fastest) with a bound topk cannot meet: at the first check (topk needs the monitor: one
    check is enough, whatever ``patience`` says) the bucket moves to qsgd (the next fastest) at the step after the
    check (its figures are read there, off the hook's path), every rank at the same step; topk's residual travels
    with the next gradient, so over the run every rank received what every rank sent, less what qsgd still owes at
    the end."""
    config = Config("auto", warmup_steps=0, options={"candidates": ["none", "fp16", "qsgd", "topk"]},
                    monitor={"period": 3, "max_lag": 0.3, "patience": 2})  # fmt: skip
    res = _auto_run(config, 12, "topk", save_at=12)
    assert res[0]["choices"] == res[1]["choices"]
    assert res[0]["choices"][:4] == ["topk"] * 4 and res[0]["choices"][4:] == ["qsgd"] * 8
    adapted = res[0]["stats"]["monitor"]["adapted"]
    assert len(adapted) == 1 and adapted[0].endswith("topk -> qsgd"), adapted
    for n in ("w1", "w2"):
        got = sum(res[0]["outs"][s][n] for s in range(12))
        want = sum(mean(2, res[0]["probe"] + s)[n] for s in range(12))
        owed = sum(r["saved"]["params"]["candidates"]["qsgd"][n]["residual"] for r in res) / 2
        torch.testing.assert_close(got + owed, want, rtol=0, atol=1e-4)


def test_auto_leaves_every_codec_that_needs_the_monitor_once_one_is_over_the_bound() -> None:
    """topk (timed fastest) over the bound, onebit next by the clock: the bucket skips onebit (it needs the monitor
    too) for qsgd, the fastest of the candidates that do not."""
    config = Config("auto", warmup_steps=0, options={"candidates": ["none", "fp16", "qsgd", "onebit", "topk"]},
                    monitor={"period": 3, "max_lag": 0.3, "patience": 2})  # fmt: skip
    totals = {"none": 3.0, "fp16": 2.0, "qsgd": 1.0, "onebit": 0.7, "topk": 0.5}
    for choices in run_local(2, lambda tr: _auto_choices(tr, config, "topk", totals)):
        assert choices[:4] == ["topk"] * 4 and choices[4:] == ["qsgd"] * 8, choices


def test_auto_waits_the_monitors_patience_on_a_candidate_that_needs_no_monitor() -> None:
    """qsgd over an unmeetable bound moves the bucket to fp16 only after ``patience`` (2) checks: it keeps the model
    by itself on every workload measured, so one check over the bound is not enough to give up its speed (the
    move at the step after the second check, where its figures are read)."""
    config = Config("auto", warmup_steps=0, options={"candidates": ["none", "fp16", "qsgd"]},
                    monitor={"period": 3, "max_lag": 1e-6, "patience": 2})  # fmt: skip
    totals = {"none": 3.0, "fp16": 2.0, "qsgd": 1.0}
    for choices in run_local(2, lambda tr: _auto_choices(tr, config, "qsgd", totals)):
        assert choices[:7] == ["qsgd"] * 7 and choices[7:] == ["fp16"] * 5, choices


def _auto_choices(tr: Any, config: Config, start: str, totals: dict[str, float]) -> list[str]:
    """auto's choice at each of 12 steps after its probe, the probe's agreed times given and ``start`` chosen."""
    session = Session("test", config, tr)
    alg = session.algorithm
    alg.load_state_dict({"auto": {"choices": {0: start}, "timings": {}, "totals": {0: totals}, "rejected": {}},
                         "candidates": {}})  # fmt: skip
    choices = []
    probe = alg.settles_after()
    for step in range(probe, probe + 12):
        session.step = step
        values = grads(tr.rank, step)
        members = [Member(n, values[n].clone(), *session.policy.member_options(n, SHAPES[n])) for n in SHAPES]
        session.run(Group(0, members)).wait()
        choices.append(alg.choices()[0])
        session.step = step + 1
    session.close()
    return choices


def test_auto_resumes_with_its_demotions() -> None:
    config = Config("auto", warmup_steps=0, options={"candidates": ["none", "fp16", "qsgd", "topk"]},
                    monitor={"period": 3, "max_lag": 0.3, "patience": 2})  # fmt: skip
    straight = _auto_run(config, 14, "topk", save_at=8)
    resumed = _auto_run(config, 14, "topk", state=[r["saved"] for r in straight])
    for a, b in zip(straight, resumed, strict=True):
        assert a["choices"][8:] == b["choices"] == ["qsgd"] * 6
        for s, out in enumerate(b["outs"]):
            for n in SHAPES:
                assert torch.equal(a["outs"][8 + s][n], out[n]), (s, n)


def test_auto_without_the_monitor_leaves_out_the_candidates_that_need_it() -> None:
    def body(tr: Any) -> tuple[str, ...]:
        session = Session("t", Config("auto", monitor={"period": 0}), tr)
        names = session.algorithm.names
        session.close()
        return names

    assert run_local(1, body)[0] == ("none", "fp16", "qsgd")


def test_the_per_step_figures_are_taken_on_the_window_before_each_check() -> None:
    """period 10, window 3: steps 7, 8, 9 of every ten (the figures the check at 10 reads)."""

    def body(tr: Any) -> list[int]:
        session = Session("t", Config("topk", monitor={"period": 10, "window": 3}), tr)
        mon = session.policy.monitor
        assert mon is not None
        taken = [s for s in range(25) if mon.measures(s)]
        session.close()
        return taken

    assert run_local(1, body)[0] == [7, 8, 9, 17, 18, 19]


def test_the_first_checks_come_early_then_every_period() -> None:
    """At the defaults: checks at 10, 30, 70, then every 50 (120, 170, ...), each reading the 5 steps before it;
    ``first`` at or past ``period`` gives checks at the multiples of ``period``; ``period: 1`` checks every step."""

    def body(tr: Any) -> list[Any]:
        out = []
        for monitor in ({}, {"first": 50}, {"first": 80}, {"period": 1}, {"period": 3, "first": 1, "window": 1}):
            session = Session("t", Config("topk", monitor=monitor), tr)
            mon = session.policy.monitor
            assert mon is not None
            out.append(([s for s in range(400) if mon.due(s)], [s for s in range(80) if mon.measures(s)]))
            due = out[-1][0]
            assert all(mon.next_check(s) == min(c for c in due if c >= s) for s in range(1, due[-1] + 1))
            session.close()
        return out

    (default, first50, first80, every, small) = run_local(1, body)[0]
    assert default[0] == [10, 30, 70, 120, 170, 220, 270, 320, 370]
    assert default[1] == [5, 6, 7, 8, 9, 25, 26, 27, 28, 29, 65, 66, 67, 68, 69]
    assert first50[0] == first80[0] == list(range(50, 400, 50))
    assert every[0] == list(range(1, 400)) and every[1] == list(range(80))
    assert small[0] == [1, 3, *range(6, 400, 3)]
    assert small[1] == [0, 2, *range(5, 80, 3)]


def test_auto_checks_count_from_the_end_of_its_probe_and_trial() -> None:
    """auto probes 5 candidates for 2 steps each, then judges those that need the monitor for ``first`` (10) steps
    beside a carrier: a check in either would judge candidates that are not the choice, so the first comes 10 steps
    into the choice (step 30), then at the doubling gaps (50, 90, 140)."""

    def body(tr: Any) -> list[int]:
        session = Session("t", Config("auto"), tr)
        mon = session.policy.monitor
        assert mon is not None and session.algorithm.settles_after() == 20
        due = [s for s in range(150) if mon.due(s)]
        session.close()
        return due

    assert run_local(1, body)[0] == [30, 50, 90, 140]


@pytest.mark.parametrize("codec", ["acpsgd", "powersgd", "topk", "qsgd"])
def test_a_resume_at_any_step_is_the_straight_run(codec: str) -> None:
    """Saved after every step of a run whose monitor adapts (the ranks, bits or ratio changing at the checks, and
    tensors going raw), resumed in two buckets: the outputs, the decisions in their order, the number of checks
    and every counter are the straight run's (a low-rank checkpoint written at the step a rank changed included).
    The figures since the last check are the straight run's to fp32 rounding: the resumed low-rank residual holds
    the owed update applied, where the straight run reads it unapplied (the same value, summed in another order)."""
    config = Config(codec, warmup_steps=1, options={"rank": 1} if codec in ("acpsgd", "powersgd") else {},
                    monitor={"period": 3, "max_lag": 0.05, "patience": 1, "adapt": True, "budget": 8.0})  # fmt: skip
    steps = 14
    straight = run(2, steps, config, buckets=2)
    assert len(straight[0]["stats"]["monitor"]["adapted"]) >= 2, "the bound must make things adapt in this test"
    for save_at in range(1, steps):
        saved = run(2, save_at, config, save_at=save_at, buckets=2)
        resumed = run(2, steps, config, state=[r["saved"] for r in saved], buckets=2)
        for a, b in zip(straight, resumed, strict=True):
            for s, out in enumerate(b["outs"]):
                for n in SHAPES:
                    assert torch.equal(a["outs"][save_at + s][n], out[n]), (save_at, s, n)
            ma, mb = a["end"]["monitor"], b["end"]["monitor"]
            assert {k: v for k, v in ma.items() if k != "tensors"} == {k: v for k, v in mb.items() if k != "tensors"}
            for n, ta in ma["tensors"].items():
                tb = mb["tensors"][n]
                for k, v in ta.items():
                    if k in ("lag_sum", "err_sum"):
                        assert v == pytest.approx(tb[k], rel=1e-6), (save_at, n, k)
                    else:
                        assert v == tb[k], (save_at, n, k)
            ra, rb = a["stats"]["monitor"], b["stats"]["monitor"]
            assert ra["checks"] == rb["checks"] and ra["adapted"] == rb["adapted"], save_at
            for n, fa in ra["tensors"].items():  # the report's last figures, kept across the resume
                fb = rb["tensors"][n]
                assert set(fa) == set(fb), (save_at, n)
                for k, v in fa.items():
                    assert v == (pytest.approx(fb[k], rel=1e-6) if k == "error" and v is not None else fb[k]), (k, n)


@pytest.mark.parametrize("codec", ["onebit", "qsgd", "fp16"])
def test_the_monitor_without_adaptation_changes_no_bit_of_a_reduce_scatter(codec: str) -> None:
    """The exact check reads a copy of the unit's buffer: a whole shard smaller than the exact window (a small
    FSDP2 unit) was once the buffer itself, all-reduced in place while the algorithm encoded it."""
    from sylvie_comm.algorithms.base import Segment, ShardLayout

    world, shard = 2, 24
    layout = ShardLayout("unit", (Segment("a", 0, 16, row=4), Segment("b", 16, 8, row=1, compress=False)))

    def body(tr: Any, monitor: dict[str, Any]) -> list[torch.Tensor]:
        session = Session("t", _Config(codec, warmup_steps=0, monitor=monitor), tr)
        outs = []
        for step in range(9):
            flat = torch.randn(world * shard, generator=torch.Generator().manual_seed(31 * step + tr.rank))
            out = torch.empty(shard)
            session.reduce_scatter(flat, out, layout, step).wait()
            outs.append(out)
        session.close()
        return outs

    off = run_local(world, lambda tr: body(tr, {"period": 0}))
    on = run_local(world, lambda tr: body(tr, {"period": 2, "first": 2, "share": 100.0}))
    for a, b in zip(off, on, strict=True):
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), step


def test_the_monitors_bytes_are_bounded_by_its_share_of_the_traffic() -> None:
    """At the defaults, on a unit small enough that one exact window was the whole gradient in fp32 (a third of
    one-bit's traffic on a small model): the monitor's bytes are at most ``share`` of the compressed bytes plus its
    figures, and the run sends at most that much more than with the monitor off."""
    from sylvie_comm.algorithms.base import Segment, ShardLayout

    world, shard, steps = 2, 1024, 60
    layout = ShardLayout("unit", (Segment("w", 0, 1024, row=32),))

    def body(tr: Any, monitor: dict[str, Any]) -> dict[str, Any]:
        session = Session("t", _Config("onebit", warmup_steps=0, monitor=monitor), tr)
        for step in range(steps):
            flat = torch.randn(world * shard, generator=torch.Generator().manual_seed(31 * step + tr.rank))
            session.step = step
            session.reduce_scatter(flat, torch.empty(shard), layout, step).wait()
        stats = session.stats()
        session.close()
        return stats

    off = run_local(world, lambda tr: body(tr, {"period": 0}))[0]
    on = run_local(world, lambda tr: body(tr, {}))[0]
    mon = on["monitor"]
    assert mon["checks"] == 2  # compressed steps 10 and 30 (the defaults' first checks; the next is at 70)
    figures = mon["checks"] * 6 * 4  # one tensor
    assert 0 < mon["bytes"] - figures <= MONITOR_DEFAULTS["share"] * off["bytes_sent"], (mon["bytes"], off)
    assert on["bytes_sent"] - off["bytes_sent"] == mon["bytes"]
