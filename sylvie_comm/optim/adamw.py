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
parameters on every rank); where they do not, every rank raises a ValueError naming the parameter (a rank
whose own set did not change, at its next step), instead of sending payloads of different sizes (see
:meth:`CompressedAdamW._agree_on_gradients`). A step whose gradient is NaN or Inf on any rank is skipped on
every rank with every state tensor (parameters, moments, step counts, residuals) left as it was, decided on
the device from what every rank received (no host read in the step), as the algorithms' step guard does
(:mod:`sylvie_comm.algorithms.guard`); ``torch.amp.GradScaler`` calls :meth:`step` on every rank for it
(``_step_supports_amp_scaling``) instead of skipping it on the rank that overflowed, which would leave
the others waiting in the collective. A skipped step does not count towards the warm-up: the variance
freezes after ``warmup`` steps *taken* (GradScaler's first steps, with a large initial scale, are often
all skipped). The host learns each step's verdict at the start of the next step, from a copy made
without waiting for the device (see :meth:`CompressedAdamW._settle_verdict`).
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
        warmup: steps of uncompressed AdamW (>= 1) before the variance freezes; steps skipped for a NaN or Inf
            gradient do not count. Give it, or ``total_steps``.
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
        self._index = {id(p): i for i, (_, p) in enumerate(self._named)}
        # The host's view of the steps (see _settle_verdict and _agree_on_gradients).
        self._skipped_warm = 0  # warm-up steps skipped on every rank (non-finite): they do not count
        self._frozen = False  # the variance has been frozen (_freeze)
        self._verdict: tuple[Any, bool] | None = None  # the last step's verdict, not read yet, and its phase
        self._verdict_host: torch.Tensor | None = None  # pinned memory the verdict of a CUDA step is copied to
        self._recheck = False  # the last step was skipped: the ranks compare the gradients they had in it
        self._agreed: tuple[bool, ...] | None = None  # which parameters have a gradient, as the ranks agreed
        self._sent: tuple[bool, ...] | None = None  # which had one on this rank in the last step
        self._probes = 0  # probe steps (_probe), counted by the guard as skipped: not in skipped_nonfinite

    @property
    def _step(self) -> int:
        """Steps every rank called (skipped ones included): the statistics' and the checkpoint's step."""
        return int(self.session.step)

    @property
    def _policy_step(self) -> int:
        """The policy's and the algorithm's step: skipped warm-up steps left out, so the momentum starts
        compressing (policy step ``warmup``) after ``warmup`` steps taken. Exact once the verdict is settled."""
        return int(self.session.step) - self._skipped_warm

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
        """``warmup`` (uncompressed AdamW) until ``warmup`` steps have been taken (skipped ones do not count),
        ``compressed`` after (reads the last step's verdict on the host: not for the hot path)."""
        self._settle_verdict()
        return "warmup" if self._policy_step < self.warmup else "compressed"

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
        device = entries[0][1].device if entries else self._named[0][1].device if self._named else None
        for _, p in entries:
            if p.grad.is_sparse:
                raise RuntimeError(f"{WHAT}: parameter '{self._names[id(p)]}' has a sparse gradient (not supported)")
            if p.device != device:
                raise RuntimeError(
                    f"{WHAT}: parameters on {device} and {p.device}; the collective averages one buffer on one device"
                )
        if device is None:
            return
        self._settle_verdict()
        # The guard decides the last step now: after a skipped warm-up step the policy's step repeats.
        self.algorithm.guard.settle()
        if not self._frozen and self._policy_step >= self.warmup:
            self._freeze()
        warm = not self._frozen
        mask = tuple(p.grad is not None for _, p in self._named)
        self._agree_on_gradients(mask, warm, device)
        if not entries:
            return
        # torch.amp.GradScaler (``_step_supports_amp_scaling``): gradients still scaled unless unscale_() ran,
        # and this rank's own overflow flag, which every rank must see.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        inv = grad_scale.double().reciprocal().float().to(device) if grad_scale is not None else None
        local_bad = (found_inf.to(device) > 0).reshape(()) if found_inf is not None else None
        for _, p in entries:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        flat, slots = self._payload(entries, warm, device)
        for kind, group, p, view in slots:
            grad = cast(torch.Tensor, p.grad) if inv is None else cast(torch.Tensor, p.grad) * inv
            if kind == "momentum":
                beta1 = group["betas"][0]
                view.copy_(torch.lerp(self.state[p]["exp_avg"].float(), grad.float(), 1 - beta1))
            else:
                view.copy_(grad)
        poison([flat], local_bad)
        self._send(flat, slots)
        bad = nonfinite(flat)  # what every rank received: a NaN or Inf sent by any rank shows on every rank
        ok = torch.ones((), dtype=torch.bool, device=device) if bad is None else ~bad
        for kind, group, p, view in slots:
            if kind == "momentum":
                _frozen_update(p, view, self.state[p], group, ok)
            else:
                _adamw_update(p, view, self.state[p], group, ok)
        self._remember_verdict(ok, warm, mask)
        self.session.step += 1
        restart = getattr(self.transport, "restart_names", None)
        if restart is not None:  # Horovod: nothing in flight, so the next step's collective names repeat
            restart()

    def _payload(
        self, entries: list[tuple[dict[str, Any], torch.Tensor]], warm: bool, device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[str, dict[str, Any], torch.Tensor, torch.Tensor]]]:
        """One fp32 buffer and each parameter's view of it: the frozen parameters' local momenta, then the others'
        gradients (all of them in the warm-up; after it, parameters that got their first taken step after the
        freeze keep plain AdamW)."""
        frozen = [(g, p) for g, p in entries if not warm and "freeze_step" in self.state[p]]
        late = [(g, p) for g, p in entries if warm or "freeze_step" not in self.state[p]]
        flat = torch.empty(sum(p.numel() for _, p in entries), dtype=torch.float32, device=device)
        slots, at = [], 0
        for kind, items in (("momentum", frozen), ("gradient", late)):
            for group, p in items:
                slots.append((kind, group, p, flat[at : at + p.numel()].view(p.shape)))
                at += p.numel()
        return flat, slots

    def _send(self, flat: torch.Tensor, slots: list[tuple[str, dict[str, Any], torch.Tensor, torch.Tensor]]) -> None:
        """Average the payload through the policy at the policy's step, counted in this step's statistics."""
        members = []
        for kind, _, p, view in slots:
            name = self._names[id(p)]
            compress, opts = self._options[name] if kind == "momentum" else (False, {})
            members.append(Member(name, view, compress, opts))
        self.session.policy(Group(0, members, flat=flat), self._policy_step, self.session.meter()).wait()

    # ------------------------------------------------------------------ the host's view of the steps

    def _remember_verdict(self, ok: torch.Tensor, warm: bool, mask: tuple[bool, ...]) -> None:
        """Keep the step's verdict (``ok``: taken on every rank) for the host to read at the next step. On CUDA it
        is copied to pinned memory behind the step's work, so reading it then waits for nothing still running."""
        if ok.device.type == "cuda":
            if self._verdict_host is None:
                self._verdict_host = torch.empty((), dtype=torch.bool, pin_memory=True)
            with torch.cuda.device(ok.device):
                self._verdict_host.copy_(ok, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            self._verdict = (event, warm)
        else:
            self._verdict = (ok, warm)
        self._sent = mask

    def _settle_verdict(self) -> None:
        """Read the last step's verdict on the host: a skipped warm-up step does not count towards the warm-up, and
        after any skipped step the ranks compare the gradients they had in it (see :meth:`_agree_on_gradients`).

        This is the one host read per step, one step late: on the CPU the value is at hand; on CUDA it waits for
        the copy queued behind the last step's collective (done, in a training loop, while the host queued the
        forward and backward passes since), not for the work queued after it. A ``meta`` tensor has no value:
        there nothing is found non-finite."""
        if self._verdict is None:
            return
        held, warm = self._verdict
        self._verdict = None
        if isinstance(held, torch.cuda.Event):
            held.synchronize()
            taken = bool(cast(torch.Tensor, self._verdict_host).item())
        else:
            taken = held.device.type == "meta" or bool(held.item())
        if not taken:
            self._recheck = True
            if warm:
                self._skipped_warm += 1

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
        self._frozen = True

    def _agree_on_gradients(self, mask: tuple[bool, ...], warm: bool, device: torch.device) -> None:
        """Fail on every rank, naming the parameter, where the ranks differ in which parameters have a gradient.

        The payload's size follows that set, and ranks whose sizes differ would abort in the collective (gloo) or
        read each other's bytes. A check every step would cost a host read of the device per step, so the ranks
        compare their sets (:meth:`_compare_gradients`, a host all-gather) only when some rank can know it is
        needed:

        * at the first step (after construction or a load), and every step while the agreed set is empty;
        * on a rank whose set differs from the agreed one: it first sends a *probe*, the payload of the agreed set
          filled with NaN, so that its collectives pair with those of the ranks whose set did not change; the
          step is then skipped on every rank, and they compare at their next step (below); if every rank's set
          changed alike, all of them compared now and the step is sent again with the new set;
        * after a skipped step (its verdict, read on the host one step late: :meth:`_settle_verdict`): on a rank
          whose set did not change, this is where it learns that another's did.

        So a step with the agreed set costs nothing, and a new set (every rank's) one more collective round."""
        if self._recheck:
            self._recheck = False
            self._compare_gradients(cast(tuple[bool, ...], self._sent))
        if self._agreed is None or not any(self._agreed):
            self._compare_gradients(mask)
        elif mask != self._agreed:
            self._probe(warm, device)
            self._compare_gradients(mask)
            self._probes += 1
        self._agreed = mask

    def _probe(self, warm: bool, device: torch.device) -> None:
        """The payload of the agreed set of parameters, filled with zeros and one NaN: it pairs with the steps of
        ranks whose set did not change, and every rank skips it (state as before, the guard's put back now)."""
        agreed = cast(tuple[bool, ...], self._agreed)
        items = [(g, p) for g in self.param_groups for p in g["params"] if agreed[self._index[id(p)]]]
        flat, slots = self._payload(items, warm, device)
        flat.zero_()
        poison([flat], torch.ones((), dtype=torch.bool, device=device))
        self._send(flat, slots)
        self.algorithm.guard.settle()

    def _compare_gradients(self, mask: tuple[bool, ...]) -> None:
        """Every rank's set of parameters with a gradient; a ValueError on every rank where they differ."""
        masks = self.session.objects.all_gather_object(mask)
        for i, (name, _) in enumerate(self._named):
            having = [r for r, m in enumerate(masks) if m[i]]
            if 0 < len(having) < len(masks):
                lacking = [r for r in range(len(masks)) if r not in having]
                self._agreed, self._sent, self._recheck, self._verdict = None, None, False, None
                raise ValueError(
                    f"{WHAT}[{self.name}] step: parameter '{name}' has a gradient on {_ranks(having)} but none "
                    f"(grad None) on {_ranks(lacking)}; every rank must hold gradients for the same parameters "
                    "(give an unused parameter a zero gradient on the ranks that did not use it, e.g. "
                    "zero_grad(set_to_none=False), or build the optimizer without it)"
                )

    # ------------------------------------------------------------------ reports and state

    def stats(self) -> dict[str, Any]:
        """Wire bytes (``bytes_sent``), the fp32 all-reduce of the same values (``bytes_uncompressed``), their
        ``compression_ratio``, ``collectives``, encode/decode seconds, cumulative and for ``last_step``; the
        ``phase``, ``warmup_steps``, ``step``, ``skipped_nonfinite`` and ``warmup_skipped`` (the skipped steps
        that fell in the warm-up, which does not count them)."""
        stats = self.session.stats()
        stats["skipped_nonfinite"] -= self._probes
        return {**stats, "codec": self.name, "phase": self.phase, "warmup_steps": self.warmup,
                "warmup_skipped": self._skipped_warm, "step": self._step}  # fmt: skip

    def memory_bytes(self) -> int:
        """Bytes kept between steps: the moments and the compression state (residuals, the guard's copies)."""
        moments = sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())
        return int(moments) + self.algorithm.memory_bytes()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state (moments, steps, each parameter's ``freeze_step``) and ``sylvie_comm``: the codec,
        configuration, world size, rank, step, phase, ``warmup_skipped`` (the skipped warm-up steps, which the
        warm-up does not count) and this rank's compression state by parameter name.

        The compression state is per rank: save it on every rank and load each rank's own."""
        out = super().state_dict()
        phase = self.phase  # reads the last step's verdict: warmup_skipped is exact
        out["sylvie_comm"] = {**self.session.state_dict(), "phase": phase, "warmup_skipped": self._skipped_warm}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own).

        Every field is checked before anything is loaded (a ValueError names the first that does not fit),
        then the ranks agree: all load, or none, and only checkpoints of one step."""
        who = f"{WHAT}[{self.name}]"
        what = f"{who} load_state_dict"
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups", "sylvie_comm"} <= set(state_dict):
            raise ValueError(f"{what}: expected a dict from CompressedAdamW.state_dict() with 'state', "
                             "'param_groups' and 'sylvie_comm' entries")  # fmt: skip
        ours = dict(state_dict["sylvie_comm"]) if isinstance(state_dict["sylvie_comm"], Mapping) else {}
        phase = ours.pop("phase", None)
        # Written before skipped steps were left out of the warm-up: every step counted, as if none was skipped.
        skipped = ours.pop("warmup_skipped", 0)

        def check(ours: Mapping[str, Any], step: int) -> None:
            if not _integer(skipped) or not 0 <= skipped <= step:
                raise ValueError(f"{what}: checkpoint field warmup_skipped must be an integer in [0, {step}] (the "
                                 f"checkpoint's step), got {skipped!r}")  # fmt: skip
            expected = "warmup" if step - skipped < self.warmup else "compressed"
            if phase != expected:
                raise ValueError(f"{what}: checkpoint phase {phase!r} does not fit its step {step} with "
                                 f"{skipped} warm-up steps skipped (expected {expected!r} with warmup "
                                 f"{self.warmup})")  # fmt: skip
            for name, freeze in _freeze_steps(state_dict, self.param_groups, self._names):
                if not float(freeze) >= 1:
                    raise ValueError(
                        f"{what}: checkpoint freeze_step {float(freeze)} of parameter '{name}' must be at least 1: "
                        "a variance frozen before any step was taken divides by bias corrections of 0 (NaN)"
                    )

        # The session appends ' load_state_dict' to the name it is given in the ranks' agreement.
        step = self.session.load_state_dict(ours, ((n, p.shape) for n, p in self._named), check=check,
                                            stepped=False, what=who)  # fmt: skip
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
        self._skipped_warm = skipped
        # The freeze happens at the start of the step of policy step ``warmup``: done once that step was taken.
        self._frozen = step - skipped > self.warmup
        # Nothing pending: the ranks compare their gradients again at the next step.
        self._verdict, self._recheck, self._agreed, self._sent = None, False, None, None

    def close(self) -> None:
        """Stop the algorithm's communication thread (and close the transport if this optimizer owns it)."""
        self.session.close(transport=self._close_transport)


def _freeze_steps(
    state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]], names: Mapping[int, str]
) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's ``freeze_step`` values that can be read, with their parameters' names (a checkpoint of
    another shape is left to torch.optim's own load to refuse)."""
    saved, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(saved, Mapping) or not isinstance(groups, list):
        return []
    ids = [i for g in groups if isinstance(g, Mapping) for i in g.get("params", ())]
    params = [p for g in param_groups for p in g["params"]]
    out = []
    for i, p in zip(ids, params, strict=False):
        entry = saved.get(i)
        freeze = entry.get("freeze_step") if isinstance(entry, Mapping) else None
        if isinstance(freeze, torch.Tensor) and freeze.device.type != "meta" and freeze.numel() == 1:
            out.append((names[id(p)], freeze))
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


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
