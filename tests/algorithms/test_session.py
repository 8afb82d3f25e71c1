"""The one holder every integration wraps (``sylvie_comm.algorithms.session``), in one process.

The configuration merge, the agreement across ranks, the one checkpoint format with its checks, older
checkpoints read as today's, and every integration's state in that format.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.session import CHECKPOINT_FIELDS, Session, merge_config, upgrade_checkpoint
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config
from sylvie_comm.integrations.average import GradientAverage


def test_merge_config_sets_config_fields_and_options_apart() -> None:
    cfg = merge_config("t", "qsgd", None, {"bits": 4, "warmup_steps": 3, "warmup": "fixed", "seed": 9})
    assert (cfg.codec, cfg.options["bits"], cfg.warmup_steps, cfg.seed) == ("qsgd", 4, 3, 9)
    over = merge_config("t", None, Config(codec="onebit", options={"chunk_size": 64}), {"scale": "mean"})
    assert over.codec == "onebit" and over.options == {"chunk_size": 64, "scale": "mean"}
    assert merge_config("t", None, None, {}, default="none").codec == "none"
    with pytest.raises(ValueError, match=r"t: codec 'fp16' given with a config for 'onebit'; pass one of them"):
        merge_config("t", "fp16", Config(codec="onebit"), {})
    with pytest.raises(TypeError, match=r"t: config must be a sylvie_comm.Config, got dict"):
        merge_config("t", None, {"codec": "none"}, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"t: codec must be an algorithm's name \(a str\), got int"):
        merge_config("t", 4, None, {})  # type: ignore[arg-type]


def test_older_field_names_are_read_as_today() -> None:
    old = {"hook": "acpsgd", "steps": {"w": 3}, "params": {}}
    assert upgrade_checkpoint(old) == {"codec": "acpsgd", "step": {"w": 3}, "params": {}}
    today = {"codec": "none", "step": 1}
    assert upgrade_checkpoint(today) is today


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 8))


def _grads(model: nn.Module, step: int, rank: int) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + 10 * i + rank))


def test_ranks_that_disagree_fail_on_every_rank_naming_the_field_and_nothing_is_left_open() -> None:
    def body(tr: Any) -> str:
        fork = tr.fork()
        try:
            Session.agreed("t", fork, lambda: Config(codec="qsgd", options={"bits": 4 if tr.rank else 8}))
        except ValueError as exc:
            return str(exc)
        return "no error"

    for msg in run_local(2, body):
        assert "t: ranks disagree on the configuration: 'options.bits' is 8 on rank 0 but 4 on rank 1" in msg


def test_one_checkpoint_format_round_trips_and_refuses_what_does_not_fit() -> None:
    def body(tr: Any) -> dict[str, Any]:
        model = _model()
        avg = GradientAverage(model, tr.fork(), "qsgd", bits=4, warmup_steps=1)
        for step in range(3):
            _grads(model, step, tr.rank)
            avg.average()
        state = avg.state_dict()
        out: dict[str, Any] = {"fields": sorted(state), "step": state["step"], "names": sorted(state["params"])}
        _grads(model, 3, tr.rank)
        avg.average()
        straight = [p.grad.clone() for p in model.parameters()]
        again = GradientAverage(model, tr.fork(), "qsgd", bits=4, warmup_steps=1)
        again.load_state_dict(state)
        _grads(model, 3, tr.rank)
        again.average()
        out["bitwise"] = all(torch.equal(a, p.grad) for a, p in zip(straight, model.parameters(), strict=True))
        # Written before the bound was per path: the old default max_lag (0.5) is today's default; another is not.
        older = GradientAverage(model, tr.fork(), "qsgd", bits=4, warmup_steps=1)
        older.load_state_dict({**state, "config": {**state["config"], "monitor": {
            **state["config"]["monitor"], "max_lag": 0.5}}})  # fmt: skip
        older.close()
        errors = {}
        for key, bad in {
            "codec": {**state, "codec": "onebit"},
            "rank": {**state, "rank": 1 - tr.rank},
            "world": {**state, "world_size": 3},
            "config": {**state, "config": {**state["config"], "warmup_steps": 5}},
            "bound": {
                **state,
                "config": {**state["config"], "monitor": {**state["config"]["monitor"], "max_lag": 0.3}},
            },
            "foreign": {**state, "params": {**state["params"], "nope": state["params"]["0.weight"]}},
        }.items():
            try:
                again.load_state_dict(bad)
                errors[key] = "no error"
            except ValueError as exc:
                errors[key] = str(exc)
        out["errors"] = errors
        avg.close()
        again.close()
        return out

    for rank, res in enumerate(run_local(2, body)):
        assert res["fields"] == sorted(CHECKPOINT_FIELDS)
        assert res["step"] == 3 and res["names"] == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert res["bitwise"]
        e = res["errors"]
        assert "checkpoint is for 'onebit', not 'qsgd'" in e["codec"]
        assert f"written by rank {1 - rank} and is loaded on rank {rank}" in e["rank"]
        assert "written with world size 3, this run has 2" in e["world"]
        assert "checkpoint config differs: 'warmup_steps' is 5, this run has 1" in e["config"]
        assert "checkpoint config differs: 'monitor.max_lag' is 0.3, this run has None" in e["bound"]
        assert "'nope', which is not a compressed parameter of this model" in e["foreign"]


def test_an_older_gradient_average_checkpoint_still_loads() -> None:
    """Before the one format the GNN trainer's average saved codec, step, params and warmup only."""

    def body(tr: Any) -> bool:
        model = _model()
        avg = GradientAverage(model, tr.fork(), "acpsgd")
        for step in range(3):
            _grads(model, step, tr.rank)
            avg.average()
        state = avg.state_dict()
        old = {k: state[k] for k in ("codec", "step", "params", "warmup")}
        again = GradientAverage(model, tr.fork(), "acpsgd")
        again.load_state_dict(old)
        ok = again.step == 3
        avg.close()
        again.close()
        return ok

    assert run_local(2, body) == [True, True]


