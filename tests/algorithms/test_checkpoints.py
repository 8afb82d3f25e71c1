"""A checkpoint's per-name state is checked against the model before anything is loaded.

Each stateful algorithm writes a real checkpoint (two ranks of the in-process transport, behind the policy as
the integrations drive it); then one field at a time is made not to fit: a foreign or missing name, a wrong
shape or dtype, a factor that would broadcast, NaN, an extra key, an ``auto`` choice that is no candidate.
Every case is a ``ValueError`` naming the field, and the untouched checkpoint passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, Policy, make_algorithm
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config

SHAPES = {"a.weight": (24, 40), "a.bias": (24,), "b.weight": (16, 24)}
STATEFUL = ["acpsgd", "powersgd", "onebit", "topk", "sign", "qsgd", "auto"]
STEPS = 12  # auto probes its four candidates twice from step 2, then chooses (or judges acpsgd beside its choice)


def checkpoint_and_check(name: str, tamper: Callable[[dict[str, Any]], Any] | None) -> list[str]:
    """Per rank: "ok" when ``check_state_dict`` accepts the (tampered) checkpoint, else its message."""
    config = Config(codec=name, options={"candidates": ["none", "fp16", "qsgd", "acpsgd"]} if name == "auto" else {})

    def body(tr: Any) -> str:
        alg = make_algorithm(name, tr, config.options, seed=2)
        policy = Policy(alg, config)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(31 * step + tr.rank)
            members = []
            for n, s in SHAPES.items():
                compress, options = policy.member_options(n, s)
                members.append(Member(n, torch.randn(s, generator=g), compress, options))
            policy(Group(0, members), step).wait()
        state = alg.state_dict()
        alg.close()
        if tamper is not None:
            state = tamper(state)
        tensors = policy.compressed_tensors(SHAPES.items())
        try:
            alg.check_state_dict(state, tensors, stepped=True)
        except ValueError as exc:
            return str(exc)
        return "ok"

    return run_local(2, body)


def entries(state: dict[str, Any], name: str) -> dict[str, Any]:
    """The per-name entries (auto: those of its qsgd candidate, which averaged the model's gradients in the probe;
    acpsgd ran on copies only, and what those built is dropped when the probe ends)."""
    return state["candidates"]["qsgd"] if name == "auto" else state


@pytest.mark.parametrize("name", STATEFUL)
def test_an_untouched_checkpoint_passes(name: str) -> None:
    assert checkpoint_and_check(name, None) == ["ok", "ok"]


def _foreign(name: str) -> Callable[[dict[str, Any]], Any]:
    def tamper(state: dict[str, Any]) -> Any:
        e = entries(state, name)
        e["other.weight"] = e["a.weight"]
        return state

    return tamper


def _missing(name: str) -> Callable[[dict[str, Any]], Any]:
    def tamper(state: dict[str, Any]) -> Any:
        del entries(state, name)["b.weight"]
        return state

    return tamper


def _each_tensor(name: str, fn: Callable[[str, torch.Tensor], torch.Tensor], key: str) -> Callable[..., Any]:
    def tamper(state: dict[str, Any]) -> Any:
        e = entries(state, name)["a.weight"]
        k = next(k for k in e if k.startswith(key))
        e[k] = fn(k, e[k])
        return state

    return tamper


CASES: dict[str, tuple[Callable[[str], Callable[..., Any]], str]] = {
    "foreign name": (_foreign, "holds state for 'other.weight', which is not a compressed parameter"),
    "wider residual": (
        lambda n: _each_tensor(n, lambda k, t: torch.zeros(t.shape[0], t.shape[1] + 4), "residual"),
        "'residual' must be a float32 tensor of shape",
    ),
    "float64 residual": (lambda n: _each_tensor(n, lambda k, t: t.double(), "residual"), "float32 tensor of shape"),
    "NaN residual": (
        lambda n: _each_tensor(n, lambda k, t: t.clone().fill_(float("nan")), "residual"),
        "'residual' holds NaN or Inf",
    ),
    "not a tensor": (lambda n: _each_tensor(n, lambda k, t: t.tolist(), "residual"), "must be a tensor, got list"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", STATEFUL)
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_field(name: str, case: str) -> None:
    make, message = CASES[case]
    for got in checkpoint_and_check(name, make(name)):
        assert message in got, got


@pytest.mark.parametrize("name", [n for n in STATEFUL if n != "auto"])  # auto's candidates hold what they ran
def test_missing_or_empty_state_after_a_compressed_step_is_refused(name: str) -> None:
    for got in checkpoint_and_check(name, _missing(name)):
        assert "the checkpoint has no state for 'b.weight'" in got, got
    for got in checkpoint_and_check(name, lambda state: {}):
        assert "the checkpoint has no state for" in got, got


@pytest.mark.parametrize("name", ["acpsgd", "powersgd"])
def test_factors_of_another_rank_are_refused_though_they_would_broadcast(name: str) -> None:
    for got in checkpoint_and_check(name, _each_tensor(name, lambda k, t: t[:, :1].clone(), "p")):
        assert "'p' must be a float32 tensor of shape (24, 4), got torch.float32 of shape (24, 1)" in got, got


def test_onebit_needs_this_ranks_server_residual() -> None:
    """Rank 0's checkpoint loaded on rank 1 holds ``server_residual@0``, not rank 1's."""

    def swap(state: dict[str, Any]) -> Any:
        for e in state.values():
            for k in [k for k in e if k.startswith("server_residual@")]:
                e["server_residual@9"] = e.pop(k)
        return state

    for got in checkpoint_and_check("onebit", swap):
        assert "has ['residual', 'server_residual@9']; expected ['residual', 'server_residual@" in got, got


def test_an_extra_key_is_refused_and_a_legacy_qsgd_offset_is_not() -> None:
    def extra(state: dict[str, Any]) -> Any:
        state["a.weight"]["momentum"] = torch.zeros(1)
        return state

    for got in checkpoint_and_check("topk", extra):
        assert "has ['momentum', 'residual']; expected ['residual']" in got, got

    def offset(state: dict[str, Any]) -> Any:
        for e in state.values():
            e["offset"] = 123
        return state

    assert checkpoint_and_check("qsgd", offset) == ["ok", "ok"]


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda s: {**s, "auto": {**s["auto"], "choices": {0: "threebit"}}}, "choice 'threebit' for group 0"),
        (lambda s: {**s, "auto": {**s["auto"], "choices": {"x": "none"}}}, "for group 'x' is not one of"),
        (lambda s: {**s, "auto": {"choices": {}}}, "'auto' must hold 'choices' and 'timings'"),
        (lambda s: {**s, "auto": {**s["auto"], "timings": {0: {"none": [float("nan")]}}}}, "timings of group 0"),
        (lambda s: {**s, "candidates": {**s["candidates"], "topk": {}}}, "holds candidates ['topk']"),
        (lambda s: {"candidates": s["candidates"]}, "expected a state with 'auto' and 'candidates'"),
    ],
)
def test_auto_checks_its_choices_timings_and_candidates(tamper: Callable[..., Any], message: str) -> None:
    for got in checkpoint_and_check("auto", tamper):
        assert message in got, got


def test_a_stateless_algorithm_takes_no_state() -> None:
    def body(tr: Any) -> str:
        alg = make_algorithm("fp16", tr, {})
        try:
            alg.check_state_dict({"a.weight": {"residual": torch.zeros(2)}}, {}, stepped=True)
        except ValueError as exc:
            return str(exc)
        finally:
            alg.close()
        return "ok"

    assert "not a compressed parameter" in run_local(1, body)[0]
