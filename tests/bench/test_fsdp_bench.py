"""``sylvie-comm bench fsdp --link``: FSDP2's rows and ours in one lab, one record with consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from sylvie_comm.bench import fsdp as bf
from sylvie_comm.bench import link
from sylvie_comm.bench.workloads import WORKLOADS
from sylvie_comm.collectives import wire_bytes


def test_the_rows_fsdps_then_ours_then_the_bound():
    assert bf.ROWS == ("fsdp2", "fsdp2-bf16", "none", "fp16", "bf16", "qsgd", "onebit", "no-comm")
    assert bf.check_rows(["none", "fsdp2", "none"]) == ["none", "fsdp2"]
    with pytest.raises(ValueError, match=r"unknown row 'acpsgd'; valid: fsdp2, fsdp2-bf16, none, fp16, bf16, qsgd"):
        bf.check_rows(["acpsgd"])
    with pytest.raises(ValueError, match="no row given"):
        bf.check_rows([])
    assert bf.label("fsdp2") == "FSDP2 fully_shard, fp32 reduce-scatter"
    assert bf.label("fsdp2-bf16") == "FSDP2, MixedPrecisionPolicy(reduce_dtype=bf16)"
    assert bf.label("qsgd") == "sylvie_comm.fsdp qsgd"
    assert bf.label("no-comm") == "FSDP2, comms that send nothing (bound)"


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"unknown link 'fast'"):
        bf.run("fast")
    with pytest.raises(ValueError, match=r"model 'lm' is not one of mlp_17m, small .*out_proj"):
        bf.run("none", model="lm")
    with pytest.raises(ValueError, match="warmup must be >= 3"):
        bf.run("none", rows=["qsgd"], warmup=2)
    with pytest.raises(ValueError, match="workers must be an integer >= 2"):
        bf.run("none", workers=1)
    assert set(bf.MODELS) <= set(WORKLOADS)


def test_the_units_are_each_linear_then_the_root():
    units = bf.shard_units(WORKLOADS["small"].model(0))
    assert units == [("0", [(256, 512), (256,)]), ("2", [(256, 256), (256,)]), ("4", [(10, 256), (10,)]), ("", [])]
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert bf.shard_units(model) == [("0", [(4, 3), (4,)]), ("", [(4,), (4,)])]


def test_the_padding_is_fsdps_own():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_dim0_padded_size

    for shape in [(5, 3), (5,), (2048, 512), (10,), (7, 2, 3)]:
        for world in (2, 3, 4):
            assert bf.padded_numel(shape, world) == _get_dim0_padded_size(torch.Size(shape), world).numel()


def test_the_reduce_scatter_bytes_count_as_wire_bytes_counts_ours():
    units = [("a", [(5, 3), (5,)]), ("b", [(4, 4)]), ("", [])]
    # world 2: a pads dim 0 to 6 (18 + 6 elements), b needs none (16): one reduce-scatter per unit with parameters.
    assert bf.reduce_scatter_bytes(units, 2) == wire_bytes("reduce_scatter", 4 * 24, 2) + wire_bytes(
        "reduce_scatter", 4 * 16, 2
    )
    assert bf.reduce_scatter_bytes(units, 2) == 48 + 32
    assert bf.reduce_scatter_bytes(units, 3) == 2 * (4 * 24) // 3 + 2 * (4 * 24) // 3 == 128  # b: 6 x 4 elements
    assert bf.reduce_scatter_bytes(units, 2, element_size=2) == 40  # a bf16 reduce: half
    assert bf.reduce_scatter_bytes(units, 1) == 0
    # The benchmark's model: every dim 0 is even, so at 2 ranks each rank sends half of the fp32 gradients.
    net = WORKLOADS["mlp_17m"].model(0)
    params = sum(p.numel() for p in net.parameters())
    assert bf.reduce_scatter_bytes(bf.shard_units(net), 2) == wire_bytes("reduce_scatter", 4 * params, 2) == 2 * params


def _rank(t: float, wire: float | None, *, codec: int = 0, rss: float = 500.0, **extra: object) -> dict[str, object]:
    """One rank's figures of one row, as its worker reports them."""
    return {"step_s": [t, t + 0.1, t + 0.2], "encode_decode_s": None if wire is None else 0.01, "hook_bytes": wire,
            "eth0_tx_bytes": 3e6, "loss_first": 2.3, "loss_last": 2.2, "peak_rss_mib": rss, "rss_start_mib": 300.0,
            "param_bytes": 1000, "grad_bytes": 1000, "optimizer_bytes": 1000, "codec_bytes": codec,
            "grad_opt_codec_bytes": 2000 + codec, **extra}  # fmt: skip


UNITS = [("a", [(4, 4)]), ("", [])]  # 64 fp32 bytes: each of 2 ranks sends 32 in a reduce-scatter


