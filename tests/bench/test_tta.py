"""``sylvie-comm bench tta``: time to plain DDP's final metric, from the pure figures to one tiny run in the lab."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm import cli
from sylvie_comm.algorithms.registry import ALGORITHMS
from sylvie_comm.bench import quality, tta, tta_methods, tta_report
from sylvie_comm.bench.tta_report import error_line, reached
from tests.bench.test_datasets import need
from tests.lab_marks import needs_lab

# ---------------------------------------------------------------------- time to target


def test_time_to_target_is_the_first_evaluation_at_or_past_it():
    acc = [(0.0, 10.0), (2.0, 60.0), (4.0, 79.9), (6.0, 80.0), (8.0, 85.0)]
    assert tta_report.time_to_target(acc, 80.0, higher_is_better=True) == 6.0  # equal counts; no interpolation
    assert tta_report.time_to_target(acc, 70.0, higher_is_better=True) == 4.0  # the evaluation past it, not 3.0
    assert tta_report.time_to_target(acc, 85.1, higher_is_better=True) is None  # never
    assert tta_report.time_to_target(acc, 5.0, higher_is_better=True) == 0.0
    dips = [(0.0, 10.0), (6.0, 80.0), (9.0, 79.0)]
    assert tta_report.time_to_target(dips, 80.0, higher_is_better=True) == 6.0  # a later dip does not undo it
    assert tta_report.time_to_target([], 80.0, higher_is_better=True) is None


def test_time_to_target_of_a_loss_is_at_or_below_it_and_nan_never_reaches():
    loss = [(0.0, 5.5), (1.0, 3.0), (2.0, float("nan")), (3.0, 2.4), (4.0, 2.5)]
    assert tta_report.time_to_target(loss, 2.5, higher_is_better=False) == 3.0
    assert tta_report.time_to_target(loss, 3.0, higher_is_better=False) == 1.0
    assert tta_report.time_to_target(loss, 2.0, higher_is_better=False) is None
    nan = [(1.0, float("nan")), (2.0, float("nan"))]
    assert tta_report.time_to_target(nan, 0.0, higher_is_better=True) is None
    assert tta_report.time_to_target(nan, 100.0, higher_is_better=False) is None
    assert not reached(math.nan, 1.0, True) and reached(1.0, 1.0, False) and not reached(1.1, 1.0, False)


def test_time_to_target_refuses_a_nan_target_and_times_that_go_back():
    with pytest.raises(ValueError, match="target is NaN"):
        tta_report.time_to_target([(0.0, 1.0)], float("nan"), True)
    with pytest.raises(ValueError, match=r"must not decrease, got 1\.0 after 2\.0"):
        tta_report.time_to_target([(2.0, 1.0), (1.0, 2.0)], 5.0, True)


# ---------------------------------------------------------------------- names and bad input


def test_the_methods_plain_first_then_pytorchs_hooks_every_algorithm_and_the_optimizer_of_the_workload():
    sgd, adamw = tta_methods.default_methods("sgd"), tta_methods.default_methods("adamw")
    hooks = ["bf16_hook", "fp16_hook", "powersgd_hook"]
    assert sgd == ["plain", *hooks, *ALGORITHMS, "csgd"] and adamw == ["plain", *hooks, *ALGORITHMS, "cadamw"]
    assert "auto" in sgd
    assert tta_methods.check_methods(["qsgd", "plain", "qsgd"], "sgd") == ["plain", "qsgd"]
    assert tta_methods.check_methods(["onebit"], "sgd") == ["plain", "onebit"]  # plain sets the target: always run
    with pytest.raises(ValueError, match=r"unknown method 'zip'; valid: plain, bf16_hook, fp16_hook, powersgd_hook"):
        tta_methods.check_methods(["zip"], "sgd")
    with pytest.raises(ValueError, match="method 'cadamw' replaces adamw and this workload trains with sgd"):
        tta_methods.check_methods(["cadamw"], "sgd")
    with pytest.raises(ValueError, match="method 'csgd' replaces sgd and this workload trains with adamw"):
        tta_methods.check_methods(["csgd"], "adamw")
    assert tta.check_optimizer("cnn", None) == "sgd" and tta.check_optimizer("lm", None) == "adamw"
    with pytest.raises(ValueError, match="workload lm trains with adamw, not 'sgd'"):
        tta.check_optimizer("lm", "sgd")
    with pytest.raises(ValueError, match="unknown workload 'vit'; valid: cnn, lm"):
        tta.check_optimizer("vit", None)
    assert tta_methods.powersgd_start(600) == 60 and tta_methods.powersgd_start(10) == 2  # 10 %, at least 2
    assert "start_powerSGD_iter=30" in tta_methods.label("powersgd_hook", 300)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"link": "20mbit"}, "unknown link '20mbit'"),
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
        ({"eval_every": 0}, "eval_every must be an integer >= 1, got 0"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"methods": ["plain", "zip"]}, "unknown method 'zip'"),
        ({"workload": "lm", "eval_size": 100}, "eval_size is for the cnn workload only"),
        ({"timeout": 0.0}, r"timeout must be positive seconds \(a finite number\), got 0.0"),
        ({"timeout": math.inf}, r"timeout must be positive seconds \(a finite number\), got inf"),
        ({"outer_lr": math.inf}, "outer_lr must be a finite number > 0, got inf"),
        ({"outer_lr": math.nan}, "outer_lr must be a finite number > 0, got nan"),
        ({"outer_lr": 0}, "outer_lr must be a finite number > 0, got 0"),
        (
            {"methods": ["plain", "qsgd"], "method_steps": {"diloco": 900}},
            "method_steps names 'diloco', which is not among the methods run \\(plain, qsgd\\)",
        ),
        (
            {"methods": ["plain", "qsgd"], "method_steps": {"qsgd": 0}},
            "method_steps\\['qsgd'\\] must be an integer >= 1",
        ),
    ],
)
def test_bad_input_is_an_error_naming_the_value_before_any_lab(kwargs: dict[str, Any], message: str):
    args = {"link": "100mbit", **kwargs}
    with pytest.raises(ValueError, match=message):
        tta.run(args.pop("link"), **args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link", "20mbit"], "argument --link: invalid choice: '20mbit'"),
        (["--link", "100mbit", "--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["--link", "100mbit", "--methods", "plain,zip"], "argument --methods: unknown method 'zip'"),
        (["--link", "100mbit", "--workload", "vit"], "argument --workload: invalid choice: 'vit'"),
        (["--steps", "10"], "the following arguments are required: --link"),
        (
            ["--link", "100mbit", "--method-steps", "diloco"],
            "argument --method-steps: expected NAME=STEPS with STEPS a positive integer, got 'diloco'",
        ),
        (
            ["--link", "100mbit", "--method-steps", "diloco=0"],
            "argument --method-steps: expected NAME=STEPS with STEPS a positive integer, got 'diloco=0'",
        ),
        (["--link", "100mbit", "--outer-lr", "inf"], "argument --outer-lr: expected a finite number > 0, got 'inf'"),
        (["--link", "100mbit", "--outer-lr", "nan"], "argument --outer-lr: expected a finite number > 0, got 'nan'"),
        (["--link", "100mbit", "--outer-lr", "-0.5"], "argument --outer-lr: expected a finite number > 0, got '-0.5'"),
        (["--link", "100mbit", "--timeout", "inf"], "argument --timeout: expected a finite number > 0, got 'inf'"),
        (["--link", "100mbit", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    ],
)
def test_the_command_line_names_a_bad_value(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "tta", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def no_lab(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """An empty data folder, and a lab that fails the test if it is built (it needs root and namespaces)."""
    monkeypatch.setenv("SYLVIE_COMM_DATA", str(tmp_path / "data"))

    def lab(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the lab was started")

    monkeypatch.setattr(tta, "Lab", lab)


@pytest.mark.usefixtures("no_lab")
@pytest.mark.parametrize(("workload", "missing"), [("cnn", "fashion-mnist/train-images-idx3-ubyte"),
                                                   ("lm", "pydocs/MANIFEST.json")])  # fmt: skip
def test_a_missing_data_set_is_one_line_before_the_lab_starts(
    workload: str, missing: str, tmp_path, capsys: pytest.CaptureFixture[str]
):
    data = tta.DATASETS[workload]
    message = (
        f"workload {workload} reads data set {data}: {tmp_path / 'data' / missing} is missing (run scripts/data.sh)"
    )
    with pytest.raises(ValueError, match=re.escape(f"bench tta: {message}")):
        tta.run("100mbit", workload, echo=None, progress=False)
    assert cli.main(["bench", "tta", "--link", "100mbit", "--workload", workload]) == 1
    out = capsys.readouterr()
    assert out.err == f"sylvie-comm bench tta: {message}\n" and out.out == ""


def test_the_command_line_refuses_a_method_the_workload_cannot_run(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["bench", "tta", "--link", "100mbit", "--methods", "cadamw"]) == 1
    assert "bench tta: method 'cadamw' replaces adamw and this workload trains with sgd" in capsys.readouterr().err


# ---------------------------------------------------------------------- the figures and the table


def _rank(curve: list[tuple[int, float, float]], steps: list[float], sent: int | None, rank: int = 0) -> dict:
    return {
        "step_s": steps,
        "curve": [{"step": s, "seconds": t, "metric": m, "loss": None} for s, t, m in curve] if rank == 0 else [],
        "eval_s": 3.0,
        "bytes": None if sent is None else {"sent": sent + rank, "received": sent - rank},
        "loss_last": 0.5,
        "replicas_equal": True,
        "reported": None,
        "process_s": 9.0,
    }


def _raw(bound_step: float = 0.05, shaped: bool = True) -> dict[str, list[dict]]:
    def both(curve: list[tuple[int, float, float]], steps: list[float], sent: int) -> list[dict]:
        mb = sent if shaped else None
        return [_rank(curve, steps, mb, 0), _rank(curve, [s / 2 for s in steps], mb, 1)]

    return {
        "no-comm": both([], [bound_step] * 4, 1000),
        "plain": both([(0, 0.0, 10.0), (2, 4.0, 70.0), (4, 8.0, 80.0)], [2.0, 2.0, 2.0, 2.0], 8_000_000),
        "qsgd": both([(0, 0.0, 10.0), (2, 1.0, 80.5), (4, 2.0, 81.0)], [0.5, 0.5, 0.4, 0.6], 1_000_000),
        "onebit": both([(0, 0.0, 10.0), (2, 1.0, 60.0), (4, 2.0, 75.0)], [0.5] * 4, 500_000),
    }


def _record(raw: dict[str, list[dict]], **kw: Any) -> dict:
    lab = {"shaped": kw.pop("shaped", True), "fallback_reason": None, "banner": "lab: ...", "namespaces": None,
           "launch": {}}  # fmt: skip
    args: dict[str, Any] = {"link": "100mbit", "workload": "cnn", "optimizer": "sgd", "steps": 4, "eval_every": 2,
                            "seed": 0, "eval_size": None, "parameters": 225034, "lab_info": lab, "failed": {},
                            "skipped": {}, "wall": 30.0, **kw}  # fmt: skip
    return tta_report.record(raw, **args)


def test_each_method_against_plain_in_the_same_run():
    rec = _record(_raw(), loads={"plain": [1.5, 1.0, 0.5], "no-comm": [0.5, 0.5, 0.5]})
    assert rec["target"] == 80.0 and rec["plain_time_to_target_s"] == 8.0 and rec["higher_is_better"]
    plain, qsgd, onebit = (rec["methods"][n] for n in ("plain", "qsgd", "onebit"))
    assert list(rec["methods"]) == ["plain", "qsgd", "onebit"]  # the bound is apart
    assert plain["time_ratio"] == 1.0 and plain["gap"] == 0.0 and plain["step_ratio"] == 1.0
    assert qsgd["time_to_target_s"] == 1.0 and qsgd["time_ratio"] == pytest.approx(1.0 / 8.0)
    assert qsgd["gap"] == pytest.approx(1.0) and qsgd["median_step_s"] == 0.5
    assert qsgd["step_ratio"] == pytest.approx(0.25)
    assert onebit["time_to_target_s"] is None and onebit["time_ratio"] is None and onebit["gap"] == -5.0
    # A step takes as long as its slowest rank; bytes per rank.
    assert plain["step_s"] == [2.0] * 4 and plain["bytes_sent"] == [8_000_000, 8_000_001]
    assert plain["bytes_received"] == [8_000_000, 7_999_999] and plain["train_s"] == 8.0
    bound = rec["bound"]
    assert "curve" not in bound and bound["median_step_s"] == 0.05 and bound["train_s"] == pytest.approx(0.2)
    check = rec["bound_check"]
    assert check["ratio"] == pytest.approx(40.0) and check["at_least_factor"] and check["warning"] is None
    assert rec["workload"] == "cnn/fashion-mnist/sgd" and rec["metric"] == "test accuracy %"
    assert {"cpu_model", "cpu_count", "torch"} <= set(rec["machine"]) and rec["date"] and rec["command"]
    assert plain["loadavg_at_start"] == [1.5, 1.0, 0.5] and bound["loadavg_at_start"] == [0.5, 0.5, 0.5]
    assert qsgd["loadavg_at_start"] is None  # not given


def test_a_method_given_its_own_steps_says_so():
    rec = _record(_raw(), method_steps={"qsgd": 8})
    assert rec["methods"]["qsgd"]["steps"] == 8 and rec["methods"]["plain"]["steps"] == rec["steps"] == 4
    rows = tta_report.format_table(rec).splitlines()
    assert next(r for r in rows if r.startswith("| qsgd |")).endswith("| 8 |")
    assert next(r for r in rows if r.startswith("| plain |")).endswith("| 4 |")


def test_a_loss_is_lower_is_better():
    raw = _raw()
    for per_rank in raw.values():
        for p in per_rank:
            for point in p["curve"]:
                point["metric"] = 100.0 / point["metric"]  # 10, 1.43, 1.25 for plain
    rec = _record(raw, workload="lm", optimizer="adamw")
    assert not rec["higher_is_better"] and rec["target"] == pytest.approx(1.25)
    assert rec["methods"]["qsgd"]["time_to_target_s"] == 1.0 and rec["methods"]["onebit"]["time_to_target_s"] is None
    assert rec["methods"]["onebit"]["gap"] == pytest.approx(100 / 75 - 1.25)  # positive: worse
    assert "| plain | 1.2500 | - | 8.0 | 1.00x |" in tta_report.format_table(rec)


def test_the_bound_check_warns_below_twice_the_bound():
    assert tta_report.bound_check(0.2, 0.1, "1gbit")["at_least_factor"]  # 2x exactly is enough
    check = tta_report.bound_check(0.15, 0.1, "1gbit")
    assert not check["at_least_factor"] and check["ratio"] == pytest.approx(1.5)
    assert check["warning"].startswith("WARNING: plain DDP's step (150.0 ms) is only 1.50x the no-comm bound")
    assert "on link 1gbit, below 2x" in check["warning"]
    table = tta_report.format_table(_record(_raw(bound_step=1.5)))
    assert "plain DDP's step (2000.0 ms) is 1.33x the no-comm bound (1500.0 ms): below 2x" in table
    assert "WARNING: plain DDP's step" in table


def test_the_table_from_fabricated_figures(tmp_path):
    rec = _record(_raw(), skipped={"csgd": "sylvie_comm.optim has no CompressedSGD"},
                  failed={"sign": "[rank0]: Traceback\n[rank0]: RuntimeError: gloo broke\n--- rank 1"})  # fmt: skip
    table = tta_report.format_table(rec)
    lines = table.splitlines()
    assert lines[0].startswith("Time to plain DDP's final test accuracy % on link 100mbit, 2 workers, cnn/")
    assert (
        lines[1] == "target: plain DDP's final test accuracy % 80.00 (higher is better), which plain DDP first "
        "reached at 8.0 s"
    )
    header = next(line for line in lines if line.startswith("| method |"))
    rows = [line for line in lines if line.startswith("| ") and line != header]
    assert len(rows) == 4 and all(line.count("|") == header.count("|") for line in rows)
    assert "| plain | 80.00 | - | 8.0 | 1.00x | 8.0/8.0 | 2000.0 | 8.0 | 4 |" in rows
    assert "| qsgd | 81.00 | +1.00 | 1.0 | 0.12x | 1.0/1.0 | 500.0 | 2.0 | 4 |" in rows
    assert "| onebit | 75.00 | -5.00 | never | never | 0.5/0.5 | 500.0 | 2.0 | 4 |" in rows
    assert "| no-comm (bound) | - | - | - | - | 0.0/0.0 | 50.0 | 0.2 | 4 |" in rows
    assert "plain DDP's step (2000.0 ms) is 40.00x the no-comm bound (50.0 ms): at least 2x, the link is the " in table
    assert "skipped csgd: sylvie_comm.optim has no CompressedSGD" in table
    assert "FAILED sign: RuntimeError: gloo broke (the workers' output in the JSON: failed)" in table
    path, message = tta_report.save(rec, tmp_path / "run.json")  # OUT may end in .json
    assert path == tmp_path / "run.json" and json.loads(path.read_text()) == rec
    assert message == f"wrote {tmp_path / 'run.png'}" and (tmp_path / "run.png").stat().st_size > 0
    loop = tta_report.format_table(_record(_raw(shaped=False), shaped=False))
    assert "| plain | 80.00 | - | 8.0 | 1.00x | -/- |" in loop and "LOOPBACK" in loop


# ---------------------------------------------------------------------- the timed loop


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tiny_workload(clock: _Clock) -> quality.Workload:
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    labels = (data[:, 0] > 0).long()

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        clock.now += 1.0  # a step takes a second
        idx = torch.randint(0, 64, (8,), generator=gen)
        return data[idx], labels[idx]

    def evaluate(model: nn.Module) -> float:
        clock.now += 100.0  # an evaluation takes long: none of it is training time
        with torch.no_grad():
            return float((model(data).argmax(1) == labels).float().mean() * 100)

    return quality.Workload("tiny", 7, lambda: nn.Linear(4, 2), lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
                            batch, F.cross_entropy, evaluate, "accuracy %", True)  # fmt: skip


def test_the_clock_stops_while_evaluating():
    clock = _Clock()
    wl = _tiny_workload(clock)
    torch.manual_seed(0)
    model = wl.make_model()
    opt = wl.make_optimizer(model)
    barriers: list[float] = []
    ticks: list[int] = []
    out = tta.timed_training(wl, model, model, opt, torch.Generator().manual_seed(0), steps=7, eval_every=3,
                             evaluates=True, barrier=lambda: barriers.append(clock.now),
                             progress=lambda: ticks.append(1), clock=clock)  # fmt: skip
    assert [p["step"] for p in out["curve"]] == [0, 3, 6, 7]  # before the first step, every 3, after the last
    assert [p["seconds"] for p in out["curve"]] == [0.0, 3.0, 6.0, 7.0]  # training time only
    assert out["step_s"] == [1.0] * 7 and out["eval_s"] == 400.0 and len(ticks) == 7
    assert len(barriers) == 4  # every rank meets after each evaluation
    assert out["curve"][0]["loss"] is None and out["curve"][-1]["loss"] == pytest.approx(out["loss_last"])
    assert out["curve"][-1]["metric"] > out["curve"][0]["metric"]
    # A rank that does not evaluate still meets the others; without points, no barrier and no curve.
    other = tta.timed_training(wl, model, model, opt, torch.Generator(), steps=4, eval_every=2, evaluates=False,
                               barrier=lambda: barriers.append(clock.now), clock=clock)  # fmt: skip
    assert other["curve"] == [] and len(barriers) == 4 + 3 and other["eval_s"] == 0.0
    none = tta.timed_training(wl, model, model, opt, torch.Generator(), steps=2, eval_every=None, evaluates=True,
                              barrier=lambda: barriers.append(-1.0), clock=clock)  # fmt: skip
    assert none["curve"] == [] and -1.0 not in barriers and none["step_s"] == [1.0, 1.0]


def test_the_failed_line_names_the_error():
    text = "[rank0]: Traceback (most recent call last):\n[rank0]:   File x\n[rank0]: TypeError: no bf16 here\n"
    assert error_line(text) == "TypeError: no bf16 here"
    assert error_line("lab (100mbit): rank 0 failed (exit 1)\nsomething") == "lab (100mbit): rank 0 failed (exit 1)"


# ---------------------------------------------------------------------- one rank in this process


@pytest.fixture
def one_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CNN workload read once for the test (the data set is read-only: every method gets the same)."""
    need("fashion-mnist")
    made: dict[str, quality.Workload] = {}
    make = quality.make_workload

    def once(name: str, rank: int, world: int, **kw: Any) -> quality.Workload:
        key = json.dumps([name, rank, world, kw], sort_keys=True)
        if key not in made:
            made[key] = make(name, rank, world, **kw)
        return made[key]

    monkeypatch.setattr(quality, "make_workload", once)


