"""The monitor's bound on ``lag`` by what an integration averages (``LAG_BOUNDS``), and what a warning means.

A ``max_lag`` left unset is the bound calibrated for the path: a DDP hook's gradient, a compressed optimizer's
momentum (docs/guide/monitor.md). A ``max_lag`` the user sets holds on every path. On a small noisy regression
(2 ranks as threads of the in-process transport, deterministic), each path at its own bound warns where the
compression costs the model (top-k at 1%: a residual of many steps, the loss many times plain's) and not where it
does not (qsgd: the loss plain's).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.monitor import Monitor
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives.local import run_local
from sylvie_comm.config import LAG_BOUNDS, MONITOR_DEFAULTS, Config
from sylvie_comm.optim import CompressedAdamW, CompressedSGD

IN, OUT, BATCH, STEPS = 64, 32, 16, 80
MONITOR = {"first": 10, "period": 20}  # checks at compressed steps 10, 30, 50, 70 (patience 2: a warning by 30)


def test_an_unset_max_lag_is_the_bound_of_what_is_averaged() -> None:
    assert MONITOR_DEFAULTS["max_lag"] is None
    assert Config("onebit").monitor["max_lag"] is None

    def body(tr: Any) -> list[float]:
        bounds = []
        for averages in ("gradient", "momentum"):
            for monitor in ({}, {"max_lag": 0.7}):
                s = Session("t", Config("onebit", monitor=monitor), tr, averages=averages)
                assert s.policy.monitor is not None
                bounds.append(s.policy.monitor.max_lag)
                s.close(transport=False)
        return bounds

    assert run_local(1, body)[0] == [LAG_BOUNDS["gradient"], 0.7, LAG_BOUNDS["momentum"], 0.7]
    assert LAG_BOUNDS["momentum"] != LAG_BOUNDS["gradient"]


def test_what_is_averaged_must_be_known() -> None:
    def body(tr: Any) -> str:
        s = Session("t", Config("onebit"), tr)
        with pytest.raises(ValueError, match=r"averages must be one of gradient, momentum, got 'weights'"):
            Monitor(s.algorithm, {}, tr, averages="weights")
        s.close(transport=False)
        return "ok"

    run_local(1, body)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "0.5", True])
def test_a_bad_max_lag_names_null_as_the_alternative(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"max_lag must be a finite number > 0 \(or null: the bound of what"):
        Config("onebit", monitor={"max_lag": bad})


def test_a_null_max_lag_round_trips() -> None:
    cfg = Config("onebit", monitor={"max_lag": None, "adapt": True})
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config.from_dict(Config("onebit", monitor={"max_lag": 2}).to_dict()).monitor["max_lag"] == 2.0


@pytest.mark.parametrize("cls", [CompressedSGD, CompressedAdamW])
def test_the_compressed_optimizers_take_the_momentum_bound_unless_set(cls: Any) -> None:
    def body(tr: Any) -> list[float]:
        out = []
        for monitor in (None, {"max_lag": 3.0}):
            w = torch.zeros(4, 4, requires_grad=True)
            opt = cls([("w", w)], lr=0.01, transport=tr, codec="onebit", warmup=1, monitor=monitor)
            out.append(opt.policy.monitor.max_lag)
            opt.close()
        return out

    assert run_local(2, body)[0] == [LAG_BOUNDS["momentum"], 3.0]


# ---------------------------------------------------------------------------------------------- what a warning means


def _teacher() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) / IN**0.5


def _batch(rank: int, step: int, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x @ teacher.t() + 0.1 * torch.randn(BATCH, OUT, generator=g)


def _error(w: torch.Tensor, teacher: torch.Tensor) -> float:
    """The held-out mean squared error of ``w`` against the teacher."""
    x = torch.randn(512, IN, generator=torch.Generator().manual_seed(99))
    return float(((x @ (w - teacher).t()) ** 2).mean())


def _train(path: str, codec: str, options: dict[str, Any]) -> tuple[float, list[str]]:
    """SGD Nesterov momentum 0.9 on the regression over 2 ranks, the momentum averaged by CompressedSGD (``path``
    ``momentum``) or the gradient by a session as a DDP hook runs it (``gradient``): the held-out error, and the
    names the monitor warned on (rank 0's)."""
    teacher = _teacher()
    monitor = {**MONITOR, "max_lag": None}

    def body(tr: Any) -> tuple[float, list[str]]:
        w = torch.zeros(OUT, IN, requires_grad=True)
        if path == "momentum":
            opt: Any = CompressedSGD([("w", w)], lr=0.05, momentum=0.9, nesterov=True, transport=tr, codec=codec,
                                     warmup=5, monitor=monitor, **options)  # fmt: skip
            session = opt.session
        else:
            opt = torch.optim.SGD([w], lr=0.05, momentum=0.9, nesterov=True)
            session = Session("test", Config(codec, options=options, warmup_steps=5, monitor=monitor), tr)
        for step in range(STEPS):
            x, y = _batch(tr.rank, step, teacher)
            opt.zero_grad()
            ((x @ w.t() - y) ** 2).mean().backward()
            if path == "gradient":
                session.step = step
                member = Member("w", w.grad, *session.policy.member_options("w", w.shape))
                session.run(Group(0, [member])).wait()
                session.step = step + 1
            opt.step()
        mon = session.policy.monitor  # none where nothing is compressed (codec none)
        warned = [] if mon is None else [n for n, t in mon._tensors.items() if t.warned]
        (opt if path == "momentum" else session).close()
        return _error(w.detach(), teacher), warned

    return run_local(2, body)[0]


@pytest.mark.parametrize("path", ["gradient", "momentum"])
def test_at_its_own_bound_each_path_warns_where_the_model_suffers_and_only_there(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    plain, _ = _train(path, "none", {})
    with caplog.at_level(logging.WARNING, logger="sylvie_comm"):
        fine, fine_warned = _train(path, "qsgd", {})
        hurt, hurt_warned = _train(path, "topk", {"ratio": 0.01})
    assert fine < 1.1 * plain and hurt > 5 * plain, (plain, fine, hurt)  # what the cases are
    assert fine_warned == [], fine_warned
    assert hurt_warned == ["w"], hurt_warned
    lines = [r.getMessage() for r in caplog.records if "over the bound" in r.getMessage()]
    assert lines and all(f"lag (residual / {path})" in line for line in lines), lines
    assert all(f"over the bound {LAG_BOUNDS[path]:.3g}" in line for line in lines), lines
