"""PyTorch FSDP2 (``fully_shard``): a compressed gradient reduce-scatter, or a compressed replica all-reduce (HSDP).

Three lines, after ``fully_shard`` on each block and on the root::

    import sylvie_comm
    state = sylvie_comm.fsdp.register(model, "qsgd", bits=4)
    ...  # train; state.stats(), state.state_dict(), state.close()

FSDP2 reduce-scatters each unit's gradients as one flat buffer: ``world`` shards, rank-major, each holding every
parameter's dim-0 shard (padded) in the unit's order. :func:`register` installs one
:class:`torch.distributed.fsdp.ReduceScatter` comm per unit (``set_custom_reduce_scatter``) that maps that
buffer back to parameter names through FSDP's own metadata (a :class:`~sylvie_comm.algorithms.base.ShardLayout`:
per-name rules, per-row scales) and hands it to the algorithm's reduce-scatter form: ``none``, ``fp16``,
``bf16``, ``qsgd`` and ``onebit`` have one. The low-rank algorithms need whole matrices, which a shard is not;
with ``replicas=`` (HSDP: ``fully_shard`` within a node, replicas across nodes) the reduce-scatter stays
FSDP's and the algorithm, any of them, averages each rank's shard across the replicas instead
(``set_all_reduce_hook``): there each parameter's shard is a block of its rows, a matrix.

This module owns no math; the configuration, statistics, checkpoint and agreement across ranks are those of
every integration (:class:`~sylvie_comm.algorithms.session.Session`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.base import Segment, ShardLayout
from sylvie_comm.algorithms.session import Session, SessionHolder, merge_config
from sylvie_comm.collectives import ProcessGroupTransport
from sylvie_comm.collectives.local import LocalGroup
from sylvie_comm.config import Config

WHAT = "sylvie_comm.fsdp"

# Each FSDP unit's open state: FSDP takes one reduce-scatter comm (or all-reduce hook) per unit, so a second
# register() would silently take the units of the first. close() releases them.
_REGISTERED: weakref.WeakKeyDictionary[nn.Module, FSDPState] = weakref.WeakKeyDictionary()


def _fsdp() -> Any:
    try:
        from torch.distributed import fsdp
    except ImportError as exc:  # pragma: no cover - torch without distributed
        raise ImportError(f"{WHAT}: this torch has no torch.distributed.fsdp ({exc})") from None
    if not hasattr(fsdp, "FSDPModule") or not hasattr(fsdp.FSDPModule, "set_custom_reduce_scatter"):
        raise ImportError(f"{WHAT}: needs FSDP2 with FSDPModule.set_custom_reduce_scatter (torch >= 2.9), this "
                          f"torch is {torch.__version__}")  # fmt: skip
    return fsdp


def param_groups(module: nn.Module) -> list[Any]:
    """The FSDP parameter groups of one ``fully_shard`` module: FSDP2's list where it keeps one (torch >= 2.13: one
    group per mesh), else its single group (or none) as a list."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class _Unit:
    """One FSDP unit: its parameter group, the names of its parameters and, once seen, its shard layout and the
    plan of its reduce-scatter."""

    def __init__(self, index: int, fqn: str, module: nn.Module, names: dict[int, str]) -> None:
        groups = param_groups(module)
        if len(groups) != 1:
            raise ValueError(
                f"{WHAT}: the FSDP unit '{fqn or '<root>'}' has {len(groups)} parameter groups (a per-parameter "
                "mesh through shard_placement_fn); FSDP's own set_custom_reduce_scatter takes one comm per unit "
                "and refuses such units, so one comm cannot serve them: give the unit one mesh"
            )
        self.index = index
        self.fqn = fqn
        self.module = module
        self.group = groups[0]
        self.key = fqn or "<root>"
        self.names = [names[id(p.sharded_param)] for p in self.group.fsdp_params]
        self.world = dist.get_world_size(self.shard_group)  # what the flat buffer is laid out for
        self.session: Session | None = None  # the session that counts the unit's steps (its state's)
        self.layout: ShardLayout | None = None
        self.plan: _Plan | None = None  # built at the unit's first reduce-scatter, rebuilt only if its call changes
        self.shard = -1  # the elements per rank the replica hook last checked the layout against

    @property
    def step(self) -> int:
        """The unit's steps done (its reduce-scatters or replica all-reduces), as the session counts them."""
        return self.session.step_of(self.key) if self.session is not None else 0

    @property
    def shard_group(self) -> Any:
        return self.group.mesh_info.shard_process_group

    def segments(self, world: int, policy: Any) -> ShardLayout:
        """Each parameter's slice of every rank's shard, as FSDP lays it out (``foreach_reduce``): dim 0 padded
        to a multiple of the world size and cut in ``world`` blocks of rows (``Shard(i)``, ``i > 0``: the
        gradient cut along dim ``i``, the pieces stacked on dim 0)."""
        segs, at = [], 0
        for name, p in zip(self.names, self.group.fsdp_params, strict=True):
            size = tuple(p._orig_size) or (1,)
            if p.fsdp_placement.dim == 0:
                rows, row = -(-size[0] // world), math.prod(size[1:])
            else:
                rows, row = size[0], math.prod(size[1:]) // world
            compress, options = policy.member_options(name, size)
            segs.append(Segment(name, at, rows * row, max(row, 1), compress, options))
            at += rows * row
        return ShardLayout(self.key, tuple(segs))


class _Plan:
    """One unit's reduce-scatter as FSDP calls it, checked once: the group and op, the buffers' sizes, dtypes
    and device, the layout (every parameter's segment, the tiling checked) and what the op asks the average to
    be multiplied by. A later call is checked against it in O(1) (:meth:`fits`, and the unit's layout still
    the plan's object) and runs it; a call that differs (another group, op, size, dtype or device, another
    layout) builds a new plan, and its checks run again there. The algorithms find their row plans by the
    layout's identity too, so the layout object a plan keeps is what keeps theirs."""

    __slots__ = ("device", "dtype", "group", "in_dtype", "layout", "numel", "op", "scale", "shard")

    def __init__(self, layout: ShardLayout, output: torch.Tensor, flat: torch.Tensor, group: Any, op: Any,
                 scale: float) -> None:  # fmt: skip
        self.layout = layout
        self.group = group
        self.op = op
        self.scale = scale
        self.shard = output.numel()
        self.numel = flat.numel()
        self.dtype = output.dtype
        self.in_dtype = flat.dtype
        self.device = output.device

    def fits(self, output: torch.Tensor, flat: torch.Tensor, group: Any, op: Any) -> bool:
        """Tell whether a call with these arguments is the one this plan was built for (no value is read)."""
        return (
            group is self.group
            and (op is self.op or op == self.op)
            and output.numel() == self.shard
            and flat.numel() == self.numel
            and output.dtype == self.dtype
            and flat.dtype == self.in_dtype
            and output.device == self.device
        )


class _ReduceScatter:
    """The comm object FSDP calls for one unit: ``allocate`` (plain buffers) and ``__call__``."""

    __slots__ = ("state", "unit")

    def __init__(self, state: FSDPState, unit: _Unit) -> None:
        self.state = state
        self.unit = unit

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
        async_op: bool = False,
    ) -> None:  # fmt: skip
        self.state._reduce_scatter(self.unit, output_tensor, input_tensor, group, op)


