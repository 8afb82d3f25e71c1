"""``python -m sylvie_comm.bench.step``: a whole DDP step per hook on ResNet-50 and a GPT-2-sized decoder, next to DDP
without a hook and PyTorch's hooks. Here with tiny models on the CPU (gloo): a test of the bench, not a measurement;
the 2-process part starts processes (the integration tier)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.bench import hooks, models, step
from sylvie_comm.bench.timing import threads
from tests.gpu_marks import HAS_GPU_KERNELS

CPU = torch.device("cpu")


def _check_rows(part: dict, names: tuple[str, ...]) -> None:
    """Every row measured, each ratio the quotient of its rows' figures, each goal judged from them."""
    rows = part["rows"]
    assert tuple(rows) == names, part.get("errors")
    for name, r in rows.items():
        assert r["ms"] == pytest.approx(statistics.median(r["step_ms"])) and r["ms"] > 0, name
        assert r["mean_ms"] == pytest.approx(statistics.fmean(r["step_ms"])), name
        assert r["buckets"] >= 1 and math.isfinite(r["loss_last"]), name
        assert r["x_ddp"] == pytest.approx(r["ms"] / rows["ddp"]["ms"]), name
        assert r["x_torch_fp16"] == pytest.approx(r["ms"] / rows["torch-fp16"]["ms"]), name
        assert ("x_none" in r) == (name in hooks.OURS), name
        if name in hooks.OURS:
            assert r["x_none"] == pytest.approx(r["ms"] / rows["none"]["ms"]), name
    assert rows["ddp"]["x_ddp"] == 1.0 and rows["torch-fp16"]["x_torch_fp16"] == 1.0
    for g in part["goals"]:
        ratio = rows[g["row"]][g["statistic"]] / rows[g["base"]][g["statistic"]]
        assert g["ratio"] == pytest.approx(ratio) and g["met"] == (ratio <= g["bound"]), g


def test_the_error_feedback_codecs_are_read_from_the_algorithms_classes(monkeypatch) -> None:
    assert set(step.feedback_codecs()) == {"onebit", "qsgd", "sign", "topk"}
    monkeypatch.setattr(ALGORITHMS["sign"], "record", replace(ALGORITHMS["sign"].record, error_feedback=False))
    assert "sign" not in step.feedback_codecs()
    assert [g.row for g in step.goal_list()] == ["none", "fp16", "topk", "onebit", "qsgd", step.DEFAULT_HOOK]


def test_the_models_have_resnet50s_and_gpt2_smalls_parameters_and_shrink_for_a_check() -> None:
    with torch.device("meta"):
        assert models.parameter_count(models.resnet50()) == 25_557_032  # torchvision's resnet50
        assert models.parameter_count(models.gpt2()) == 124_439_808  # GPT-2 small
    for name in step.MODEL_NAMES:
        work = step.workload(name, "tiny")
        model = work.build()
        x, y = work.batch(torch.Generator().manual_seed(0), CPU)
        out = model(x)
        assert out.shape[:-1] == y.shape and models.parameter_count(model) < 50_000, name
    gpt = models.gpt2(vocab=64, width=16, layers=1, heads=2, context=8)
    assert gpt.head.weight is gpt.tokens.weight and gpt.head.bias is None
    with pytest.raises(ValueError, match="width 30 must be a multiple of heads 4"):
        models.gpt2(width=30, heads=4)
    with pytest.raises(ValueError, match=r"blocks \(3, 0\)"):
        models.resnet50(blocks=(3, 0))


def test_one_process_measures_every_row_with_ratios_and_goals_from_its_figures() -> None:
    with threads(1):
        part = step.one_process(step.workload("resnet50", "tiny"), CPU, step.MIN_WARMUP, 2)
    _check_rows(part, step.one_process_rows())
    assert part["backend"] == "gloo" and part["world_size"] == 1 and "errors" not in part
    assert {g["row"] for g in part["goals"]} == {"none", "fp16", *step.feedback_codecs(), step.DEFAULT_HOOK}
    monitor = next(g for g in part["goals"] if g["base"] == step.MONITOR_OFF)
    assert monitor["statistic"] == "mean_ms" and monitor["bound"] == 1.02
    assert step.POWERSGD_ON_GLOO in part["notes"] and step.MONITOR_NOTE in part["notes"]
    assert part["rows"]["torch-powersgd"]["buckets"] == 1
    assert all(isinstance(part["rows"][n]["monitor_checks"], int) for n in hooks.OURS)


