"""Checkpoint and resume: a restarted run continues bit for bit; foreign checkpoints are refused.

One distributed run (2 ranks) trains each configuration N epochs straight through and, separately, k
epochs, checkpoints (through torch.save/torch.load), builds a fresh Trainer, loads and trains N - k
more; the tests compare the two, and the refusal cases run in the same processes.

The gradient hook's compression monitor (``grad_hook``) across the checkpoint: MONITOR_RUNS train long enough that a
check of it falls after the checkpoint, at its defaults and adapting.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.gnn import workloads as gw

pytestmark = pytest.mark.multiprocess

EPOCHS = 7
BASE = {"model": "sage", "hidden": 8, "layers": 3, "backend": "torch", "forward": "q1", "backward": "q1"}
Q2 = {"forward": "q2", "backward": "q2", "meta_dtype": "bf16"}
# name -> (config, epochs before the checkpoint)
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "s0": ({**BASE}, 3),
    "s0-ef": ({**BASE, "error_feedback": True}, 3),
    "s1-dropout": ({**BASE, "staleness": 1, "dropout": 0.5}, 3),
    "s1-ef": ({**BASE, "staleness": 1, "error_feedback": True}, 4),
    # The running average of the halo rows (the receiver's smoothing) across the checkpoint.
    "s1-ef-smoothed": ({**BASE, "staleness": 1, "error_feedback": True, "halo_smoothing": 0.5}, 4),
    "s1-ef-acpsgd": ({**BASE, "staleness": 1, "error_feedback": True, "grad_hook": "acpsgd"}, 4),
    # Checkpoint after epoch 4: epoch 5 uses epoch 3's halos (the last synchronous one), epoch 6 is synchronous.
    "s2-sync3-q2-bf16": ({**BASE, **Q2, "staleness": 2, "sync_every": 3, "error_feedback": True}, 5),
}
# The gradient hook's monitor across the checkpoint: one hook step an epoch, 13 epochs (0-12), the checkpoint after 8.
# name -> (config, the monitor's defaults for the run (the trainer takes no monitor settings), epochs before the
# checkpoint). "defaults": the first check at compressed step 10 (epoch 12, warm-up 2), its figures taken on epochs
# 7-12, across the checkpoint. "adapting": checks every 5 compressed steps (epochs 7 and 12), patience 1 and a bound
# every lag exceeds: the check at epoch 7, the last before the checkpoint, doubles the hook's ranks (16 x 16
# matrices: hidden 16), applied at the first resumed epoch, and the one at epoch 12 runs after the resume.
MONITOR_EPOCHS = 13
HOOKED = {**BASE, "hidden": 16, "staleness": 1, "error_feedback": True, "grad_hook": "acpsgd"}
MONITOR_RUNS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "defaults": (HOOKED, {}, 8),
    "adapting": (HOOKED, {"first": 5, "period": 5, "adapt": True, "max_lag": 0.05, "patience": 1}, 8),
}


def _parts(world: int, seed: int = 1) -> list[Any]:
    from sylvie_comm.gnn.partition import partition

    g = gw.small_graph()
    return partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=seed)


def _trainer(part: Any, config: dict[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    """A Trainer and the list its model's outputs (training and evaluation logits) are appended to."""
    from sylvie_comm.gnn.train import TrainConfig, Trainer

    tr = Trainer(part, TrainConfig(**config))
    logits: list[torch.Tensor] = []
    tr.model.register_forward_hook(lambda module, inputs, out: logits.append(out.detach().clone()))
    return tr, logits


def _epochs(tr: Any, n: int) -> list[dict[str, Any]]:
    """n epochs, each followed by an evaluation (which draws q-bit noise too); timings dropped."""
    out = []
    for _ in range(n):
        stats = tr.train_epoch()
        for timing in ("seconds", "compute_s", "halo_wait_s", "halo_exchange_s", "halo_hidden_s"):
            stats.pop(timing)
        out.append({**stats, "eval": tr.evaluate()})
    return out


