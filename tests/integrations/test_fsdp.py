"""FSDP2 (``fully_shard``) with our reduce-scatter, and HSDP with our replica all-reduce, on gloo.

2 ranks for the reduce-scatter, 4 (2 replicas of 2 shards) for HSDP: plain averaging bit-identical to
FSDP's own, digits within one point of plain FSDP2 at SGD momentum 0.9 and Adam for every lossy codec, one-bit
at least 16x under the fp32 reduce-scatter, a resumed run bit-identical, and the errors users meet.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import sylvie_comm
from sylvie_comm.algorithms import ALGORITHMS
from tests.dist_utils import run_distributed
from tests.integrations import fsdp_worker as fw

pytestmark = pytest.mark.multiprocess

SHARDED = [n for n, cls in ALGORITHMS.items() if cls.record.shards]  # the codecs with a reduce-scatter form
# Those whose reduce-scatter is the fp32 average itself (none: bit-identical to FSDP's own, tested below) or that
# average rounded to 16 bits (tests/algorithms/test_reduce_scatter.py): no training run can tell them from plain
# FSDP2 on digits. The others lose information each step and are trained to an accuracy here.
ROUNDING = ("none", "fp16", "bf16")
LOSSY = [n for n in SHARDED if n not in ROUNDING]
OPTIMIZERS = ("sgd_momentum", "adam")


def test_a_model_without_fsdp_units_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Linear has no FSDP units; call fully_shard\(\)"):
        sylvie_comm.fsdp.register(nn.Linear(3, 3), "fp16")


def _equal(rank: int, world: int, hsdp: bool, force_sum: bool) -> dict[str, Any]:
    return fw.equal_to_fsdp(rank, world, hsdp, force_sum)


@pytest.mark.parametrize(("hsdp", "force_sum"), [(False, False), (False, True), (True, False)],
                         ids=["fsdp", "fsdp-sum", "hsdp"])  # fmt: skip
def test_plain_averaging_is_bit_identical_to_fsdp_own(hsdp: bool, force_sum: bool) -> None:
    """Codec ``none`` is FSDP2's own reduce-scatter, bit for bit, whether FSDP asks for AVG or (with
    ``set_force_sum_reduction_for_comms``) SUM; with ``replicas`` it is FSDP2's own HSDP."""
    world = 4 if hsdp else 2
    for r in run_distributed(_equal, world, hsdp, force_sum, timeout=300):
        assert r["bitwise"]
        assert r["stats"]["bytes_sent"] == r["stats"]["bytes_uncompressed"] > 0


def _convergence(rank: int, world: int, optimizer: str) -> dict[str, Any]:
    out: dict[str, Any] = {"fsdp": fw.train(rank, world, None, {}, optimizer)}
    for codec in LOSSY:
        out[codec] = fw.train(rank, world, codec, {}, optimizer)
    if optimizer == "adam":
        out["onebit-mean"] = fw.train(rank, world, "onebit", {"scale": "mean"}, "adam")
    return out


@pytest.mark.quality
@pytest.mark.parametrize("optimizer", OPTIMIZERS)  # one test each, so that a parallel run can spread them
def test_every_lossy_codec_trains_digits_within_a_point_of_plain_fsdp(optimizer: str) -> None:
    assert set(ROUNDING) <= set(SHARDED) and LOSSY, (SHARDED, LOSSY)  # a new reduce-scatter form is trained here
    res = run_distributed(_convergence, 2, optimizer, timeout=1200)[0]
    base = res["fsdp"]["accuracy"]
    row = {c: round(res[c]["accuracy"] - base, 2) for c in LOSSY}
    print(f"\n{optimizer}: plain FSDP2 {base:.2f}%, gaps {row}")
    assert base > 96, (optimizer, base)
    for codec in LOSSY:
        # One-bit's RMS scale (its default) costs Adam on digits 7 of the 397 test digits here (95.47 against
        # plain FSDP2's 97.23; under DDP 95.47 against 96.98); its mean scale keeps Adam's accuracy (below).
        bound = -2.0 if (optimizer, codec) == ("adam", "onebit") else -1.0
        assert res[codec]["accuracy"] >= base + bound, (optimizer, codec, row)
    if optimizer == "adam":
        mean_scale = res["onebit-mean"]["accuracy"]
        print(f"adam/onebit with scale 'mean': {mean_scale:.2f}%")
        assert mean_scale >= base - 1.0
        return
    for codec in LOSSY:
        stats = res[codec]["stats"]["last_step"]
        assert stats["bytes_sent"] <= stats["bytes_uncompressed"], codec
    if "onebit" in SHARDED:
        last = res["onebit"]["stats"]["last_step"]
        assert last["bytes_uncompressed"] >= 16 * last["bytes_sent"], last


