"""One holder for every integration: configuration, algorithm and policy, step, statistics, checkpoint, close.

What PyTorch's ``PowerSGDState`` is for its DDP hooks, for every framework: the DDP hook, both Horovod routes,
the FSDP2 reduce-scatter, the GNN trainer's gradient average and the compressed optimizer each wrap one
:class:`Session` and add only the mapping of their framework's unit of communication (a bucket, a gradient, a
flat shard) onto :class:`~sylvie_comm.algorithms.Group` or a reduce-scatter. So the configuration is merged
in one place (:func:`merge_config`), the ranks agree in one place (:meth:`Session.agreed`), and a checkpoint
has one format (:data:`CHECKPOINT_FIELDS`) with one set of checks (:meth:`Session.load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm, Future, Group, Segment, ShardLayout
from sylvie_comm.algorithms.checkpoint import check_checkpoint
from sylvie_comm.algorithms.monitor import Monitor
from sylvie_comm.algorithms.policy import Policy
from sylvie_comm.algorithms.registry import algorithm_class
from sylvie_comm.collectives import Meter, Stats, Transport, agree
from sylvie_comm.collectives.transport import ObjectGather
from sylvie_comm.config import FIELDS, Config

# The fields of every integration's checkpoint of its compression state (one per rank).
CHECKPOINT_FIELDS = ("codec", "config", "world_size", "rank", "step", "params", "warmup", "monitor")
# Names an older release wrote, read as today's.
_LEGACY_KEYS = {"hook": "codec", "steps": "step"}


def merge_config(
    what: str, codec: str | None, config: Config | None, options: Mapping[str, Any], default: str = "acpsgd"
) -> Config:
    """A Config from a codec name and keywords, or from ``config`` with keywords merged over it.

    Keywords that are fields of :class:`~sylvie_comm.config.Config` (``warmup_steps``, ``warmup``,
    ``min_compression_rate``, ``seed``, ``total_steps``) set those; the others are the algorithm's options.
    """
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"{what}: config must be a sylvie_comm.Config, got {type(config).__name__}")
    if codec is not None and not isinstance(codec, str):
        raise TypeError(f"{what}: codec must be an algorithm's name (a str), got {type(codec).__name__}")
    if config is not None and codec is not None and codec != config.codec:
        raise ValueError(f"{what}: codec {codec!r} given with a config for {config.codec!r}; pass one of them")
    cfg = config if config is not None else Config(codec=codec or default)
    opts = dict(options)
    extra = {k: opts.pop(k) for k in FIELDS if k != "codec" and k in opts}
    if opts or extra:
        d = cfg.to_dict()
        d["options"] = {**d["options"], **opts}
        d.update(extra)
        cfg = Config.from_dict(d)
    return cfg


def upgrade_checkpoint(state: Any) -> Any:
    """``state`` with the field names an older release wrote (``hook``, ``steps``) renamed to today's."""
    if not isinstance(state, Mapping) or not any(k in state for k in _LEGACY_KEYS):
        return state
    out = dict(state)
    for old, new in _LEGACY_KEYS.items():
        if old in out and new not in out:
            out[new] = out.pop(old)
    return out


