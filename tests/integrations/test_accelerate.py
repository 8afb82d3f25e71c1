"""Accelerate 1.16.0 with our hook: examples/accelerate_train.py on 2 CPU processes started by ``accelerate launch``
(accelerate_worker.py, run once for every test here).

ACP-SGD at SGD momentum 0.9: the weights equal our own loop's (DDP + ``sylvie_comm.ddp.register`` on the batches
Accelerate hands each process) bit for bit; 1 epoch, ``save_state``, a new Accelerator that ``load_state``s and
trains the 2nd equals 2 epochs straight, bit for bit, across a check of the compression monitor (at its defaults,
and adapting the ranks at a check just before the checkpoint and at one after it), with the monitor's checks,
decisions and figures; the one file written from the main process
(``sylvie_comm_state.pt``) holds both ranks' states; the hooks Accelerate would drop or put in our place are refused
with the reason.

In one process (a real Accelerator over a process group of one): that file, replaced by a pickle that runs code
when unpickled, is refused by ``load_state`` and the code does not run (Accelerate unpickles its custom objects
with ``weights_only=False``, so the state is not one of them); every hook's state reads back with
``weights_only=True``; the file's checks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.integrations.accelerate import (
    FORMAT,
    STATE_FILE,
    PerRankState,
    checkpoint_with,
    own_state,
    read_state_file,
    register,
    state_file,
)
from tests.dist_utils import free_port
from tests.integrations.launcher import launch
from tests.integrations.test_lightning import assert_same_monitor

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
def test_the_example_logs_the_compression_figures_through_the_accelerator(run: dict[str, Any]) -> None:
    """sylvie_comm.accelerate.log after each epoch: the ratio, the bytes and the monitor's figures, as stats()."""
    for res in run["ranks"]:
        straight = res["straight"]
        logged = straight["logged"]
        assert logged["sylvie_comm/bytes_sent"] == straight["bytes_sent"]
        assert logged["sylvie_comm/compression_ratio"] > 4
        assert logged["sylvie_comm/monitor/checks"] == straight["monitor"]["checks"]


@pytest.mark.multiprocess
def test_load_state_resumes_bit_for_bit(run: dict[str, Any]) -> None:
    """The monitor at its defaults: its check at step 32 falls after the checkpoint (after 22 steps), in the resumed
    run."""
    for r, res in enumerate(run["ranks"]):
        assert res["resumed"]["steps"] == 44  # the hook's step counter came back with its state
        assert _max_diff(res["straight"]["weights"], res["resumed"]["weights"]) == 0.0, r
        assert _max_diff(res["straight"]["weights"], res["first"]["weights"]) > 0  # the 2nd epoch did train
        assert (res["first"]["monitor"]["checks"], res["straight"]["monitor"]["checks"]) == (1, 2), r
        assert_same_monitor(res["straight"]["monitor"], res["resumed"]["monitor"], r)


@pytest.mark.multiprocess
def test_load_state_resumes_bit_for_bit_across_the_monitor_s_adaptation(run: dict[str, Any]) -> None:
    """Checks at steps 7 and 12 (of 0-15) that adapt (accelerate_worker.ADAPT_MONITOR), the checkpoint after 8
    steps: the first check's decisions apply after the resume, the second check falls in the resumed run."""
    for r, res in enumerate(run["ranks"]):
        straight, first, resumed = (res["adapting"][k] for k in ("straight", "first", "resumed"))
        assert (first["steps"], resumed["steps"]) == (8, 16), r
        assert _max_diff(straight["weights"], resumed["weights"]) == 0.0, r
        assert (first["saved"]["checks"], straight["monitor"]["checks"]) == (1, 2), r
        assert len(first["saved"]["events"]) < len(straight["monitor"]["adapted"]), (r, straight["monitor"])
        assert any("rank 2 -> 4" in event for event in straight["monitor"]["adapted"]), straight["monitor"]
        assert_same_monitor(straight["monitor"], resumed["monitor"], r, every=False)


@pytest.mark.multiprocess
def test_the_main_process_file_holds_every_rank_state(run: dict[str, Any]) -> None:
    folder = run["out"] / "ckpt" / "epoch1"
    blob = read_state_file(folder / STATE_FILE)  # torch.load(weights_only=True)
    assert torch.load(folder / "custom_checkpoint_0.pkl", weights_only=True) == {"epoch": 1}  # the example's own
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


# ---------------------------------------------------------------------------------------------- one process


class RunsCode:
    """Unpickled, it runs code (makes the folder ``marker``): what a tampered checkpoint file can hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.fixture
def one_process(tmp_path: Path) -> Iterator[None]:
    """A default process group of one (gloo) and a fresh Accelerate state, both undone afterwards."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    if dist.is_initialized():
        pytest.skip("a default process group is already set up in this process")
    environ = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def _holding_our_state(folder: Path) -> list[Path]:
    """The files of ``folder`` that hold sylvie_comm's per-rank state (read with weights_only=True)."""
    found = []
    for path in sorted(folder.iterdir()):
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            continue
        if isinstance(blob, dict) and blob.get("format") == FORMAT:
            found.append(path)
    return found


