"""SGD with momentum (and Nesterov) whose momentum, not its gradient, crosses the wire compressed.

* **warm-up** (the first ``warmup`` steps taken): :class:`torch.optim.SGD` on the gradients averaged in fp32
  (one fused all-reduce per step), with its conventions: weight decay added to the gradient,
  ``d = g + weight_decay p``; the buffer ``b = d`` at a parameter's first step, then
  ``b = momentum b + (1 - dampening) d``; the step ``p -= lr b``, or with Nesterov ``p -= lr (d + momentum b)``.
* **compressed** (every later step): each rank updates its own buffer from its own gradient,
  ``b_r = momentum b + (1 - dampening) (g_r + weight_decay p)``; the ranks average ``b_r`` with an
  error-feedback compressed all-reduce (``onebit`` by default) and every rank keeps the average ``B_t`` as its
  buffer. ``b`` and ``p`` are identical on every rank, so with the average exact ``B_t`` *is*
  torch.optim.SGD's buffer on the mean gradient (the average of ``b_r`` is linear in ``g_r``), and the step
  ``p -= lr B_t`` is SGD's.

**Nesterov** needs the step's gradient beside the buffer, ``p -= lr (d_t + momentum b_t)``, and a rank holds only
its own gradient: stepping with it would move each rank's parameters differently. Nesterov requires
``dampening = 0``, so the averaged buffers of this step and the last give the mean gradient back:
``B_t = momentum B_{t-1} + d_t``, hence ``d_t = B_t - momentum B_{t-1}`` and the step is
``p -= lr (B_t + momentum (B_t - B_{t-1}))`` (that is, ``lr ((1 + momentum) B_t - momentum B_{t-1})``), computed
from ``B_{t-1}``, the buffer every rank holds before the step (0 at a parameter's first step), and
``B_t``, the average every rank receives: the same on every rank, and with exact averaging exactly
torch.optim.SGD's Nesterov step on the mean gradient. Under compression ``B_t`` carries the step's compression
error ``e_t`` (what error feedback sends later), which the Nesterov step weighs by ``1 + momentum``.

Why the momentum: SGD's step is linear in the gradient, so unlike Adam's it can be compressed as a gradient (a
DDP comm hook with error feedback under torch.optim.SGD) as well as a momentum; under error feedback both keep
the sum of what was sent right over steps. The momentum's signs are stabler from step to step (on the digits MLP
88% of a weight matrix's, against 66% of a rank's gradient's), but its magnitudes are more uneven within a row,
so one step's one-bit code loses more of it (relative error 0.75 against 0.67); on digits the two end within the
test set's noise of each other and of plain SGD (the guide, ``docs/guide/compressed-sgd.md``, has the figures).
What this optimizer adds is the collective it owns: one fused payload per step over any transport, a warm-up
that is exactly torch.optim.SGD, and the checkpoint, non-finite and GradScaler handling of CompressedAdamW.

The set-up, the ranks' agreement, gradients present on some ranks only, non-finite steps skipped on every rank,
GradScaler and checkpoints are :class:`~sylvie_comm.optim.momentum.MomentumOptimizer`'s, shared with
:class:`~sylvie_comm.optim.CompressedAdamW`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sylvie_comm import kernels
from sylvie_comm.optim.momentum import MomentumOptimizer, is_number, saved_states

# Warm-up as a fraction of ``total_steps`` when no ``warmup`` is given. SGD freezes no statistic (unlike
# CompressedAdamW's variance), so the warm-up only lets the buffer and the residuals start from settled gradients:
# half of CompressedAdamW's 10%. On the digits MLP of the tests (lr 0.05, momentum 0.9, 300 steps) warm-ups of 0,
# 15 (this default) and 30 steps ended alike, within 0.2 point of plain SGD, and each fp32 step halves the bytes
# saved (20.8x, 10.4x, 6.9x fewer than fp32 over the run); 5% keeps a margin for the first steps' large gradients.
SGD_WARMUP_FRACTION = 0.05
WHAT = "CompressedSGD"


def _check_hyperparameters(
    lr: Any, momentum: Any, dampening: Any, weight_decay: Any, nesterov: Any, where: str = WHAT
) -> None:
    """torch.optim.SGD's checks, with the rule in each message, and a momentum; ``where`` starts the messages."""
    if not is_number(lr) or lr < 0:
        raise ValueError(f"{where}: lr must be a finite number >= 0, got {lr!r}")
    if not is_number(momentum) or not 0 <= momentum < 1:
        raise ValueError(f"{where}: momentum must be a number in (0, 1), got {momentum!r}")
    if momentum == 0:
        raise ValueError(
            f"{where}: momentum must be > 0, got {momentum!r}: without momentum there is nothing to average but the "
            "gradient; compress the gradient with a DDP comm hook (sylvie_comm.ddp.register) or a Horovod "
            "compressor and step with torch.optim.SGD"
        )
    if not is_number(dampening) or not 0 <= dampening < 1:
        raise ValueError(
            f"{where}: dampening must be a number in [0, 1), got {dampening!r} (1 leaves the gradient out of the "
            "momentum)"
        )
    if not is_number(weight_decay) or weight_decay < 0:
        raise ValueError(f"{where}: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not isinstance(nesterov, bool):
        raise ValueError(f"{where}: nesterov must be True or False, got {nesterov!r}")
    if nesterov and dampening != 0:
        raise ValueError(
            f"{where}: nesterov=True requires dampening 0, got {dampening!r} (as torch.optim.SGD; the Nesterov step "
            "is recovered from the averaged buffers only without dampening)"
        )


class CompressedSGD(MomentumOptimizer):
    """SGD with momentum that averages the gradient in fp32 for a warm-up, then the momentum buffer with a
    compressed all-reduce.

    See the module docstring for the why and the Nesterov step. Turn every other gradient all-reduce off
    (DDP's: :func:`sylvie_comm.integrations.optim.ddp_compressed_sgd` does it): this optimizer's step is the only
    collective, on local gradients.

    Building one is a collective call: the ranks agree on the configuration (codec, options, warm-up,
    seed, hyperparameters, parameter names and shapes) and fail together, naming the first difference.

    Args:
        params: parameters or parameter groups, as for torch.optim.SGD; ``(name, parameter)`` pairs
            (``model.named_parameters()``) name the compression state, else ``param.<k>`` by position.
        lr: as torch.optim.SGD; it may change between steps (schedulers).
        momentum: as torch.optim.SGD, in (0, 1) (default 0.9): the buffer is what crosses the wire, so a
            momentum is required (for plain SGD compress the gradient with a DDP hook).
        dampening: as torch.optim.SGD, in [0, 1) (default 0).
        weight_decay: as torch.optim.SGD, added to the gradient (default 0).
        nesterov: as torch.optim.SGD (default False; needs ``dampening=0``).
        **settings: the keywords of every compressed optimizer
            (:class:`~sylvie_comm.optim.momentum.MomentumOptimizer`): ``transport`` (required: the ranks to
            average among), ``codec`` (``onebit`` by default, ``sign``, ``topk``, ``qsgd``, ``fp16``, ``bf16`` or
            ``none``), ``warmup`` (steps of SGD on the fp32-averaged gradient, >= 0, 0 compressing from the first
            step, before the momenta compress; steps skipped for a NaN or Inf gradient do not count) or
            ``total_steps`` (the warm-up is then ``ceil(warmup_fraction * total_steps)``, ``warmup_fraction`` 0.05
            by default), ``seed``, ``rules``, ``monitor`` (the bound on ``lag`` calibrated for a momentum by
            default), ``close_transport``, and the codec's options (``chunk_size``, ``scale``, ``ratio``, ``bits``).

    Example::

        opt = CompressedSGD(model.named_parameters(), lr=0.05, momentum=0.9, transport=transport,
                            total_steps=10_000)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # local gradients: no all-reduce
            opt.step()                        # the collective, then the SGD update
    """

    what = WHAT
    warmup_meaning = "the steps of SGD on the fp32-averaged gradient before the momenta compress"
    warmup_minimum = 0
    default_warmup_fraction = SGD_WARMUP_FRACTION
    fp32_counts = ("step",)
    state_keys = frozenset({"step", "momentum_buffer"})

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **settings: Any,
    ) -> None:
        def hyperparameters() -> dict[str, Any]:
            _check_hyperparameters(lr, momentum, dampening, weight_decay, nesterov)
            return {"lr": float(lr), "momentum": float(momentum), "dampening": float(dampening),
                    "weight_decay": float(weight_decay), "nesterov": nesterov}  # fmt: skip

        super().__init__(params, hyperparameters, **settings)

    # ------------------------------------------------------------------ SGD's part

    def _check_group(self, index: int, group: Mapping[str, Any]) -> None:
        """A group's own ``lr``, ``momentum``, ... as the defaults (a group's momentum of 0 has nothing to average)."""
        _check_hyperparameters(group["lr"], group["momentum"], group["dampening"], group["weight_decay"],
                               group["nesterov"], where=f"{WHAT}: param_groups[{index}]")  # fmt: skip

    def _check_checkpoint(self, state_dict: Mapping[str, Any], what: str) -> None:
        """Each parameter's momentum buffer is finite and of its shape (its state's keys, a step count and the
        buffer, are checked by the base: :attr:`state_keys`)."""
        for name, p, entry in saved_states(state_dict, self.param_groups, self._names):
            if not entry:
                continue  # not stepped yet: its first step fills it
            buf = entry["momentum_buffer"]
            if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != tuple(p.shape):
                got = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
                raise ValueError(
                    f"{what}: checkpoint momentum_buffer of parameter '{name}' is {got}, expected a tensor of shape "
                    f"{tuple(p.shape)}"
                )
            if buf.device.type != "meta" and not bool(torch.isfinite(buf).all()):
                raise ValueError(f"{what}: checkpoint momentum_buffer of parameter '{name}' holds NaN or Inf")

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], device: torch.device) -> None:
        # The steps taken: a buffer of 0 steps is no buffer (torch.optim.SGD's None), decided on the device.
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _local_momentum(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any]
    ) -> torch.Tensor:
        """``b_r = momentum b + (1 - dampening) (g_r + weight_decay p)`` in fp32 (``g_r + ...`` at the first step)."""
        d = grad.float()
        if group["weight_decay"]:
            d = d.add(p.float(), alpha=group["weight_decay"])
        return _buffer(state, state["momentum_buffer"].float(), d, group)

    def _gradient_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any], ok: torch.Tensor
    ) -> None:
        """torch.optim.SGD's step with the averaged gradient ``grad`` (the warm-up), in the parameter's dtype."""
        d = grad.to(p.dtype)
        if group["weight_decay"]:
            d = d.add(p, alpha=group["weight_decay"])
        buf = _buffer(state, state["momentum_buffer"], d, group)
        direction = d.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        _apply(p, direction, buf, state, group, ok)

    def _momentum_step(
        self, p: torch.Tensor, momentum: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
        ok: torch.Tensor,
    ) -> None:  # fmt: skip
        """The averaged buffer ``B_t`` becomes the buffer; the step ``lr B_t``, or with Nesterov
        ``lr (B_t + momentum (B_t - B_{t-1}))`` (see the module docstring)."""
        buf = momentum.to(p.dtype)
        direction = buf.add(buf - state["momentum_buffer"], alpha=group["momentum"]) if group["nesterov"] else buf
        _apply(p, direction, buf, state, group, ok)