def _raw() -> dict[str, list[list[dict[str, object]]]]:
    return {
        "fsdp2": [[_rank(1.0, None), _rank(1.1, None, rss=510.0)]],
        "fsdp2-bf16": [[_rank(0.8, None), _rank(0.8, None)]],
        "qsgd": [[_rank(0.5, 4.0, codec=64, fp32_reduce_scatter_bytes=32), _rank(0.4, 4.0, codec=64)]],
        "onebit": [[{"skipped": "ValueError: onebit: no reduce-scatter form", "rss_start_mib": 300.0}] * 2],
        "no-comm": [[_rank(0.2, None), _rank(0.2, None)]],
    }


def _record(shaped: bool = True) -> dict[str, object]:
    lab = {"shaped": shaped, "fallback_reason": None if shaped else "no root", "banner": "lab: ...",
           "namespaces": None, "launch": {}}  # fmt: skip
    return bf.record(_raw(), UNITS, link="1gbit", workers=2, model="small", steps=3, warmup=3, rounds=1,
                     lab_info=lab, wall=12.0)  # fmt: skip


def test_the_record_from_fabricated_figures():
    rec = _record()
    rows = rec["rows"]
    assert list(rows) == ["fsdp2", "fsdp2-bf16", "qsgd", "onebit", "no-comm"]
    assert rec["benchmark"] == "fsdp-link" and rec["link"] == "1gbit" and rec["baseline"] == "fsdp2"
    assert rec["torch"] == torch.__version__ and rec["date"] and rec["command"]
    assert set(rec["machine"]) >= {"cpu_count", "cpu_model", "torch", "python", "sylvie_comm"}
    assert rec["fp32_reduce_scatter_bytes_per_step"] == 32 and rec["fsdp_units"] == ["a"]
    # Each step takes its slowest rank's time: fsdp2 runs 1.1, 1.2, 1.3 s (median 1.2), qsgd 0.5, 0.6, 0.7 s.
    base = rows["fsdp2"]
    assert base["step_s"] == pytest.approx([1.1, 1.2, 1.3]) and base["median_s"] == pytest.approx(1.2)
    assert rows["qsgd"]["median_s"] == pytest.approx(0.6)
    assert rows["qsgd"]["speedup_vs_fsdp2"] == pytest.approx(2.0)
    assert rows["fsdp2-bf16"]["speedup_vs_fsdp2"] == pytest.approx(1.2 / 0.9)
    assert base["speedup_vs_fsdp2"] == pytest.approx(1.0)
    assert base["samples_per_s"] == pytest.approx(2 * 32 / 1.2)
    # Wire bytes: FSDP's rows from the formula (fp32, then bf16), ours from state.stats(), the bound none.
    assert (base["wire_bytes_per_step"], base["wire_ratio_vs_fp32"], base["wire_bytes_from"]) == (
        32,
        1.0,
        "reduce_scatter_bytes()",
    )
    assert rows["fsdp2-bf16"]["wire_bytes_per_step"] == 16 and rows["fsdp2-bf16"]["wire_ratio_vs_fp32"] == 2.0
    assert rows["qsgd"]["wire_bytes_per_step"] == 4.0 and rows["qsgd"]["wire_ratio_vs_fp32"] == 8.0
    assert rows["qsgd"]["wire_bytes_from"] == "state.stats()" and rows["qsgd"]["fp32_reduce_scatter_bytes"] == 32
    assert rows["no-comm"]["wire_bytes_per_step"] == 0 and rows["no-comm"]["wire_ratio_vs_fp32"] is None
    # Memory: per rank, as reported.
    assert base["peak_rss_mib"] == [500.0, 510.0] and base["codec_bytes"] == [0, 0]
    assert rows["qsgd"]["codec_bytes"] == [64, 64] and rows["qsgd"]["grad_opt_codec_bytes"] == [2064, 2064]
    assert base["eth0_tx_bytes_per_step"] == 3e6
    # The row whose register raised: its error, no figures.
    skipped = {"label": "sylvie_comm.fsdp onebit", "skipped": "ValueError: onebit: no reduce-scatter form"}
    assert rows["onebit"] == skipped
    assert json.loads(json.dumps(rec)) == rec  # JSON as it is


def test_loopback_has_no_eth0_figure_and_no_baseline_without_fsdp2():
    raw = _raw()
    del raw["fsdp2"]
    lab = {"shaped": False, "fallback_reason": "no root", "banner": "", "namespaces": None, "launch": {}}
    rec = bf.record(raw, UNITS, link="none", workers=2, model="small", steps=3, warmup=3, rounds=1, lab_info=lab,
                    wall=1.0)  # fmt: skip
    assert rec["baseline"] is None and rec["rows"]["qsgd"]["speedup_vs_fsdp2"] is None
    assert rec["rows"]["qsgd"]["eth0_tx_bytes_per_step"] is None
    assert "LOOPBACK (not shaped: no root)" in bf.format_table(rec)