class Session:
    """The configuration, the algorithm behind its policy, the step, the statistics and the checkpoint of one
    integration on one rank.

    Args:
        what: the integration's name in messages (``"ddp[acpsgd]"``).
        config: the merged configuration.
        transport: the algorithm's transport.
        kind: what the integration calls an algorithm in the message for an unknown name (``hook``, ``codec``).
        world_size: the run's, where it differs from the transport's (a transport of one rank whose
            all-reduce a framework performs outside).
        rank: the run's, where it differs from the transport's (likewise).
        objects: the object all-gather the ranks agree through, where the transport cannot (default: it).
        averages: what the integration averages, ``gradient`` (default) or ``momentum`` (the compressed
            optimizers): the compression monitor's bound where the config leaves ``max_lag`` unset
            (:data:`~sylvie_comm.config.LAG_BOUNDS`).
    """

    def __init__(
        self, what: str, config: Config, transport: Transport, *, kind: str = "codec",
        world_size: int | None = None, rank: int | None = None, objects: ObjectGather | None = None,
        averages: str = "gradient",
    ) -> None:  # fmt: skip
        cls = algorithm_class(config.codec, kind)
        self.what = what
        self.config = config
        self.transport = transport
        self.algorithm = cls(transport, config.options, seed=config.seed)
        self.name = self.algorithm.name
        self.options = self.algorithm.options
        self.policy = Policy(self.algorithm, config, averages)
        self.world_size = transport.world_size if world_size is None else world_size
        self.rank = transport.rank if rank is None else rank
        self.objects: ObjectGather = objects if objects is not None else transport
        # The one step counter (see "the step" below): steps done, per unit where the integration counts per unit,
        # and the steps left out of the policy's count.
        self._step = 0
        self._units: dict[str, int] | None = None
        self._discounted = 0
        self._stats = Stats()
        self._meter: Meter | None = None  # the last step's

    @classmethod
    def agreed(
        cls, what: str, transport: Transport, config: Callable[[], Config], *,
        describe: Callable[[Session], Mapping[str, Any]] | None = None,
        prepare: Callable[[Session], None] | None = None, close_transport: bool = True, **kwargs: Any,
    ) -> Session:  # fmt: skip
        """Build a session on every rank (a collective): ``config()`` merges this rank's configuration,
        ``prepare(session)`` checks what the integration adds (its parameters), and the ranks compare
        ``{**config.to_dict(), **describe(session)}``; any rank's error, or any difference, fails every rank
        naming it. On failure the transport is closed (no one will use it) unless ``close_transport`` is False.
        """

        built: list[Session] = []

        def build() -> Session:
            session = cls(what, config(), transport, **kwargs)
            built.append(session)
            if prepare is not None:
                prepare(session)
            return session

        def describe_all(session: Session) -> dict[str, Any]:
            return {**session.config.to_dict(), **(describe(session) if describe is not None else {})}

        try:
            return agree(kwargs.get("objects") or transport, build, describe_all, what)
        except BaseException:
            for session in built:  # its algorithm's thread: no one will use it
                session.close(transport=False)
            close = getattr(transport, "close", None)
            if close_transport and close is not None:
                close()
            raise

    # ------------------------------------------------------------------ the step

    @property
    def step(self) -> int:
        """Steps done, every rank's, warm-up and skipped ones included: the statistics' and the checkpoint's step
        (counting per unit, the most steps any unit has done). :meth:`advance` moves it."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # Replaying steps a caller numbers itself (a test's loop); the integrations only ever call advance().
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{self.what}: step must be an integer >= 0, got {value!r}")
        self._step = value

    def count_per_unit(self, units: Iterable[str]) -> None:
        """Count steps per unit (FSDP2's units: each steps once per training step, at its own time in the
        backward pass): :meth:`advance` takes the unit, the session's step is the most steps any unit has done,
        and the checkpoint's step maps each unit to its steps."""
        self._units = dict.fromkeys(units, 0)

    def advance(self, unit: str | None = None) -> None:
        """Count one step done: the one place the step moves. ``unit``: that unit's step (:meth:`count_per_unit`);
        units step one at a time by one, so the session's step moves when a unit passes it (once per training
        step, by the first unit to finish it), in O(1)."""
        if unit is None:
            self._step += 1
            return
        units = self._units
        if units is None:
            raise ValueError(f"{self.what}: advance({unit!r}) counts a unit's step, but this session counts its "
                             "steps whole (count_per_unit() first)")  # fmt: skip
        done = units[unit] = units.get(unit, 0) + 1
        if done > self._step:
            self._step = done

    def step_of(self, unit: str | None = None) -> int:
        """Steps done by ``unit`` (0 before its first), or the session's (None)."""
        if unit is None or self._units is None:
            return self._step
        return self._units.get(unit, 0)

    def discount(self) -> None:
        """Leave one step done out of the policy's count: a step every rank skipped that the warm-up must not
        count (the compressed optimizers' warm-up steps skipped for a NaN or an Inf, learned one step late)."""
        self._discounted += 1

    @property
    def discounted(self) -> int:
        """Steps done that the policy does not count (:meth:`discount`)."""
        return self._discounted

    @property
    def policy_step(self) -> int:
        """The policy's step: the steps done less those :meth:`discount` left out (the algorithm's is
        ``policy.compressed(policy_step)``)."""
        return self._step - self._discounted

    # ------------------------------------------------------------------ running

    def meter(self, step: int | None = None) -> Meter:
        """The byte and time meter of ``step`` (default: the current one), made once per step."""
        step = self._step if step is None else step
        meter = self._meter
        if meter is None or meter.step != step:
            meter = self._meter = self._stats.meter(step, self.world_size)
        return meter

    def run(self, group: Group, step: int | None = None, *, unit: str | None = None) -> Future[None]:
        """Average ``group`` in place through the policy at the current step (``unit``'s, counting per unit), or
        at ``step`` where the caller numbers its steps itself; counted in that step's statistics."""
        if step is not None:
            return self.policy(group, step, self.meter(step))
        done = self.step_of(unit)
        return self.policy(group, done - self._discounted, self.meter(done))

    def reduce_scatter(
        self, flat: torch.Tensor, out: torch.Tensor, layout: ShardLayout | None = None, step: int | None = None,
        *, unit: str | None = None,
    ) -> Future[None]:  # fmt: skip
        """``out`` = this rank's shard of the average of ``flat`` through the policy, at the current step
        (``unit``'s, counting per unit) or at ``step``."""
        if step is not None:
            return self.policy.reduce_scatter(flat, out, step, self.meter(step), layout)
        done = self.step_of(unit)
        return self.policy.reduce_scatter(flat, out, done - self._discounted, self.meter(done), layout)

    # ------------------------------------------------------------------ public

    def stats(self, steps: int | None = None) -> dict[str, Any]:
        """Cumulative wire bytes, the plain fp32 equivalent, their ratio and encode/decode seconds over
        ``steps`` steps (default: the steps done); ``last_step`` holds the same for the last completed step."""
        out = {**self._stats.summary(self._step if steps is None else steps), **self.algorithm.report()}
        if self.policy.monitor is not None:
            out["monitor"] = self.policy.monitor.report()
        return out

    def memory_bytes(self) -> int:
        """Bytes of tensors kept between steps (residuals, factors, buffers, the guard's copies where it keeps any)."""
        return self.algorithm.memory_bytes()

    def state_dict(self, step: Any = None) -> dict[str, Any]:
        """This rank's compression state in the one checkpoint format (:data:`CHECKPOINT_FIELDS`): the
        algorithm, the configuration, the world size and rank that wrote it, the step (per unit where the session
        counts per unit; ``step`` where the integration counts per name itself) and the per-name state."""
        if step is None:
            step = dict(self._units) if self._units is not None else self._step
        return {
            "codec": self.name,
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "rank": self.rank,
            "step": step,
            "params": self.algorithm.state_dict(),
            "warmup": self.policy.state_dict(),
            "monitor": self.policy.monitor_state(),
        }

    def load_state_dict(
        self, state: Any, shapes: Iterable[tuple[str, tuple[int, ...]]] | None, *,
        shards: Mapping[str, Segment] | None = None, check: Callable[[Mapping[str, Any], int], None] | None = None,
        agreed: bool = True, stepped: bool | None = None, what: str | None = None, discounted: int = 0,
    ) -> Any:  # fmt: skip
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own checkpoint).

        Every field is checked before anything is loaded (a ValueError names the first that does not fit:
        another algorithm, configuration, world size or rank, foreign or missing names, shapes, dtypes, NaN;
        ``check(state, step)`` adds the integration's own), then the ranks agree: all of them load, or none,
        and only checkpoints of one step (``stepped``: whether every compressed tensor must have its state,
        by default whether the checkpoint is past the warm-up). ``shapes`` are the named tensors' shapes (None
        where the names are not known yet); ``shards`` the reduce-scatter segments by name, where the state is
        of that form.
        Returns the checkpoint's step (an int, or the per-name steps it holds). With ``agreed=False`` nothing is
        exchanged: the caller agrees across ranks around this call (a trainer checking its own checkpoint).
        ``what`` names the caller in the messages (default: the session's name). The step counter is restored:
        the checkpoint's step (its units' steps, counting per unit), ``discounted`` of them left out of the
        policy's count (:meth:`discount`; the caller's own field, checked by ``check``).
        """
        what = self.what if what is None else what
        state = upgrade_checkpoint(state)

        def checked() -> Any:
            step = check_checkpoint(what, state, self.name, self.config, self.world_size, self.rank,
                                    name_key="codec")  # fmt: skip
            warm = state.get("warmup", {})
            self.policy.check_state(warm)
            mon = state.get("monitor") or {}
            if mon:
                if self.policy.monitor is None:
                    raise ValueError(f"{what}: the checkpoint holds the compression monitor's state, but this "
                                     "run's monitor is off (period 0)")  # fmt: skip
                Monitor.check_state(mon)
            has_all = self.policy.compressed(step) > 0 if stepped is None else stepped
            if shards is not None:
                self.algorithm.check_state_dict(state["params"], None, has_all, shards=shards)
            else:
                tensors = None if shapes is None else self.policy.compressed_tensors(shapes, step, warm, mon)
                self.algorithm.check_state_dict(state["params"], tensors, has_all)
            if check is not None:
                check(state, step)
            return state["step"]

        if agreed:
            step = agree(self.objects, checked, lambda step: {"step": step}, f"{what} load_state_dict", "checkpoint")
        else:
            step = checked()
        self.algorithm.load_state_dict(state["params"])
        self.policy.load_state_dict(state.get("warmup", {}))
        self.policy.load_monitor_state(state.get("monitor") or {})
        self._restore(step, discounted)
        return step

    def _restore(self, step: Any, discounted: int) -> None:
        """The step counter from a checked checkpoint's step: an int, or the per-unit (per-name) steps."""
        self._discounted = discounted
        if not isinstance(step, Mapping):
            self._step = step
        elif self._units is not None:  # else steps per name the integration counts itself (the Horovod compressor)
            self._units = dict(step)
            self._step = max(self._units.values(), default=0)

    def close(self, transport: bool = True) -> None:
        """Stop the algorithm's thread and (unless ``transport`` is False) close the transport (idempotent)."""
        self.algorithm.close()
        self.policy.close()
        if transport:
            close = getattr(self.transport, "close", None)
            if close is not None:
                close()