# ---------------------------------------------------------------------------------------------------------------------
# The updates. ``ok`` is a 0-dim bool tensor on the parameters' device: every state tensor is written only where it
# is set (kernels.copy_if reads it there), so a skipped step changes nothing and the host never reads a value.


def _buffer(state: dict[str, Any], buf: torch.Tensor, d: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
    """torch.optim.SGD's ``momentum buf + (1 - dampening) d``, with its ops; ``d`` at the parameter's first step.

    Without dampening the first step needs no test: the buffer starts at 0 and ``0 * momentum + 1 * d`` is ``d``
    (bit for bit); with dampening the step count decides, on the device."""
    new = buf.mul(group["momentum"]).add_(d, alpha=1 - group["dampening"])
    if group["dampening"]:
        new = torch.where(state["step"] == 0, d, new)
    return new


def _apply(p: torch.Tensor, direction: torch.Tensor, buf: torch.Tensor, state: dict[str, Any],
           group: Mapping[str, Any], ok: torch.Tensor) -> None:  # fmt: skip
    """``p <- p - lr direction``, the buffer ``buf`` and one more step, where ``ok``."""
    kernels.copy_if(p, p.add(direction, alpha=-group["lr"]), ok)
    kernels.copy_if(state["momentum_buffer"], buf.contiguous(), ok)
    kernels.copy_if(state["step"], state["step"] + 1, ok)


__all__ = ["SGD_WARMUP_FRACTION", "CompressedSGD"]