def _one_rank(method: str, **cfg: Any) -> dict[str, Any]:
    import torch.distributed as dist

    ticks: list[int] = []
    base = {"method": method, "workload": "cnn", "workload_kw": {"steps": 4, "optimizer": "sgd", "eval_size": 100},
            "steps": 4, "eval_every": 2, "seed": 0, "shaped": False, "eval_threads": 1,
            "collective_timeout": 60.0, **cfg}  # fmt: skip
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = tta._run_method(base, 0, 1, lambda: ticks.append(1))
    finally:
        dist.destroy_process_group()
    assert len(ticks) == 4
    return out


@pytest.mark.usefixtures("one_workload")
def test_a_method_runs_on_one_rank_from_the_seed():
    plain = _one_rank("plain")
    assert [p["step"] for p in plain["curve"]] == [0, 2, 4] and len(plain["step_s"]) == 4
    assert plain["bytes"] is None and plain["replicas_equal"] and plain["reported"] is None  # loopback: no counters
    again = _one_rank("plain")
    assert [p["metric"] for p in again["curve"]] == [p["metric"] for p in plain["curve"]]  # one seed: same run
    qsgd = _one_rank("qsgd")
    assert qsgd["reported"]["bytes_sent"] is not None and qsgd["curve"][0]["metric"] == plain["curve"][0]["metric"]
    bound = _one_rank("no-comm")
    assert bound["curve"] == [] and bound["replicas_equal"] is None and bound["eval_s"] == 0.0


