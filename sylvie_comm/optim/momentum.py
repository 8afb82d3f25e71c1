"""What every optimizer whose momentum crosses the wire compressed shares: :class:`MomentumOptimizer`.

An optimizer of this family (:class:`~sylvie_comm.optim.CompressedAdamW`, :class:`~sylvie_comm.optim.CompressedSGD`)
averages the ranks' gradients in fp32 for a warm-up, then has each rank update its momentum from its own
gradient and the ranks average the momenta through an error-feedback algorithm; the subclass holds only its
update rule (the hooks listed in :class:`MomentumOptimizer`). The base holds the rest, written once:

* **set-up**: the transport, the :class:`~sylvie_comm.algorithms.session.Session` and its policy (the warm-up is
  the policy's fixed ``warmup_steps``), the ranks agreeing on codec, options, warm-up, seed, hyperparameters and
  the parameters' names and shapes (they fail together, naming the first difference);
* **the step**: one fp32 payload per step (the averaged gradients in the warm-up, the local momenta after it),
  sent through the policy at the policy's step;
* **gradients present on some ranks only**: every rank must hold gradients for the same parameters (data-parallel
  training does: DDP fills ``.grad`` of the same parameters on every rank); where they do not, every rank raises a
  ValueError naming the parameter (a rank whose own set did not change, at its next step) instead of sending
  payloads of different sizes (:mod:`sylvie_comm.optim.agreement`);
* **non-finite steps**: a step whose gradient is NaN or Inf on any rank is skipped on every rank with every state
  tensor (parameters, moments, step counts, residuals) left as it was, decided on the device from what every rank
  received (no host read in the step), as the algorithms' step guard does (:mod:`sylvie_comm.algorithms.guard`);
  ``torch.amp.GradScaler`` calls :meth:`~MomentumOptimizer.step` on every rank for it (``_step_supports_amp_scaling``)
  instead of skipping it on the rank that overflowed, which would leave the others waiting in the collective;
* **the warm-up counts steps taken**: a skipped step does not count (GradScaler's first steps, with a large initial
  scale, are often all skipped): the session counts every step and leaves those out of its policy's count. The host
  learns each step's verdict at the start of the next step, from a copy made without waiting for the device (see
  :meth:`~sylvie_comm.optim.agreement.StepAgreement.settle`);
* **checkpoints**: torch.optim's state plus ``sylvie_comm`` (the session's one checkpoint format, the phase and
  ``warmup_skipped``), checked before anything is loaded (another optimizer's by its state's keys and its
  hyperparameters), the ranks agreeing; ``stats()``, ``memory_bytes()``,
  ``close()``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, cast

import torch

from sylvie_comm.algorithms import ALGORITHMS, Group, Member
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives import Transport
from sylvie_comm.config import Config
from sylvie_comm.optim.agreement import Mask, StepAgreement

# The algorithms that average the momentum (``averages_momentum``: error feedback, casts, plain fp32), sorted.
# The low-rank ones and auto are gradient algorithms only.
MOMENTUM_CODECS = tuple(sorted(name for name, cls in ALGORITHMS.items() if cls.record.averages_momentum))
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# One payload slot: "momentum" (this rank's momentum, averaged by the algorithm) or "gradient" (this rank's gradient,
# averaged in fp32), the parameter's group, the parameter, and its view of the payload.
Slot = tuple[str, dict[str, Any], torch.Tensor, torch.Tensor]


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def is_integer(value: Any) -> bool:
    """An int (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int)


def resolve_warmup(
    warmup: int | None, total_steps: int | None, fraction: float, *, what: str, default_fraction: float,
    meaning: str, minimum: int = 1, why: str = "",
) -> int:  # fmt: skip
    """The warm-up length: ``warmup`` itself (an integer >= ``minimum``), or ``ceil(fraction * total_steps)``
    (at least 1).

    Args:
        what: the optimizer's name in the messages.
        default_fraction: its default ``warmup_fraction``, named in the message when neither length is given.
        meaning: what the warm-up's steps are, for that message.
        minimum: the shortest ``warmup`` accepted.
        why: the reason for ``minimum``, appended to the message of a shorter one.
    """
    if not is_number(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"{what}: warmup_fraction must be a number in (0, 1], got {fraction!r}")
    if total_steps is not None and (not is_integer(total_steps) or total_steps < 1):
        raise ValueError(f"{what}: total_steps must be an integer >= 1, got {total_steps!r}")
    if warmup is None:
        if total_steps is None:
            raise ValueError(
                f"{what}: pass warmup= ({meaning}) or total_steps= (warm-up {default_fraction:g} of them by default, "
                "warmup_fraction=)"
            )
        return max(1, math.ceil(fraction * total_steps))
    if not is_integer(warmup) or warmup < minimum:
        raise ValueError(f"{what}: warmup must be an integer >= {minimum}, got {warmup!r}{': ' + why if why else ''}")
    return warmup


