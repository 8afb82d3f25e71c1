"""``python -m sylvie_comm.bench.diloco``: its runs parsed, a few steps of each against plain data parallel, the
table's ratios from the figures."""

from __future__ import annotations

import pytest

from sylvie_comm.bench import diloco as bd


def test_runs_are_parsed_or_refused_naming_the_run() -> None:
    assert bd._parse("ddp") == ("ddp", 1, 0.7, 0.9)
    assert bd._parse("qsgd2:16") == ("qsgd2", 16, 0.7, 0.9)
    assert bd._parse("none:64:0.5:0.0") == ("none", 64, 0.5, 0.0)
    for bad in ("qsgd2", "zip:16", "qsgd2:0", "none:16:0.5", "none:16:-1:0.5", "none:16:0.5:1.0"):
        with pytest.raises(ValueError, match=f"run '{bad}': expected ddp or <codec>:<H>"):
            bd._parse(bad)
    with pytest.raises(ValueError, match=r"steps \(10\) must be a multiple of every H \(run 'none:4'\)"):
        bd.measure(10, 2, "ddp,none:4")


def test_a_few_steps_of_each_run_against_plain_data_parallel() -> None:
    result = bd.measure(4, 2, "ddp,none:2,qsgd2:2:0.5:0.5")
    rows = {r["run"]: r for r in result["rows"]}
    assert list(rows) == ["ddp", "none:2", "qsgd2:2:0.5:0.5"]
    assert rows["ddp"]["loss_vs_ddp"] == 1.0 and rows["ddp"]["fewer_bytes_than_ddp"] == 1.0
    assert rows["none:2"]["fewer_bytes_than_ddp"] == pytest.approx(2.0)  # fp32, every 2nd step
    assert rows["qsgd2:2:0.5:0.5"]["fewer_bytes_than_ddp"] > 2 * 10
    for row in rows.values():
        assert row["val_loss"] > 0 and row["skipped"] == 0
    table = bd.markdown(result)
    assert "| none:2 |" in table and "| 2x |" in table
