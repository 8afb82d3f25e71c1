"""``sylvie-comm`` from the checkout: argument checks, ``bench kernels`` output, the example scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sylvie_comm import cli
from sylvie_comm.bench import kernels as bk

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KINETO_")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.parametrize(
    ("text", "sizes"), [("64K", (65536,)), ("1M,16M", (1 << 20, 16 << 20)), ("1000", (1000,)), ("1g", (1 << 30,))]
)
def test_sizes(text: str, sizes: tuple[int, ...]) -> None:
    assert cli._sizes(text) == sizes


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "kernels", "--sizes", "0"],
        ["bench", "kernels", "--sizes", "1X"],
        ["bench", "kernels", "--threads", "0"],
        ["demo", "--steps", "0"],
        ["demo", "--gnn-nproc", "two"],
    ],
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_bench_kernels_prints_only_the_report(tmp_path: Path) -> None:
    """Two sizes, one thread: stdout is the table and the path, stderr one progress line per size.

    torch's profiler (used for peak memory) would add two lines of its own per measurement.
    """
    out = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "sylvie_comm.bench", "kernels", "--sizes", "4K,64K", "--threads", "1",
           "--min-time", "0.01", "--ref-elems", "4096", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    results = json.loads(out.read_text())
    assert proc.stdout == f"{bk.format_table(results)}\n\nwrote {out}\n"
    assert proc.stderr.splitlines() == [
        "  measuring 4,096 elements, 1 thread(s) ...",
        "  measuring 65,536 elements, 1 thread(s) ...",
    ]
    # Quiet, and still measuring: encodes allocate their output, decodes into a preallocated tensor nothing.
    for run in results["runs"]:
        peaks = {o["op"]: o["kernel_peak_bytes"] for o in run["ops"]}
        assert all(peaks[op] > 0 for op in peaks if op.endswith("encode")), peaks
        assert all(peaks[op] == 0 for op in peaks if op.endswith("decode")), peaks


@pytest.mark.multiprocess
def test_ddp_example_runs_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--codec", "acpsgd", "--rank", "4", "--steps",
           "5", "--no-progress", "--json-out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["codec"], result["steps"], result["world_size"]) == ("acpsgd", 5, 1)
    assert 0 <= result["accuracy"] <= 100
    assert proc.stdout.startswith("acpsgd: accuracy ")


def _torchrun_example(tmp_path: Path, script: str, *args: str) -> tuple[dict[str, Any], str]:
    """``examples/<script> args`` on 2 processes under torchrun: rank 0's JSON result and the standard output."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / script), *args, "--json-out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.multiprocess
def test_fsdp_example_runs_under_torchrun(tmp_path: Path) -> None:
    result, stdout = _torchrun_example(tmp_path, "fsdp_train.py", "--codec", "fp16", "--steps", "5")
    assert (result["codec"], result["steps"], result["world_size"]) == ("fp16", 5, 2)
    assert 0 < result["bytes_sent"] < result["bytes_uncompressed"] and result["codec_state_bytes"] == 0
    assert stdout.startswith("fp16: accuracy ")


@pytest.mark.multiprocess
def test_diloco_example_runs_under_torchrun(tmp_path: Path) -> None:
    result, stdout = _torchrun_example(tmp_path, "diloco_train.py", "--sync-every", "8", "--steps", "32")
    assert (result["codec"], result["steps"], result["world_size"], result["outer_steps"]) == ("qsgd", 32, 2, 4)
    assert result["bytes_sent"] > 0 and result["reduction_vs_ddp"] > 8
    assert stdout.startswith("DiLoCo[qsgd], H=8: accuracy ")


@pytest.mark.multiprocess
def test_gnn_example_runs_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "gnn.json"
    cmd = [sys.executable, str(ROOT / "examples" / "gnn_full_graph.py"), "--nodes", "400", "--epochs", "2",
           "--bits-fwd", "1", "--bits-bwd", "1", "--staleness", "1", "--backend", "torch",
           "--parts-dir", str(tmp_path / "parts"), "--no-progress", "--json-out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["config"], result["epochs"], result["world_size"], result["nodes"]) == ("q1/q1 S=1", 2, 1, 400)
    assert proc.stdout.startswith("q1/q1 S=1: test accuracy ")


def test_bench_quality_hands_its_options_over_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sylvie-comm bench quality --workload cnn --variants plain csgd`: quality.main gets them as typed."""
    from sylvie_comm import cli
    from sylvie_comm.bench import quality

    seen: list[list[str]] = []
    monkeypatch.setattr(quality, "main", lambda argv: seen.append(list(argv)))
    argv = ["bench", "quality", "--workload", "cnn", "--optimizer", "sgd", "--variants", "plain", "csgd"]
    assert cli.main(argv) == 0
    assert seen == [argv[2:]]


def test_bench_quality_refuses_zero_steps(capsys: pytest.CaptureFixture[str]) -> None:
    from sylvie_comm import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "quality", "--workload", "cnn", "--steps", "0"])
    assert exc.value.code == 2
    assert "--steps must be an integer >= 1, got 0" in capsys.readouterr().err
