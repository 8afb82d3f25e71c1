"""AdamW whose momentum, not its gradient, crosses the wire compressed: 1-bit Adam's frozen variance.

Why not a gradient hook: Adam divides each coordinate's step by the root of its second moment
``v = EMA(g^2)``, which is not linear in the gradient. Error feedback keeps a compressed gradient's
*sum over steps* right (what compression drops now is sent later), not its square: the one-bit gradient
of every coordinate has the magnitude of its row's scale, so ``v`` of a compressed gradient is
the wrong statistic, and the gradient delayed in the residual arrives in bursts that ``v`` then
amplifies or damps per coordinate. Tang et al. observed that ``v`` settles early in training
(1-bit Adam, https://arxiv.org/abs/2102.02888, Algorithm 1; DeepSpeed's ``OnebitAdam``), so:

* **warm-up** (the first ``warmup`` steps): plain AdamW on the gradients averaged in fp32, one fused
  all-reduce per step, exactly :class:`torch.optim.AdamW` on the averaged gradient;
* **compressed** (every later step): ``v`` and both bias corrections are frozen at their warm-up
  values, so AdamW becomes momentum SGD with a fixed per-coordinate learning rate
  ``lr / bc1 / (sqrt(v / bc2) + eps)``, which *is* linear in the momentum. Each rank updates its
  local momentum from its local gradient, ``m_r = beta1 m + (1 - beta1) g_r``, and the ranks average
  ``m_r`` with an error-feedback compressed all-reduce (``onebit`` by default: signs and one fp32 scale
  per row, worker and server residuals); every rank keeps the average as its momentum and takes the
  AdamW step with it. Weight decay stays decoupled (``p *= 1 - lr * weight_decay``) in both phases.

The momentum is an average of gradients over about ``1 / (1 - beta1)`` steps, so it changes slowly
and compresses with a small residual; what one step's compression drops is sent on later steps.
One departure from the paper: after the freeze each tensor's denominator is floored at ``denom_floor``
(0.1) of its mean, because a coordinate whose gradient was (nearly) zero throughout the warm-up keeps a
``v`` near zero for good, hence a step of up to ``lr / eps`` per unit of momentum (see
:data:`DEFAULT_DENOM_FLOOR`).

Everything that is not Adam's math (the set-up and the ranks' agreement, the step's collective, gradients
present on some ranks only, non-finite steps skipped on every rank, GradScaler, the warm-up counted in steps
taken, checkpoints) is :class:`~sylvie_comm.optim.momentum.MomentumOptimizer`'s, shared with
:class:`~sylvie_comm.optim.CompressedSGD`. Every rank must call :meth:`CompressedAdamW.step` at every step (it is
a collective); parameters whose ``.grad`` is None are skipped as :class:`torch.optim.AdamW` skips them, and every
rank must then hold gradients for the same parameters (else a ValueError on every rank, naming the parameter).
The variance freezes after ``warmup`` steps *taken*: a step skipped for a NaN or Inf gradient does not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.optim.momentum import MOMENTUM_CODECS, MomentumOptimizer, is_number, saved_states
from sylvie_comm.optim.momentum import resolve_warmup as _resolve_warmup

# Warm-up as a fraction of ``total_steps`` when no ``warmup`` is given. 1-bit Adam warms up for 15-25% of
# BERT pre-training; on the digits MLP of the tests 10% ends within the accuracy of plain AdamW and keeps the
# whole run over 6x smaller than fp32 (a longer warm-up sends more fp32 steps).
DEFAULT_WARMUP_FRACTION = 0.1
# After the freeze a coordinate's step is lr / (sqrt(v) + eps) per unit of momentum. A coordinate (almost) silent
# during the warm-up (a pixel that is nearly always 0, a ReLU unit that was dead) keeps a v near 0 for good, and
# with it a learning rate up to lr / eps: Adam would raise its v as soon as gradients arrive, the frozen variance
# never does, and sign compression hands such coordinates the scale of their row. So the frozen denominator of
# each tensor is floored at this fraction of its mean. On the digits MLP of the tests, without the floor (0: the
# published algorithm) every seed diverged within a few compressed steps, even with the momentum sent uncompressed.
DEFAULT_DENOM_FLOOR = 0.1
WHAT = "CompressedAdamW"
_WARMUP_MEANING = "the steps of uncompressed AdamW before the variance is frozen"
_WARMUP_WHY = "the compressed steps divide by the second moment the warm-up estimated, and without one it is zero"


def resolve_warmup(warmup: int | None, total_steps: int | None, fraction: float) -> int:
    """The warm-up length: ``warmup`` itself, or ``ceil(fraction * total_steps)`` (at least 1)."""
    return _resolve_warmup(warmup, total_steps, fraction, what=WHAT, default_fraction=DEFAULT_WARMUP_FRACTION,
                           meaning=_WARMUP_MEANING, minimum=1, why=_WARMUP_WHY)  # fmt: skip


def _check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[float, float]:
    """torch.optim.AdamW's checks, with the rule in each message; returns the betas."""
    if not is_number(lr) or lr < 0:
        raise ValueError(f"{WHAT}: lr must be a finite number >= 0, got {lr!r}")
    if not is_number(eps) or eps < 0:
        raise ValueError(f"{WHAT}: eps must be a finite number >= 0, got {eps!r}")
    if not is_number(weight_decay) or weight_decay < 0:
        raise ValueError(f"{WHAT}: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{WHAT}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not is_number(b) or not 0 <= b < 1:
            raise ValueError(f"{WHAT}: betas[{i}] must be a number in [0, 1), got {b!r}")
    return float(betas[0]), float(betas[1])


class CompressedAdamW(MomentumOptimizer):
    """AdamW that averages the gradient in fp32 for a warm-up, then the momentum with a compressed all-reduce.

    1-bit Adam (Tang et al. 2021, https://arxiv.org/abs/2102.02888): see the module docstring for the why.
    Turn every other gradient all-reduce off (DDP's: :func:`sylvie_comm.integrations.optim.ddp_compressed_adamw`
    does it): this optimizer's step is the only collective, on local gradients.

    Building one is a collective call: the ranks agree on the configuration (codec, options, warm-up,
    seed, hyperparameters, parameter names and shapes) and fail together, naming the first difference.

    Args:
        params: parameters or parameter groups, as for torch.optim.AdamW; ``(name, parameter)`` pairs
            (``model.named_parameters()``) name the compression state, else ``param.<k>`` by position.
        lr: as torch.optim.AdamW (default 1e-3); it may change between steps (schedulers).
        betas: as torch.optim.AdamW (default (0.9, 0.999)).
        eps: as torch.optim.AdamW (default 1e-8).
        weight_decay: as torch.optim.AdamW, decoupled (default 0.01).
        denom_floor: after the freeze, each tensor's denominator ``sqrt(v / bc2) + eps`` is at least this
            fraction of its mean (default 0.1; 0 turns the floor off): coordinates whose gradient was (nearly)
            zero throughout the warm-up would otherwise step by up to ``lr / eps`` per unit of momentum for good.
        **settings: the keywords of every compressed optimizer
            (:class:`~sylvie_comm.optim.momentum.MomentumOptimizer`): ``transport`` (required: the ranks to
            average among), ``codec`` (``onebit`` by default, ``sign``, ``topk``, ``qsgd``, ``fp16``, ``bf16`` or
            ``none``), ``warmup`` (steps of uncompressed AdamW, >= 1, before the variance freezes; steps skipped
            for a NaN or Inf gradient do not count) or ``total_steps`` (the warm-up is then
            ``ceil(warmup_fraction * total_steps)``, ``warmup_fraction`` 0.1 by default), ``seed``, ``rules``,
            ``monitor`` (the bound on ``lag`` calibrated for a momentum by default), ``close_transport``, and the
            codec's options (``chunk_size``, ``scale``, ``ratio``, ``bits``).

    Example::

        opt = CompressedAdamW(model.named_parameters(), lr=1e-3, transport=transport, total_steps=10_000)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # local gradients: no all-reduce
            opt.step()                        # the collective, then the AdamW update
    """

    what = WHAT
    warmup_meaning = _WARMUP_MEANING
    warmup_minimum = 1
    warmup_why = _WARMUP_WHY
    default_warmup_fraction = DEFAULT_WARMUP_FRACTION
    fp32_counts = ("step", "freeze_step")
    state_keys = frozenset({"step", "exp_avg", "exp_avg_sq"})
    optional_state_keys = frozenset({"freeze_step"})  # once the variance is frozen

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        denom_floor: float = DEFAULT_DENOM_FLOOR,
        **settings: Any,
    ) -> None:
        def hyperparameters() -> dict[str, Any]:
            b1, b2 = _check_hyperparameters(lr, betas, eps, weight_decay)
            if not is_number(denom_floor) or denom_floor < 0:
                raise ValueError(f"{WHAT}: denom_floor must be a finite number >= 0, got {denom_floor!r}")
            return {"lr": float(lr), "betas": (b1, b2), "eps": float(eps), "weight_decay": float(weight_decay),
                    "denom_floor": float(denom_floor)}  # fmt: skip

        super().__init__(params, hyperparameters, **settings)

    # ------------------------------------------------------------------ Adam's part

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], device: torch.device) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _compresses(self, p: torch.Tensor) -> bool:
        """Frozen parameters send their momentum; one first stepped after the freeze (no variance) its gradient."""
        return "freeze_step" in self.state[p]

    def _local_momentum(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any]
    ) -> torch.Tensor:
        """``m_r = beta1 m + (1 - beta1) g_r``, in fp32."""
        return torch.lerp(state["exp_avg"].float(), grad.float(), 1 - group["betas"][0])

    def _gradient_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any], ok: torch.Tensor
    ) -> None:
        _adamw_update(p, grad, state, group, ok)

    def _momentum_step(
        self, p: torch.Tensor, momentum: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
        ok: torch.Tensor,
    ) -> None:  # fmt: skip
        _frozen_update(p, momentum, state, group, ok)

    def _begin_compressed(self) -> None:
        self._freeze()

    def _freeze(self) -> None:
        """The warm-up is over (``warmup`` steps taken): each parameter's variance freezes with the bias corrections
        of its own steps. A parameter whose every step so far was skipped (a step count of 0: bias corrections of
        0, hence NaN) is not frozen: it keeps AdamW steps, as one first stepped after the freeze. One host read
        of the step counts, once per run."""
        states = [self.state[p] for _, p in self._named if self.state.get(p)]
        if states:
            counts = torch.stack([s["step"] for s in states])
            taken = [1.0] * len(states) if counts.device.type == "meta" else counts.tolist()
            for state, n in zip(states, taken, strict=True):
                if n >= 1:
                    state["freeze_step"] = state["step"].clone()

    def _check_checkpoint(self, state_dict: Mapping[str, Any], what: str) -> None:
        for name, _, entry in saved_states(state_dict, self.param_groups, self._names):
            freeze = entry.get("freeze_step")
            if not isinstance(freeze, torch.Tensor) or freeze.device.type == "meta" or freeze.numel() != 1:
                continue  # not frozen, no value to read, or not a count: torch.optim's load judges it
            if not float(freeze) >= 1:
                raise ValueError(
                    f"{what}: checkpoint freeze_step {float(freeze)} of parameter '{name}' must be at least 1: "
                    "a variance frozen before any step was taken divides by bias corrections of 0 (NaN)"
                )