class FSDPState(SessionHolder):
    """The :class:`~sylvie_comm.algorithms.session.Session` of one model's FSDP units, and their comms."""

    def __init__(self, model: nn.Module, session: Session, units: list[_Unit], replicas: bool) -> None:
        self.model = model
        self.session = session
        self.units = units
        self.replicas = replicas
        # Each unit steps once per training step, at its own time in the backward pass: the session counts them.
        session.count_per_unit(u.key for u in units)
        for u in units:
            u.session = session

    # ------------------------------------------------------------------ FSDP's calls

    def _layout(self, unit: _Unit, numel: int) -> ShardLayout:
        """Return the unit's layout (built once), checked against the ``numel`` elements per rank FSDP hands over."""
        layout = self._unit_layout(unit)
        full = sum(s.numel for s in layout.segments)
        if numel != full:
            raise ValueError(
                f"{WHAT}: the unit '{unit.key}' reduces {numel} elements per rank where its parameters hold {full}: "
                "some of its parameters got no gradient this step, so FSDP left them out. Call "
                "model.set_reduce_scatter_unused_params(True) so that every parameter travels (zeros where "
                "unused), as DDP's find_unused_parameters does"
            )
        return layout

    def _plan(self, unit: _Unit, output: torch.Tensor, flat: torch.Tensor, group: Any, op: Any) -> _Plan:
        """Check a unit's reduce-scatter call and keep what it needs (:class:`_Plan`): once, at its first call,
        and again only where a call differs from the plan's."""
        world = self.session.transport.world_size
        if group is not None and dist.get_world_size(group) != world:
            raise ValueError(f"{WHAT}: the unit '{unit.key}' reduce-scatters over {dist.get_world_size(group)} "
                             f"ranks, this state's transport has {world}")  # fmt: skip
        scale = _op_scale(op, world)
        layout = self._layout(unit, output.numel())
        self.algorithm.check_reduce_scatter(flat, output, layout)  # sizes, dtypes, device and tiling, here once
        plan = unit.plan = _Plan(layout, output, flat, group, op, scale)
        return plan

    def _reduce_scatter(
        self, unit: _Unit, output: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, op: Any
    ) -> None:
        """Run one unit's reduce-scatter: its plan checked in O(1) (built where it does not fit), the session's
        reduce-scatter waited for (FSDP reads ``output`` once this returns), the op's scale, the unit's step
        counted (the session's step is the most steps any unit has done: :meth:`Session.advance`)."""
        plan = unit.plan
        if plan is None or plan.layout is not unit.layout or not plan.fits(output, flat, group, op):
            plan = self._plan(unit, output, flat, group, op)
        self.session.reduce_scatter(flat, output, plan.layout, unit=unit.key).wait()
        if plan.scale != 1:
            output.mul_(plan.scale)
        self.session.advance(unit.key)

    def _replica_hook(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(reduce_output: torch.Tensor) -> None:
            layout = unit.layout
            if layout is None or reduce_output.numel() != unit.shard:
                layout = self._layout(unit, reduce_output.numel())
                unit.shard = reduce_output.numel()
            flat = reduce_output.view(-1)
            members = [
                Member(s.name, flat[s.offset : s.offset + s.numel].view(-1, s.row), s.compress, s.options)
                for s in layout.segments
            ]
            self.session.run(Group(unit.index, members, flat=flat), unit=unit.key).wait()
            self.session.advance(unit.key)

        return hook

    def install(self) -> None:
        """Hand FSDP each unit's comm (the reduce-scatter, or with replicas the all-reduce hook) and take the
        units; on failure, closed (the units handed back)."""
        try:
            for u in self.units:
                if self.replicas:
                    u.module.set_all_reduce_hook(self._replica_hook(u))  # type: ignore[operator]
                else:
                    u.module.set_custom_reduce_scatter(_ReduceScatter(self, u))  # type: ignore[operator]
                _REGISTERED[u.module] = self
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (its residuals), per unit steps, in every integration's checkpoint format."""
        return self.session.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own); every field is
        checked first, and the ranks agree (see ``sylvie_comm.ddp.HookState.load_state_dict``); the session
        restores each unit's steps."""
        keys = {u.key for u in self.units}

        def units(state: Any, step: int) -> None:
            steps = state["step"]
            if not isinstance(steps, dict) or set(steps) != keys:
                raise ValueError(f"{WHAT}: checkpoint 'step' must map this model's FSDP units {sorted(keys)} to "
                                 f"their steps, got {steps!r:.120}")  # fmt: skip

        if self.replicas:
            shapes = [(s.name, (s.numel // s.row, s.row)) for u in self.units for s in self._unit_layout(u).segments]
            self.session.load_state_dict(state, shapes, check=units)
        else:
            shards = {s.name: s for u in self.units for s in self._unit_layout(u).segments if s.compress}
            self.session.load_state_dict(state, None, shards=shards, check=units)

    def _unit_layout(self, unit: _Unit) -> ShardLayout:
        if unit.layout is None:
            unit.layout = unit.segments(unit.world, self.policy)
        return unit.layout

    def close(self) -> None:
        """Stop the algorithm's thread and destroy its process group (idempotent); FSDP's own reduce-scatter
        serves the units again, and :func:`register` takes the model again."""
        for u in self.units:
            if _REGISTERED.get(u.module) is not self:
                continue  # released already (a second close() leaves a later state's units alone)
            if self.replicas:
                u.module.set_all_reduce_hook(None)  # type: ignore[operator]
            else:
                u.group._reduce_scatter_comm = _default_comm()
            del _REGISTERED[u.module]
        self.session.close()


def _default_comm() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter()


def _op_scale(op: Any, world: int) -> float:
    """What the average is multiplied by for FSDP's ``op``: 1 for AVG, the world size for SUM (FSDP divides
    before or after, ``set_force_sum_reduction_for_comms``)."""
    red = dist.ReduceOp
    if op == red.AVG:
        return 1.0
    if op == red.SUM:
        return float(world)
    raise ValueError(f"{WHAT}: FSDP asked for a reduce-scatter with op {op!r}; the codecs average (AVG) or sum "
                     "(SUM); leave set_gradient_divide_factor unset")  # fmt: skip


def _check_session(session: Session, replicas: bool) -> None:
    """What :func:`register` refuses in a configuration, whatever the model: an algorithm without a reduce-scatter
    form, and ``warmup: auto``, on the reduce-scatter (without ``replicas``)."""
    alg = session.algorithm
    if not replicas and not alg.record.shards:
        alg.reduce_scatter(torch.zeros(0), torch.zeros(0), 0)  # raises the reason, naming the other path
    if session.policy.warmup is not None and not replicas:
        raise ValueError(f"{WHAT}: warmup 'auto' watches whole averaged gradients and each rank holds a shard "
                         "of them; use warmup 'fixed' (warmup_steps)")  # fmt: skip


def check_config(config: Config, *, replicas: bool = False) -> None:
    """Raise what :func:`register` would raise of ``config`` alone (the algorithm's name, its options, the
    per-name rules, a reduce-scatter form, the warm-up), here, without a process group: for a caller that
    builds the configuration in one process before the others start (Lightning's strategy). ``replicas``: for
    the HSDP replica all-reduce. The checks run on a session of one in-process rank, closed again."""
    session = Session(WHAT, config, LocalGroup(1).transport(0))
    try:
        _check_session(session, replicas)
    finally:
        session.close()


def _mesh_replicas(mesh: Any) -> tuple[list[int], str, str] | None:
    """This rank's replicas in the 2-D device mesh that FSDP's 1-D shard ``mesh`` was sliced from (the ranks at
    its shard coordinate along the other dimension), that dimension's name and the shard dimension's; None
    where ``mesh`` is not such a slice."""
    try:
        root = mesh._get_root_mesh()
        if root is mesh or root.ndim != 2 or mesh.ndim != 1:
            return None
        dim = mesh._get_root_mesh_dim()
        coordinate = root.get_coordinate()
        if dim is None or coordinate is None:
            return None
        ranks = [int(r) for r in root.mesh.select(dim, coordinate[dim]).tolist()]
        names = root.mesh_dim_names or ("dimension 0", "dimension 1")
        return ranks, names[1 - dim], names[dim]
    except (AttributeError, IndexError, KeyError, RuntimeError, TypeError):  # a DeviceMesh without these internals
        return None


def _check_replicas(replicas: Any, mesh_info: Any) -> None:
    """Fail where ``replicas`` is not this rank's replica group in the model's shard layout (local: a process
    group has the same ranks on each of its members, so its members all fail, before any collective on it)."""
    if not isinstance(replicas, dist.ProcessGroup):
        outside = isinstance(replicas, int) and replicas == dist.GroupMember.NON_GROUP_MEMBER
        got = "torch's NON_GROUP_MEMBER: this rank is not in that group" if outside else repr(replicas)
        raise TypeError(f"{WHAT}.register: replicas must be a process group holding this rank, got {got}")
    if getattr(mesh_info, "replicate_mesh_dim", None) is not None:
        raise ValueError(
            f"{WHAT}.register: replicas given, but the model's FSDP mesh replicates already (HSDP: a 2-D mesh in "
            "fully_shard), so FSDP all-reduces each shard across its replicas itself and the codec would average "
            "it a second time; give fully_shard the mesh's shard dimension (mesh=mesh['shard']) and pass "
            "replicas=mesh['replicate'].get_group(), or leave replicas out to compress the reduce-scatter alone"
        )
    me = dist.get_rank()
    shard_ranks = dist.get_process_group_ranks(mesh_info.shard_process_group)
    given = dist.get_process_group_ranks(replicas)
    index = shard_ranks.index(me)
    found = _mesh_replicas(mesh_info.mesh)
    if found is not None:
        expected, dim, shard_dim = found
        if sorted(given) == sorted(expected):
            return
        why = (f"expected the ranks {expected}: the '{dim}' dimension of the model's device mesh, whose "
               f"'{shard_dim}' dimension fully_shard was given (replicas=mesh['{dim}'].get_group())")  # fmt: skip
    else:
        mixed = sorted(set(given) & set(shard_ranks) - {me})
        if me in given and not mixed:
            return  # the ranks' shard indices are compared when they agree (register's describe)
        where = (f"it holds other ranks of this rank's own shard group {shard_ranks} ({mixed})" if mixed
                 else "it does not hold this rank")  # fmt: skip
        why = (f"{where}; expected this rank and, from each other shard group, its rank at shard index {index}: "
               "the replicate dimension of a 2-D device mesh (mesh = init_device_mesh(device, (replicas, shards), "
               "mesh_dim_names=('replicate', 'shard')), fully_shard(..., mesh=mesh['shard']), "
               "replicas=mesh['replicate'].get_group())")  # fmt: skip
    raise ValueError(
        f"{WHAT}.register: replicas is a group of {len(given)} ranks {given} that does not match the model's shard "
        f"layout: rank {me} shards over the FSDP group of ranks {shard_ranks} (shard index {index}), so its "
        f"replicas are the ranks at shard index {index} of the other shard groups; {why}"
    )


def _check_unregistered(model: nn.Module, units: list[_Unit]) -> None:
    for u in units:
        other = _REGISTERED.get(u.module)
        if other is not None:
            how = f"codec {other.name!r}" + (", replicas" if other.replicas else "")
            raise ValueError(
                f"{WHAT}.register: this {type(model).__name__} is registered already: its FSDP unit '{u.key}' belongs "
                f"to an open state ({how}), and FSDP takes one reduce-scatter comm (or all-reduce hook) per unit, as "
                "DDP takes one communication hook per model, so a second register() would take the first one's "
                "units; close() of that state releases it, then register again"
            )


def units_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP units of ``model`` (``fully_shard`` modules), root included, in module order."""
    fsdp = _fsdp()
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, fsdp.FSDPModule)]


def register(
    model: nn.Module, codec: str | None = None, *, config: Config | None = None,
    replicas: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None, **options: Any,
) -> FSDPState:  # fmt: skip
    """Compress the gradient traffic of a model sharded with FSDP2's ``fully_shard`` (a collective call).

    Args:
        model: the root module, after ``fully_shard`` on its blocks and on itself.
        codec: ``qsgd`` (default), ``onebit``, ``fp16``, ``bf16``, ``none`` for the reduce-scatter; with
            ``replicas`` any algorithm (``acpsgd``, ``powersgd`` too).
        config: a :class:`~sylvie_comm.config.Config` (e.g. from YAML) instead of keywords.
        replicas: HSDP: the process group of this rank's replicas (the other shard groups' ranks of the same
            shard index: ``mesh["replicate"].get_group()`` of a 2-D mesh whose ``mesh["shard"]`` went to
            ``fully_shard``); FSDP's reduce-scatter stays within the shard group and the codec averages each
            rank's shard across ``replicas`` (``set_all_reduce_hook``). Another group (the world's, the shard
            group) is refused here, naming the group expected.
        timeout: seconds one collective may wait for the other ranks (default 600 s; with ``replicas`` the
            replicas' group keeps its own timeout, as its collectives run on it).
        **options: the algorithm's options (``bits``, ``error_feedback``, ``chunk_size``, ``rank``, ...) and
            ``warmup_steps``, ``min_compression_rate``, ``seed``.

    Ranks that disagree on the configuration, the units or their parameters fail on every rank naming the
    first difference. A model takes one state at a time (FSDP one comm per unit, as DDP one comm hook): a
    second ``register`` of it, or of one of its units, is refused until ``close()`` of the first. Call
    ``state.close()`` on every rank after the last backward pass.
    """
    units = units_of(model)
    if not units:
        raise ValueError(f"{WHAT}.register: {type(model).__name__} has no FSDP units; call fully_shard() on its "
                         "blocks and on the model first (torch.distributed.fsdp.fully_shard)")  # fmt: skip
    names = {id(p): n for n, p in model.named_parameters()}
    # Units without parameters of their own (a root whose blocks hold them all) reduce nothing.
    units = [(fqn, m) for fqn, m in units if param_groups(m)]
    if not units:
        raise ValueError(f"{WHAT}.register: the FSDP units of {type(model).__name__} hold no parameters")
    mesh_info = param_groups(units[0][1])[0].mesh_info
    shard_group = mesh_info.shard_process_group
    transport = _transport(mesh_info, replicas, timeout)
    built: list[_Unit] = []

    def prepare(session: Session) -> None:
        built.extend(_Unit(i, fqn, m, names) for i, (fqn, m) in enumerate(units))
        _check_unregistered(model, built)
        if any(u.shard_group is not shard_group for u in built):
            raise ValueError(f"{WHAT}.register: the model's FSDP units shard over different process groups; "
                             "register one state per group of units")  # fmt: skip
        _check_session(session, replicas is not None)
        params = [(n, p) for u in built for n, p in zip(u.names, (q.sharded_param for q in u.group.fsdp_params),
                                                         strict=True)]  # fmt: skip
        session.policy.check_parameters(params, WHAT)

    def describe(session: Session) -> dict[str, Any]:
        layout = [(u.key, [(n, tuple(p._orig_size)) for n, p in zip(u.names, u.group.fsdp_params, strict=True)])
                  for u in built]  # fmt: skip
        out = {"units": repr(layout), "replicas": replicas is not None, "shard_world": dist.get_world_size(shard_group)}
        if replicas is not None:  # the replicas of a rank hold the same shard of each parameter
            out["shard_index"] = dist.get_group_rank(shard_group, dist.get_rank())
        return {"fsdp": out}

    session = Session.agreed(WHAT, transport, lambda: merge_config(WHAT, codec, config, options, default="qsgd"),
                             describe=describe, prepare=prepare)  # fmt: skip
    state = FSDPState(model, session, built, replicas is not None)
    state.install()
    return state


def _transport(
    mesh_info: Any, replicas: dist.ProcessGroup | None, timeout: float | timedelta | None
) -> ProcessGroupTransport:
    """The algorithm's transport: over FSDP's shard group, or (HSDP) over ``replicas``, checked first."""
    if replicas is None:
        return ProcessGroupTransport(mesh_info.shard_process_group, timeout=timeout)
    _check_replicas(replicas, mesh_info)  # before any collective on it
    # The replicas' group itself (a DeviceMesh dimension FSDP does not use with a 1-D shard mesh): a dedicated
    # copy would be a subgroup that every rank of the world must create in one order.
    return ProcessGroupTransport(replicas, dedicated=False)


__all__ = ["FSDPState", "check_config", "register", "units_of"]
