"""CompressedAdamW and CompressedSGD with one-bit momenta on scikit-learn's digits end where their plain optimizer does.

Two ranks as threads of the in-process transport, MLP 64-256-256-10, batch 64 per rank, 300 steps, the default
warm-up (0.1 of ``total_steps`` for AdamW, 0.05 for SGD) and options; AdamW at lr 1e-3, SGD at lr 0.05 and
momentum 0.9 (where plain SGD reaches about 97%). The plain optimizer trains on both ranks' batches at once (the
mean of the two ranks' gradients). Mean test accuracy of seeds 0-2 (397 test images).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sylvie_comm.collectives.local import run_local
from sylvie_comm.integrations.average import GradientAverage
from sylvie_comm.optim import CompressedAdamW, CompressedSGD
from tests.integrations.workloads import digits_split

WORLD, STEPS, BATCH, SEEDS = 2, 300, 64, (0, 1, 2)
SGD_LR, SGD_MOMENTUM = 0.05, 0.9


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item() * 100


def batches(rank: int, seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank + 100 * seed)
    return [torch.randint(0, n, (BATCH,), generator=g) for _ in range(STEPS)]


def run_ranks(seed: int, make: Any) -> tuple[float, dict[str, Any]]:
    """Two ranks of the digits run; ``make(model, transport)`` returns ``(step, stats, close)`` callables. The test
    accuracy (the same on both ranks: identical replicas) and rank 0's stats."""
    base = mlp(seed)

    def body(tr: Any) -> tuple[float, dict[str, Any]]:
        xtr, ytr, xte, yte = digits_split(tr.rank, WORLD)
        model = copy.deepcopy(base)
        step, stats, close = make(model, tr)
        for idx in batches(tr.rank, seed, len(xtr)):
            model.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            step()
        out = stats()
        close()
        return accuracy(model, xte, yte), out

    results = run_local(WORLD, body, timeout=300)
    assert results[0][0] == results[1][0]  # identical replicas
    return results[0]


# Each compressed optimizer with its learning rate (and momentum).
COMPRESSED: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw": (CompressedAdamW, {"lr": 1e-3}),
    "sgd": (CompressedSGD, {"lr": SGD_LR, "momentum": SGD_MOMENTUM}),
}


def compressed(seed: int, optimizer: str = "adamw", **options: Any) -> tuple[float, dict[str, Any]]:
    """CompressedAdamW (or CompressedSGD) for ``total_steps``: the default warm-up unless ``options`` set one."""
    cls, hyper = COMPRESSED[optimizer]

    def make(model: nn.Module, tr: Any) -> Any:
        opt = cls(model.named_parameters(), **hyper, transport=tr, **{"total_steps": STEPS, **options})
        return opt.step, opt.stats, opt.close

    return run_ranks(seed, make)


def compressed_sgd(seed: int, **options: Any) -> tuple[float, dict[str, Any]]:
    return compressed(seed, "sgd", **options)


def gradient_compressed_sgd(seed: int, codec: str = "onebit", warmup: int = 15) -> tuple[float, dict[str, Any]]:
    """torch.optim.SGD (momentum 0.9) on gradients averaged by ``codec`` (what a DDP comm hook does): the
    comparison for compressing the momentum instead."""

    def make(model: nn.Module, tr: Any) -> Any:
        avg = GradientAverage(model, tr, codec, warmup_steps=warmup)
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=SGD_MOMENTUM)

        def step() -> None:
            avg.average()
            opt.step()

        return step, avg.stats, avg.session.close

    return run_ranks(seed, make)


@functools.cache  # the baselines of every test of this file (and of a pytest process that runs several)
def plain(seed: int, optimizer: type[torch.optim.Optimizer], **hyper: Any) -> float:
    """``optimizer(**hyper)`` on both ranks' batches at once (the mean of their gradients): the test accuracy."""
    model = mlp(seed)
    opt = optimizer(model.parameters(), **hyper)
    shards = [digits_split(r, WORLD) for r in range(WORLD)]
    steps = zip(*(batches(r, seed, len(shards[r][0])) for r in range(WORLD)), strict=True)
    for idx in steps:
        x = torch.cat([shards[r][0][i] for r, i in enumerate(idx)])
        y = torch.cat([shards[r][1][i] for r, i in enumerate(idx)])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return accuracy(model, shards[0][2], shards[0][3])


def plain_adamw(seed: int) -> float:
    return plain(seed, torch.optim.AdamW, lr=1e-3)


