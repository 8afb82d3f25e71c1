"""Per-name rules: every option a rule may set is honoured for the tensors it matches, and checked up front.

A rule's options are validated when the policy is built (at registration, on every rank), like the
algorithm's own options: an unknown option, one that holds for the whole run, or a bad value is a
``ValueError`` naming the rule. A rule that sets an option makes the tensors it matches travel exactly as
they would with that option for the whole run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, Policy, make_algorithm
from sylvie_comm.collectives import Stats
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config, Rule

SHAPES = {"head.weight": (24, 40), "body.weight": (16, 24), "body.bias": (16,)}
# (algorithm, option, a rule's value, the base value): the rule's value changes what the head sends
PER_NAME = [
    ("topk", "ratio", 0.3, 0.1),
    ("qsgd", "bits", 8, 4),
    ("qsgd", "bits", 2, 4),
    ("onebit", "chunk_size", 16, 2048),
    ("onebit", "scale", "norm", "mean"),
    ("acpsgd", "rank", 2, 4),
    ("powersgd", "rank", 6, 4),
]


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(97 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def run(config: Config, world: int = 2, steps: int = 4, only: str | None = None) -> list[dict[str, Any]]:
    """Per rank: the bytes each step sent and the outputs of the last step (``only``: that tensor alone)."""

    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(config.codec, tr, config.options, seed=1)
        policy = Policy(alg, config)
        stats = Stats()
        outs: dict[str, torch.Tensor] = {}
        for step in range(steps):
            values = {n: t for n, t in grads(tr.rank, step).items() if only in (None, n)}
            members = []
            for n, t in values.items():
                compress, options = policy.member_options(n, t.shape)
                members.append(Member(n, t, compress, options))
            policy(Group(0, members), step, stats.meter(step, world)).wait()
            outs = {m.name: m.tensor.clone() for m in members}
        alg.close()
        return {"bytes": [stats.step(s).bytes_sent for s in range(steps)], "outs": outs}

    return run_local(world, body)


@pytest.mark.parametrize(("name", "option", "value", "base"), PER_NAME)
def test_a_rule_makes_its_tensors_travel_as_with_that_option(name: str, option: str, value: Any, base: Any) -> None:
    ruled = Config(codec=name, options={option: base}, rules=(Rule("head.*", options={option: value}),))
    plain = Config(codec=name, options={option: base})
    as_if = Config(codec=name, options={option: value})
    with_rule = run(ruled, only="head.weight")
    without = run(plain, only="head.weight")
    reference = run(as_if, only="head.weight")
    for a, b in zip(with_rule, reference, strict=True):
        assert a["bytes"] == b["bytes"], (a["bytes"], b["bytes"])
        assert torch.equal(a["outs"]["head.weight"], b["outs"]["head.weight"])
    if option != "scale":  # the scale kind changes values, not bytes
        assert with_rule[0]["bytes"][2:] != without[0]["bytes"][2:], "the rule changed nothing on the wire"
    else:
        assert not torch.equal(with_rule[0]["outs"]["head.weight"], without[0]["outs"]["head.weight"])
    # the other tensors keep the base option: a group with both sends the sum of the two
    both = run(ruled)[0]["bytes"]
    body_alone = run(plain, only="body.weight")[0]["bytes"]
    bias_alone = run(plain, only="body.bias")[0]["bytes"]
    if name in ("topk", "qsgd"):  # one collective of the concatenated parts (+ raw): bytes add up exactly
        assert (
            both[2:] == [h + b + c for h, b, c in zip(with_rule[0]["bytes"], body_alone, bias_alone, strict=True)][2:]
        )


def policy_error(config: Config) -> str:
    def body(tr: Any) -> str:
        alg = make_algorithm(config.codec, tr, config.options)
        try:
            Policy(alg, config)
        except ValueError as exc:
            return str(exc)
        finally:
            alg.close()
        return "no error"

    return run_local(1, body)[0]


@pytest.mark.parametrize(
    ("codec", "options", "message"),
    [
        ("acpsgd", {"rank": 0}, "rules[0] (match 'head.*'): acpsgd: rank must be 'auto' or an integer >= 1, got 0"),
        ("acpsgd", {"rank": "eight"}, "rank must be 'auto' or an integer >= 1, got 'eight'"),
        ("acpsgd", {"rnak": 2}, "sets unknown option(s) rnak; per-name options: rank"),
        ("topk", {"ratio": 0.0}, "ratio must be in (0, 1], got 0.0"),
        ("topk", {"ratio": "0.3"}, "ratio must be in (0, 1]"),
        ("qsgd", {"bits": 4.0}, "bits must be 2, 4 or 8, got 4.0"),
        ("qsgd", {"bits": 1}, "bits must be 2, 4 or 8, got 1"),
        ("onebit", {"chunk_size": 12}, "rules[0] (match 'head.*'): onebit"),
        ("onebit", {"scale": "max"}, "rules[0] (match 'head.*'): onebit"),
        ("sign", {"ratio": 0.1}, "sets unknown option(s) ratio; per-name options: scale"),
        ("sign", {"scale": "max"}, "sign: scale must be 'mean' or 'norm', got 'max'"),
        ("fp16", {"ratio": 0.1}, "sets unknown option(s) ratio; per-name options: none"),
        ("auto", {"probe_steps": 3}, "sets probe_steps, which holds for the whole run"),
        ("auto", {"candidates": ["none"]}, "sets candidates, which holds for the whole run"),
        ("auto", {"rank": -1}, "rank must be 'auto' or an integer >= 1, got -1"),
    ],
)
def test_rule_options_are_validated_when_the_policy_is_built(codec: str, options: dict[str, Any], message: str) -> None:
    got = policy_error(Config(codec=codec, rules=(Rule("head.*", options=options),)))
    assert message in got, got


def test_base_options_reject_a_float_width() -> None:
    with pytest.raises(ValueError, match=r"bits must be 2, 4 or 8, got 4\.0"):
        Config(codec="qsgd", options={"bits": 4.0}) and make_algorithm("qsgd", _one(), {"bits": 4.0})


def _one() -> Any:
    from sylvie_comm.collectives.local import LocalGroup

    return LocalGroup(1).transport(0)


@pytest.mark.parametrize("world", [1, 2])
def test_qsgd_takes_empty_tensors(world: int) -> None:
    """A (0, n) parameter (and a 0-element vector) next to others: nothing to send for it, the rest averaged."""
    shapes = {"empty": (0, 5), "none": (0,), "w": (6, 5)}

    def body(tr: Any) -> dict[str, torch.Tensor]:
        alg = make_algorithm("qsgd", tr, {})
        out = {}
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + tr.rank)
            members = [Member(n, torch.randn(s, generator=g), True, {}) for n, s in shapes.items()]
            alg(Group(0, members), step).wait()
            out = {m.name: m.tensor for m in members}
        only_empty = [Member("empty", torch.zeros(0, 5), True, {})]
        alg(Group(1, only_empty), 3).wait()
        alg.close()
        return out

    for out in run_local(world, body):
        assert out["empty"].shape == (0, 5) and out["none"].shape == (0,)
        assert bool(torch.isfinite(out["w"]).all())