def check_codec(what: str, codec: Any) -> str:
    """``codec`` if it can average a momentum (:data:`MOMENTUM_CODECS`), else a ValueError listing those that can."""
    if not isinstance(codec, str) or codec not in MOMENTUM_CODECS:
        gradients_only = isinstance(codec, str) and codec in ALGORITHMS  # registered, but not averages_momentum
        extra = "; the low-rank algorithms and auto average gradients only" if gradients_only else ""
        raise ValueError(
            f"{what}: codec {codec!r} cannot average the momentum; valid: {', '.join(MOMENTUM_CODECS)}{extra}"
        )
    return codec


def saved_states(
    state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]], names: Mapping[int, str]
) -> list[tuple[str, torch.Tensor, Mapping[str, Any]]]:
    """The checkpoint's per-parameter states that can be read, with their parameters (and names) in this optimizer
    (a checkpoint of another shape is left to torch.optim's own load to refuse)."""
    saved, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(saved, Mapping) or not isinstance(groups, list):
        return []
    ids = [i for g in groups if isinstance(g, Mapping) for i in g.get("params", ())]
    params = [p for g in param_groups for p in g["params"]]
    out = []
    for i, p in zip(ids, params, strict=False):
        entry = saved.get(i)
        if isinstance(entry, Mapping):
            out.append((names[id(p)], p, entry))
    return out