def test_the_table_from_fabricated_figures(tmp_path):
    rec = _record()
    table = bf.format_table(rec)
    lines = table.splitlines()
    assert lines[0].startswith("FSDP2 on link 1gbit, 2 workers, small (")
    header = next(line for line in lines if line.startswith("| row |"))
    width = header.count("|")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| row |")]
    assert len(rows) == 5 and all(line.count("|") == width for line in rows)
    qsgd = next(line for line in rows if line.startswith("| sylvie_comm.fsdp qsgd |"))
    assert "| 0.600 | 0.500-0.700 |" in qsgd and "| 2.00x |" in qsgd and "| 8.00x |" in qsgd
    assert qsgd.endswith("| 500/500 |")
    assert "| FSDP2 fully_shard, fp32 reduce-scatter | 1.200 |" in table and "| 1.00x |" in table
    assert "| sylvie_comm.fsdp onebit | skipped (below) |" in table
    assert "skipped onebit: ValueError: onebit: no reduce-scatter form" in table
    path = link.save(rec, tmp_path / "fsdp-link-1gbit.json")
    assert json.loads(path.read_text()) == rec


def test_a_row_whose_register_raises_is_skipped_with_its_error(monkeypatch):
    import torch.distributed as dist

    import sylvie_comm.fsdp

    def refuse(model: nn.Module, codec: str, **options: object) -> None:
        raise ValueError(f"{codec}: no reduce-scatter form yet")

    monkeypatch.setattr(sylvie_comm.fsdp, "register", refuse)
    ticks: list[int] = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = {"model": "small", "warmup": 3, "steps": 2, "collective_timeout": 60.0}
        out = bf._run_row("qsgd", cfg, 0, lambda: ticks.append(1))
    finally:
        dist.destroy_process_group()
    assert out == {"skipped": "ValueError: qsgd: no reduce-scatter form yet"}
    assert len(ticks) == 5  # its steps still move the progress bar


@pytest.mark.multiprocess
def test_the_command_line_needs_a_link_and_known_rows():
    proc = subprocess.run([sys.executable, "-m", "sylvie_comm.cli", "bench", "fsdp"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--link" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "sylvie_comm.cli", "bench", "fsdp", "--link", "none", "--rows", "zip"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "unknown row 'zip'" in proc.stderr


@pytest.mark.multiprocess
def test_a_small_real_run_on_plain_gloo_without_the_lab():
    rows = ["fsdp2", "fsdp2-bf16", "none", "no-comm"]
    rec = bf.run("none", 2, rows, model="small", shaped=False, timeout=300, echo=None, progress=False)
    assert not rec["lab"]["shaped"] and list(rec["rows"]) == rows and rec["baseline"] == "fsdp2"
    assert "--nnodes 2 --node-rank 0 --nproc-per-node 1" in rec["lab"]["launch"]["torchrun"]
    out = rec["rows"]
    fp32 = rec["fp32_reduce_scatter_bytes_per_step"]
    for name, c in out.items():
        assert len(c["step_s"]) == 2 and c["min_s"] <= c["median_s"] <= c["max_s"], name
        assert c["speedup_vs_fsdp2"] == pytest.approx(out["fsdp2"]["median_s"] / c["median_s"])
        assert all(p > s > 0 for p, s in zip(c["peak_rss_mib"], c["rss_start_mib"], strict=True)), name
        assert c["eth0_tx_bytes_per_step"] is None  # loopback
        # Sharded fp32 parameters, their gradients and SGD's momentum: the same bytes on each rank.
        assert c["grad_bytes"] == c["param_bytes"] == c["optimizer_bytes"], name
    # Our plain reduce-scatter counts FSDP's real buffer: the formula's bytes, which it sends as they are.
    assert out["none"]["fp32_reduce_scatter_bytes"] == fp32 == out["none"]["wire_bytes_per_step"]
    assert out["fsdp2"]["wire_bytes_per_step"] == fp32 and out["fsdp2-bf16"]["wire_bytes_per_step"] == fp32 // 2
    assert out["no-comm"]["wire_bytes_per_step"] == 0
    assert out["none"]["codec_bytes"] == out["fsdp2"]["codec_bytes"] == [0, 0]
    # The same weights and batches in every row: the same first loss (the bound's gathered weights are not the model's).
    assert out["none"]["loss_first"] == pytest.approx(out["fsdp2"]["loss_first"], rel=1e-6)
    assert out["fsdp2-bf16"]["loss_first"] == pytest.approx(out["fsdp2"]["loss_first"], rel=1e-6)
    assert "| sylvie_comm.fsdp none |" in bf.format_table(rec)