def _rows(**ms: float) -> dict[str, dict[str, float]]:
    return {name.replace("_", "-"): {"ms": v, "mean_ms": v} for name, v in ms.items()}


def test_a_goal_is_met_from_the_figures_and_unjudged_where_a_row_is_missing() -> None:
    rows = _rows(ddp=100.0, torch_fp16=90.0, none=102.9, fp16=93.0, topk=113.0, onebit=114.0)
    rows[step.DEFAULT_HOOK] = {"ms": 120.0, "mean_ms": 121.0}
    rows[step.MONITOR_OFF] = {"ms": 119.0, "mean_ms": 119.0}
    judged = {g["row"]: g for g in step.goals(rows, step.one_process_rows())}
    assert judged["none"]["met"] is True and judged["none"]["ratio"] == pytest.approx(1.029)
    assert judged["fp16"]["met"] is False and judged["fp16"]["ratio"] == pytest.approx(93 / 90)
    assert judged["onebit"]["met"] is False and judged["topk"]["ratio"] == pytest.approx(113 / 102.9)
    assert judged["topk"]["met"] is True  # 1.098
    assert judged[step.DEFAULT_HOOK]["ratio"] == pytest.approx(121 / 119) and judged[step.DEFAULT_HOOK]["met"]
    assert judged["sign"]["met"] is None and judged["sign"]["missing"] == ["sign"]
    assert rows["fp16"]["x_torch_fp16"] == pytest.approx(93 / 90) and rows["none"]["x_none"] == 1.0
    assert "x_none" not in rows["ddp"] and "x_none" not in rows[step.MONITOR_OFF]
    # The 2-process part runs no monitor-off row: that goal is not its own.
    assert step.DEFAULT_HOOK not in {g["row"] for g in step.goals(rows, step.two_process_rows())}


def test_a_row_that_raises_is_named_and_past_the_time_limit_none_starts(monkeypatch) -> None:
    make_hook = hooks.make_hook

    def broken(name: str, model: object) -> object:
        if name == "topk":
            raise RuntimeError("rewritten under us")
        return make_hook(name, model)

    monkeypatch.setattr(hooks, "make_hook", broken)
    part = step.one_process(step.workload("gpt2", "tiny"), CPU, step.MIN_WARMUP, 1)
    assert part["errors"] == {"topk": "RuntimeError: rewritten under us"}
    assert "topk" not in part["rows"] and len(part["rows"]) == len(step.one_process_rows()) - 1
    assert next(g for g in part["goals"] if g["row"] == "topk")["missing"] == ["topk"]
    result = step.measure(("gpt2",), "cpu", steps=1, procs=2, time_limit=1e-9)
    gpt = result["models"]["gpt2"]
    assert gpt["one"]["rows"] == {} and gpt["one"]["not_reached"] == list(step.one_process_rows())
    assert gpt["ranks"]["rows"] == {} and gpt["ranks"]["not_reached"] == list(step.two_process_rows())
    table = step.markdown(result)
    assert "Not reached in the time limit: ddp, torch-fp16" in table and "not measured (" in table