def _outcome(tr: Any, logits: list[torch.Tensor], history: list[dict[str, Any]]) -> dict[str, Any]:
    stats = tr.stats()
    stats.pop("peak_rss_mb")
    out = {"history": history, "logits": logits, "params": [p.detach().clone() for p in tr.model.parameters()],
           "stats": stats}  # fmt: skip
    tr.close()
    return out


def _save(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _load(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)  # type: ignore[no-any-return]


def _error(fn: Any) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def _resume_worker(rank: int, world: int) -> dict[str, Any]:
    parts = _parts(world)
    out: dict[str, Any] = {"runs": {}}
    checkpoints: dict[str, bytes] = {}
    for name, (config, k) in RUNS.items():
        tr, logits = _trainer(parts[rank], config)
        straight = _outcome(tr, logits, _epochs(tr, EPOCHS))

        tr, logits = _trainer(parts[rank], config)
        first = _epochs(tr, k)
        ckpt = _save(tr.state_dict())
        checkpoints[name] = ckpt
        state = tr.state_dict()
        summary = {
            "queued_gradients": sum(len(v) for v in state["halo"]["gradients"].values()),
            "residuals": len(state["halo"]["exchanger"]["feedback"]["residuals"]),
            "offsets": [c["codec"]["offset"] for c in state["halo"]["exchanger"]["codecs"]],
            "hook_ratio": tr.hook_state.stats()["compression_ratio"] if tr.hook_state is not None else None,
        }
        first_logits = list(logits)
        tr.close()
        tr, logits = _trainer(parts[rank], config)
        tr.load_state_dict(_load(ckpt))
        second = _epochs(tr, EPOCHS - k)
        resumed = _outcome(tr, first_logits + logits, first + second)
        out["runs"][name] = {"straight": straight, "resumed": resumed, "summary": summary}

    out["monitor_runs"] = {}
    for name, (config, defaults, k) in MONITOR_RUNS.items():
        with gw.monitor_defaults(**defaults):
            tr, logits = _trainer(parts[rank], config)  # the checkpoint taken on the way (the straight run goes on)
            first = _epochs(tr, k)
            ckpt = _save(tr.state_dict())
            history = first + _epochs(tr, MONITOR_EPOCHS - k)
            report = tr.hook_state.stats()["monitor"]
            first_logits = logits[: 2 * k]
            straight = _outcome(tr, logits, history)
            tr, logits = _trainer(parts[rank], config)
            tr.load_state_dict(_load(ckpt))
            second = _epochs(tr, MONITOR_EPOCHS - k)
            resumed_report = tr.hook_state.stats()["monitor"]
            resumed = _outcome(tr, first_logits + logits, first + second)
        saved = _load(ckpt)["grad_hook"]["monitor"]
        monitor = (saved, report, resumed_report)
        out["monitor_runs"][name] = {"straight": straight, "resumed": resumed, "monitor": monitor}

    # Control: restoring only the model, the optimizer, the random generator and the epoch counter (no halo
    # state) does not reproduce the run, so the comparison above does test the halo state.
    config, k = RUNS["s0-ef"]
    tr, logits = _trainer(parts[rank], config)
    state = _load(checkpoints["s0-ef"])
    tr.model.load_state_dict(state["model"])
    tr.opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    tr.epoch = state["epoch"]
    out["partial"] = _outcome(tr, logits, _epochs(tr, EPOCHS - k))

    # Refusals. Every case is a fresh trainer of the s1-ef run, whose checkpoint is after epoch 3.
    config, _ = RUNS["s1-ef"]
    ckpt = checkpoints["s1-ef"]
    errors: dict[str, str] = {}

    def refuse(case: str, config: dict[str, Any], state: Any, part: Any = None, train_first: bool = False) -> None:
        tr, _ = _trainer(part if part is not None else parts[rank], config)
        if train_first:
            tr.train_epoch()
        errors[case] = _error(lambda: tr.load_state_dict(state))
        tr.close()

    refuse("hidden", {**config, "hidden": 16}, _load(ckpt))
    refuse("forward", {**config, "forward": "q2"}, _load(ckpt))
    refuse("staleness", {**config, "staleness": 2}, _load(ckpt))
    refuse("partition", config, _load(ckpt), part=_parts(world, seed=2)[rank])
    # Each rank loads the other rank's checkpoint.
    swapped: list[Any] = [None] * world
    dist.all_gather_object(swapped, ckpt)
    refuse("other_rank", config, _load(swapped[1 - rank]))
    # Rank 1 loads a checkpoint of the same run taken one epoch later.
    tr, _ = _trainer(parts[rank], config)
    _epochs(tr, 5)
    later = _save(tr.state_dict())
    tr.close()
    refuse("epochs", config, _load(ckpt if rank == 0 else later))
    # Only rank 1's checkpoint is foreign (it has a gradient hook): rank 0 fails too, naming rank 1.
    refuse("one_rank", config, _load(ckpt if rank == 0 else checkpoints["s1-ef-acpsgd"]))
    refuse("trained", config, _load(ckpt), train_first=True)
    missing = _load(ckpt)
    del missing["rng"]
    refuse("missing_key", config, missing)
    # The pieces refuse on their own (local calls), and a refused load changes nothing.
    state = _load(ckpt)
    other = _load(swapped[1 - rank])
    tr, _ = _trainer(parts[rank], config)
    exchanger = state["halo"]["exchanger"]
    reseeded = [{**c, "codec": {**c["codec"], "seed": c["codec"]["seed"] + 1}} for c in exchanger["codecs"]]
    bad_rows = {1: [{"epoch": 3, "sync": False, "rows": torch.zeros(3, 8)}]}
    pieces = {
        "pipeline_staleness": lambda: tr.pipeline.load_state_dict({**state["halo"], "staleness": 2}),
        "pipeline_rows": lambda: tr.pipeline.load_state_dict({**state["halo"], "features": bad_rows}),
        "exchanger_rank": lambda: tr.pipeline.exchanger.load_state_dict(other["halo"]["exchanger"]),
        "codec_seed": lambda: tr.pipeline.exchanger.load_state_dict({**exchanger, "codecs": reseeded}),
    }
    out["piece_errors"] = {case: _error(fn) for case, fn in pieces.items()}
    tr.load_state_dict(state)
    out["after_piece_refusals"] = _epochs(tr, 1)[0]
    tr.close()
    # After all the refusals a good checkpoint still loads and continues the run.
    tr, _ = _trainer(parts[rank], config)
    tr.load_state_dict(_load(ckpt))
    out["after_refusals"] = _epochs(tr, 1)[0]
    tr.close()
    out["errors"] = errors
    out["checkpoint"] = ckpt
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_resume_worker, 2, timeout=300)


