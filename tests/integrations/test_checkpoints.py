"""DDP hook checkpoints that do not fit are refused on every rank, naming the field, before anything loads.

Two gloo ranks, the one-bit hook (worker and per-rank server residuals) and ACP-SGD: a rank loading another
rank's file, ranks loading checkpoints of different steps (which used to abort gloo or let the replicas
diverge), a checkpoint of another model; a refused load leaves every rank's state as it was, and a fitting one
still resumes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.integrations import workloads as wl

pytestmark = pytest.mark.multiprocess


def _flat(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _flat(state[k])]
    return []


def _cases(rank: int, world: int, folder: str, codec: str) -> dict[str, str]:
    import sylvie_comm

    def hook_of(model: torch.nn.Module) -> Any:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=wl.TINY_BUCKET_MB)
        return ddp, sylvie_comm.ddp.register(ddp, codec)

    ddp, state = hook_of(wl.mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    wl.train_steps(ddp, opt, rank, range(4))
    torch.save(state.state_dict(), os.path.join(folder, f"{codec}-step4-rank{rank}.pt"))
    wl.train_steps(ddp, opt, rank, range(4, 6))
    torch.save(state.state_dict(), os.path.join(folder, f"{codec}-step6-rank{rank}.pt"))
    other_ddp, other = hook_of(wl.square_mlp())
    wl.train_steps(other_ddp, torch.optim.SGD(other_ddp.parameters(), lr=0.05), rank, range(4))
    torch.save(other.state_dict(), os.path.join(folder, f"{codec}-other-rank{rank}.pt"))
    other.close()
    dist.barrier()

    def load(name: str) -> str:
        ckpt = torch.load(os.path.join(folder, name), weights_only=True)
        before = [t.clone() for t in _flat(state.state_dict())]
        step_before = state.step
        try:
            state.load_state_dict(ckpt)
        except ValueError as exc:
            after = _flat(state.state_dict())
            kept = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            return f"refused ({'state kept' if kept and state.step == step_before else 'STATE CHANGED'}): {exc}"
        return f"loaded step {state.step}"

    out = {
        "own": load(f"{codec}-step4-rank{rank}.pt"),
        "rank0_everywhere": load(f"{codec}-step6-rank0.pt"),
        "different_steps": load(f"{codec}-step{4 if rank == 0 else 6}-rank{rank}.pt"),
        "other_model": load(f"{codec}-other-rank{rank}.pt"),
    }
    # after the refusals, a fitting checkpoint still resumes and trains
    out["own_again"] = load(f"{codec}-step6-rank{rank}.pt")
    wl.train_steps(ddp, opt, rank, range(6, 8))
    out["trained"] = str(all(bool(torch.isfinite(p).all()) for p in ddp.parameters()))
    state.close()
    return out


@pytest.mark.parametrize("codec", ["onebit", "acpsgd"])
def test_checkpoints_that_do_not_fit_are_refused_on_every_rank(tmp_path, codec: str) -> None:
    r0, r1 = run_distributed(_cases, 2, str(tmp_path), codec, timeout=180)
    assert r0["own"] == r1["own"] == "loaded step 4"
    # rank 0's file on every rank: rank 1 names it, rank 0 learns of it; neither loads
    assert "refused (state kept)" in r1["rank0_everywhere"], r1["rank0_everywhere"]
    assert "written by rank 0 and is loaded on rank 1" in r1["rank0_everywhere"]
    assert "refused (state kept)" in r0["rank0_everywhere"], r0["rank0_everywhere"]
    assert "rank 1 could not take its checkpoint" in r0["rank0_everywhere"]
    # checkpoints of two steps: both ranks refuse, naming the steps
    for r in (r0, r1):
        assert "refused (state kept)" in r["different_steps"], r["different_steps"]
        assert "ranks disagree on the checkpoint: 'step' is 4 on rank 0 but 6 on rank 1" in r["different_steps"]
        # another model's checkpoint: the first parameter whose state does not fit is named
        assert "refused (state kept)" in r["other_model"], r["other_model"]
        other = r["other_model"]  # square_mlp: 16 x 16 weights in layers 0, 2, 4, 6; mlp: 0, 2, 4 of other shapes
        assert "'6.bias'" in other or "'6.weight'" in other or "'0.weight'" in other, other
        assert r["own_again"] == "loaded step 6" and r["trained"] == "True"