def plain_sgd(seed: int, nesterov: bool = False) -> float:
    return plain(seed, torch.optim.SGD, lr=SGD_LR, momentum=SGD_MOMENTUM, nesterov=nesterov)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def accuracies(
    baseline: Callable[[int], float], ours: Callable[[int], tuple[float, dict[str, Any]]]
) -> tuple[list[float], list[float], list[dict[str, Any]]]:
    """Per seed: the baseline's accuracy, ours and our run's stats."""
    plain = [baseline(s) for s in SEEDS]
    runs = [ours(s) for s in SEEDS]
    return plain, [acc for acc, _ in runs], [stats for _, stats in runs]


def report(capsys: Any, baseline: str, plain: list[float], name: str, ours: list[float], stats: dict[str, Any]) -> None:
    """Both accuracies and the first seed's bytes, printed past the capture (``-s``: what the guides report)."""
    warmup = f"warm-up {stats['warmup_steps']} steps, " if "warmup_steps" in stats else ""
    sent, fp32, last = stats["bytes_sent"], stats["bytes_uncompressed"], stats["last_step"]["compression_ratio"]
    with capsys.disabled():
        print(f"\n{baseline} {plain} mean {mean(plain):.2f}; {name} {ours} mean {mean(ours):.2f}; {warmup}"
              f"{stats['compression_ratio']:.2f}x fewer bytes than fp32 ({sent} of {fp32}), {last:.1f}x per compressed "
              "step")  # fmt: skip


@pytest.mark.quality
def test_onebit_momentum_ends_within_a_point_of_adamw_at_six_times_fewer_bytes(capsys: Any) -> None:
    plain, ours, stats = accuracies(plain_adamw, compressed)
    report(capsys, "AdamW", plain, "CompressedAdamW onebit", ours, stats[0])
    assert mean(ours) >= mean(plain) - 1.0, (plain, ours)
    assert stats[0]["compression_ratio"] >= 6.0, stats[0]
    assert stats[0]["skipped_nonfinite"] == 0


@pytest.mark.quality
@pytest.mark.parametrize("codec", ["sign", "topk", "qsgd", "none"])
def test_the_other_momentum_codecs_end_within_a_point_of_adamw(codec: str, capsys: Any) -> None:
    plain, ours, stats = accuracies(plain_adamw, functools.partial(compressed, codec=codec))
    report(capsys, "AdamW", plain, f"CompressedAdamW {codec}", ours, stats[0])
    assert mean(ours) >= mean(plain) - 1.0, (plain, ours)
    assert stats[0]["skipped_nonfinite"] == 0


# ---------------------------------------------------------------- CompressedSGD


@pytest.mark.quality
def test_onebit_momentum_sgd_ends_within_half_a_point_of_sgd_at_sixteen_times_fewer_bytes_per_step(
    capsys: Any,
) -> None:
    plain, ours, stats = accuracies(plain_sgd, compressed_sgd)
    report(capsys, f"SGD momentum {SGD_MOMENTUM}", plain, "CompressedSGD onebit", ours, stats[0])
    assert mean(ours) >= mean(plain) - 0.5, (plain, ours)
    for s in stats:
        assert s["last_step"]["compression_ratio"] >= 16.0, s["last_step"]
        assert s["skipped_nonfinite"] == 0


# The guide's other rows: one setting changed each (Nesterov against plain SGD with Nesterov).
SGD_SETTINGS: dict[str, dict[str, Any]] = {
    "warmup=0": {"warmup": 0},
    "warmup=30": {"warmup": 30},
    "sign": {"codec": "sign"},
    "topk": {"codec": "topk"},
    "qsgd": {"codec": "qsgd"},
    "none": {"codec": "none"},
    "nesterov": {"nesterov": True},
}


@pytest.mark.quality
@pytest.mark.parametrize("setting", list(SGD_SETTINGS))
def test_other_momentum_sgd_settings_end_within_half_a_point_of_sgd(setting: str, capsys: Any) -> None:
    options = SGD_SETTINGS[setting]
    baseline = functools.partial(plain_sgd, nesterov=options.get("nesterov", False))
    plain, ours, stats = accuracies(baseline, functools.partial(compressed_sgd, **options))
    report(capsys, "SGD", plain, f"CompressedSGD {setting}", ours, stats[0])
    assert mean(ours) >= mean(plain) - 0.5, (plain, ours)
    assert stats[0]["skipped_nonfinite"] == 0


@pytest.mark.quality
def test_momentum_sgd_against_the_onebit_gradient_hook(capsys: Any) -> None:
    """The comparison the guide reports: torch.optim.SGD on one-bit gradients (error feedback, the same warm-up)."""
    plain, ours, stats = accuracies(plain_sgd, gradient_compressed_sgd)
    report(capsys, "SGD", plain, "onebit gradient hook", ours, stats[0])
    assert mean(ours) >= mean(plain) - 0.5, (plain, ours)