def _assert_identical(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", list(RUNS))
def test_resumed_run_is_bit_identical(results, name):
    """Losses, accuracies, halo bytes, every logit and the final parameters equal the uninterrupted run's."""
    for rank, r in enumerate(results):
        run = r["runs"][name]
        _assert_identical(run["straight"], run["resumed"], f"{name} rank {rank}")
        assert len(run["straight"]["logits"]) == 2 * EPOCHS  # one training and one evaluation pass per epoch


@pytest.mark.parametrize("name", list(MONITOR_RUNS))
def test_a_run_resumed_across_a_check_of_the_hook_s_monitor_is_bit_identical(results, name):
    """Every logit, loss and parameter (as above), and the hook monitor's checks, decisions and figures ("error" to
    rounding: see tests/integrations/test_lightning.py assert_same_monitor); a check after the checkpoint."""
    from tests.integrations.test_lightning import assert_same_monitor

    for rank, r in enumerate(results):
        run = r["monitor_runs"][name]
        _assert_identical(run["straight"], run["resumed"], f"{name} rank {rank}")
        assert len(run["straight"]["logits"]) == 2 * MONITOR_EPOCHS
        saved, straight, resumed = run["monitor"]
        assert straight["checks"] > saved["checks"], (name, rank)
        assert_same_monitor(straight, resumed, (name, rank), every=name == "defaults")
        if name == "adapting":  # decisions at the check before the checkpoint and at the one after it
            assert len(saved["events"]) < len(straight["adapted"]), (rank, straight["adapted"])
        else:
            assert not straight["adapted"], rank


def test_checkpoints_hold_the_state_that_matters(results):
    """Otherwise the comparison would pass without the halo state: stale exchanges are in flight at the
    checkpoint, residuals exist with error feedback, the q-bit codecs have drawn noise, the hook compresses."""
    for r in results:
        runs = r["runs"]
        for name, (config, _) in RUNS.items():
            summary = runs[name]["summary"]
            assert summary["offsets"] and all(o > 0 for o in summary["offsets"]), name
            assert (summary["residuals"] > 0) == config.get("error_feedback", False), name
            assert (summary["queued_gradients"] > 0) == (config.get("staleness", 0) > 0), name
        assert runs["s1-ef-acpsgd"]["summary"]["hook_ratio"] > 1


def test_resuming_without_the_halo_state_diverges(results):
    for r in results:
        straight = [h["loss"] for h in r["runs"]["s0-ef"]["straight"]["history"]]
        partial = [h["loss"] for h in r["partial"]["history"]]
        k = RUNS["s0-ef"][1]
        assert partial != straight[k:]


@pytest.mark.parametrize(
    "case,message",
    [
        ("hidden", "'config.hidden' is 8 but this run's is 16"),
        ("forward", "'config.forward' is 'q1' but this run's is 'q2'"),
        ("staleness", "'config.staleness' is 1 but this run's is 2"),
        ("partition", "the checkpoint's 'partition.inner' is"),
        ("other_rank", "the checkpoint's 'partition.rank' is"),
        ("epochs", "'epoch' is 3 on rank 0 but 4 on rank 1"),
        ("one_rank", "the checkpoint's 'config.grad_hook' is 'acpsgd' but this run's is None"),
        ("trained", "before its first epoch (this one is at epoch 0)"),
        ("missing_key", "lacks ['rng']"),
    ],
)
def test_foreign_checkpoints_fail_on_every_rank(results, case, message):
    for r in results:
        assert r["errors"][case].startswith("gnn: Trainer.load_state_dict"), r["errors"][case]
        assert message in r["errors"][case], r["errors"][case]
    if case == "one_rank":
        assert "rank 1 could not set up" in results[0]["errors"][case]


def test_a_good_checkpoint_loads_after_refusals(results):
    """Into a fresh trainer after the refusals, and into one whose pipeline and exchanger refused a load."""
    k = RUNS["s1-ef"][1]
    for r in results:
        _assert_identical(r["after_refusals"], r["runs"]["s1-ef"]["straight"]["history"][k], "after refusals")
        _assert_identical(r["after_piece_refusals"], r["after_refusals"], "after refusals of the pieces")


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "pipeline_staleness",
            "halo: HaloPipeline.load_state_dict: the checkpoint's 'staleness' is 2 but this run's is 1",
        ),
        ("pipeline_rows", "features[1] rows must be a ("),
        ("exchanger_rank", "halo: HaloExchanger.load_state_dict: the checkpoint's 'partition.rank' is"),
        ("codec_seed", "qbit: checkpoint seed"),
    ],
)
def test_halo_pieces_refuse_foreign_state(results, case, message):
    for r in results:
        assert message in r["piece_errors"][case], r["piece_errors"][case]


def test_world_size_is_checked(results):
    """A 2-rank checkpoint cannot resume a single-process run."""
    tr, _ = _trainer(_parts(1)[0], RUNS["s1-ef"][0])
    with pytest.raises(ValueError, match="'world_size' is 2 but this run's is 1"):
        tr.load_state_dict(_load(results[0]["checkpoint"]))
    tr.close()
