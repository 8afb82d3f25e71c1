"""The small training runs the multi-process tests of CompressedAdamW share (run inside workers or threads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.integrations import workloads as wl

STEPS = 20
WARMUP = 5


def train_fixed_batch(rank: int, model: nn.Module, opt: Any, forward: Callable[[torch.Tensor], torch.Tensor],
                      steps: int = STEPS) -> dict[str, Any]:  # fmt: skip
    """Fit one batch per rank (the loss must fall); per step the loss and this rank's gradients after backward."""
    x, y = wl.batch(rank, 0)
    losses, grads, before = [], [], []
    for _ in range(steps):
        before.append([p.detach().clone() for p in model.parameters()])
        opt.zero_grad()
        loss = F.cross_entropy(forward(x)[:, :8], y % 8)
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads, "before": before, "stats": opt.stats(),
            "params": [p.detach().clone() for p in model.parameters()]}  # fmt: skip


def local_gradients(rank: int, model: nn.Module, params: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """This rank's own gradients of the fixed batch at each step's parameters (what DDP must leave alone)."""
    x, y = wl.batch(rank, 0)
    out = []
    for ps in params:
        with torch.no_grad():
            for p, v in zip(model.parameters(), ps, strict=True):
                p.copy_(v)
        model.zero_grad()
        F.cross_entropy(model(x)[:, :8], y % 8).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    return out
