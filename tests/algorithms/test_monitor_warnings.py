"""The monitor's warnings: one per group and check, every tensor over its bound named, and each tensor's trouble
said once.

48 named tensors in four groups (as a 48-layer model's DDP buckets), two ranks as threads of the in-process
transport, through the session as every integration calls it; the ``sylvie_comm`` logger captured per rank.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.monitor_figures import TensorFigures
from sylvie_comm.algorithms.monitor_judge import Over, judge, warning
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config

LAYERS = 48
GROUPS = 4
SHAPE = (24, 16)  # 384 elements: top-k at its default ratio 0.1 keeps 39
MONITOR = {"first": 4, "period": 8}  # checks at compressed steps 4, 12, 20, 28 (patience 2: over at 12)
STEPS = 30


def names() -> list[str]:
    return [f"layers.{i}.weight" for i in range(LAYERS)]


def fine(name: str) -> bool:
    """Every fourth tensor's gradient has 8 nonzeros, always the same: top-k sends it whole, nothing is owed."""
    return int(name.split(".")[1]) % 4 == 3


def grad(name: str, rank: int, step: int) -> torch.Tensor:
    i = int(name.split(".")[1])
    g = torch.Generator().manual_seed(100_003 * step + 101 * i + rank)
    out = torch.randn(SHAPE, generator=g)
    if fine(name):
        keep = torch.zeros(SHAPE)
        keep.view(-1)[:8] = 1.0
        out = out * keep
    return out


class _PerRank(logging.Handler):
    """The ``sylvie_comm`` warnings, each with the thread (rank) and the step it was logged in."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.step: dict[int, int] = {}
        self.records: list[tuple[int, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.thread or 0, self.step.get(record.thread or 0, -1), record.getMessage()))


def _run(codec: str, monitor: dict[str, Any]) -> tuple[list[tuple[int, int, str]], list[dict[str, Any]]]:
    """The warnings ``(thread, step, text)`` of a run of :data:`STEPS` steps, and each rank's ``stats()``."""
    handler = _PerRank()
    logger = logging.getLogger("sylvie_comm")
    logger.addHandler(handler)
    size = LAYERS // GROUPS
    groups = [names()[g * size : (g + 1) * size] for g in range(GROUPS)]  # 9 hurt and 3 fine tensors each

    def body(tr: Any) -> dict[str, Any]:
        session = Session("test", Config(codec, warmup_steps=0, monitor={**MONITOR, **monitor}), tr)
        for step in range(STEPS):
            handler.step[threading.get_ident()] = step
            session.step = step
            futures = []
            for key, group in enumerate(groups):
                members = [Member(n, grad(n, tr.rank, step), *session.policy.member_options(n, SHAPE)) for n in group]
                futures.append(session.run(Group(key, members)))
            for f in futures:
                f.wait()
            session.step = step + 1
        stats = session.stats()
        session.close()
        return stats

    try:
        stats = run_local(2, body)
    finally:
        logger.removeHandler(handler)
    return handler.records, stats


def _named(text: str) -> list[str]:
    return re.findall(r"'(layers\.\d+\.weight)'", text)


@pytest.mark.parametrize("adapt", [False, True])
def test_a_48_tensor_model_under_topk_gets_one_warning_per_group_and_check(adapt: bool) -> None:
    records, stats = _run("topk", {"adapt": adapt})
    over = [r for r in records if "over the bound" in r[2]]
    assert over, records
    # At most one warning per rank, group and step (a step judges one check), and one per rank and group at the
    # first check over the bound: 4 per rank, not one per tensor.
    per = Counter((thread, step, re.search(r"group (\d+):", text)[1]) for thread, step, text in over)  # type: ignore[index]
    assert max(per.values()) == 1, per
    ranks = {thread for thread, _, _ in over}
    assert len(ranks) == 2
    for thread in ranks:
        mine = [(step, text) for t, step, text in over if t == thread]
        first = min(step for step, _ in mine)
        assert first == 13 and sum(step == first for step, _ in mine) == GROUPS, mine  # check 12, read at 13
        # Every tensor over its bound named: the 36 whose gradients top-k drops, not the 12 it sends whole.
        named = Counter(n for _, text in mine for n in _named(text))
        hurt = {n for n in names() if not fine(n)}
        assert set(named) == hurt, sorted(set(named) ^ hurt)
        # Each trouble said once: a tensor is named again only after adaptation changed it.
        changed = Counter(n for e in stats[0]["monitor"]["adapted"] for n in _named(e))
        for n, times in named.items():
            assert times <= 1 + changed[n], (n, times, changed[n])
        if not adapt:
            assert max(named.values()) == 1 and len(mine) == GROUPS, mine
            assert all("monitor adapt=True" in text for _, text in mine)
        else:
            assert all("adapted from the next step" in text for _, text in mine), mine
    # Compact: the worst three with their lag, the others by name, the bound and the figure once.
    text = over[0][2]
    assert "9 tensors over the bound 0.5 of lag (residual / gradient) at 2 check(s) in a row" in text, text
    assert re.search(r": 'layers\.\d+\.weight' [\d.]+, 'layers\.\d+\.weight' [\d.]+, 'layers\.\d+\.weight' [\d.]+ "
                     r"and 6 more \(('layers\.\d+\.weight'(, )?){6}\)", text), text  # fmt: skip


@pytest.mark.parametrize("codec", ["qsgd", "fp16"])
def test_no_warning_where_the_compression_is_fine(codec: str) -> None:
    records, stats = _run(codec, {})
    assert [r for r in records if "over the bound" in r[2]] == []
    assert stats[0]["monitor"]["checks"] == 4  # it did check


def test_a_tensor_is_named_again_once_it_recovers_and_goes_over_again() -> None:
    """judge: over at patience -> named (new); still over -> not new; under the bound -> its trouble ends; over at
    patience again -> new again."""
    t = TensorFigures("w", (4, 4), {})
    lag = "lag (residual / gradient)"
    figures = [2.0, 2.0, 2.0, 0.3, 2.0, 2.0]
    got = [judge(t, (f, 0.5, lag), 2, None) for f in figures]
    assert [isinstance(v, Over) and v.new for v in got] == [False, True, False, False, False, True]
    assert [isinstance(v, Over) for v in got] == [False, True, True, False, False, True]
    assert warning("topk", "group 0", [v for v in got[2:3] if isinstance(v, Over)], "x") is None  # named before


def test_the_warning_counts_those_named_before_and_separates_the_figures() -> None:
    over = [
        Over("a", 3.0, 0.5, "lag (residual / gradient)", 2, True),
        Over("b", 0.9, 0.5, "lag (residual / gradient)", 2, False),
        Over("c", 1.5, 1.0, "exact relative error", 3, True),
    ]
    text = warning("topk", "group 7", over, "not adapted")
    assert text == (
        "sylvie_comm topk: group 7: 1 tensor over the bound 1 of exact relative error at 3 check(s) in a row: "
        "'c' 1.5; 1 tensor over the bound 0.5 of lag (residual / gradient) at 2 check(s) in a row: 'a' 3; "
        "1 named before still over; not adapted"
    )
