"""The FSDP2 reduce-scatter host-time benchmark in one process: its rows, their figures and ratios, its table, and
the arguments it refuses. Tiny sizes: what is checked is the record's shape and arithmetic, not the times."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.bench import hooks_fsdp as hf


def test_the_rows_of_one_size_time_every_units_call_against_fsdp2s_own():
    assert not dist.is_initialized()
    rows = hf.fsdp_rows(2, 2)
    assert not dist.is_initialized()  # the group it set up is gone again
    # Every algorithm with a reduce-scatter form, as bench fsdp's rows: none, fp16, bf16, qsgd and onebit today.
    sharded = [name for name, cls in ALGORITHMS.items() if cls.record.shards]
    assert [r["row"] for r in rows] == ["fsdp2", *hf.OURS] and sorted(hf.OURS) == sorted(sharded)
    assert {"none", "fp16", "bf16", "qsgd", "onebit"} <= set(hf.OURS)
    base = rows[0]
    assert base["x_fsdp2"] == base["x_fsdp2_step"] == 1.0
    for r in rows:
        assert r["units"] == 2 and r["steps"] == 2 and r["calls_per_step"] == 2, r
        assert r["us_per_unit"] > 0 and r["us_per_step"] > 0
        assert r["x_fsdp2"] == pytest.approx(r["us_per_unit"] / base["us_per_unit"])
        assert r["x_fsdp2_step"] == pytest.approx(r["us_per_step"] / base["us_per_step"])


def test_the_record_at_two_sizes_and_its_table():
    record = hf.measure((2, 1), 1)
    assert record["units"] == [1, 2] and record["units_growth"] == 2.0
    small, large = record["rows"][1], record["rows"][2]
    for a, b in zip(small, large, strict=True):
        growth = b["us_per_step"] / a["us_per_step"]
        assert record["step_growth"][a["row"]] == pytest.approx(growth)
        assert record["step_growth_x_fsdp2"][a["row"]] == pytest.approx(growth / record["step_growth"]["fsdp2"])
    lines = hf.table(record).splitlines()
    assert lines[0].startswith("host time of one FSDP2 unit's reduce-scatter, Linear(16, 16) units, median of 1 ")
    assert lines[1].split()[:4] == ["row", "us/unit", "@1", "x"]
    rows = len(hf.ROWS)
    assert [line.split()[0] for line in lines[2 : 2 + rows]] == list(hf.ROWS)
    growth = "(linear in units: a step's total grows 2.00x from 1 to 2 units, as fsdp2's: 1.00 over it)"
    assert lines[2 + rows] == growth


def test_bad_arguments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="units must be an integer >= 1, got 0"):
        hf.fsdp_rows(0, 2)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got True"):
        hf.fsdp_rows(2, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"rows must be 'fsdp2' followed by distinct rows of {', '.join(hf.OURS)}, "
                                         r"got \['none'\]"):  # fmt: skip
        hf.fsdp_rows(2, 2, ("none",))
    assert not dist.is_initialized()


def test_the_command_line_prints_the_table_and_writes_the_record(capsys, tmp_path):
    threads = torch.get_num_threads()
    try:
        assert hf.main(["--units", "1", "--steps", "1", "--out", str(tmp_path / "fsdp.json")]) == 0
    finally:
        torch.set_num_threads(threads)  # main measures on one thread
    printed = capsys.readouterr().out
    assert printed.startswith("host time of one FSDP2 unit's reduce-scatter") and "\nonebit " in printed
    record = json.loads((tmp_path / "fsdp.json").read_text())
    assert record["benchmark"] == "hooks_fsdp" and record["units"] == [1] and "step_growth" not in record
    assert [r["row"] for r in record["rows"]["1"]] == list(hf.ROWS)
