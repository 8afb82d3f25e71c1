"""The memory-traffic floor benchmark: its statistics and table, on a small model."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm.bench import floor


def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))


def test_floor_reports_pairs_of_steps_and_both_kinds():
    res = floor.run(("acpsgd", "onebit"), repeats=3, warmup=1, model=small())
    assert res["bytes"] == sum(p.numel() * 4 for p in small().parameters())
    assert res["read_s"] > 0 and res["copy_s"] > 0 and res["write_s"] >= 0
    for name, row in res["algorithms"].items():
        steps = row["steps_s"]
        assert len(steps) == 4, "3 repeats round up to two pairs"
        pairs = sorted((a + b) / 2 for a, b in zip(steps[0::2], steps[1::2], strict=True))
        assert row["hook_s"] == pytest.approx((pairs[0] + pairs[1]) / 2)
        assert row["even_s"] == pytest.approx((steps[0] + steps[2]) / 2)
        assert row["odd_s"] == pytest.approx((steps[1] + steps[3]) / 2)
        assert row["ratio"] == pytest.approx(row["hook_s"] / row["floor_s"])
        assert (row["reads"], row["writes"]) == ((2.0, 2.0) if name == "acpsgd" else (3.0, 3.0))
    table = floor.format_table(res)
    assert "even ms" in table and "odd ms" in table
    assert table.splitlines()[-1].split()[0] == "onebit"


def test_floor_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats must be >= 1 and warmup >= 0, got repeats=0, warmup=0"):
        floor.run(("acpsgd",), repeats=0, warmup=0, model=small())


def test_the_floor_of_an_algorithm_is_read_from_its_class():
    """Low-rank algorithms first, then the error-fed ones with a server phase; the others have no floor modelled."""
    from sylvie_comm.algorithms import ALGORITHMS as REGISTERED

    assert floor.ALGORITHMS == ("acpsgd", "powersgd", "onebit")
    assert [floor.floor_kind(REGISTERED[n]) for n in floor.ALGORITHMS] == ["low-rank", "low-rank", "server"]
    assert floor._passes_of("onebit", 4) == (2.25, 2.25) and floor._passes_of("powersgd", 4) == (2.0, 2.0)
    assert all(floor.floor_kind(REGISTERED[n]) is None for n in ("none", "qsgd", "topk", "auto"))
    with pytest.raises(ValueError, match="'qsgd' has no floor modelled"):
        floor._passes_of("qsgd", 1)