# ---------------------------------------------------------------------------------------------------------------------
# The updates. ``ok`` is a 0-dim bool tensor on the parameters' device: every state tensor is written only where it
# is set (kernels.copy_if reads it there), so a skipped step changes nothing and the host never reads a value.


def _bias_corrections(step: torch.Tensor, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 - beta ** step`` for both betas, in float64 as torch.optim.AdamW computes them on the host."""
    s = step.double()
    return 1 - torch.pow(beta1, s), 1 - torch.pow(beta2, s)


def _apply(p: torch.Tensor, avg: torch.Tensor, denom: torch.Tensor, step_size: torch.Tensor,
           group: Mapping[str, Any], ok: torch.Tensor) -> None:  # fmt: skip
    """``p <- p (1 - lr wd) - step_size avg / denom`` where ``ok``."""
    lr, wd = group["lr"], group["weight_decay"]
    new = p.mul(1 - lr * wd) if wd else p.clone()
    new.sub_(avg.div(denom).mul_(step_size))
    kernels.copy_if(p, new, ok)


def _adamw_update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
                  ok: torch.Tensor) -> None:  # fmt: skip
    """torch.optim.AdamW's step with the averaged gradient ``grad`` (the warm-up)."""
    beta1, beta2 = group["betas"]
    g = grad.to(p.dtype)
    step = state["step"] + 1
    m = torch.lerp(state["exp_avg"], g, 1 - beta1)
    v = state["exp_avg_sq"].mul(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2 = _bias_corrections(step, beta1, beta2)
    denom = (v.sqrt() / bc2.sqrt()).add_(group["eps"])
    _apply(p, m, denom, group["lr"] / bc1, group, ok)
    kernels.copy_if(state["exp_avg"], m, ok)
    kernels.copy_if(state["exp_avg_sq"], v, ok)
    kernels.copy_if(state["step"], step, ok)


def _frozen_update(p: torch.Tensor, momentum: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
                   ok: torch.Tensor) -> None:  # fmt: skip
    """The compressed phase: the averaged ``momentum`` becomes the momentum; ``v`` and the bias corrections of
    the freeze step divide it, the denominator floored at ``denom_floor`` times its tensor's mean (see
    :class:`CompressedAdamW`)."""
    beta1, beta2 = group["betas"]
    m = momentum.to(p.dtype)
    bc1, bc2 = _bias_corrections(state["freeze_step"], beta1, beta2)
    denom = (state["exp_avg_sq"].sqrt() / bc2.sqrt()).add_(group["eps"])
    floor = group["denom_floor"]
    if floor:
        denom = torch.maximum(denom, denom.mean().mul_(floor))
    _apply(p, m, denom, group["lr"] / bc1, group, ok)
    kernels.copy_if(state["exp_avg"], m.contiguous(), ok)
    kernels.copy_if(state["step"], state["step"] + 1, ok)


__all__ = ["DEFAULT_DENOM_FLOOR", "DEFAULT_WARMUP_FRACTION", "MOMENTUM_CODECS", "CompressedAdamW", "resolve_warmup"]
