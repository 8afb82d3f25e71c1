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

Every rank must call :meth:`CompressedAdamW.step` at every step (it is a collective); parameters whose
``.grad`` is None are skipped as :class:`torch.optim.AdamW` skips them, and every rank must then hold
gradients for the same parameters (data-parallel training does: DDP fills ``.grad`` of the same
parameters on every rank). A step whose gradient is NaN or Inf on any rank is skipped on every rank
with every state tensor (parameters, moments, step counts, residuals) left as it was, decided on the
device from what every rank received (no host read), as the algorithms' step guard does
(:mod:`sylvie_comm.algorithms.guard`); ``torch.amp.GradScaler`` calls :meth:`step` on every rank for it
(``_step_supports_amp_scaling``) instead of skipping it on the rank that overflowed, which would leave
the others waiting in the collective.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives import Transport
from sylvie_comm.config import Config

# The algorithms that average the momentum: error feedback (onebit, sign, topk, qsgd), casts, and plain fp32.
# The low-rank ones (acpsgd, powersgd) and auto are gradient algorithms only here: not supported.
MOMENTUM_CODECS = ("bf16", "fp16", "none", "onebit", "qsgd", "sign", "topk")
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
_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WHAT = "CompressedAdamW"


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def resolve_warmup(warmup: int | None, total_steps: int | None, fraction: float) -> int:
    """The warm-up length: ``warmup`` itself, or ``ceil(fraction * total_steps)`` (at least 1)."""
    if not _number(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"{WHAT}: warmup_fraction must be a number in (0, 1], got {fraction!r}")
    if total_steps is not None and (not _integer(total_steps) or total_steps < 1):
        raise ValueError(f"{WHAT}: total_steps must be an integer >= 1, got {total_steps!r}")
    if warmup is None:
        if total_steps is None:
            raise ValueError(
                f"{WHAT}: pass warmup= (the steps of uncompressed AdamW before the variance is frozen) or "
                f"total_steps= (warm-up {DEFAULT_WARMUP_FRACTION:g} of them by default, warmup_fraction=)"
            )
        return max(1, math.ceil(fraction * total_steps))
    if not _integer(warmup) or warmup < 1:
        raise ValueError(
            f"{WHAT}: warmup must be an integer >= 1, got {warmup!r}: the compressed steps divide by the "
            "second moment the warm-up estimated, and without one it is zero"
        )
    return warmup


