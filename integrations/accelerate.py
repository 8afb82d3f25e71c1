"""Hugging Face Accelerate: a sylvie_comm hook on the DDP model ``accelerator.prepare`` returns, and its state
in ``accelerator.save_state`` / ``load_state``.

Three lines, after ``prepare``::

    import sylvie_comm.accelerate
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = sylvie_comm.accelerate.register(accelerator, model, "acpsgd", rank=4)

which is ``sylvie_comm.ddp.register(model, ...)`` plus ``checkpoint_with(accelerator, PerRankState(state))``
(every rank's state saved and loaded with the accelerator's), after checking that the accelerator does not
register a hook of its own.

Two traps of Accelerate 1.16 this module works around:

- ``DistributedDataParallelKwargs(comm_hook=...)`` looks the hook up in a table of its own enum
  (``DDPCommunicationHookType``: fp16, bf16, PowerSGD) and registers nothing for any other value, a function or a
  string included, without a word; our hook is registered on the prepared model instead, and :func:`register`
  refuses a handler whose hook would be dropped or would take DDP's one hook slot.
- ``save_state`` writes a checkpoint from the main process only, and ``load_state`` hands that one file to every
  process. The hook's state is per rank (error-feedback residuals differ between ranks), so
  :class:`PerRankState` gathers every rank's state in its ``state_dict()`` (a collective: ``save_state`` runs on
  every process) and each rank restores its own in ``load_state_dict()``.

And one hazard: ``load_state`` unpickles the file of every object registered with
``accelerator.register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``) with ``torch.load(weights_only=False)``
(``checkpointing.load_custom_state``), before the object sees it, so a tampered file runs its code. The state is
therefore not registered that way: :func:`checkpoint_with` saves it in its own file (:data:`STATE_FILE`) from a
``register_save_state_pre_hook`` and loads it from a ``register_load_state_pre_hook`` with
``torch.load(weights_only=True)`` (:func:`read_state_file`), which reads tensors and plain Python values only and
refuses anything else, naming the file. What Accelerate loads itself is outside our reach (see
``docs/integrations/accelerate.md``): a checkpoint folder stays trusted input.

:class:`PerRankState` serves any per-rank state (``HookState``, ``FSDPState``) and any checkpointer that writes
from one process; the Lightning strategies (:mod:`sylvie_comm.integrations.lightning`) use its format too.
Accelerate itself is never imported here: the accelerator is read through its attributes.
"""

from __future__ import annotations

import os
import pickle
import re
import stat
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.algorithms.monitor import metrics
from sylvie_comm.config import Config
from sylvie_comm.integrations.ddp import HookState
from sylvie_comm.integrations.ddp import register as ddp_register
from sylvie_comm.optim.diloco import DiLoCo, ReplicaState

WHAT = "sylvie_comm.accelerate"
FORMAT = "sylvie_comm.per_rank/1"  # every rank's state, by rank, in one object
STATE_FILE = "sylvie_comm_state.pt"  # checkpoint_with's file in a save_state folder (the first; state_file(i))
_COUNT = "_sylvie_comm_checkpoints"  # on the accelerator: how many states checkpoint_with registered there


def state_file(index: int = 0) -> str:
    """The file name of the ``index``-th state :func:`checkpoint_with` registered on one accelerator:
    :data:`STATE_FILE`, then ``sylvie_comm_state_1.pt``, ... (numbered as Accelerate numbers its own files)."""
    return STATE_FILE if index == 0 else f"sylvie_comm_state_{index}.pt"


class RankState(Protocol):
    """What :class:`PerRankState` wraps: one rank's checkpointable state (``HookState``, ``FSDPState``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Any) -> None: ...


def _to_cpu(obj: Any) -> Any:
    # Gathered objects are pickled: a CUDA tensor would be rebuilt on its rank's device in the main process.
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def gather_states(state: Mapping[str, Any], *, everywhere: bool = False) -> dict[str, Any]:
    """Every rank's ``state`` on rank 0 of the default group (on every rank with ``everywhere``): a collective.

    Returns ``{"format", "world_size", "ranks"}`` where ``ranks[r]`` is rank ``r``'s state, tensors on the CPU;
    ``ranks`` is None on the ranks that receive nothing (their copy is not meant to be written).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{WHAT}: torch.distributed is not initialized; the per-rank states cannot be gathered")
    world, rank = dist.get_world_size(), dist.get_rank()
    local = _to_cpu(state)
    ranks: list[Any] | None
    if everywhere:
        ranks = [None] * world
        dist.all_gather_object(ranks, local)
    else:
        ranks = [None] * world if rank == 0 else None
        dist.gather_object(local, ranks, dst=0)
    return {"format": FORMAT, "world_size": world, "ranks": ranks}


