"""``auto``: probes each candidate on each group, agrees across ranks, keeps the fastest; resumes without probing."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member, algorithm_class, make_algorithm
from sylvie_comm.algorithms.auto import AutoAlgorithm, pick
from sylvie_comm.collectives import Stats
from sylvie_comm.collectives.local import run_local


class SlowLink:
    """A transport whose collectives take ``seconds_per_mb`` per MB sent (a slow network), forks included."""

    def __init__(self, inner: Any, seconds_per_mb: float) -> None:
        self.inner, self.seconds_per_mb = inner, seconds_per_mb
        self.rank, self.world_size = inner.rank, inner.world_size

    def _wait(self, t: torch.Tensor) -> None:
        time.sleep(t.numel() * t.element_size() / 1e6 * self.seconds_per_mb)

    def all_reduce(self, t: torch.Tensor) -> Any:
        self._wait(t)
        return self.inner.all_reduce(t)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        self._wait(t)
        return self.inner.reduce_scatter(out, t)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        self._wait(out)
        return self.inner.all_gather(out, t)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        self._wait(t)
        return self.inner.all_to_all(out, t)

    def all_to_all_v(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> Any:
        self._wait(t)
        return self.inner.all_to_all_v(out, t, out_splits, in_splits)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)  # type: ignore[no-any-return]

    def fork(self) -> SlowLink:
        return SlowLink(self.inner.fork(), self.seconds_per_mb)


def gradients(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"w": torch.randn(512, 512, generator=g), "b": torch.randn(512, generator=g)}


def train(tr: Any, steps: range, alg: AutoAlgorithm, stats: Stats) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in steps:
        values = gradients(tr.rank, step)
        group = Group(0, [Member(n, v, n == "w") for n, v in values.items()])
        alg(group, step, stats.meter(step, tr.world_size)).wait()
        out.append({m.name: m.tensor.clone() for m in group.members})
    return out


def test_pick_takes_the_least_time_and_the_earlier_candidate_on_a_tie():
    assert pick(["none", "fp16", "acpsgd"], [3.0, 2.0, 2.5]) == "fp16"
    assert pick(["none", "fp16"], [1.0, 1.0]) == "none"
    with pytest.raises(ValueError, match="2 candidates but 1 timings"):
        pick(["none", "fp16"], [1.0])


def test_on_a_slow_link_every_rank_chooses_the_same_compressed_candidate_and_reports_it():
    def body(tr: Any) -> tuple[dict[int, str], dict[str, Any], list[dict[str, torch.Tensor]]]:
        link = SlowLink(tr, seconds_per_mb=0.2)  # 1 MB of fp32 gradient: 0.2 s plain, 0.1 s fp16
        alg = make_algorithm("auto", link, {"candidates": ["fp16", "acpsgd"], "probe_steps": 1, "rank": 4})
        assert isinstance(alg, AutoAlgorithm) and alg.names == ("none", "fp16", "acpsgd")
        stats = Stats()
        outs = train(tr, range(4), alg, stats)  # 3 probes, then the choice
        report = alg.report()
        alg.close()
        return alg.choices(), report, outs

    results = run_local(2, body, timeout=120)
    choices = [c for c, _, _ in results]
    assert choices[0] == choices[1] == {0: "acpsgd"}
    report = results[0][1]["auto"]
    assert set(report["probe_seconds"][0]) == {"none", "fp16", "acpsgd"}
    assert report["probe_seconds"][0]["acpsgd"] < report["probe_seconds"][0]["none"]
    for a, b in zip(results[0][2], results[1][2], strict=True):  # every rank holds the same average
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_resumed_run_keeps_the_choice_and_continues_bit_identically():
    def body(tr: Any) -> tuple[list[Any], list[Any], dict[int, str]]:
        options = {"candidates": ["fp16", "acpsgd"], "probe_steps": 1, "rank": 4}
        alg = make_algorithm("auto", SlowLink(tr, 0.2), options)
        train(tr, range(4), alg, Stats())
        state = alg.state_dict()
        cont = train(tr, range(4, 6), alg, Stats())
        fresh = make_algorithm("auto", SlowLink(tr, 0.0), options)  # a fast link now: no new probing
        fresh.load_state_dict(state)
        again = train(tr, range(4, 6), fresh, Stats())
        alg.close()
        fresh.close()
        assert isinstance(fresh, AutoAlgorithm)
        return cont, again, fresh.choices()

    for cont, again, choices in run_local(2, body, timeout=120):
        assert choices == {0: "acpsgd"}
        for a, b in zip(cont, again, strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"candidates": "acpsgd"}, "candidates must be a list"),
        ({"candidates": ["auto"]}, "cannot be its own candidate"),
        ({"candidates": ["threebit"]}, r"unknown candidate 'threebit'; valid: .*acpsgd"),
        ({"probe_steps": 0}, "probe_steps must be an integer >= 1"),
        ({"rank": 0}, "rank must be 'auto' or an integer >= 1"),
    ],
)
def test_bad_options_name_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        algorithm_class("auto").validate_options(options)


def test_an_unknown_candidate_lists_only_the_valid_candidates():
    """``auto`` is refused as its own candidate, so the valid ones listed leave it out."""
    from sylvie_comm.algorithms.registry import ALGORITHMS

    valid = ", ".join(n for n in sorted(ALGORITHMS) if n != "auto")
    with pytest.raises(ValueError) as exc:
        algorithm_class("auto").validate_options({"candidates": ["threebit"]})
    assert str(exc.value) == f"unknown candidate 'threebit'; valid: {valid}"
    with pytest.raises(ValueError) as exc:
        algorithm_class("auto").validate_options({"candidates": ["qbit"]})  # a codec, not an algorithm
    assert str(exc.value) == (f"unknown candidate 'qbit'; valid: {valid} ('qbit' is a codec "
                              "(sylvie_comm.codecs.get_codec))")  # fmt: skip