def test_diloco_methods_run_when_named():
    defaults = set(tta_methods.default_methods("sgd")) | set(tta_methods.default_methods("adamw"))
    assert not set(tta_methods.DILOCO) & defaults
    assert tta_methods.check_methods(["diloco_qsgd2", "diloco"], "sgd") == ["plain", "diloco_qsgd2", "diloco"]
    assert "DiLoCo(sync_every=32, codec='qsgd', bits=2, block=1)" in tta_methods.label("diloco_qsgd2", 600, 32)
    assert "bits=8, error_feedback=False, block=1" in tta_methods.label("diloco_qsgd8_noef", 600)
    assert "(lr 0.35, momentum 0.9)" in tta_methods.label("diloco", 600, 16, 0.35)


@pytest.mark.usefixtures("one_workload")
def test_a_diloco_method_runs_on_one_rank_without_ddp():
    out = _one_rank("diloco_qsgd2", sync_every=2, outer_lr=0.7)
    plain = _one_rank("plain")
    assert out["curve"][0]["metric"] == plain["curve"][0]["metric"]  # the same initial weights
    assert out["reported"]["outer_steps"] == 2 and out["replicas_equal"] is None


@pytest.mark.usefixtures("one_workload")
def test_a_pytorch_hook_ddp_refuses_is_skipped_with_its_reason():
    out = _one_rank("bf16_hook")  # DDP refuses bf16_compress_hook without CUDA and NCCL
    assert out == {"skipped": "PyTorch refuses it here: TypeError: BF16 all reduce communication hook required "
                              "CUDA 11+ and NCCL 2.10+ or XPU and XCCL"}  # fmt: skip