def own_state(blob: Any, rank: int, world_size: int, what: str = WHAT, fix: str = "") -> Any:
    """Rank ``rank``'s state out of :func:`gather_states`' ``blob``; a ValueError says why it does not fit.

    ``fix`` is appended to the world-size message: how the caller's framework starts the state afresh.
    """
    if not isinstance(blob, Mapping) or blob.get("format") != FORMAT:
        got = f"a mapping of {sorted(map(str, blob))[:8]}" if isinstance(blob, Mapping) else type(blob).__name__
        raise ValueError(
            f"{what}: expected every rank's compression state (format {FORMAT!r}, from PerRankState.state_dict()), "
            f"got {got}; a single rank's state_dict() loads through that state's own load_state_dict()"
        )
    ranks, saved = blob.get("ranks"), blob.get("world_size")
    if ranks is None:
        raise ValueError(
            f"{what}: this copy of the compression state was made on a rank that received no other rank's state "
            "(only rank 0 gathers them); load the copy rank 0 wrote, or gather with everywhere=True"
        )
    if not isinstance(ranks, list) or saved != len(ranks):
        raise ValueError(f"{what}: malformed per-rank state: world_size {saved!r} with {type(ranks).__name__} ranks")
    if saved != world_size:
        raise ValueError(
            f"{what}: the checkpoint holds the compression state of {saved} ranks and this run has {world_size}; "
            "each rank resumes its own state (error-feedback residuals differ between ranks), so resume with "
            f"{saved} processes{fix}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank {rank} is outside the world of {world_size}")
    return ranks[rank]


class PerRankState:
    """Every rank's compression state as one checkpointable object, for checkpointers that write from one
    process (``accelerator.register_for_checkpointing``).

    Args:
        state: this rank's state: a ``HookState`` (``sylvie_comm.ddp.register``), an ``FSDPState``, or any object
            with ``state_dict()`` and ``load_state_dict()``.
        everywhere: gather onto every rank instead of rank 0 only (a checkpointer that writes on the main process
            of each node, ``ProjectConfiguration(save_on_each_node=True)``); costs every rank the memory of all.
        on_world_change: ``"error"`` (default): loading a checkpoint of another world size raises;
            ``"fresh"``: it warns and keeps this rank's state as it is (the compression state starts afresh,
            the rest of the checkpoint resumes).

    ``state_dict()`` and ``load_state_dict()`` are collectives over the default process group: call them on
    every rank (``save_state`` and ``load_state`` do). ``state_dict()`` holds tensors and plain Python values
    only, so :func:`read_state_file` (``torch.load(weights_only=True)``) reads it back.

    Hand it to :func:`checkpoint_with`, not to ``accelerator.register_for_checkpointing``: that works too, but
    Accelerate then unpickles its file with ``weights_only=False``, which runs whatever code a tampered file holds.

    Example::

        state = sylvie_comm.ddp.register(model, "acpsgd", rank=4)
        sylvie_comm.accelerate.checkpoint_with(accelerator, sylvie_comm.accelerate.PerRankState(state))
    """

    def __init__(self, state: RankState, *, everywhere: bool = False, on_world_change: str = "error") -> None:
        if not callable(getattr(state, "state_dict", None)) or not callable(getattr(state, "load_state_dict", None)):
            raise TypeError(f"{WHAT}.PerRankState: expected a state with state_dict() and load_state_dict(), "
                            f"got {type(state).__name__}")  # fmt: skip
        if on_world_change not in ("error", "fresh"):
            raise ValueError(
                f"{WHAT}.PerRankState: on_world_change must be 'error' or 'fresh', got {on_world_change!r}"
            )
        self.state = state
        self.everywhere = everywhere
        self.on_world_change = on_world_change

    def state_dict(self) -> dict[str, Any]:
        """Every rank's ``state.state_dict()`` (a collective); complete on rank 0 (every rank with ``everywhere``)."""
        return gather_states(self.state.state_dict(), everywhere=self.everywhere)

    def load_state_dict(self, blob: Mapping[str, Any]) -> None:
        """Restore this rank's own state out of every rank's (a collective, as ``state.load_state_dict`` is)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if self.on_world_change == "fresh" and isinstance(blob, Mapping) and blob.get("world_size") != world:
            warnings.warn(
                f"{WHAT}: the checkpoint holds the compression state of {blob.get('world_size')} ranks and this run "
                f"has {world}; the compression state starts afresh (on_world_change='fresh')",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.state.load_state_dict(own_state(blob, rank, world, f"{WHAT}.PerRankState"))


_STATE_EXPECTED = (
    f"sylvie_comm's per-rank state (format {FORMAT!r}: tensors and plain Python values, as torch.save wrote "
    "PerRankState.state_dict())"
)


def _refusal(exc: BaseException) -> str:
    """The line of torch's weights-only refusal that says what it met (its message runs over a dozen lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = next((line for line in lines if "unsupported" in line.lower() or "GLOBAL" in line), lines[0] if lines else "")
    return why[:300]