def _hsdp(rank: int, world: int) -> dict[str, Any]:
    out = {"hsdp": fw.train(rank, world, None, {}, "sgd_momentum", steps=200, hsdp=True)}
    for codec in ("acpsgd", "powersgd"):
        out[codec] = fw.train(rank, world, codec, {}, "sgd_momentum", steps=200, hsdp=True)
    out["resume"] = fw.resume(rank, world, "acpsgd", {}, "adam", hsdp=True)
    return out


@pytest.mark.quality
def test_hsdp_low_rank_replica_all_reduce_trains_within_a_point() -> None:
    """4 ranks, 2 replicas of 2 shards: FSDP's own HSDP against fully_shard on the shard dimension with
    ACP-SGD / PowerSGD averaging each rank's shard (a block of rows of each weight) across the replicas; a
    resumed ACP-SGD run (Adam) bit-identical."""
    res = run_distributed(_hsdp, 4, timeout=1200)
    base = res[0]["hsdp"]["accuracy"]
    print(f"\nHSDP {base:.2f}%: " + ", ".join(f"{c} {res[0][c]['accuracy']:.2f}%" for c in ("acpsgd", "powersgd")))
    assert base > 95, base
    for codec in ("acpsgd", "powersgd"):
        assert res[0][codec]["accuracy"] >= base - 1.0, (codec, res[0][codec]["accuracy"], base)
        last = res[0][codec]["stats"]["last_step"]
        assert last["bytes_sent"] * 2 < last["bytes_uncompressed"], (codec, last)
    for r in res:  # ACP-SGD's factors and residuals of each rank's shard, checkpointed and resumed
        assert r["resume"]["bitwise"], r["resume"]["max_diff"]
        assert r["resume"]["state_names"] == ["0.weight", "2.weight", "4.weight"], r["resume"]["state_names"]


def _resume(rank: int, world: int, cases: list[tuple[str, dict[str, Any], str]]) -> dict[str, Any]:
    return {f"{c}/{o}": fw.resume(rank, world, c, opts, o) for c, opts, o in cases}


def test_a_resumed_run_is_bit_identical() -> None:
    cases = [(c, {}, "adam" if c == "fp16" else "sgd_momentum") for c in SHARDED]
    for r in run_distributed(_resume, 2, cases, timeout=600):
        for key, res in r.items():
            assert res["bitwise"], (key, res["max_diff"])
            assert set(res["step"]) == {"0", "2", "4"} and set(res["step"].values()) == {5}, res["step"]


def _resume_across(rank: int, world: int, cases: list[tuple[str, str]], k: int) -> dict[str, Any]:
    return {f"{c}/{o}": fw.resume(rank, world, c, {}, o, k=k) for c, o in cases}


def test_a_run_resumed_across_a_monitor_check_is_bit_identical() -> None:
    """At the defaults (the monitor on: its first check at step 12, its figures taken on steps 7-11), saved at
    step 8 and resumed to 16: the straight run's bits. (The exact check of a unit smaller than its window once
    all-reduced the unit's own buffer in place while the algorithm encoded it: runs differed from the check on.)"""
    cases = [("onebit", "sgd_momentum"), ("qsgd", "adam")]
    for r in run_distributed(_resume_across, 2, cases, 8, timeout=600):
        for key, res in r.items():
            assert res["bitwise"], (key, res["max_diff"])
            assert res["checks"] == 1, (key, res["checks"])  # the check at step 12 ran in the resumed half


def test_register_errors_name_the_problem_on_every_rank() -> None:
    for res in run_distributed(fw.errors, 2, timeout=300):
        assert "ranks disagree on the configuration: 'warmup_steps' is 2 on rank 0 but 3 on rank 1" in res["disagree"]
        assert "acpsgd: no reduce-scatter form" in res["lowrank"] and "replica all-reduce of HSDP" in res["lowrank"]
        assert "unknown codec 'zip'" in res["unknown"], res["unknown"]
        assert "warmup 'auto'" in res["auto_warmup"], res["auto_warmup"]


def test_per_name_rules_reach_each_parameter_of_the_flat_buffer() -> None:
    for r in run_distributed(fw.rules, 2, timeout=300):
        lay = r["layouts"]
        assert lay["0.weight"] == (False, 2, 64)  # raw; rows of the weight's 64 inputs
        assert lay["2.weight"] == (True, 2, 256) and lay["4.weight"] == (True, 8, 256) and lay["4.bias"][1] == 8
        assert "0.weight" not in r["names"] and "2.weight" in r["names"] and "4.weight" in r["names"]
        assert r["stats"]["last_step"]["compression_ratio"] > 1


def test_the_short_form_is_the_adapter() -> None:
    from sylvie_comm.integrations import fsdp

    assert sylvie_comm.fsdp.register is fsdp.register
    assert torch.distributed.is_available()
