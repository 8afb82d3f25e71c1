"""Accelerate 1.16.0 with our hook: examples/accelerate_train.py on 2 CPU processes started by ``accelerate launch``
(accelerate_worker.py, run once for every test here).

ACP-SGD at SGD momentum 0.9: the weights equal our own loop's (DDP + ``sylvie_comm.ddp.register`` on the batches
Accelerate hands each process) bit for bit; 1 epoch, ``save_state``, a new Accelerator that ``load_state``s and
trains the 2nd equals 2 epochs straight, bit for bit; the one file Accelerate writes from the main process holds
both ranks' states; the hooks Accelerate would drop or put in our place are refused with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sylvie_comm.integrations.accelerate import FORMAT, PerRankState, own_state, register
from tests.dist_utils import free_port
from tests.integrations.launcher import launch

WORKER = Path(__file__).with_name("accelerate_worker.py")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("accelerate")
    # --multi_gpu: torchrun's launcher (with --cpu, accelerate launch starts one process); the script asks for the CPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(WORKER), str(out)]  # fmt: skip
    launch(cmd, out, TIMEOUT_S, env={"HF_HOME": str(out / "hf")})  # no accelerate config of this machine's
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"out": out, "ranks": ranks}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.multiprocess
def test_it_trains_with_our_hook_and_equals_our_own_loop_bit_for_bit(run: dict[str, Any]) -> None:
    for r, res in enumerate(run["ranks"]):
        straight = res["straight"]
        assert (straight["world_size"], straight["rank"], straight["steps"]) == (2, r, 44)  # 2 x 22 batches
        assert 0 < straight["bytes_sent"] < straight["bytes_uncompressed"] / 4, straight
        assert _max_diff(straight["weights"], res["own"]) == 0.0, r


@pytest.mark.multiprocess
def test_load_state_resumes_bit_for_bit(run: dict[str, Any]) -> None:
    for r, res in enumerate(run["ranks"]):
        assert res["resumed"]["steps"] == 44  # the hook's step counter came back with its state
        assert _max_diff(res["straight"]["weights"], res["resumed"]["weights"]) == 0.0, r
        assert _max_diff(res["straight"]["weights"], res["first"]["weights"]) > 0  # the 2nd epoch did train


@pytest.mark.multiprocess
def test_the_main_process_file_holds_every_rank_state(run: dict[str, Any]) -> None:
    folder = run["out"] / "ckpt" / "epoch1"
    blob = torch.load(folder / "custom_checkpoint_0.pkl", weights_only=True)
    assert (blob["format"], blob["world_size"]) == (FORMAT, 2)
    states = [own_state(blob, r, 2) for r in (0, 1)]
    assert [(s["rank"], s["step"]) for s in states] == [(0, 22), (1, 22)]
    residuals = [{n: p["residual"] for n, p in s["params"].items()} for s in states]
    assert residuals[0].keys() == residuals[1].keys() and residuals[0]
    assert any(not torch.equal(residuals[0][n], residuals[1][n]) for n in residuals[0])  # per rank, truly
    with pytest.raises(ValueError, match="compression state of 2 ranks and this run has 3; each rank resumes its own"):
        own_state(blob, 0, 3)


@pytest.mark.multiprocess
def test_a_hook_accelerate_would_drop_or_register_itself_is_refused(run: dict[str, Any]) -> None:
    for res in run["ranks"]:
        traps = res["traps"]
        assert traps["dropped"] == {"registered": 0, "calls": 0}  # Accelerate's own silence, shown
        for name, value in (("function", "<function counting_hook"), ("string", "'fp16'")):
            assert f"DistributedDataParallelKwargs(comm_hook={value}" in traps[name]
            assert "drops such a comm_hook without registering anything" in traps[name]
        assert "makes Accelerate register its own communication hook" in traps["enum"]
        assert "pass the model prepare() returned" in traps["unwrapped"]


def test_one_process_and_a_bare_model_are_explained() -> None:
    single = SimpleNamespace(ddp_handler=None, distributed_type="NO", num_processes=1)
    with pytest.raises(TypeError, match=r"only one process runs, and `accelerate launch --cpu --num_processes N` "
                                        r"starts one, not N: launch with `--multi_gpu"):  # fmt: skip
        register(single, torch.nn.Linear(2, 2), "acpsgd")


def test_per_rank_state_checks_what_it_wraps_and_loads() -> None:
    with pytest.raises(TypeError, match="expected a state with state_dict"):
        PerRankState(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_world_change must be 'error' or 'fresh'"):
        PerRankState(SimpleNamespace(state_dict=dict, load_state_dict=print), on_world_change="keep")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"expected every rank's compression state .*got a mapping of \['codec', 'rank'\]"
    ):
        own_state({"codec": "acpsgd", "rank": 0}, 0, 2)
    with pytest.raises(ValueError, match="made on a rank that received no other rank's state"):
        own_state({"format": FORMAT, "world_size": 2, "ranks": None}, 1, 2)