def read_state_file(path: str | os.PathLike[str]) -> Any:
    """Read a file :func:`checkpoint_with` wrote (or any ``torch.save`` of ``PerRankState.state_dict()``) with
    ``torch.load(weights_only=True)``: tensors and plain Python values only.

    Raises FileNotFoundError for a missing file and ValueError, naming the file, for anything but a regular file
    (never opened: a FIFO would block) or for a file that holds more than tensors and plain values (refused
    unread: unpickling it in full could run code).
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{WHAT}: {path} is missing; expected {_STATE_EXPECTED}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{WHAT}: {path} is not a regular file ({stat.filemode(mode)}); expected {_STATE_EXPECTED}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped since the stat
            raise ValueError(f"{WHAT}: {path} is not a regular file; expected {_STATE_EXPECTED}")
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{WHAT}: {path} refused: torch.load(weights_only=True) cannot read it as tensors and plain "
                f"Python values ({_refusal(exc)}); expected {_STATE_EXPECTED}. Do not unpickle it in full "
                "(weights_only=False), which could run code: the checkpoint folder may have been tampered with"
            ) from exc
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise ValueError(f"{WHAT}: {path} is not a torch.save file ({exc}); expected {_STATE_EXPECTED}") from exc


def _earlier_layout(folder: Path, wanted: str) -> str:
    """Where an earlier sylvie_comm left its state in ``folder`` (a custom object of Accelerate's), if it did."""
    for name in sorted(os.listdir(folder)):
        if re.fullmatch(r"custom_checkpoint_\d+\.pkl", name) is None:
            continue
        try:
            blob = read_state_file(folder / name)  # weights_only=True: safe on any file
        except (OSError, ValueError):
            continue
        if isinstance(blob, Mapping) and blob.get("format") == FORMAT:
            return (
                f"; {folder / name} holds it, registered with accelerator.register_for_checkpointing by an earlier "
                f"sylvie_comm: rename it to {wanted} (and the custom_checkpoint files after it one number down), "
                "or, if you trust the folder, register PerRankState that way again to load it as it was saved"
            )
    return ""


def checkpoint_with(accelerator: Any, state: PerRankState) -> tuple[Any, Any]:
    """Save ``state`` in ``accelerator.save_state`` and load it in ``load_state``, in its own file
    (:data:`STATE_FILE`; the states registered after it on the same accelerator, one per prepared model, in
    ``sylvie_comm_state_1.pt``, ... in registration order: :func:`state_file`) read back with
    ``torch.load(weights_only=True)`` (:func:`read_state_file`).

    Use it instead of ``accelerator.register_for_checkpointing(state)``, whose file Accelerate unpickles with
    ``weights_only=False``. ``save_state`` calls the save hook on every process: every rank's state is gathered
    (a collective) and written by the main process (each node's main process under
    ``ProjectConfiguration(save_on_each_node=True)``, which needs ``PerRankState(..., everywhere=True)``).
    ``load_state`` calls the load hook on every process before it loads anything else, so a missing, tampered
    or mismatched state stops it before the model is touched.

    Returns the two hooks' handles (``handle.remove()`` on both undoes this).
    """
    if not isinstance(state, PerRankState):
        raise TypeError(f"{WHAT}.checkpoint_with: expected a PerRankState, got {type(state).__name__}")
    each_node = bool(getattr(getattr(accelerator, "project_configuration", None), "save_on_each_node", False))
    if each_node and not state.everywhere:
        raise ValueError(
            f"{WHAT}.checkpoint_with: ProjectConfiguration(save_on_each_node=True) writes the checkpoint on every "
            "node's main process, which holds every rank's state only with PerRankState(..., everywhere=True)"
        )

    index = int(getattr(accelerator, _COUNT, 0))
    name = state_file(index)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        blob = state.state_dict()  # a collective: every process runs this hook
        if accelerator.is_local_main_process if each_node else accelerator.is_main_process:
            path = Path(output_dir) / name
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            torch.save(blob, tmp)
            os.replace(tmp, path)

    def load(models: Any, input_dir: str) -> None:
        path = Path(input_dir) / name
        if not os.path.lexists(path):
            raise FileNotFoundError(
                f"{WHAT}: {path} is missing; expected {_STATE_EXPECTED}, which save_state writes there once "
                f"sylvie_comm.accelerate.register (or checkpoint_with) ran{_earlier_layout(Path(input_dir), name)}"
            )
        state.load_state_dict(read_state_file(path))

    handles = accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
    setattr(accelerator, _COUNT, index + 1)
    return handles


def _hook_types() -> Any:
    from accelerate.utils import DDPCommunicationHookType

    return DDPCommunicationHookType


def check_accelerator(accelerator: Any) -> None:
    """Fail where the accelerator's DDP handler would drop a hook silently or register one of its own.

    ``DistributedDataParallelKwargs(comm_hook=...)`` registers only its enum's hooks (fp16, bf16, PowerSGD) and
    ignores anything else; DDP takes one communication hook, so an enum hook leaves no room for ours.
    """
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is None:
        return
    kinds = _hook_types()
    for field in ("comm_hook", "comm_wrapper"):
        value = getattr(handler, field, kinds.NO)
        if not isinstance(value, kinds):
            raise ValueError(
                f"{WHAT}: DistributedDataParallelKwargs({field}={value!r}) is not a DDPCommunicationHookType, and "
                f"Accelerate drops such a {field} without registering anything; leave {field} at its default and "
                "register sylvie_comm's hook on the prepared model (sylvie_comm.accelerate.register)"
            )
        if value is not kinds.NO:
            raise ValueError(
                f"{WHAT}: DistributedDataParallelKwargs({field}={value}) makes Accelerate register its own "
                f"communication hook, and DDP takes one per model; leave {field} at DDPCommunicationHookType.NO"
            )


def register(
    accelerator: Any,
    model: nn.Module,
    codec: str | None = None,
    *,
    config: Config | None = None,
    timeout: float | timedelta | None = None,
    **options: Any,
) -> HookState:
    """Register a sylvie_comm hook on a model prepared by ``accelerator.prepare`` and checkpoint its state with the
    accelerator's (a collective call: every process makes it, after ``prepare``).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the model ``prepare`` returned (a ``DistributedDataParallel`` under a multi-process launch).
        codec: the hook's name, as for ``sylvie_comm.ddp.register`` (default ``acpsgd``).
        config: a :class:`~sylvie_comm.config.Config` instead of keywords.
        timeout: seconds one of the hook's collectives may wait for the other ranks.
        **options: hook options, as for ``sylvie_comm.ddp.register``.

    Returns the hook's ``HookState`` (``stats()``, ``close()``); ``accelerator.save_state`` saves every rank's
    state in one file (:class:`PerRankState`, :data:`STATE_FILE`) and ``load_state`` gives each rank its own
    back, read with ``torch.load(weights_only=True)`` (:func:`checkpoint_with`).

    Example::

        model, opt, loader = accelerator.prepare(model, opt, loader)
        state = sylvie_comm.accelerate.register(accelerator, model, "acpsgd", rank=4)
    """
    check_accelerator(accelerator)
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        kind, procs = getattr(accelerator, "distributed_type", "unknown"), getattr(accelerator, "num_processes", 0)
        why = (
            "; only one process runs, and `accelerate launch --cpu --num_processes N` starts one, not N: launch "
            "with `--multi_gpu --num_processes N` and Accelerator(cpu=True), or with torchrun"
            if procs == 1
            else "; pass the model prepare() returned, not the one given to it"
        )
        raise TypeError(
            f"{WHAT}.register: expected the DistributedDataParallel model accelerator.prepare() returns, got "
            f"{type(model).__name__} (distributed type {kind}, {procs} process(es)){why}"
        )
    config_ = getattr(accelerator, "project_configuration", None)
    everywhere = bool(getattr(config_, "save_on_each_node", False))
    state = ddp_register(model, codec, config=config, timeout=timeout, **options)
    try:
        checkpoint_with(accelerator, PerRankState(state, everywhere=everywhere))
    except BaseException:
        state.close()
        raise
    return state


def diloco(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sync_every: int,
    codec: str | None = None,
    config: Config | None = None,
    timeout: float | timedelta | None = None,
    **kwargs: Any,
) -> DiLoCo:
    """DiLoCo across the accelerator's processes (:class:`~sylvie_comm.optim.diloco.DiLoCo`), every rank's replica
    (DiLoCo's state, its model and its optimizer) saved in ``accelerator.save_state`` and each rank's own loaded
    back by ``load_state`` (a collective call: every process makes it).

    The replicas train apart between outer steps, so the model and its optimizer stay out of ``prepare`` (DDP would
    average every step, and Accelerate saves the main process's model and optimizer only); prepare the data loader
    (each process its own batches) and move the model to ``accelerator.device`` yourself.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the run.
        model: the plain model (not ``prepare``'s).
        optimizer: its optimizer, as built (not ``prepare``'s).
        sync_every, codec, config, timeout, **kwargs: as :class:`~sylvie_comm.optim.diloco.DiLoCo` takes them
            (``fragments``, ``delay``, ``alpha``, ``outer_optimizer``, the codec's options).

    Example::

        loader = accelerator.prepare(loader)
        model.to(accelerator.device)
        run = sylvie_comm.accelerate.diloco(accelerator, model, opt, sync_every=16, codec="qsgd", bits=2)
    """
    what = f"{WHAT}.diloco"
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"{what}: model is the DistributedDataParallel prepare() returns, which averages the gradients every "
            "step; DiLoCo's replicas train apart: pass the model without prepare() (prepare the data loader only)"
        )
    wrapped = getattr(optimizer, "optimizer", None)  # prepare()'s AcceleratedOptimizer wraps the one built
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(wrapped, torch.optim.Optimizer):
        raise TypeError(
            f"{what}: expected the torch optimizer as built, got {type(optimizer).__name__}: leave it out of "
            "prepare() (Accelerate saves and loads the main process's optimizer state, and each replica has its own)"
        )
    config_ = getattr(accelerator, "project_configuration", None)
    everywhere = bool(getattr(config_, "save_on_each_node", False))
    run = DiLoCo(model, optimizer, sync_every=sync_every, codec=codec, config=config, timeout=timeout, **kwargs)
    try:
        checkpoint_with(accelerator, PerRankState(ReplicaState(run), everywhere=everywhere))
    except BaseException:
        run.close()
        raise
    return run


def log(accelerator: Any, state: Any, step: int | None = None) -> dict[str, float]:
    """Log the hook's figures through ``accelerator.log`` (its trackers: TensorBoard, W&B, ...): the compression
    ratio, the bytes sent and the monitor's per-tensor figures (see
    :func:`sylvie_comm.algorithms.monitor.metrics`); returns them. Call it on every process (Accelerate logs on
    the main one), e.g. every 50 steps::

        if step % 50 == 0:
            sylvie_comm.accelerate.log(accelerator, state, step)
    """
    check_accelerator(accelerator)
    values = metrics(state.stats())
    accelerator.log(values, step=step)
    return values


__all__ = [
    "FORMAT",
    "STATE_FILE",
    "PerRankState",
    "check_accelerator",
    "checkpoint_with",
    "gather_states",
    "log",
    "own_state",
    "read_state_file",
    "register",
    "state_file",
]