def test_the_session_runs_groups_and_counts_bytes() -> None:
    def body(tr: Any) -> dict[str, Any]:
        session = Session("t", Config(codec="none"), tr.fork())
        t = torch.full((10,), float(tr.rank))
        session.run(Group(0, [Member("x", t)])).wait()
        session.advance()
        stats = session.stats()
        session.close()
        return {"mean": t.tolist(), "bytes": stats["bytes_sent"], "memory": session.memory_bytes()}

    for res in run_local(2, body):
        assert res["mean"] == [0.5] * 10 and res["bytes"] > 0 and res["memory"] == 0


class _Recorder:
    """A policy stand-in that records the step it is run at and the step of the meter it counts in."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.calls: list[tuple[int, int]] = []

    def __call__(self, group: Group, step: int, meter: Any) -> Any:
        self.calls.append((step, meter.step))
        return self.policy(group, step, meter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


def test_the_session_owns_the_one_step_counter_and_advance_moves_it() -> None:
    def body(tr: Any) -> dict[str, Any]:
        session = Session("t", Config(codec="qsgd", warmup_steps=2), tr.fork())
        recorder = _Recorder(session.policy)
        session.policy = recorder  # type: ignore[assignment]
        t = torch.ones(64, 64)
        out: dict[str, Any] = {"start": (session.step, session.policy_step)}
        for _ in range(3):
            session.run(Group(0, [Member("x", t)])).wait()
            session.advance()
        session.discount()  # the last step left out of the policy's count
        out["after"] = (session.step, session.policy_step, session.discounted)
        session.run(Group(0, [Member("x", t)])).wait()
        session.run(Group(0, [Member("x", t)]), 7).wait()  # a step the caller numbers itself
        out["calls"] = recorder.calls
        policy = recorder.policy
        out["compressed"] = [(s, policy.compressed(s), policy.warming(s)) for s in (0, 1, 2, 3)]
        out["saved"] = session.state_dict()["step"]
        with pytest.raises(ValueError, match=r"t: advance\('u'\) counts a unit's step, but this session counts"):
            session.advance("u")
        session.close()
        return out

    for res in run_local(2, body):
        assert res["start"] == (0, 0)
        assert res["after"] == (3, 2, 1)
        # the policy's step (the steps done less those discounted), counted in the meter of the steps done
        assert res["calls"] == [(0, 0), (1, 1), (2, 2), (2, 3), (7, 7)]
        assert res["compressed"] == [(0, -2, True), (1, -1, True), (2, 0, False), (3, 1, False)]
        assert res["saved"] == 3


def test_units_step_once_each_and_the_session_step_is_the_most_any_has_done() -> None:
    """FSDP2's units: each counts its own steps in the session; the checkpoint holds them and a load restores
    them, the session's step with them; the policy runs each unit at its own step."""

    def body(tr: Any) -> dict[str, Any]:
        session = Session("t", Config(codec="none", warmup_steps=0), tr.fork())
        session.count_per_unit(["a", "b", "c"])
        recorder = _Recorder(session.policy)
        session.policy = recorder  # type: ignore[assignment]
        seen = []
        for unit in ["c", "b", "a", "c", "b"]:
            session.run(Group(0, [Member("x", torch.ones(4))]), unit=unit).wait()
            session.advance(unit)
            seen.append((session.step, session.step_of(unit)))
        saved = session.state_dict()
        again = Session("t", Config(codec="none", warmup_steps=0), tr.fork())
        again.count_per_unit(["a", "b", "c"])
        again.load_state_dict(saved, [("x", (4,))])
        restored = (again.step, [again.step_of(u) for u in "abc"])
        session.close()
        again.close()
        return {"seen": seen, "calls": recorder.calls, "saved": saved["step"], "restored": restored}

    for res in run_local(2, body):
        assert res["seen"] == [(1, 1), (1, 1), (1, 1), (2, 2), (2, 2)]
        assert [step for step, _ in res["calls"]] == [0, 0, 0, 1, 1]
        assert res["saved"] == {"a": 1, "b": 2, "c": 2}
        assert res["restored"] == (2, [1, 2, 2])