def test_the_ranks_lines_merge_into_rows_as_long_as_the_slower_rank() -> None:
    names = ("ddp", "none", "fp16", "topk", "qsgd")
    line = {"buckets": 2, "loss_last": 1.0}
    rank0 = {"ddp": {**line, "step_s": [0.010, 0.030]}, "none": {**line, "step_s": [0.02]},
             "fp16": {"error": "failed on another rank"}, "topk": {"late": True}}  # fmt: skip
    rank1 = {"ddp": {**line, "step_s": [0.020, 0.010]}, "none": {**line, "step_s": [0.01]},
             "fp16": {"error": "ValueError: bad"}, "topk": {"late": True}}  # fmt: skip
    rows, errors, late = step._merge(names, [rank0, rank1], "rank 1 exited with code 1")
    assert rows["ddp"]["step_ms"] == pytest.approx([20.0, 30.0]) and rows["ddp"]["ms"] == pytest.approx(25.0)
    assert rows["none"]["ms"] == pytest.approx(20.0)
    assert errors == {"fp16": "ValueError: bad", "qsgd": "rank 1 exited with code 1"} and late == ["topk"]
    # Stopped at the time limit: the row in progress failed, the ones after it were not reached.
    rows, errors, late = step._merge(("ddp", "none", "fp16"), [{"ddp": rank0["ddp"]}, {}], "stopped", stopped=True)
    assert rows == {} and errors == {"ddp": "stopped"} and late == ["none", "fp16"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"models": ("vgg",)}, "unknown model 'vgg'; expected one of resnet50, gpt2"),
    ({"models": ()}, "no model asked for"),
    ({"size": "huge"}, "unknown size 'huge'; expected one of full, tiny"),
    ({"device": "mps"}, "device must be 'cpu' or 'cuda', got 'mps'"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda', got 'tpu'"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"warmup": 4}, r"warmup must be an integer >= 5 \(our error-feedback hooks' 2 uncompressed steps"),
    ({"procs": 1}, "procs must be 0 .* or an integer >= 2, got 1"),
    ({"time_limit": -1.0}, "time_limit must be a number of seconds > 0 or None, got -1.0"),
])  # fmt: skip
def test_bad_arguments_are_refused_naming_the_value_and_what_was_expected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        step.measure(**{"device": "cpu", **kwargs})


@pytest.mark.skipif(HAS_GPU_KERNELS, reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so(capsys) -> None:
    with pytest.raises(ValueError, match="device 'cuda' asked for, but this torch sees no CUDA GPU"):
        step.measure(device="cuda")
    assert step.main(["--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step.main(["--device", "cpu", "--model", "vgg"])


def test_the_command_line_writes_the_record_and_its_tables(tmp_path, capsys) -> None:
    out = tmp_path / "step.json"
    with threads(torch.get_num_threads()):  # main() runs on one thread
        assert step.main(["--device", "cpu", "--model", "gpt2", "--steps", "1", "--procs", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["size"] == "tiny" and list(result["models"]) == ["gpt2"] and "ranks" not in result["models"]["gpt2"]
    assert result["feedback_codecs"] == list(step.feedback_codecs())
    table = out.with_suffix(".md").read_text()
    assert table == capsys.readouterr().out
    assert "**Tiny models: a check of the bench, not a measurement of ResNet-50 or GPT-2.**" in table
    assert "| hook | ms a step | mean ms | buckets | x ddp | x torch fp16 | x none |" in table
    assert "| ddp (no hook) |" in table and all(f"| {n} |" in table for n in step.one_process_rows()[1:])
    assert "| our none within 3% of DDP without a hook |" in table and ("| met |" in table or "not met" in table)
    assert "Note: torch-powersgd runs in one bucket here" in table


@pytest.mark.multiprocess
def test_two_processes_over_gloo_measure_every_row_a_step_as_long_as_the_slower_rank() -> None:
    part = step.two_process("gpt2", "tiny", CPU, step.MIN_WARMUP, 2)
    _check_rows(part, step.two_process_rows())
    assert part["backend"] == "gloo" and part["world_size"] == 2 and part["device"] == "cpu"
    assert {g["row"] for g in part["goals"]} == {"none", "fp16", *step.feedback_codecs()}
    assert all(len(r["step_ms"]) == 2 for r in part["rows"].values())


@pytest.mark.multiprocess
def test_the_hooks_bench_runs_the_step_part_on_the_cpu_when_asked(tmp_path) -> None:
    with threads(torch.get_num_threads()):  # main() runs on one thread
        assert hooks.main(["--only", "step", "--steps", "1", "--out", str(tmp_path / "hooks.json")]) == 0
    result = json.loads((tmp_path / "hooks.json").read_text())
    assert set(result["step"]["models"]) == set(step.MODEL_NAMES) and result["layouts"] == {}
    assert all("ranks" not in m for m in result["step"]["models"].values())  # one process only on the CPU
    assert "A whole DDP step per hook on the CPU" in (tmp_path / "hooks.md").read_text()
    assert "step" in hooks.PARTS and "step" not in hooks.CPU_PARTS  # by default on CUDA only
