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
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        bd.measure(4, 2, "ddp", seed=-1)
    with pytest.raises(ValueError, match=r"eval_every must be an integer >= 0 \(0: at the end only\), got -2"):
        bd.measure(4, 2, "ddp", eval_every=-2)


def test_a_few_steps_of_each_run_against_plain_data_parallel(tmp_path) -> None:
    result = bd.measure(4, 2, "ddp,none:2,qsgd2:2:0.5:0.5,qsgd2-block:4", eval_every=2)
    rows = {r["run"]: r for r in result["rows"]}
    assert list(rows) == ["ddp", "none:2", "qsgd2:2:0.5:0.5", "qsgd2-block:4"]
    # The curve: the initial model, every 2nd step where an outer step ends, the end.
    assert [s for s, _ in rows["none:2"]["curve"]] == [0, 2, 4] and [s for s, _ in rows["ddp"]["curve"]] == [0, 2, 4]
    assert [s for s, _ in rows["qsgd2-block:4"]["curve"]] == [0, 4]
    assert len({r["curve"][0][1] for r in rows.values()}) == 1  # the same initial weights
    assert all(r["curve"][-1][1] == r["val_loss"] for r in rows.values())
    # One scale per >= 2,048 values: fewer bytes than a scale per row, the same packed values.
    # Per outer step, against fp32's 16x at 2 bits: the model's rows (a scale and a minimum per row) leave about
    # 14.3x; whole tensors' blocks of >= 2,048 values leave over 15.6x, 250x at H=16.
    per_row = rows["qsgd2:2:0.5:0.5"]["fewer_bytes_than_ddp"] / 2
    block = rows["qsgd2-block:4"]["fewer_bytes_than_ddp"] / 4
    assert per_row < 14.5 and 16 * block >= 250 and block < 16
    path, message = bd.plot(result, tmp_path / "run.png")
    assert message == f"wrote {path}" and path.stat().st_size > 0
    assert rows["ddp"]["loss_vs_ddp"] == 1.0 and rows["ddp"]["fewer_bytes_than_ddp"] == 1.0
    assert rows["none:2"]["fewer_bytes_than_ddp"] == pytest.approx(2.0)  # fp32, every 2nd step
    assert rows["qsgd2:2:0.5:0.5"]["fewer_bytes_than_ddp"] > 2 * 10
    for row in rows.values():
        assert row["val_loss"] > 0 and row["skipped"] == 0
    table = bd.markdown(result)
    assert "| none:2 |" in table and "| 2x |" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "-4"], "argument --steps: expected an integer >= 1, got '-4'"),
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        (["--steps", "many"], "argument --steps: expected an integer >= 1, got 'many'"),
        (["--world", "0"], "argument --world: expected an integer >= 1, got '0'"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        (["--eval-every", "-2"], "argument --eval-every: expected an integer >= 0, got '-2'"),
        (["--runs", ","], "argument --runs: runs ',' names no run; expected a comma-separated list such as ddp,"),
        (["--runs", "ddp,none:16:inf:0.9"], "argument --runs: run 'none:16:inf:0.9': expected ddp or <codec>:<H>"),
        (["--runs", "ddp,none:16:nan:0.9"], "the outer lr a finite number > 0 and the outer momentum in [0, 1)"),
        (["--runs", "ddp,zip:16"], "argument --runs: run 'zip:16': expected ddp or <codec>:<H>"),
        (["--steps", "10", "--runs", "ddp,none:4"], "error: steps (10) must be a multiple of every H (run 'none:4')"),
        (
            ["--out", "{tmp}/missing/run.json"],
            "argument --out: '{tmp}/missing/run.json' is in folder '{tmp}/missing', "
            "which does not exist; expected a path in an existing folder",
        ),
        (["--out", "{tmp}"], "argument --out: '{tmp}' is a folder; expected a file name such as '{tmp}/diloco.json'"),
    ],
)
def test_the_command_line_refuses_a_bad_value_before_any_run(
    argv: list[str], message: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error (exit status 2) on one line naming the value, the output folder checked first: nothing runs
    (the record of runs that took minutes is not lost at the end)."""

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a run started")

    monkeypatch.setattr(bd, "measure", no_run)
    with pytest.raises(SystemExit) as exc:
        bd.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the usage
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert last.startswith("python -m sylvie_comm.bench.diloco: error: ") and message.format(tmp=tmp_path) in last, err


def test_measure_refuses_counts_and_runs_naming_the_value() -> None:
    for args, message in [
        ((0, 2, "ddp"), "steps must be an integer >= 1, got 0"),
        ((-4, 2, "ddp"), "steps must be an integer >= 1, got -4"),
        ((4, 0, "ddp"), r"world must be an integer >= 1 \(replicas\), got 0"),
        ((4, 2, ","), "runs ',' names no run"),
        ((4, 2, "ddp,none:2:inf:0.5"), "run 'none:2:inf:0.5': expected ddp or <codec>:<H>"),
    ]:
        with pytest.raises(ValueError, match=message):
            bd.measure(*args)  # type: ignore[arg-type]