def _check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[float, float]:
    """torch.optim.AdamW's checks, with the rule in each message; returns the betas."""
    if not _number(lr) or lr < 0:
        raise ValueError(f"{WHAT}: lr must be a finite number >= 0, got {lr!r}")
    if not _number(eps) or eps < 0:
        raise ValueError(f"{WHAT}: eps must be a finite number >= 0, got {eps!r}")
    if not _number(weight_decay) or weight_decay < 0:
        raise ValueError(f"{WHAT}: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{WHAT}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not _number(b) or not 0 <= b < 1:
            raise ValueError(f"{WHAT}: betas[{i}] must be a number in [0, 1), got {b!r}")
    return float(betas[0]), float(betas[1])


class CompressedAdamW(torch.optim.Optimizer):
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
        transport: the ranks to average among (:class:`~sylvie_comm.collectives.Transport`).
        codec: the algorithm that averages the momentum: ``onebit`` (default), ``sign``, ``topk``,
            ``qsgd``, ``fp16``, ``bf16`` or ``none`` (plain fp32).
        warmup: steps of uncompressed AdamW (>= 1) before the variance freezes. Give it, or ``total_steps``.
        total_steps: the run's length; the warm-up is then ``ceil(warmup_fraction * total_steps)``.
        warmup_fraction: see ``total_steps`` (default 0.1).
        seed: agreed by every rank (qsgd's noise).
        rules: per-parameter-name rules (:class:`~sylvie_comm.config.Rule`: send a momentum raw, or
            other options), as for the hooks.
        close_transport: :meth:`close` closes ``transport`` too (the adapters that create it set it).
        **options: the codec's options (``chunk_size``, ``scale``, ``ratio``, ``bits``).

    Example::

        opt = CompressedAdamW(model.named_parameters(), lr=1e-3, transport=transport, total_steps=10_000)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # local gradients: no all-reduce
            opt.step()                        # the collective, then the AdamW update
    """

    # torch.amp.GradScaler calls step() on every rank, passing grad_scale and found_inf (see step()).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        denom_floor: float = DEFAULT_DENOM_FLOOR,
        transport: Transport,
        codec: str = "onebit",
        warmup: int | None = None,
        total_steps: int | None = None,
        warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
        seed: int = 0,
        rules: Iterable[Any] = (),
        close_transport: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(transport, Transport):
            raise TypeError(f"{WHAT}: transport must be a sylvie_comm Transport, got {type(transport).__name__}")
        self.transport = transport
        self.world_size = transport.world_size
        self._close_transport = close_transport
        self._building = True
        params = list(params)

        def build() -> Config:
            b1, b2 = _check_hyperparameters(lr, betas, eps, weight_decay)
            if not _number(denom_floor) or denom_floor < 0:
                raise ValueError(f"{WHAT}: denom_floor must be a finite number >= 0, got {denom_floor!r}")
            steps = resolve_warmup(warmup, total_steps, warmup_fraction)
            if not isinstance(codec, str) or codec not in MOMENTUM_CODECS:
                extra = "; the low-rank algorithms and auto average gradients only" if codec in (
                    "acpsgd", "powersgd", "auto") else ""  # fmt: skip
                raise ValueError(
                    f"{WHAT}: codec {codec!r} cannot average the momentum; valid: {', '.join(MOMENTUM_CODECS)}{extra}"
                )
            defaults = {"lr": float(lr), "betas": (b1, b2), "eps": float(eps), "weight_decay": float(weight_decay),
                        "denom_floor": float(denom_floor)}  # fmt: skip
            super(CompressedAdamW, self).__init__(params, defaults)
            self._named = self._name_parameters()
            # The warm-up is this optimizer's own, the policy's fixed ``warmup_steps``: where the configuration
            # also has a per-tensor adaptive warm-up it is turned off (the momentum compresses from the freeze on).
            fixed: dict[str, Any] = (
                {"warmup": "fixed"} if "warmup" in {f.name for f in dataclasses.fields(Config)} else {}
            )
            return Config(codec=codec, options=dict(options), warmup_steps=steps, seed=seed, rules=tuple(rules),
                          **fixed)  # fmt: skip

        def describe(session: Session) -> dict[str, Any]:
            shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in self._named)
            g = self.defaults
            return {"optimizer": {"lr": g["lr"], "betas": list(g["betas"]), "eps": g["eps"],
                                  "weight_decay": g["weight_decay"], "denom_floor": g["denom_floor"],
                                  "parameters": len(self._named),
                                  "parameter_digest": f"{zlib.crc32(shapes.encode()):08x}"}}  # fmt: skip

        self.session = Session.agreed(
            WHAT, transport, build, describe=describe, close_transport=False,
            prepare=lambda session: session.policy.check_parameters(self._named, WHAT),
        )  # fmt: skip
        self.policy = self.session.policy
        self._building = False
        self.config = self.policy.config
        self.algorithm = self.policy.algorithm
        self.name = self.algorithm.name
        self.warmup = self.config.warmup_steps
        self._names = {id(p): n for n, p in self._named}
        self._options: dict[str, tuple[bool, Mapping[str, Any]]] = {
            n: self.policy.member_options(n, p.shape) for n, p in self._named
        }

    @property
    def _step(self) -> int:
        """Steps taken by every rank (skipped ones included): the phase and the algorithm's step."""
        return int(self.session.step)

    # ------------------------------------------------------------------ set-up

    def _name_parameters(self) -> list[tuple[str, torch.Tensor]]:
        named: list[tuple[str, torch.Tensor]] = []
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                name = str(names[i]) if names else f"param.{len(named)}"
                if p.is_complex() or p.dtype not in _PARAM_DTYPES:
                    kinds = ", ".join(str(d).replace("torch.", "") for d in _PARAM_DTYPES)
                    raise TypeError(
                        f"{WHAT}: parameter '{name}' is {str(p.dtype).replace('torch.', '')}; the optimizer "
                        f"averages in fp32 and steps {kinds} parameters"
                    )
                named.append((name, p))
        seen: set[str] = set()
        for n, _ in named:
            if n in seen:
                raise ValueError(f"{WHAT}: two parameters are named '{n}'; the compression state is kept by name")
            seen.add(n)
        return named

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                f"{WHAT}: parameter groups cannot be added after construction: the ranks agreed on the parameters "
                "then; build a new optimizer over all of them"
            )
        super().add_param_group(param_group)

    @property
    def phase(self) -> str:
        """``warmup`` (uncompressed AdamW) before ``warmup`` steps, ``compressed`` after."""
        return "warmup" if self._step < self.warmup else "compressed"

    # ------------------------------------------------------------------ the step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average (gradients in the warm-up, momenta after), then take the AdamW step; a collective.

        Skipped on every rank, every state tensor as before, when a gradient is NaN or Inf on any rank
        (counted in ``stats()["skipped_nonfinite"]``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._take_step()
        return loss

    def _take_step(self) -> None:
        entries = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not entries:
            return
        device = entries[0][1].device
        for _, p in entries:
            if p.grad.is_sparse:
                raise RuntimeError(f"{WHAT}: parameter '{self._names[id(p)]}' has a sparse gradient (not supported)")
            if p.device != device:
                raise RuntimeError(
                    f"{WHAT}: parameters on {device} and {p.device}; the collective averages one buffer on one device"
                )
        # torch.amp.GradScaler (``_step_supports_amp_scaling``): gradients still scaled unless unscale_() ran,
        # and this rank's own overflow flag, which every rank must see.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        inv = grad_scale.double().reciprocal().float().to(device) if grad_scale is not None else None
        local_bad = (found_inf.to(device) > 0).reshape(()) if found_inf is not None else None
        warm = self._step < self.warmup
        if not warm and self._step == self.warmup:  # the variance freezes with the bias corrections
            for _, p in self._named:
                state = self.state.get(p)
                if state:
                    state["freeze_step"] = state["step"].clone()
        frozen: list[tuple[dict[str, Any], torch.Tensor]] = []
        late: list[tuple[dict[str, Any], torch.Tensor]] = []
        for group, p in entries:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            (frozen if not warm and "freeze_step" in state else late).append((group, p))
        # One fp32 buffer: the frozen parameters' local momenta, then the others' gradients (all of them in
        # the warm-up; after it, parameters that got their first gradient after the freeze keep plain AdamW).
        numel = sum(p.numel() for _, p in entries)
        flat = torch.empty(numel, dtype=torch.float32, device=device)
        members, views, at = [], [], 0
        for kind, items in (("momentum", frozen), ("gradient", late)):
            for group, p in items:
                name, view = self._names[id(p)], flat[at : at + p.numel()].view(p.shape)
                at += p.numel()
                grad = cast(torch.Tensor, p.grad) if inv is None else cast(torch.Tensor, p.grad) * inv
                if kind == "momentum":
                    beta1 = group["betas"][0]
                    view.copy_(torch.lerp(self.state[p]["exp_avg"].float(), grad.float(), 1 - beta1))
                    compress, opts = self._options[name]
                else:
                    view.copy_(grad)
                    compress, opts = False, {}
                members.append(Member(name, view, compress, opts))
                views.append((kind, group, p, view))
        poison([flat], local_bad)
        self.session.run(Group(0, members, flat=flat)).wait()
        bad = nonfinite(flat)  # what every rank received: a NaN or Inf sent by any rank shows on every rank
        ok = torch.ones((), dtype=torch.bool, device=device) if bad is None else ~bad
        for kind, group, p, view in views:
            if kind == "momentum":
                _frozen_update(p, view, self.state[p], group, ok)
            else:
                _adamw_update(p, view, self.state[p], group, ok)
        self.session.step += 1
        restart = getattr(self.transport, "restart_names", None)
        if restart is not None:  # Horovod: nothing in flight, so the next step's collective names repeat
            restart()

    # ------------------------------------------------------------------ reports and state

    def stats(self) -> dict[str, Any]:
        """Wire bytes (``bytes_sent``), the fp32 all-reduce of the same values (``bytes_uncompressed``), their
        ``compression_ratio``, ``collectives``, encode/decode seconds, cumulative and for ``last_step``; the
        ``phase``, ``warmup_steps``, ``step`` and ``skipped_nonfinite``."""
        return {**self.session.stats(), "codec": self.name, "phase": self.phase,
                "warmup_steps": self.warmup, "step": self._step}  # fmt: skip

    def memory_bytes(self) -> int:
        """Bytes kept between steps: the moments and the compression state (residuals, the guard's copies)."""
        moments = sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())
        return int(moments) + self.algorithm.memory_bytes()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state (moments, steps, each parameter's ``freeze_step``) and ``sylvie_comm``: the codec,
        configuration, world size, rank, step, phase and this rank's compression state by parameter name.

        The compression state is per rank: save it on every rank and load each rank's own."""
        out = super().state_dict()
        out["sylvie_comm"] = {**self.session.state_dict(), "phase": self.phase}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own).

        Every field is checked before anything is loaded (a ValueError names the first that does not fit),
        then the ranks agree: all load, or none, and only checkpoints of one step."""
        what = f"{WHAT}[{self.name}] load_state_dict"
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups", "sylvie_comm"} <= set(state_dict):
            raise ValueError(f"{what}: expected a dict from CompressedAdamW.state_dict() with 'state', "
                             "'param_groups' and 'sylvie_comm' entries")  # fmt: skip
        ours = dict(state_dict["sylvie_comm"]) if isinstance(state_dict["sylvie_comm"], Mapping) else {}
        phase = ours.pop("phase", None)

        def check(ours: Mapping[str, Any], step: int) -> None:
            expected = "warmup" if step < self.warmup else "compressed"
            if phase != expected:
                raise ValueError(f"{what}: checkpoint phase {phase!r} does not fit its step {step} (expected "
                                 f"{expected!r} with warmup {self.warmup})")  # fmt: skip

        step = self.session.load_state_dict(ours, ((n, p.shape) for n, p in self._named), check=check,
                                            stepped=False, what=what)  # fmt: skip
        # torch.optim casts every state tensor but 'step' to the parameter's dtype: the step counts stay fp32.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        counts = {
            id(p): {k: v for k, v in state_dict["state"][i].items() if k in ("step", "freeze_step")}
            for i, p in zip(saved_ids, params, strict=False)
            if i in state_dict["state"]
        }
        super().load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        for p in params:
            for key, value in counts.get(id(p), {}).items():
                self.state[p][key] = torch.as_tensor(value).to(dtype=torch.float32, device=p.device).clone()
        self.session.step = step

    def close(self) -> None:
        """Stop the algorithm's communication thread (and close the transport if this optimizer owns it)."""
        self.session.close(transport=self._close_transport)


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