def _and_list(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


class MomentumOptimizer(torch.optim.Optimizer, abc.ABC):
    """An optimizer that averages the gradient in fp32 for a warm-up, then each rank's momentum through an
    error-feedback algorithm; see the module docstring for what it does for its subclasses.

    A subclass sets :attr:`what` and the warm-up's wording (:attr:`warmup_meaning`, :attr:`warmup_minimum`,
    :attr:`warmup_why`, :attr:`default_warmup_fraction`) and implements its update:

    * :meth:`_init_state`: a parameter's state at its first step;
    * :meth:`_local_momentum`: this rank's momentum from its own gradient (what the compressed steps average);
    * :meth:`_gradient_step`: the update from the fp32-averaged gradient (the warm-up);
    * :meth:`_momentum_step`: the update from the averaged momentum (the compressed steps);

    and, where it needs them, :meth:`_compresses` (which parameters send a momentum after the warm-up),
    :meth:`_begin_compressed` (at the end of the warm-up), :meth:`_check_checkpoint` and :attr:`fp32_counts`.
    The updates write every state tensor through :func:`sylvie_comm.kernels.copy_if` with the step's verdict
    ``ok``, so a skipped step changes nothing.

    Building one is a collective call (the ranks agree on the configuration); so is every :meth:`step` and
    :meth:`load_state_dict`.

    Args:
        params: parameters or parameter groups; ``(name, parameter)`` pairs (``model.named_parameters()``) name
            the compression state, else ``param.<k>`` by position.
        hyperparameters: checks the subclass's hyperparameters (a ValueError naming the value) and returns the
            optimizer's ``defaults``; called inside the ranks' agreement, so a rank's error fails every rank.
        transport: the ranks to average among (:class:`~sylvie_comm.collectives.Transport`).
        codec: the algorithm that averages the momentum (:data:`MOMENTUM_CODECS`; default ``onebit``).
        warmup: steps of fp32 gradient averaging before the momenta compress; steps skipped for a NaN or Inf
            gradient do not count. Give it, or ``total_steps``.
        total_steps: the run's length; the warm-up is then ``ceil(warmup_fraction * total_steps)``.
        warmup_fraction: see ``total_steps`` (default: the subclass's :attr:`default_warmup_fraction`).
        seed: agreed by every rank (qsgd's noise).
        rules: per-parameter-name rules (:class:`~sylvie_comm.config.Rule`), as for the hooks.
        monitor: the compression monitor's settings, as for the hooks (None: the defaults); an unset ``max_lag``
            is the bound calibrated for a momentum (:data:`~sylvie_comm.config.LAG_BOUNDS`).
        close_transport: :meth:`close` closes ``transport`` too (the adapters that create it set it).
        **options: the codec's options (``chunk_size``, ``scale``, ``ratio``, ``bits``).
    """

    # torch.amp.GradScaler calls step() on every rank, passing grad_scale and found_inf (see _take_step()).
    _step_supports_amp_scaling = True
    what: ClassVar[str] = "MomentumOptimizer"  # the name in messages
    warmup_meaning: ClassVar[str] = "the steps of fp32 gradient averaging before the momenta compress"
    warmup_minimum: ClassVar[int] = 1  # the shortest warmup= accepted
    warmup_why: ClassVar[str] = ""  # why a shorter one is refused
    default_warmup_fraction: ClassVar[float] = 0.1
    fp32_counts: ClassVar[tuple[str, ...]] = ("step",)  # per-parameter state kept fp32 on the device on load
    # A checkpoint's per-parameter state holds every one of ``state_keys`` and perhaps some of
    # ``optional_state_keys`` (or nothing: a parameter not stepped yet), and its parameter groups every
    # hyperparameter the optimizer was built with. Another optimizer's checkpoint of the same codec and warm-up
    # passes the compression state's checks, and torch.optim's load would take its state and groups as they are:
    # the first step would then fail on a key of this optimizer's that is missing (see _check_checkpoint_kind).
    state_keys: ClassVar[frozenset[str]] = frozenset({"step"})
    optional_state_keys: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self, params: Iterable[Any], hyperparameters: Callable[[], dict[str, Any]], *, transport: Transport,
        codec: str = "onebit", warmup: int | None = None, total_steps: int | None = None,
        warmup_fraction: float | None = None, seed: int = 0, rules: Iterable[Any] = (),
        monitor: Mapping[str, Any] | None = None, close_transport: bool = False, **options: Any,
    ) -> None:  # fmt: skip
        what = self.what
        if not isinstance(transport, Transport):
            raise TypeError(f"{what}: transport must be a sylvie_comm Transport, got {type(transport).__name__}")
        self.transport = transport
        self.world_size = transport.world_size
        self._close_transport = close_transport
        self._building = True
        params = list(params)

        def build() -> Config:
            defaults = hyperparameters()
            # The hyperparameters every checkpoint's groups must hold (torch.optim adds to ``defaults`` on a load).
            self._hyperparameters = tuple(defaults)
            fraction = self.default_warmup_fraction if warmup_fraction is None else warmup_fraction
            steps = resolve_warmup(warmup, total_steps, fraction, what=what, minimum=self.warmup_minimum,
                                   default_fraction=self.default_warmup_fraction, meaning=self.warmup_meaning,
                                   why=self.warmup_why)  # fmt: skip
            check_codec(what, codec)
            torch.optim.Optimizer.__init__(self, params, defaults)
            self._named = self._name_parameters()
            # The warm-up is this optimizer's own, the policy's fixed ``warmup_steps``: where the configuration
            # also has a per-tensor adaptive warm-up it is turned off (the momenta compress from its end on).
            fixed: dict[str, Any] = (
                {"warmup": "fixed"} if "warmup" in {f.name for f in dataclasses.fields(Config)} else {}
            )
            return Config(codec=codec, options=dict(options), warmup_steps=steps, seed=seed, rules=tuple(rules),
                          monitor=dict(monitor or {}), **fixed)  # fmt: skip

        def describe(session: Session) -> dict[str, Any]:
            shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in self._named)
            hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in self.defaults.items()}
            return {"optimizer": {**hyper, "parameters": len(self._named),
                                  "parameter_digest": f"{zlib.crc32(shapes.encode()):08x}"}}  # fmt: skip

        self.session = Session.agreed(
            what, transport, build, describe=describe, close_transport=False, averages="momentum",
            prepare=lambda session: session.policy.check_parameters(self._named, what),
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
        # The host's view of the steps: each one's verdict and the parameters with a gradient the ranks agreed on;
        # the session counts the steps, the warm-up steps skipped on every rank left out of its policy's count.
        self._agreement = StepAgreement(self.session, [n for n, _ in self._named], f"{what}[{self.name}]")
        self._compressing = False  # the warm-up is over (_begin_compressed ran)

    # ------------------------------------------------------------------ the subclass's update

    @abc.abstractmethod
    def _init_state(self, p: torch.Tensor, state: dict[str, Any], device: torch.device) -> None:
        """Fill ``state`` (empty) for ``p``'s first step."""

    @abc.abstractmethod
    def _local_momentum(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any]
    ) -> torch.Tensor:
        """This rank's momentum after this step from its own gradient ``grad`` (unscaled): what the ranks average."""

    @abc.abstractmethod
    def _gradient_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any], ok: torch.Tensor
    ) -> None:
        """The update from the fp32-averaged gradient ``grad``, written where ``ok``."""

    @abc.abstractmethod
    def _momentum_step(
        self, p: torch.Tensor, momentum: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
        ok: torch.Tensor,
    ) -> None:  # fmt: skip
        """The update from the averaged momentum ``momentum`` (fp32), written where ``ok``."""

    def _compresses(self, p: torch.Tensor) -> bool:
        """Whether ``p`` sends its momentum after the warm-up (else its gradient, averaged in fp32)."""
        return True

    def _begin_compressed(self) -> None:
        """Called once, at the start of the first step after the warm-up (``warmup`` steps taken)."""

    def _check_checkpoint(self, state_dict: Mapping[str, Any], what: str) -> None:
        """The subclass's checks of a checkpoint's torch.optim state (a ValueError names what does not fit)."""

    def _check_checkpoint_kind(self, state_dict: Mapping[str, Any], what: str) -> None:
        """A checkpoint of this optimizer's kind: each parameter's state holds :attr:`state_keys` (and perhaps
        some of :attr:`optional_state_keys`), each parameter group every hyperparameter it was built with; else a
        ValueError naming the parameter or group, what it holds and what was expected."""
        expected = _and_list(sorted(self.state_keys))
        if self.optional_state_keys:
            expected += f", with or without {_and_list(sorted(self.optional_state_keys))}"
        allowed = self.state_keys | self.optional_state_keys
        for name, _, entry in saved_states(state_dict, self.param_groups, self._names):
            keys = set(entry)
            if keys and not self.state_keys <= keys <= allowed:
                raise ValueError(
                    f"{what}: checkpoint state of parameter '{name}' holds {', '.join(sorted(map(str, keys)))}; "
                    f"expected {expected} (a {self.what} checkpoint)"
                )
        groups = state_dict.get("param_groups")
        for i, group in enumerate(groups if isinstance(groups, list) else ()):
            absent = [k for k in self._hyperparameters if isinstance(group, Mapping) and k not in group]
            if absent:
                held = sorted(str(k) for k in group if k not in ("params", "param_names"))
                raise ValueError(
                    f"{what}: checkpoint param_groups[{i}] has no {', '.join(absent)} (it holds "
                    f"{', '.join(held) or 'no hyperparameters'}); expected {self.what}'s hyperparameters "
                    f"{', '.join(self._hyperparameters)}"
                )

    # ------------------------------------------------------------------ set-up

    def _name_parameters(self) -> list[tuple[str, torch.Tensor]]:
        named: list[tuple[str, torch.Tensor]] = []
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                name = str(names[i]) if names else f"param.{len(named)}"
                if p.is_complex() or p.dtype not in PARAM_DTYPES:
                    kinds = ", ".join(str(d).replace("torch.", "") for d in PARAM_DTYPES)
                    raise TypeError(
                        f"{self.what}: parameter '{name}' is {str(p.dtype).replace('torch.', '')}; the optimizer "
                        f"averages in fp32 and steps {kinds} parameters"
                    )
                named.append((name, p))
        seen: set[str] = set()
        for n, _ in named:
            if n in seen:
                raise ValueError(f"{self.what}: two parameters are named '{n}'; the compression state is kept by name")
            seen.add(n)
        return named

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                f"{self.what}: parameter groups cannot be added after construction: the ranks agreed on the "
                "parameters then; build a new optimizer over all of them"
            )
        super().add_param_group(param_group)
        self._check_group(len(self.param_groups) - 1, self.param_groups[-1])

    def _check_group(self, index: int, group: Mapping[str, Any]) -> None:
        """A parameter group's hyperparameters (the defaults filled in), checked as the defaults are: a ValueError
        naming the group and the value."""

    @property
    def phase(self) -> str:
        """``warmup`` (fp32 gradient averages) until ``warmup`` steps have been taken (skipped ones do not count),
        ``compressed`` after (reads the last step's verdict on the host: not for the hot path)."""
        self._agreement.settle()
        return "warmup" if self.policy.warming(self.session.policy_step) else "compressed"

    # ------------------------------------------------------------------ the step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average (gradients in the warm-up, momenta after), then update the parameters; a collective.

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
                raise RuntimeError(
                    f"{self.what}: parameter '{self._names[id(p)]}' has a sparse gradient (not supported)"
                )
            if p.device != device:
                raise RuntimeError(
                    f"{self.what}: parameters on {device} and {p.device}; the collective averages one buffer on one "
                    "device"
                )
        if device is None:
            return
        self._agreement.settle()
        # The guard decides the last step now: after a skipped warm-up step the policy's step repeats.
        self.algorithm.guard.settle()
        if not self._compressing and not self.policy.warming(self.session.policy_step):
            self._begin_compressed()
            self._compressing = True
        warm = not self._compressing
        mask = tuple(p.grad is not None for _, p in self._named)
        self._agreement.agree(mask, lambda agreed: self._probe(agreed, warm, device))
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
                self._init_state(p, state, device)
        flat, slots = self._payload(entries, warm, device)
        for kind, group, p, view in slots:
            grad = cast(torch.Tensor, p.grad) if inv is None else cast(torch.Tensor, p.grad) * inv
            if kind == "momentum":
                view.copy_(self._local_momentum(p, grad, self.state[p], group))
            else:
                view.copy_(grad)
        poison([flat], local_bad)
        self._send(flat, slots)
        bad = nonfinite(flat)  # what every rank received: a NaN or Inf sent by any rank shows on every rank
        ok = torch.ones((), dtype=torch.bool, device=device) if bad is None else ~bad
        for kind, group, p, view in slots:
            if kind == "momentum":
                self._momentum_step(p, view, self.state[p], group, ok)
            else:
                self._gradient_step(p, view, self.state[p], group, ok)
        self._agreement.remember(ok, warm, mask)
        self.session.advance()
        restart = getattr(self.transport, "restart_names", None)
        if restart is not None:  # Horovod: nothing in flight, so the next step's collective names repeat
            restart()

    def _payload(
        self, entries: list[tuple[dict[str, Any], torch.Tensor]], warm: bool, device: torch.device
    ) -> tuple[torch.Tensor, list[Slot]]:
        """One fp32 buffer and each parameter's view of it: the local momenta of the parameters that compress
        (:meth:`_compresses`; none in the warm-up), then the others' gradients."""
        momenta = [(g, p) for g, p in entries if not warm and self._compresses(p)]
        gradients = [(g, p) for g, p in entries if warm or not self._compresses(p)]
        flat = torch.empty(sum(p.numel() for _, p in entries), dtype=torch.float32, device=device)
        slots: list[Slot] = []
        at = 0
        for kind, items in (("momentum", momenta), ("gradient", gradients)):
            for group, p in items:
                slots.append((kind, group, p, flat[at : at + p.numel()].view(p.shape)))
                at += p.numel()
        return flat, slots

    def _send(self, flat: torch.Tensor, slots: list[Slot]) -> None:
        """Average the payload through the session at its policy's step (skipped warm-up steps left out, so the
        momenta start compressing after ``warmup`` steps taken), counted in this step's statistics."""
        members = []
        for kind, _, p, view in slots:
            name = self._names[id(p)]
            compress, opts = self._options[name] if kind == "momentum" else (False, {})
            members.append(Member(name, view, compress, opts))
        self.session.run(Group(0, members, flat=flat)).wait()

    def _probe(self, agreed: Mask, warm: bool, device: torch.device) -> None:
        """The payload of the ``agreed`` set of parameters, filled with zeros and one NaN: it pairs with the steps
        of ranks whose set did not change, and every rank skips it (state as before, the guard's put back now)."""
        items = [(g, p) for g in self.param_groups for p in g["params"] if agreed[self._index[id(p)]]]
        flat, slots = self._payload(items, warm, device)
        flat.zero_()
        poison([flat], torch.ones((), dtype=torch.bool, device=device))
        self._send(flat, slots)
        self.algorithm.guard.settle()

    # ------------------------------------------------------------------ reports and state

    def stats(self) -> dict[str, Any]:
        """Wire bytes (``bytes_sent``), the fp32 all-reduce of the same values (``bytes_uncompressed``), their
        ``compression_ratio``, ``collectives``, encode/decode seconds, cumulative and for ``last_step``; the
        ``phase``, ``warmup_steps``, ``step``, ``skipped_nonfinite`` and ``warmup_skipped`` (the skipped steps
        that fell in the warm-up, which does not count them)."""
        stats = self.session.stats()
        stats["skipped_nonfinite"] -= self._agreement.probes
        return {**stats, "codec": self.name, "phase": self.phase, "warmup_steps": self.warmup,
                "warmup_skipped": self.session.discounted, "step": self.session.step}  # fmt: skip

    def memory_bytes(self) -> int:
        """Bytes kept between steps: the optimizer's state and the compression state (residuals, the guard's
        copies)."""
        moments = sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())
        return int(moments) + self.algorithm.memory_bytes()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state and ``sylvie_comm``: the codec, configuration, world size, rank, step, phase,
        ``warmup_skipped`` (the skipped warm-up steps, which the warm-up does not count) and this rank's
        compression state by parameter name.

        The compression state is per rank: save it on every rank and load each rank's own."""
        out = super().state_dict()
        phase = self.phase  # reads the last step's verdict: warmup_skipped is exact
        out["sylvie_comm"] = {**self.session.state_dict(), "phase": phase, "warmup_skipped": self.session.discounted}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own).

        Every field is checked before anything is loaded (a ValueError names the first that does not fit),
        then the ranks agree: all load, or none, and only checkpoints of one step."""
        who = f"{self.what}[{self.name}]"
        what = f"{who} load_state_dict"
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups", "sylvie_comm"} <= set(state_dict):
            raise ValueError(f"{what}: expected a dict from {self.what}.state_dict() with 'state', "
                             "'param_groups' and 'sylvie_comm' entries")  # fmt: skip
        ours = dict(state_dict["sylvie_comm"]) if isinstance(state_dict["sylvie_comm"], Mapping) else {}
        phase = ours.pop("phase", None)
        # Written before skipped steps were left out of the warm-up: every step counted, as if none was skipped.
        skipped = ours.pop("warmup_skipped", 0)

        def check(ours: Mapping[str, Any], step: int) -> None:
            if not is_integer(skipped) or not 0 <= skipped <= step:
                raise ValueError(f"{what}: checkpoint field warmup_skipped must be an integer in [0, {step}] (the "
                                 f"checkpoint's step), got {skipped!r}")  # fmt: skip
            expected = "warmup" if self.policy.warming(step - skipped) else "compressed"
            if phase != expected:
                raise ValueError(f"{what}: checkpoint phase {phase!r} does not fit its step {step} with "
                                 f"{skipped} warm-up steps skipped (expected {expected!r} with warmup "
                                 f"{self.warmup})")  # fmt: skip
            self._check_checkpoint_kind(state_dict, what)
            self._check_checkpoint(state_dict, what)

        # The session appends ' load_state_dict' to the name it is given in the ranks' agreement.
        self.session.load_state_dict(ours, ((n, p.shape) for n, p in self._named), check=check, stepped=False,
                                     what=who, discounted=skipped)  # fmt: skip
        # torch.optim casts every state tensor but 'step' to the parameter's dtype: the counts stay fp32.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        counts = {
            id(p): {k: v for k, v in state_dict["state"][i].items() if k in self.fp32_counts}
            for i, p in zip(saved_ids, params, strict=False)
            if i in state_dict["state"]
        }
        super().load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        for p in params:
            for key, value in counts.get(id(p), {}).items():
                self.state[p][key] = torch.as_tensor(value).to(dtype=torch.float32, device=p.device).clone()
        # The warm-up ends at the start of the step of policy step ``warmup``: done once that step was taken.
        self._compressing = self.policy.compressed(self.session.policy_step) > 0
        self._agreement.reset()  # nothing pending: the ranks compare their gradients again at the next step

    def close(self) -> None:
        """Stop the algorithm's communication thread (and close the transport if this optimizer owns it)."""
        self.session.close(transport=self._close_transport)


__all__ = ["MOMENTUM_CODECS", "MomentumOptimizer", "check_codec", "resolve_warmup", "saved_states"]
