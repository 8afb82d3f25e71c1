"""Policy around an algorithm: from which step it compresses, and which tensors.

Kept apart from the math (as epfml/powersgd's ``PowerSGD`` wraps
``BasicPowerSGD``): the algorithm compresses what it is given; the policy sends
the first ``warmup_steps`` steps as a plain fp32 average (error feedback and
low-rank factors start from real gradients, and a framework may still be
settling its groups); with ``warmup: auto`` (opt-in) each tensor then keeps
travelling raw until its gradient has settled (:mod:`.warmup`); it sends raw
whatever a rule marks uncompressed or what would not shrink by
``min_compression_rate``, and merges per-name options from the config's rules
over the algorithm's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group, Member, ShardLayout, real_view, then
from sylvie_comm.algorithms.delegating import delegating
from sylvie_comm.algorithms.monitor import Monitor
from sylvie_comm.algorithms.none import plain_all_reduce, plain_reduce_scatter
from sylvie_comm.algorithms.warmup import Warmup
from sylvie_comm.collectives import Meter
from sylvie_comm.config import UNCOMPRESSED, Config


def _any_dtype(alg: Algorithm) -> str:
    """The registered algorithms that take gradients of every floating-point dtype, as a phrase."""
    names = [n for n, c in alg.registered.items() if c.record.gradient_dtypes is None and not c.record.delegates]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


class Policy:
    """Decide per name and per step; delegate the rest to ``algorithm``.

    Args:
        algorithm: the algorithm the compressed steps run.
        config: ``warmup_steps``, ``min_compression_rate`` and the per-name ``rules``.
        averages: what the integration averages (``gradient`` or ``momentum``): the monitor's default bound.
    """

    def __init__(self, algorithm: Algorithm, config: Config, averages: str = "gradient") -> None:
        self.algorithm = algorithm
        self.config = config
        for i, rule in enumerate(config.rules):
            self._check_rule(i, rule.match, rule.options)
        # The adaptive warm-up, where something compresses (a fork of the transport: a collective call).
        self.warmup: Warmup | None = None
        if config.warmup == "auto" and not algorithm.record.rounds_only:
            self.warmup = Warmup(algorithm.transport, config.warmup_steps, config.total_steps)
        # The compression-error monitor (a fork of the transport too), unless off or nothing is compressed.
        self.monitor: Monitor | None = None
        if config.monitor["period"] > 0 and not algorithm.record.sends_raw:
            self.monitor = Monitor(algorithm, config.monitor, algorithm.transport, config.min_compression_rate,
                                   averages)  # fmt: skip
        elif (delegate := delegating(algorithm)) is not None:
            delegate.unmonitored()

    def _check_rule(self, i: int, match: str, options: Mapping[str, Any]) -> None:
        """A rule's options: known to the algorithm, allowed per name, and valid (as the base options are)."""
        alg = self.algorithm
        where = f"{alg.name}: rules[{i}] (match {match!r})"
        unknown = sorted(set(options) - set(alg.record.option_defaults))
        if unknown:
            valid = ", ".join(sorted(alg.record.per_name_options)) or "none"
            raise ValueError(f"{where} sets unknown option(s) {', '.join(unknown)}; per-name options: {valid}")
        fixed = sorted(set(options) - alg.record.per_name_options)
        if fixed:
            valid = ", ".join(sorted(alg.record.per_name_options)) or "none"
            raise ValueError(
                f"{where} sets {', '.join(fixed)}, which holds for the whole run and cannot differ per "
                f"parameter; per-name options of {alg.name}: {valid}"
            )
        try:
            alg.validate_options({**alg.options, **options})
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def compressed(self, step: int) -> int:
        """The algorithm's step at the policy's ``step``: 0 at the first step past the fixed warm-up, negative
        within it (what the step guard counts before the compressed steps' 0, 1, ...)."""
        return step - self.config.warmup_steps

    def warming(self, step: int) -> bool:
        """Whether the policy's ``step`` is within the fixed warm-up (a plain fp32 average of everything)."""
        return step < self.config.warmup_steps

    def member_options(self, name: str, shape: torch.Size | tuple[int, ...]) -> tuple[bool, Mapping[str, Any]]:
        """Whether the tensor ``name`` compresses, and the algorithm options it uses."""
        rule = self.config.rule_for(name)
        options = {**self.algorithm.options, **(rule.options if rule else {})}
        if rule is not None and rule.codec == UNCOMPRESSED:
            return False, options
        alg = self.algorithm
        compress = alg.compressible(shape, options) and (
            alg.compression_rate(shape, options) >= self.config.min_compression_rate
        )
        return compress, options

    def compressed_tensors(
        self, shapes: Iterable[tuple[str, torch.Size | tuple[int, ...]]], step: int | None = None,
        warmup_state: Mapping[str, Any] | None = None, monitor_state: Mapping[str, Any] | None = None,
    ) -> dict[str, tuple[tuple[int, ...], Mapping[str, Any]]]:  # fmt: skip
        """The tensors that compress, by name: their shape and options (what a checkpoint's state must fit).

        With ``step`` (a checkpoint's count of steps) and the adaptive warm-up, only those that had begun
        compressing by then, by the start steps in ``warmup_state`` (the checkpoint's; it is checked); with
        ``monitor_state`` (the checkpoint's), the monitor's adapted options, less the tensors it sent raw."""
        started = self.check_state(warmup_state or {}) if step is not None else None
        overrides, raw = Monitor.check_state(monitor_state) if monitor_state else ({}, set())
        out: dict[str, tuple[tuple[int, ...], Mapping[str, Any]]] = {}
        for name, shape in shapes:
            compress, options = self.member_options(name, shape)
            if name in raw:
                continue
            if compress and (self.warmup is None or started is None or self.warmup.began(name, step, started)):  # type: ignore[arg-type]
                out[name] = (tuple(shape), {**options, **overrides.get(name, {})})
        return out

    def check_parameters(self, named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
        """Refuse, at registration, parameters whose gradients the algorithm cannot compress (a float64 weight
        for an error-feedback codec), naming the first and what would work. Complex parameters are judged as
        the real tensors of their pairs (how they travel)."""
        alg = self.algorithm
        for name, p in named:
            t = real_view(p.detach())
            if not t.dtype.is_floating_point or alg.compresses_dtype(t.dtype):
                continue
            compress, _ = self.member_options(name, t.shape)
            if compress:
                half = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
                kinds = ", ".join(str(d).replace("torch.", "") for d in half if alg.compresses_dtype(d))
                raise ValueError(
                    f"{what}[{alg.name}]: parameter '{name}' is {str(p.dtype).replace('torch.', '')}; {alg.name} "
                    f"compresses {kinds} gradients. Cast the model (model.float()), send it raw with a rule "
                    f"({{match: '{name}', codec: uncompressed}}), or use {_any_dtype(alg)}"
                )

    def __call__(self, group: Group, step: int, meter: Meter | None = None) -> Future[None]:
        """One group of step ``step`` (counted from 0, warm-up included)."""
        meter = meter if meter is not None else Meter(self.algorithm.world_size)
        numel = group.flat.numel() if group.flat is not None else sum(m.tensor.numel() for m in group.members)
        meter.uncompressed(4 * numel)
        if self.warming(step):
            guard = self.algorithm.guard
            guard.begin(self.compressed(step))  # before the compressed steps' 0, 1, ...
            return guard.track(plain_all_reduce(self.algorithm, group, meter))
        if self.monitor is not None:
            return self.monitor.around(group, self.compressed(step), meter,
                                       lambda g: self._compressed(g, step, meter))  # fmt: skip
        return self._compressed(group, step, meter)

    def _compressed(self, group: Group, step: int, meter: Meter) -> Future[None]:
        """A group of a step past the fixed warm-up: the adaptive warm-up's raw tensors, the algorithm."""
        warmup, c = self.warmup, self.compressed(step)
        if warmup is None or step >= warmup.latest:
            return self.algorithm(group, c, meter)
        warming = [m.name for m in group.members if m.compress and not warmup.compressing(m.name, step)]
        if warming:
            warmup.decide(warming, step, meter)  # full windows: the settled tensors start now
            warming = [n for n in warming if not warmup.compressing(n, step)]
        if not warming:
            return self.algorithm(group, c, meter)
        held = set(warming)
        members = [Member(m.name, m.tensor, False, m.options) if m.name in held else m for m in group.members]
        raw = [m for m in members if m.name in held]

        def observe(_: Future[None]) -> None:
            for m in raw:
                warmup.observe(m.name, m.tensor)  # the averaged gradient, identical on every rank

        fut = self.algorithm(Group(group.key, members, group.flat), c, meter)
        return then(fut, observe)

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, step: int, meter: Meter | None = None,
        layout: ShardLayout | None = None,
    ) -> Future[None]:  # fmt: skip
        """One reduce-scatter of step ``step`` (sharded data parallel): a plain one during the warm-up steps,
        then the algorithm's form (:meth:`Algorithm.reduce_scatter`). The adaptive warm-up watches averaged
        gradients every rank holds whole, which a shard is not: it is refused here."""
        if self.warmup is not None:
            raise ValueError(
                f"{self.algorithm.name}: warmup 'auto' decides per tensor from the whole averaged gradient, and a "
                "reduce-scatter leaves each rank a shard of it; use warmup 'fixed' (warmup_steps) under sharded "
                "data parallel"
            )
        alg = self.algorithm
        if not self.warming(step) or not alg.record.shards:  # (the algorithm refuses if it has no form)
            c = self.compressed(step)
            if self.monitor is not None and alg.record.shards:
                checked = alg.check_reduce_scatter(flat, out, layout)
                meter = meter if meter is not None else Meter(alg.world_size)
                return self.monitor.around_shards(flat, out, checked, c, meter,
                                                  lambda lay: alg.reduce_scatter(flat, out, c, meter, lay))  # fmt: skip
            return alg.reduce_scatter(flat, out, c, meter, layout)
        meter = meter if meter is not None else Meter(alg.world_size)
        alg.check_reduce_scatter(flat, out, layout)
        meter.uncompressed(4 * flat.numel(), "reduce_scatter")
        return plain_reduce_scatter(alg, flat.reshape(-1), out, meter)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The adaptive warm-up's per-name state (empty without it)."""
        return self.warmup.state_dict() if self.warmup is not None else {}

    def monitor_state(self) -> dict[str, Any]:
        """The monitor's decisions and figures (empty without it)."""
        return self.monitor.state_dict() if self.monitor is not None else {}

    def load_monitor_state(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        """Restore :meth:`monitor_state`'s output (checked first); a monitor's state where this run has none
        is refused."""
        if state and self.monitor is None:
            raise ValueError(f"{self.algorithm.name}: the checkpoint holds the compression monitor's state, but this "
                             "config's monitor is off (period 0)")  # fmt: skip
        if self.monitor is not None:
            if state:
                Monitor.check_state(state)
            self.monitor.load_state_dict(state, device)

    def check_state(self, state: Mapping[str, Any]) -> dict[str, int | None]:
        """Check a :meth:`state_dict` before anything is loaded (a ValueError names what does not fit); return
        each name's start step."""
        if self.warmup is None:
            if state:
                raise ValueError(f"{self.algorithm.name}: warm-up state given, but this config's warmup is fixed")
            return {}
        return Warmup.check_state(state)

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device | None = None) -> None:
        self.check_state(state)
        if self.warmup is not None:
            self.warmup.load_state_dict(state, device)

    def close(self) -> None:
        if self.warmup is not None:
            self.warmup.close()
        if self.monitor is not None:
            self.monitor.close()