# ---------------------------------------------------------------------- the lab


@needs_lab
def test_two_methods_and_the_bound_in_the_lab():
    """plain and qsgd, 24 steps, an evaluation every 8 on 500 test images: the curves, the target, the bytes each
    rank's eth0 counted and the bound."""
    need("fashion-mnist")
    steps, params = 24, 225034
    rec = tta.run("100mbit", "cnn", steps=steps, eval_every=8, methods=["plain", "qsgd"], eval_size=500,
                  timeout=300, echo=None, progress=False, method_steps={"qsgd": 32})  # fmt: skip
    assert rec["lab"]["shaped"] and rec["failed"] == {} and list(rec["methods"]) == ["plain", "qsgd"]
    plain, qsgd, bound = rec["methods"]["plain"], rec["methods"]["qsgd"], rec["bound"]
    for c, own in ((plain, steps), (qsgd, 32)):  # qsgd given more steps than the run's
        assert [p["step"] for p in c["curve"]] == list(range(0, own + 1, 8)) and c["replicas_equal"]
        assert c["steps"] == own and len(c["step_s"]) == own
        assert c["train_s"] == pytest.approx(sum(c["step_s"]), rel=0.2)
        assert c["eval_s"] > 0 and c["curve"][0]["seconds"] == 0.0
    assert len(bound["step_s"]) == steps
    assert plain["curve"][0]["metric"] == qsgd["curve"][0]["metric"]  # the same initial weights
    assert rec["target"] == plain["final_metric"] and plain["time_to_target_s"] is not None
    # Each rank's eth0: plain's fp32 all-reduce of every gradient each step (at 2 ranks, the whole buffer out).
    assert min(plain["bytes_sent"]) > steps * params * 4 and min(plain["bytes_received"]) > steps * params * 4
    assert max(qsgd["bytes_sent"]) < min(plain["bytes_sent"]) / 3  # 4 bits after 2 fp32 warm-up steps, 32 steps
    assert max(bound["bytes_sent"]) < 100_000 and bound["median_step_s"] < plain["median_step_s"]
    assert rec["bound_check"]["ratio"] == pytest.approx(plain["median_step_s"] / bound["median_step_s"])
    assert "| qsgd |" in tta_report.format_table(rec) and tta_report.format_table(rec).count(f"| {steps} |") >= 2
