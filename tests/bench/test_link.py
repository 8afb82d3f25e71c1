"""``sylvie-comm bench ddp --link``: every codec in one lab, one record with consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sylvie_comm.bench import horovod as bh
from sylvie_comm.bench import lab as bl
from sylvie_comm.bench import link

# The DDP lab benchmark: a lab with namespaces where root, the loopback fallback elsewhere (both checked).
pytestmark = [pytest.mark.multiprocess, pytest.mark.lab]


def test_two_workers_two_codecs_two_rounds_on_a_shaped_link(tmp_path):
    out = tmp_path / "ddp-link.json"
    cmd = [sys.executable, "-m", "sylvie_comm.cli", "bench", "ddp", "--link", "100mbit", "--workers", "2",
           "--steps", "2", "--rounds", "2", "--codecs", "none,acpsgd,acpsgd:rank=2,no-comm", "--model", "small",
           "--timeout", "120", "--no-horovod", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    if bl.unavailable_reason() is None:
        assert first.startswith("lab: 2 workers in network namespaces"), first
    else:
        assert first.startswith("lab: LOOPBACK FALLBACK"), first
    rec = json.loads(out.read_text())
    assert rec["link"] == "100mbit" and rec["workers"] == 2
    assert list(rec["codecs"]) == ["none", "acpsgd", "acpsgd:rank=2", "no-comm"]
    assert rec["horovod_skipped"] == "--no-horovod" and {c["launcher"] for c in rec["codecs"].values()} == {"torchrun"}
    assert "--nnodes 2 --node-rank 0 --nproc-per-node 1" in rec["lab"]["launch"]["torchrun"]
    assert set(rec["machine"]) >= {"cpu_count", "cpu_model", "torch", "python", "sylvie_comm"}
    codecs = rec["codecs"]
    for c in codecs.values():
        assert len(c["step_s"]) == 4 and all(t > 0 for t in c["step_s"]) and c["median_s"] > 0  # 2 rounds x 2
        assert len(c["round_median_s"]) == 2
        assert c["min_s"] <= c["median_s"] <= c["max_s"]
        assert c["samples_per_s"] == pytest.approx(2 * rec["batch_per_worker"] / c["median_s"])
    for name in ("none", "acpsgd"):
        assert codecs[name]["encode_decode_s"] is not None and codecs[name]["encode_decode_s"] >= 0
    assert codecs["acpsgd"]["hook_bytes_per_step"] < codecs["none"]["hook_bytes_per_step"] / 10
    # A codec's options reach its hook: rank 2 sends fewer factor bytes than the benchmark's rank 4.
    assert codecs["acpsgd:rank=2"]["label"] == "sylvie acpsgd (rank=2)"
    assert codecs["acpsgd:rank=2"]["hook_bytes_per_step"] < codecs["acpsgd"]["hook_bytes_per_step"]
    bound = codecs["no-comm"]  # no collective in its hook: no bytes, no stats, the label says what it is
    assert bound["hook_bytes_per_step"] is None and bound["encode_decode_s"] is None
    assert bound["label"] == "DDP, a hook that sends nothing (bound)"
    if rec["lab"]["shaped"]:  # bytes that really left eth0 agree
        assert codecs["acpsgd"]["eth0_tx_bytes_per_step"] < codecs["none"]["eth0_tx_bytes_per_step"] / 5
        # Only the barriers' bytes: far fewer than even acpsgd's factors.
        assert bound["eth0_tx_bytes_per_step"] < codecs["acpsgd"]["eth0_tx_bytes_per_step"]
    # No ddp or torch-powersgd in the run: S-SGD is our plain all-reduce, no PyTorch PowerSGD column.
    assert rec["baselines"] == {"s-sgd": "none", "torch-powersgd": None}
    for c in codecs.values():
        assert c["speedup_vs_ssgd"] == pytest.approx(codecs["none"]["median_s"] / c["median_s"])
        assert c["speedup_vs_torch_powersgd"] is None
    table = proc.stdout
    assert "| sylvie acpsgd r4 |" in table and f"{codecs['acpsgd']['speedup_vs_ssgd']:.2f}x" in table
    if rec["lab"]["shaped"]:
        prefix = first.split("network namespaces ")[1].split("0..1")[0]
        assert prefix.startswith(bl.LAB_PREFIX) and bl.namespaces(prefix) == []


@pytest.mark.skipif(bh.available() is not None, reason=f"no Horovod here: {bh.available()}")
def test_horovod_rows_run_in_the_same_lab_beside_the_ddp_rows():
    rows = ["hvd-fp32", "hvd-sylvie-acpsgd"]
    rec = link.run("100mbit", 2, 2, ["none"], model="small", horovod=True, horovod_rows=rows, timeout=150, echo=None,
                   progress=False)  # fmt: skip
    codecs = rec["codecs"]
    assert list(codecs) == ["none", "hvd-fp32", "hvd-sylvie-acpsgd"] and rec["horovod_error"] is None
    assert [c["launcher"] for c in codecs.values()] == ["torchrun", "horovodrun", "horovodrun"]
    for c in codecs.values():
        assert len(c["step_s"]) == 2 and c["min_s"] <= c["median_s"] <= c["max_s"]
        assert c["samples_per_s"] == pytest.approx(2 * rec["batch_per_worker"] / c["median_s"])
        assert c["speedup_vs_ssgd"] == pytest.approx(codecs["none"]["median_s"] / c["median_s"])
    # Same model, data and optimizer: the first loss (before any update) is the DDP rows'.
    assert codecs["hvd-fp32"]["loss_first"] == pytest.approx(codecs["none"]["loss_first"], rel=1e-5)
    assert codecs["hvd-fp32"]["hook_bytes_per_step"] is None
    assert codecs["hvd-sylvie-acpsgd"]["hook_bytes_per_step"] < codecs["none"]["hook_bytes_per_step"] / 10
    assert codecs["hvd-sylvie-acpsgd"]["label"] == "sylvie_comm.horovod.DistributedOptimizer acpsgd r4"
    launch = rec["lab"]["launch"]["horovodrun"]
    if rec["lab"]["shaped"]:
        ns = rec["lab"]["namespaces"]
        assert launch.startswith(f"ip netns exec {ns[0]} ") and "--network-interface eth0" in launch
        assert codecs["hvd-sylvie-acpsgd"]["eth0_tx_bytes_per_step"] < codecs["hvd-fp32"]["eth0_tx_bytes_per_step"] / 5
    table = link.format_table(rec)
    assert "| sylvie_comm.horovod.DistributedOptimizer acpsgd r4 | horovodrun |" in table
    assert "| sylvie none | torchrun |" in table


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"unknown codec 'zip'; valid: ddp, torch-fp16, torch-powersgd, no-comm, none"):
        link.check_codecs(["none", "zip"])
    assert link.check_codecs(["acpsgd", "acpsgd:monitor.period=0", "acpsgd"]) == ["acpsgd", "acpsgd:monitor.period=0"]
    with pytest.raises(ValueError, match=r"unknown codec 'zip'"):
        link.check_codecs(["zip:bits=2"])
    with pytest.raises(ValueError, match=r"codec 'ddp:bits=2': 'ddp' takes no options"):
        link.check_codecs(["ddp:bits=2"])
    with pytest.raises(ValueError, match=r"option 'bits' is not key=value"):
        link.check_codecs(["qsgd:bits"])
    with pytest.raises(ValueError, match=r"unknown link 'fast'; valid: 10mbit, 100mbit, 1gbit, 10gbit, none"):
        link.run("fast", 2, 2, ["none"])
    with pytest.raises(ValueError, match="warmup must be >= 3"):
        link.run("none", 2, 2, ["acpsgd"], warmup=1)
    with pytest.raises(ValueError, match=r"unknown Horovod row 'hvd-zip'; valid: hvd-fp32, hvd-fp16"):
        link.run("none", 2, 2, ["none"], horovod_rows=["hvd-zip"])
    proc = subprocess.run([sys.executable, "-m", "sylvie_comm.cli", "bench", "ddp", "--workers", "2"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--workers need(s) --link" in proc.stderr
