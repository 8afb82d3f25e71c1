"""Models, data and training loops shared by the multi-process DDP tests (run inside workers)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sylvie_comm

# Small enough that every parameter gets a bucket of its own: several buckets on gloo.
TINY_BUCKET_MB = 0.0005


def square_mlp(width: int = 16, depth: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Square weight matrices only, so full-rank ACP-SGD is exact on P and Q steps alike."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers).to(dtype)


def batch(rank: int, step: int, width: int = 16, n: int = 32, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, width, generator=g).to(dtype)
    y = torch.randint(0, width, (n,), generator=g)
    return x, y


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))
    den = max(y.float().abs().max().item() for y in b)
    return num / den


def compare_with_default(
    rank: int, world: int, hook_name: str, options: dict[str, Any], steps: int = 6, dtype: torch.dtype = torch.float32,
    accumulate: int = 1, unused: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Gradients of a hooked DDP model against DDP's default all-reduce, at the same parameters each step."""
    base, test = square_mlp(dtype=dtype), square_mlp(dtype=dtype)
    if unused:
        base.add_module("unused", nn.Linear(16, 16).to(dtype))
        test.add_module("unused", nn.Linear(16, 16).to(dtype))
        base.forward = _skip_unused(base)  # type: ignore[method-assign]
        test.forward = _skip_unused(test)  # type: ignore[method-assign]
    kw = {"bucket_cap_mb": TINY_BUCKET_MB, "find_unused_parameters": unused}
    ddp_base, ddp_test = DDP(base, **kw), DDP(test, **kw)
    state = sylvie_comm.ddp.register(ddp_test, hook_name, **options)
    opt = torch.optim.SGD(base.parameters(), lr=0.05)
    errors, buckets = [], set()
    for step in range(steps):
        for model in (ddp_base, ddp_test):
            model.zero_grad()
            for micro in range(accumulate):
                x, y = batch(rank, step * accumulate + micro, dtype=dtype)
                if micro < accumulate - 1:
                    with model.no_sync():
                        F.cross_entropy(model(x).float(), y).backward()
                else:
                    F.cross_entropy(model(x).float(), y).backward()
        if step >= state.config.warmup_steps:
            errors.append(relative_error(grads(test), grads(base)))
        buckets.add(len(state._plans))
        opt.step()
        with torch.no_grad():
            for pt, pb in zip(test.parameters(), base.parameters(), strict=True):
                pt.copy_(pb)
    return {"errors": errors, "stats": state.stats(), "buckets": max(buckets), "steps": state.step}


def _skip_unused(seq: nn.Sequential):
    layers = [m for name, m in seq.named_children() if name != "unused"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for m in layers:
            x = m(x)
        return x

    return forward
