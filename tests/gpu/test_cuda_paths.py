"""On a CUDA GPU: every algorithm on CUDA tensors against the same run on the CPU, and DDP on NCCL.

Skipped without a GPU (CI has none); ``scripts/gpu-check.sh`` runs this file on a GPU machine.

* Every algorithm at 1, 2 and 4 in-process ranks, behind its policy, the same gradients on CUDA and on the CPU:
  the outputs agree (the lossless ones within their format's precision, the compressed ones within a small
  relative error: summation orders differ between the CUDA and CPU kernels, and a one-bit or sign decision on
  a value at zero may differ), and every tensor of the state is on the GPU.
* DDP on NCCL (world size 1, CUDA model, ``device_ids``) with every hook: it trains, the gradients stay on the
  GPU and finite, the hook counts its bytes; under ``GradScaler`` a NaN step is skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import ALGORITHMS, Group, Member, Policy, make_algorithm
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import Config
from tests.dist_utils import run_distributed
from tests.gpu_marks import NEEDS_CUDA

pytestmark = NEEDS_CUDA

SHAPES = {"a.weight": (64, 96), "a.bias": (64,), "b.weight": (32, 64), "c.weight": (8, 4, 3, 3)}
STEPS = 12
# relative (norm) error allowed between the CUDA and the CPU run of the same algorithm
TOLERANCE = {"none": 1e-6, "fp16": 1e-3, "bf16": 1e-2}
LOSSY = 2e-2


def grads(rank: int, step: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1009 * step + rank)
    n = sum(torch.Size(s).numel() for s in SHAPES.values())
    return torch.randn(n, generator=g).to(device)


def run(name: str, world: int, device: str) -> list[dict[str, Any]]:
    config = Config(codec=name, options={"candidates": ["none", "fp16", "acpsgd"]} if name == "auto" else {})

    def body(tr: Any) -> dict[str, Any]:
        alg = make_algorithm(name, tr, config.options, seed=5)
        policy = Policy(alg, config)
        outs = []
        for step in range(STEPS):
            flat = grads(tr.rank, step, device)
            members, at = [], 0
            for n, s in SHAPES.items():
                k = torch.Size(s).numel()
                members.append(Member(n, flat[at : at + k].view(s), *policy.member_options(n, s)))
                at += k
            policy(Group(0, members, flat=flat), step).wait()
            outs.append(flat.cpu())
        state = alg.state_dict()
        alg.close()

        def devices(x: Any) -> set[str]:
            if isinstance(x, torch.Tensor):
                return {x.device.type}
            return set().union(*(devices(v) for v in x.values())) if isinstance(x, dict) else set()

        return {"outs": outs, "devices": devices(state)}

    return run_local(world, body)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(n for n in ALGORITHMS if n != "auto"))
def test_every_algorithm_on_cuda_matches_the_cpu(name: str, world: int) -> None:
    gpu, cpu = run(name, world, "cuda"), run(name, world, "cpu")
    tol = TOLERANCE.get(name, LOSSY)
    for g, c in zip(gpu, cpu, strict=True):
        assert g["devices"] <= {"cuda"}, g["devices"]
        for step, (a, b) in enumerate(zip(g["outs"], c["outs"], strict=True)):
            err = float((a - b).norm() / b.norm().clamp_min(1e-30))
            assert err <= tol, (name, world, step, err)


def test_auto_runs_on_cuda() -> None:
    for r in run("auto", 2, "cuda"):
        assert r["devices"] <= {"cuda"} and all(bool(torch.isfinite(o).all()) for o in r["outs"])


def _ddp_nccl(rank: int, world: int, hooks: list[str]) -> dict[str, Any]:
    import sylvie_comm

    out: dict[str, Any] = {}
    dev = torch.device("cuda", rank)
    for name in hooks:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=0.01)
        state = sylvie_comm.ddp.register(ddp, name)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=1000)
        finite = []
        for step in range(8):
            x = torch.randn(16, 32, device=dev)
            y = torch.randint(0, 10, (16,), device=dev)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            if step == 5:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
            assert all(p.grad.device == dev for p in model.parameters())
            scaler.step(opt)
            scaler.update()
        out[name] = {"finite": finite, "stats": state.stats(), "scale": scaler.get_scale()}
        state.close()
    return out


def test_ddp_on_nccl_with_every_hook() -> None:
    hooks = sorted(ALGORITHMS)
    res = run_distributed(_ddp_nccl, 1, hooks, backend="nccl", timeout=600)[0]
    for name in hooks:
        r = res[name]
        assert r["finite"] == [s != 5 for s in range(8)], (name, r["finite"])
        assert r["scale"] == 512.0 and r["stats"]["skipped_nonfinite"] == 1, (name, r)