def test_a_tampered_state_file_is_refused_by_load_state_and_runs_no_code(one_process: None, tmp_path: Path) -> None:
    """save_state, load_state: our state round-trips; then the file holding it replaced by a pickle that runs code
    on unpickling: load_state refuses it, naming the file, and the code does not run."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = nn.parallel.DistributedDataParallel(accelerator.prepare(nn.Linear(8, 4)))
    state = register(accelerator, model, "acpsgd", rank=2, warmup_steps=2)
    steps = 4
    try:
        for _ in range(steps):  # past the warm-up: residuals in the state
            model(torch.randn(16, 8)).square().sum().backward()
        folder = tmp_path / "ckpt"
        accelerator.save_state(str(folder))
        ours = _holding_our_state(folder)
        assert len(ours) == 1, sorted(p.name for p in folder.iterdir())
        accelerator.load_state(str(folder))
        assert state.stats()["steps"] == steps

        marker = tmp_path / "marker"
        torch.save(RunsCode(marker), ours[0])
        with pytest.raises(Exception) as err:
            accelerator.load_state(str(folder))
        assert not marker.exists(), f"loading {ours[0].name} ran the code a tampered checkpoint put there"
        assert err.type is ValueError and "refused" in str(err.value), err.value
        assert str(ours[0]) in str(err.value) and "weights_only=True" in str(err.value)
        assert "unsupported GLOBAL" in str(err.value) and "mkdir" in str(err.value)  # torch's reason, one line
        assert ours[0].name == STATE_FILE and not list(folder.glob("custom_checkpoint_*"))
    finally:
        state.close()


def test_every_hooks_state_reads_back_with_weights_only(one_process: None, tmp_path: Path) -> None:
    """What read_state_file accepts: every hook's state after its warm-up is tensors and plain values only."""
    from sylvie_comm.integrations.ddp import HOOKS
    from sylvie_comm.integrations.ddp import register as ddp_register

    for name in sorted(HOOKS):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)))
        per_rank = PerRankState(ddp_register(model, name, warmup_steps=2))
        try:
            for _ in range(4):
                model(torch.randn(8, 8)).square().sum().backward()
            torch.save(per_rank.state_dict(), tmp_path / name)
            per_rank.load_state_dict(read_state_file(tmp_path / name))
        finally:
            per_rank.state.close()  # type: ignore[attr-defined]


class FakeAccelerator(SimpleNamespace):
    """What checkpoint_with reads of an accelerator: its two pre-hook registries and who writes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(hooks=[], is_main_process=True, is_local_main_process=True, **kw)

    def register_save_state_pre_hook(self, hook: Any) -> str:
        self.hooks.append(hook)
        return "save"

    def register_load_state_pre_hook(self, hook: Any) -> str:
        self.hooks.append(hook)
        return "load"


def test_the_state_file_is_checked_before_it_is_read(tmp_path: Path) -> None:
    """Missing (and where an earlier sylvie_comm left it), not a regular file (a FIFO is never opened), not a
    torch.save file: each refused naming the file; save_on_each_node needs everywhere=True."""
    per_rank = PerRankState(SimpleNamespace(state_dict=dict, load_state_dict=print))  # type: ignore[arg-type]
    accelerator = FakeAccelerator()
    assert checkpoint_with(accelerator, per_rank) == ("save", "load")
    _, load = accelerator.hooks
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"epoch": 1}, folder / "custom_checkpoint_0.pkl")
    torch.save({"format": FORMAT, "world_size": 1, "ranks": [{}]}, folder / "custom_checkpoint_1.pkl")
    with pytest.raises(FileNotFoundError, match=rf"{folder / STATE_FILE} is missing; expected sylvie_comm's") as err:
        load([], str(folder))
    assert f"{folder / 'custom_checkpoint_1.pkl'} holds it" in str(err.value) and f"rename it to {STATE_FILE}" in str(
        err.value
    )
    if hasattr(os, "mkfifo"):
        os.mkfifo(folder / STATE_FILE)
        with pytest.raises(ValueError, match=rf"{folder / STATE_FILE} is not a regular file \(prw"):
            load([], str(folder))  # refused by its stat: opening it would wait for a writer
        os.unlink(folder / STATE_FILE)
    (folder / STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"{folder / STATE_FILE} refused: torch.load\(weights_only=True\) cannot"):
        read_state_file(folder / STATE_FILE)
    (folder / STATE_FILE).write_bytes((folder / "custom_checkpoint_0.pkl").read_bytes()[:100])  # cut short
    with pytest.raises(ValueError, match=rf"{folder / STATE_FILE} is not a torch.save file \(PytorchStreamReader"):
        read_state_file(folder / STATE_FILE)
    each_node = FakeAccelerator(project_configuration=SimpleNamespace(save_on_each_node=True))
    with pytest.raises(ValueError, match=r"save_on_each_node=True.*PerRankState\(\.\.\., everywhere=True\)"):
        checkpoint_with(each_node, per_rank)


def test_states_registered_on_one_accelerator_each_get_their_file(one_process: None, tmp_path: Path) -> None:
    """Two prepared models, two hooks: their states go to sylvie_comm_state.pt and sylvie_comm_state_1.pt, in
    registration order, and each comes back to its own."""
    loaded: dict[str, Any] = {}

    def local(name: str, value: float) -> PerRankState:
        return PerRankState(SimpleNamespace(state_dict=lambda: {"x": torch.tensor([value])},  # type: ignore[arg-type]
                                            load_state_dict=lambda s: loaded.__setitem__(name, s)))  # fmt: skip

    accelerator = FakeAccelerator()
    checkpoint_with(accelerator, local("a", 1.0))
    checkpoint_with(accelerator, local("b", 2.0))
    save_a, load_a, save_b, load_b = accelerator.hooks
    save_a([], [], str(tmp_path))
    save_b([], [], str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("sylvie_comm_state*")) == [STATE_FILE, state_file(1)]
    assert state_file(1) == "sylvie_comm_state_1.pt"
    load_b([], str(tmp_path))
    load_a([], str(tmp_path))
    assert {k: v["x"].item() for k, v in loaded.items()} == {"a": 1.0, "b": 2.0}