class SessionHolder:
    """What every integration's object forwards to its :class:`Session`, written once.

    An integration (the DDP hook's state, the FSDP2 state, the Horovod optimizer and compressor, the gradient
    average) sets ``self.session`` and inherits the session's figures and lifetime from here; it overrides
    only what it adds (a checkpoint that holds more than the session's, a close that also unhooks a framework).
    """

    session: Session

    @property
    def name(self) -> str:
        """The algorithm's registered name."""
        return self.session.name

    @property
    def config(self) -> Config:
        """The merged configuration the ranks agreed on."""
        return self.session.config

    @property
    def algorithm(self) -> Algorithm:
        """The algorithm (behind :attr:`policy`)."""
        return self.session.algorithm

    @property
    def policy(self) -> Policy:
        """The warm-up, per-name rules and monitor around the algorithm."""
        return self.session.policy

    @property
    def options(self) -> dict[str, Any]:
        """The algorithm's options, defaults merged."""
        return self.session.options

    @property
    def world_size(self) -> int:
        """The run's world size."""
        return self.session.world_size

    def stats(self) -> dict[str, Any]:
        """Cumulative wire bytes, the plain fp32 equivalent, their ratio and encode/decode seconds; ``last_step``
        holds the same for the last completed step (:meth:`Session.stats`)."""
        return self.session.stats()

    def memory_bytes(self) -> int:
        """Bytes of tensors kept between steps (residuals, factors, buffers, the step guard's copies)."""
        return self.session.memory_bytes()

    def close(self) -> None:
        """Stop the algorithm's thread and close the transport (idempotent)."""
        self.session.close()


__all__ = ["CHECKPOINT_FIELDS", "Session", "SessionHolder", "merge_config", "upgrade_checkpoint"]
