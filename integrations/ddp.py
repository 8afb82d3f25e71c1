"""PyTorch DistributedDataParallel communication hooks.

Three lines::

    import sylvie_comm
    model = DDP(net)
    state = sylvie_comm.ddp.register(model, codec="acpsgd", rank=4)

or, lower level, ``state, hook = sylvie_comm.ddp.make_hook("acpsgd", model=model, rank=4)``
then ``model.register_comm_hook(state, hook)``. Every hook is the plain function
:func:`hook` applied to a :class:`HookState`; the state holds the configuration,
the algorithm (whose per-parameter state is keyed by parameter name, so it
survives DDP's bucket rebuild and checkpoints) and the statistics.

This module owns no math: a bucket becomes a group of named gradient views,
the algorithm of :mod:`sylvie_comm.algorithms` (behind its policy: warm-up,
per-name rules) averages them in place, and the bucket goes back to DDP. Every
hook returns its future without waiting, so the next bucket is compressed while
this one is on the wire.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.algorithms import ALGORITHMS, Group, Member, then
from sylvie_comm.algorithms.base import real_view
from sylvie_comm.algorithms.session import Session, SessionHolder, merge_config
from sylvie_comm.collectives import ProcessGroupTransport
from sylvie_comm.config import Config

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket

Future = torch.futures.Future

# A hook name is an algorithm name: one registry for every integration.
HOOKS = ALGORITHMS


@dataclass
class _Entry:
    """One parameter of a bucket: where its gradient lives and how it is sent."""

    name: str
    offset: int  # into the flat bucket buffer
    shape: torch.Size
    numel: int
    compress: bool
    options: Mapping[str, Any]


@dataclass
class _Plan:
    """A bucket's parameters and the group of views into its buffer, built once: again only when DDP rebuilds its
    buckets (its parameters change) or hands over another buffer."""

    signature: tuple[str, ...]
    entries: list[_Entry]
    buffer: tuple[int, int] = (0, -1)  # data_ptr and numel of the buffer the group's views are of
    group: Group | None = None
    final: bool = False  # checked against the bucket's parameters after DDP's buckets became final


class HookState(SessionHolder):
    """The hook's :class:`~sylvie_comm.algorithms.session.Session` (configuration, algorithm, statistics,
    step, checkpoint) and DDP's buckets as groups of named gradients.

    Attributes the algorithm keeps (``_factors``, ``_residuals`` of the low-rank
    algorithms, its communication thread) read through this object.
    """

    def __init__(
        self,
        config: Config,
        transport: ProcessGroupTransport,
        named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
        *,
        session: Session | None = None,
    ) -> None:
        # hyperparameters (no collectives here: make_state() agrees across ranks, through Session.agreed)
        named = list(named_parameters) if named_parameters is not None else None
        if session is None:
            session = Session("ddp", config, transport, kind="hook")
            try:
                _check(session, named)
            except BaseException:
                session.close(transport=False)  # its algorithm's thread: no one will use it
                raise
        session.what = f"ddp[{session.name}]"
        self.session = session
        self.transport = transport
        # internal state
        self._names: dict[int, str] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._auto_names = named is None
        if named is not None:
            self.bind(named)
        self._plans: dict[int, _Plan] = {}
        # DDP's model, where given: once it has rebuilt its buckets (after the first iteration; DDP does it once),
        # a bucket's parameters are final and a plan is reused without reading them again.
        self._ddp: weakref.ref[nn.parallel.DistributedDataParallel] | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr in ("algorithm", "session"):  # not set yet: __init__ failed or is still running
            raise AttributeError(attr)
        return getattr(self.algorithm, attr)

    @property
    def step(self) -> int:
        """Backward passes done (the policy's step; the session counts them)."""
        return self.session.step

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on."""
        return {"hook": self.name, **self.config.to_dict()}

    def bind(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Name the parameters (state is keyed by these names)."""
        named = list(named_parameters)
        self._names = {id(p): n for n, p in named}
        self._shapes = {n: real_view(p.detach()).shape for n, p in named}  # as they sit in DDP's buckets
        self._auto_names = False

    def _name_of(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            if not self._auto_names:
                raise ValueError(
                    f"ddp[{self.name}]: a parameter of shape {tuple(p.shape)} in a DDP bucket is not among the "
                    "named parameters given to register()/make_hook(); pass the model DDP wraps"
                )
            # Without a model, name parameters by first appearance: DDP's first buckets are deterministic.
            name = f"param.{len(self._names)}"
            self._names[id(p)] = name
        return name

    def _plan(self, bucket: GradBucket) -> _Plan:
        params = bucket.parameters()
        names = tuple(self._name_of(p) for p in params)
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.signature == names:
            return plan
        entries, offset = [], 0
        for name, p in zip(names, params, strict=True):
            # A complex parameter sits in the (real) bucket as its (real, imaginary) pairs: 2x numel floats.
            shape = real_view(p.detach()).shape
            numel = math.prod(shape)
            compress, options = self.policy.member_options(name, shape)
            entries.append(_Entry(name, offset, shape, numel, compress, options))
            offset += numel
        plan = self._plans[bucket.index()] = _Plan(names, entries)
        return plan

    def watch(self, ddp_model: nn.parallel.DistributedDataParallel) -> None:
        """Read ``ddp_model``'s bucket rebuild, so a bucket's plan is checked against its parameters only until
        DDP's buckets are final (:func:`make_state` does this when given the DDP model)."""
        self._ddp = weakref.ref(ddp_model)

    def _buckets_final(self) -> bool:
        ddp = self._ddp() if self._ddp is not None else None
        return ddp is not None and bool(getattr(ddp, "_has_rebuilt_buckets", False))

    def _group(self, bucket: GradBucket, step: int) -> Group:
        buf = bucket.buffer()
        if self.policy.warming(step):
            # Plain averaging of the whole buffer: parameters are named once DDP's buckets are final.
            return Group(bucket.index(), [], flat=buf)
        where = (buf.data_ptr(), buf.numel())
        plan = self._plans.get(bucket.index())
        if plan is None or not plan.final or plan.group is None or plan.buffer != where:
            plan = self._plan(bucket)  # the bucket's parameters read and named: a new plan where they changed
            if plan.group is None or plan.buffer != where:
                members = [
                    Member(e.name, buf[e.offset : e.offset + e.numel].view(e.shape), e.compress, e.options)
                    for e in plan.entries
                ]
                plan.group, plan.buffer = Group(bucket.index(), members, flat=buf), where
            plan.final = self._buckets_final()
        assert plan.group is not None
        return plan.group

    def communicate(self, bucket: GradBucket) -> Future[torch.Tensor]:
        step = self.session.step  # this backward pass's, whichever bucket counts it done
        if bucket.is_last():
            self.session.advance()
        buf = bucket.buffer()
        return then(self.session.run(self._group(bucket, step), step), lambda _: buf)

    # ------------------------------------------------------------------ public

    def state_dict(self) -> dict[str, Any]:
        """Step counter and per-parameter state, keyed by parameter name, of this rank (``rank``: residuals
        are per rank, so every rank saves its own), in the one format of every integration
        (:data:`~sylvie_comm.algorithms.session.CHECKPOINT_FIELDS`)."""
        return self.session.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, agreed: bool = True) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own checkpoint).

        Every field is checked before anything is loaded (a ValueError names the first that does not fit:
        another hook, configuration, world size or rank, foreign or missing parameter names, shapes, dtypes,
        NaN), then the ranks agree: all of them load, or none, and only checkpoints of one step.
        ``agreed=False``: no exchange, the caller agrees around this call (a trainer's own checkpoint check).
        """
        self.session.load_state_dict(state, None if self._auto_names else self._shapes.items(), agreed=agreed)

    def close(self) -> None:
        """Stop the communication thread and destroy the hook's process group, now, on this thread.

        Call it on every rank after the last backward pass (before ``dist.destroy_process_group()``,
        or instead of relying on it and on interpreter exit, which release both too). Idempotent;
        the hook issues no collectives afterwards.
        """
        self.session.close()


_PYTHON_REDUCER = (
    "DDP's Python reducer (torch._dynamo.config.optimize_ddp = 'python_reducer', used with compiled autograd) "
    "calls a communication hook once per parameter as hook(state, (grad, param)) and ignores what it returns, so "
    "a bucket hook would not average anything; expected the default optimize_ddp (DDPOptimizer, which keeps "
    "DDP's C++ reducer and its buckets under torch.compile): set torch._dynamo.config.optimize_ddp = True before "
    "building DistributedDataParallel, and leave compiled autograd off for the backward pass"
)


def _check(session: Session, named: list[tuple[str, nn.Parameter]] | None) -> None:
    """What the hook adds to the session's own checks: error feedback's warm-up and the parameters' dtypes."""
    alg = session.algorithm
    if alg.error_feedback and session.config.warmup_steps < 2:
        raise ValueError(
            f"ddp[{alg.name}]: warmup_steps must be >= 2 with error feedback (got {session.config.warmup_steps}), "
            "because DDP rebuilds its buckets after the first iteration and the hook's per-bucket "
            "buffers should be laid out once the buckets are final"
        )
    if named is not None:
        session.policy.check_parameters(named, "ddp")


def check_reducer(ddp_model: nn.Module) -> None:
    """Fail where DDP would not hand the hook its buckets: a model built under the Python reducer."""
    if getattr(ddp_model, "_use_python_reducer", False):
        raise RuntimeError(f"sylvie_comm.ddp: this DistributedDataParallel model was built with {_PYTHON_REDUCER}")


def hook(state: HookState, bucket: GradBucket) -> Future[torch.Tensor]:
    """The DDP communication hook of every sylvie_comm algorithm."""
    if isinstance(bucket, tuple):  # the Python reducer's (grad, param): it would drop our average
        raise RuntimeError(f"sylvie_comm.ddp[{state.name}]: the hook was called by {_PYTHON_REDUCER}")
    return state.communicate(bucket)


# DDP checks the hook's annotations at run time; this module's are strings (PEP 563).
hook.__annotations__ = {
    "state": HookState,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


def make_state(
    codec: str | None = None,
    *,
    config: Config | None = None,
    process_group: dist.ProcessGroup | None = None,
    model: nn.Module | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> HookState:
    """Build the state of a hook (a collective call: every rank must make it)."""
    if model is not None:
        check_reducer(model)  # before the first collective: every rank's model was built the same way
    transport = ProcessGroupTransport(process_group, timeout=timeout)  # a collective: every rank gets here
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    named = list(module.named_parameters()) if module is not None else None
    session = Session.agreed(
        "sylvie_comm.ddp", transport, lambda: merge_config("ddp", codec, config, options), kind="hook",
        describe=lambda session: {"hook": session.name}, prepare=lambda session: _check(session, named),
    )  # fmt: skip
    state = HookState(session.config, transport, named, session=session)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        state.watch(model)
    return state


def make_hook(
    codec: str | None = None,
    *,
    config: Config | None = None,
    process_group: dist.ProcessGroup | None = None,
    model: nn.Module | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> tuple[HookState, Callable[[HookState, GradBucket], Future[torch.Tensor]]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Pass ``model`` (the DDP model or the module it wraps) so per-parameter state
    is keyed by parameter name; without it parameters are named by their order
    of appearance in DDP's first buckets. ``timeout`` as in :func:`register`.
    """
    state = make_state(codec, config=config, process_group=process_group, model=model, timeout=timeout, **options)
    return state, hook


def register(
    ddp_model: nn.parallel.DistributedDataParallel,
    codec: str | None = None,
    *,
    config: Config | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> HookState:
    """Register a sylvie_comm hook on a DDP model and return its state.

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        codec: hook name (see ``HOOKS``): ``acpsgd`` (default), ``powersgd``,
            ``onebit``, ``topk``, ``sign``, ``qsgd``, ``fp16``, ``bf16``, ``none``.
        config: a :class:`~sylvie_comm.config.Config` (e.g. from YAML) instead of keywords.
        process_group: defaults to the default group (and DDP's).
        timeout: seconds (or a ``timedelta``) one of the hook's collectives may wait for the
            other ranks before the backward pass fails with a
            :class:`~sylvie_comm.collectives.CollectiveError` (default 600 s; the hook talks on a
            process group of its own, created with this timeout). A peer that dies fails it at once.
        **options: hook options (``rank``, ``chunk_size``, ``scale``, ``ratio``, ``bits``) and
            ``warmup_steps``, ``min_compression_rate``, ``seed``.

    Call ``state.close()`` on every rank after the last backward pass: it stops the hook's
    thread and destroys its process group.

    Example::

        state = sylvie_comm.ddp.register(model, "acpsgd", rank=4)
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"ddp.register: expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    state = make_state(codec, config=config, process_group=process_group, model=ddp_model, timeout=timeout, **options)
    try:
        ddp_model.register_comm_hook(state, hook)
    except BaseException:
        state.close()
        raise
    return state


__all__ = ["HOOKS", "Config", "HookState", "check_reducer", "hook", "make_hook", "make_state", "register"]
