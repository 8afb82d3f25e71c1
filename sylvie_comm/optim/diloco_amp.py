"""``torch.amp.GradScaler`` and DiLoCo's inner steps: every replica counts every inner step, a skipped one too.

The scaler steps an optimizer that does not handle the scaling itself only where its gradients are finite: a skip on
one replica would leave it an inner step behind the others for the rest of the run, syncing out of phase.
:func:`hook_amp` marks the inner optimizer ``_step_supports_amp_scaling`` (as torch's fused optimizers are), so the
scaler steps it every time with ``grad_scale`` and ``found_inf`` set; its wrapper reads ``found_inf`` (the host
read the scaler makes itself otherwise), unscales the gradients as ``unscale_`` does (:func:`unscale`) and steps
where it is zero, and counts the inner step where it is not.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def unscale(opt: torch.optim.Optimizer, grad_scale: torch.Tensor) -> None:
    """Divide the gradients ``opt`` steps by ``grad_scale`` as ``GradScaler.unscale_`` does: the same reciprocal,
    the same kernel, by device and dtype (so the bits are the scaler's own)."""
    inv = grad_scale.double().reciprocal().float()
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.dtype == torch.float16:
                raise ValueError("DiLoCo: GradScaler does not unscale float16 gradients (it refuses them itself); "
                                 "keep the parameters in float32 and run the forward pass under autocast")  # fmt: skip
            g = g._values() if g.is_sparse else g
            grads.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), tensors in grads.items():
        found = torch.zeros((), device=device)  # the scaler has already looked for an Inf
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv.to(device))


def hook_amp(opt: torch.optim.Optimizer, skipped: Callable[[], None]) -> Any:
    """Let the scaler call ``opt.step()`` on every step (see the module docstring); ``skipped()`` counts an inner
    step whose update the scaler skips. Returns the wrapper set on ``opt`` (:func:`unhook_amp` takes it off), or
    None where ``opt`` handles the scaling itself already (torch's fused optimizers, the compressed ones). Without
    a scaler the wrapper calls the optimizer's own ``step()``."""
    if getattr(opt, "_step_supports_amp_scaling", False):
        return None
    step = opt.step

    def amp_step(this: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        found_inf = this.__dict__.pop("found_inf", None)
        if found_inf is None:  # no scaler, or a disabled one
            return step(*args, **kwargs)
        grad_scale = this.__dict__.pop("grad_scale", None)
        try:
            if found_inf.item():
                skipped()  # the scaler skips the update: still an inner step
                return None
            if grad_scale is not None:  # None where the loop ran scaler.unscale_(opt) itself
                unscale(this, grad_scale)
            return step(*args, **kwargs)  # torch's own optimizers refuse grad_scale and found_inf
        finally:
            this.__dict__.update(found_inf=found_inf, grad_scale=grad_scale)  # the scaler deletes them

    if getattr(step, "_wrapped_by_lr_sched", False):  # an LR scheduler's, built before: it checks for its mark
        amp_step.__dict__["_wrapped_by_lr_sched"] = True
    # A bound method, as torch's LR schedulers expect of step() (one built after wraps its __func__).
    wrapper = opt.__dict__["step"] = types.MethodType(amp_step, opt)
    opt.__dict__["_step_supports_amp_scaling"] = True
    return wrapper


def unhook_amp(opt: torch.optim.Optimizer, wrapper: Any) -> None:
    """Take :func:`hook_amp`'s ``wrapper`` off ``opt``. An LR scheduler built after it wrapped the wrapper: it stays
    then (it steps as the optimizer would)."""
    if wrapper is not None and opt.__dict__.get("step") is wrapper:
        del opt.__dict__["step"]
        opt.__dict__.pop("_step_supports_amp_scaling", None)


__all__ = ["hook_amp", "unhook_amp", "unscale"]
