"""PyTorch Lightning: compressed gradients on every device, and the compression state in Lightning's checkpoints.

Two lines::

    import sylvie_comm.lightning as sl
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=sl.CompressedDDPStrategy("acpsgd", options={"rank": 4}))

:class:`CompressedDDPStrategy` is Lightning's ``DDPStrategy`` that registers a sylvie_comm hook
(``sylvie_comm.ddp.register``) once the model is wrapped; :class:`CompressedModelParallelStrategy` is its
``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``) with the compressed reduce-scatter of
``sylvie_comm.fsdp.register``. Both keep every rank's compression state in Lightning's checkpoints.

Why they exist (Lightning 2.6.6):

- ``DDPStrategy(ddp_comm_hook=...)`` is registered by ``DDPStrategy._register_ddp_hooks`` only when the root
  device is CUDA: on the CPU the hook is skipped without a word. Ours registers on every device; :class:`CommHookCheck`
  (a callback) fails a plain ``DDPStrategy`` whose hook was skipped. ``FSDPStrategy`` (FSDP1) takes no hook at all.
- ``Trainer.save_checkpoint`` builds the checkpoint on every rank (``_CheckpointConnector.dump_checkpoint``,
  callbacks' ``state_dict`` included) but ``Strategy.save_checkpoint`` writes it from global rank 0 only, while
  the compression state is per rank (error-feedback residuals differ between ranks). Our ``save_checkpoint``
  (called on every rank) gathers every rank's state under :data:`KEY` first (format
  :data:`~sylvie_comm.integrations.accelerate.FORMAT`); at load every rank reads the file
  (``Strategy.load_checkpoint``) and ``load_model_state_dict`` (also on every rank) hands each rank its own,
  restored once the hook exists: after ``configure_ddp`` for DDP (Lightning restores the model before the
  strategy's ``setup``), at once for model parallel (which restores after ``setup``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, cast

from sylvie_comm import _deps

_deps.require("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus  # noqa: E402
from lightning.pytorch.utilities import rank_zero_warn  # noqa: E402

from sylvie_comm.algorithms.monitor import metrics  # noqa: E402
from sylvie_comm.algorithms.session import Session, merge_config  # noqa: E402
from sylvie_comm.collectives.local import LocalGroup  # noqa: E402
from sylvie_comm.config import Config  # noqa: E402
from sylvie_comm.integrations import ddp, fsdp  # noqa: E402
from sylvie_comm.integrations.accelerate import gather_states, own_state  # noqa: E402
from sylvie_comm.optim.diloco import DiLoCo, ReplicaState  # noqa: E402
from sylvie_comm.optim.diloco_checks import diloco_config  # noqa: E402
from sylvie_comm.optim.fragments import check_schedule  # noqa: E402

WHAT = "sylvie_comm.lightning"
KEY = "sylvie_comm"  # the checkpoint's entry: every rank's compression state

_ABSENT = object()  # a checkpoint without our entry (written by another strategy)
_UNSAVED = object()  # the hook's state after a fit that failed part-way: not a state to resume from

# DDPStrategy arguments that would put a second hook on the model, and what to do instead.
_REFUSED = {
    "ddp_comm_hook": "the codec is the hook (DDP takes one communication hook per model): pass codec='...'",
    "ddp_comm_state": "the hook's state is built by the strategy once the processes have joined",
    "ddp_comm_wrapper": "wrappers such as fp16_compress_wrapper wrap PyTorch's hooks; for 16-bit gradients on the "
    "wire pick codec='fp16' or 'bf16'",
    "model_averaging_period": "post-local SGD averages models with a hook of its own, which would replace ours",
}

_RESIZE_FIX = (
    ", or start the compression state afresh: drop the entry in LightningModule.on_load_checkpoint "
    f"(checkpoint.pop({KEY!r}), which runs before the strategy reads it)"
)


def _check_hook(config: Config) -> None:
    """Raise what ``sylvie_comm.ddp.register`` would raise of ``config`` once the processes have joined: the
    hook's own checks (``ddp.HookState``: the name, the options, error feedback's warm-up past DDP's bucket
    rebuild, the per-name rules), run on one in-process rank (no collective, no process group), closed again."""
    transport = LocalGroup(1).transport(0)  # the hook's checks need a transport only to build the algorithm
    ddp.HookState(config, cast(Any, transport)).close()


def _config(what: str, codec: str | None, config: Config | None, options: Mapping[str, Any] | None,
            default: str, check: Callable[[Config], None]) -> Config:  # fmt: skip
    """The configuration, checked where the strategy is built (before Lightning starts the other processes) by
    ``check``: the checks the hook (or the reduce-scatter) makes when it is registered."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"{what}: options must be a mapping of the codec's options, got {type(options).__name__}")
    try:
        cfg = merge_config(what, codec, config, options or {}, default=default)
        check(cfg)
    except (ValueError, TypeError) as exc:
        if str(exc).startswith(what):
            raise
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(f"{what}: {exc}") from None
    return cfg


class _CompressionCheckpoint:
    """The compression state of a strategy in Lightning's checkpoints: every rank's, gathered at save; each
    rank's own, restored at load."""

    _sylvie_state: Any
    _sylvie_saved: Any  # None while the hook runs; then its final state_dict(), or _UNSAVED
    _sylvie_pending: Any
    _sylvie_trainer: pl.Trainer | None

    def _sylvie_init(self) -> None:
        self._sylvie_state = None  # the last hook's state (closed once its fit ended)
        self._sylvie_saved = None  # its state_dict() at the end of that fit, for checkpoints saved afterwards
        self._sylvie_pending = None  # a loaded checkpoint's entry, until the hook exists
        self._sylvie_trainer = None

    @property
    def compression_state(self) -> Any:
        """The hook's state (``ddp.HookState`` or ``fsdp.FSDPState``: ``stats()``, ``state_dict()``) of the last
        fit, None before one; closed (no more collectives) once that fit has ended, its statistics still readable."""
        return self._sylvie_state

    def _sylvie_attach(self, state: Any, trainer: pl.Trainer | None) -> None:
        self._sylvie_state = state
        self._sylvie_saved = None
        self._sylvie_trainer = trainer
        self._sylvie_resume()

    def _sylvie_resume(self) -> None:
        blob, self._sylvie_pending = self._sylvie_pending, None
        if blob is None or self._sylvie_state is None:
            return
        if blob is _ABSENT:
            rank_zero_warn(
                f"{WHAT}: the checkpoint holds no compression state (it was written without a sylvie_comm "
                "strategy, or with weights only); the hook starts afresh"
            )
            return
        mine = own_state(blob, self.global_rank, self.world_size, f"{WHAT}: resuming", _RESIZE_FIX)  # type: ignore[attr-defined]
        self._sylvie_state.load_state_dict(mine)

    def _sylvie_add(self, checkpoint: dict[str, Any]) -> None:
        # Every rank gets here (Trainer.save_checkpoint calls the strategy on every rank), so the gather pairs up.
        if self._sylvie_state is None or self._sylvie_saved is _UNSAVED or "optimizer_states" not in checkpoint:
            return  # no hook yet, a fit that failed part-way, or a weights-only checkpoint (no training state)
        live = self._sylvie_saved is None
        local = self._sylvie_state.state_dict() if live else self._sylvie_saved
        checkpoint[KEY] = gather_states(local)

    # The strategy methods, ahead of Lightning's in the MRO. DDP loads a checkpoint before setup() (the hook does
    # not exist yet: configure_ddp() restores it); ModelParallelStrategy after setup() (restore_checkpoint_after_setup).
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]
        self._sylvie_pending = checkpoint.get(KEY, _ABSENT)
        if self._sylvie_state is not None and self._sylvie_saved is None:
            self._sylvie_resume()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self._sylvie_add(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def teardown(self) -> None:
        self._sylvie_close()
        super().teardown()  # type: ignore[misc]

    def _sylvie_close(self) -> None:
        state = self._sylvie_state
        if state is not None and self._sylvie_saved is None:
            trainer = self._sylvie_trainer
            if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
                self._sylvie_saved = _UNSAVED  # an exception may have stopped a step half-way
            else:
                # A checkpoint saved after fit() (trainer.save_checkpoint) still holds the final state.
                self._sylvie_saved = state.state_dict()
            state.close()
        self._sylvie_pending = None
        self._sylvie_trainer = None


class CompressedDDPStrategy(_CompressionCheckpoint, DDPStrategy):
    """Lightning's ``DDPStrategy`` with a sylvie_comm gradient hook, on every device (CPU included), whose
    state is saved in Lightning's checkpoints for every rank and restored on each.

    Args:
        codec: the hook (see ``sylvie_comm.ddp.HOOKS``): ``acpsgd`` (default), ``powersgd``, ``onebit``, ``topk``,
            ``sign``, ``qsgd``, ``fp16``, ``bf16``, ``none``.
        options: the codec's options (``rank``, ``ratio``, ``bits``, ...) and ``warmup_steps``,
            ``min_compression_rate``, ``seed``, as ``sylvie_comm.ddp.register`` takes them.
        config: a :class:`~sylvie_comm.config.Config` (e.g. from YAML) instead of ``codec``/``options``.
        hook_timeout: seconds one of the hook's collectives may wait for the other ranks (default 600 s);
            ``timeout`` stays Lightning's (the default process group's).
        **kwargs: ``DDPStrategy``'s (``start_method``, ``process_group_backend``, ``timeout``) and DDP's
            (``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``); not ``ddp_comm_hook``,
            ``ddp_comm_state``, ``ddp_comm_wrapper`` or ``model_averaging_period`` (a second hook).

    The codec, its options and ``config`` are checked here, in the process that builds the strategy, as the hook
    checks them when it is registered (the name, the options, the per-name rules, ``warmup_steps >= 2`` with
    error feedback): a ValueError now rather than once Lightning has started the other processes.

    The hook is registered when the model is wrapped (fitting only) and closed when the fit ends;
    :attr:`compression_state` holds it (``stats()``). A checkpoint holds every rank's state under
    ``checkpoint["sylvie_comm"]``; resuming needs the same number of processes (a ValueError otherwise).

    Example::

        strategy = CompressedDDPStrategy("acpsgd", options={"rank": 4})
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)
        trainer.fit(model)
        print(strategy.compression_state.stats()["bytes_sent"])
    """

    def __init__(
        self,
        codec: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        config: Config | None = None,
        hook_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        what = f"{WHAT}.CompressedDDPStrategy"
        refused = [k for k in _REFUSED if kwargs.get(k) is not None]
        if refused:
            raise ValueError(f"{what}: {refused[0]} is not taken: " + _REFUSED[refused[0]])
        self._sylvie_config = _config(what, codec, config, options, "acpsgd", _check_hook)
        self._sylvie_timeout = hook_timeout
        self._sylvie_init()
        super().__init__(**kwargs)

    def setup(self, trainer: pl.Trainer) -> None:
        self._sylvie_trainer = trainer
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (Lightning's own hook registration has nothing to register) and register ours."""
        super().configure_ddp()
        state = ddp.register(self.model, config=self._sylvie_config, timeout=self._sylvie_timeout)
        self._sylvie_attach(state, self._sylvie_trainer)


class CompressedModelParallelStrategy(_CompressionCheckpoint, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``LightningModule.configure_model``) with
    sylvie_comm's compressed gradient reduce-scatter (``sylvie_comm.fsdp.register``), its state in the
    checkpoints for every rank.

    Args:
        codec: a codec with a reduce-scatter form: ``qsgd`` (default), ``onebit``, ``fp16``, ``bf16``, ``none``.
        options: the codec's options and ``warmup_steps``, ``min_compression_rate``, ``seed``.
        config: a :class:`~sylvie_comm.config.Config` instead of ``codec``/``options``.
        hook_timeout: seconds one of the reduce-scatter's collectives may wait (default 600 s).
        data_parallel_size: ranks FSDP shards over; ``"auto"``: all of them (Lightning's own ``"auto"`` is the
            number of nodes, for a 2-D mesh with tensor parallelism).
        tensor_parallel_size: must be 1 (see below).
        **kwargs: ``ModelParallelStrategy``'s (``save_distributed_checkpoint``, ``process_group_backend``,
            ``timeout``).

    The codec, its options and ``config`` are checked here as ``sylvie_comm.fsdp.register`` checks them (a
    reduce-scatter form, no ``warmup: auto``; ``sylvie_comm.fsdp.check_config``).

    ``configure_model`` must apply ``fully_shard(..., mesh=self.device_mesh["data_parallel"])`` to the blocks and
    to the root. Tensor parallelism is refused: ``sylvie_comm.fsdp`` lays out FSDP2's flat reduce-scatter buffer
    for parameters sharded on dim 0 over one data-parallel mesh dimension, and a tensor-parallel DTensor
    parameter is not laid out that way.
    """

    def __init__(
        self,
        codec: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        config: Config | None = None,
        hook_timeout: float | timedelta | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = 1,
        **kwargs: Any,
    ) -> None:
        what = f"{WHAT}.CompressedModelParallelStrategy"
        if tensor_parallel_size != 1:
            raise ValueError(
                f"{what}: tensor_parallel_size must be 1, got {tensor_parallel_size!r}: the compressed reduce-scatter "
                "(sylvie_comm.fsdp) serves FSDP2 over one data-parallel mesh dimension, parameters sharded on dim 0"
            )
        self._sylvie_config = _config(what, codec, config, options, "qsgd", fsdp.check_config)
        self._sylvie_timeout = hook_timeout
        self._sylvie_init()
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            assert self.model is not None  # set by connect(); ModelParallelStrategy.setup asserts it too
            state = fsdp.register(self.model, config=self._sylvie_config, timeout=self._sylvie_timeout)
            self._sylvie_attach(state, trainer)


def _check_codec(config: Config) -> None:
    """The codec's name and options, checked on one in-process rank (no collective)."""
    Session("check", config, cast(Any, LocalGroup(1).transport(0))).close(transport=False)


class DiLoCoStrategy(_CompressionCheckpoint, DDPStrategy):
    """Lightning's processes as DiLoCo's replicas (:mod:`sylvie_comm.diloco`): no gradient average per step;
    every ``sync_every`` optimizer steps the replicas average the pseudo-gradient with ``codec`` and an outer
    optimizer applies it. Every rank's DiLoCo state, model and optimizer state go in Lightning's checkpoints (the
    replicas differ), and each rank resumes its own, bit for bit.

    Args:
        sync_every: optimizer steps between two outer steps of a fragment.
        codec: the algorithm on the outer step (default ``none``, fp32); ``options``: its options (``bits``, ...)
            and ``warmup_steps``, ``seed``; ``config``: a :class:`~sylvie_comm.config.Config` instead.
        fragments, delay, alpha: Streaming DiLoCo (see :class:`~sylvie_comm.optim.diloco.DiLoCo`).
        outer_optimizer: ``callable(parameters) -> torch.optim.Optimizer`` (default Nesterov SGD, lr 0.7,
            momentum 0.9).
        diloco_timeout: seconds an outer step's collective may wait for the other replicas (default 600 s).
        **kwargs: ``DDPStrategy``'s (``start_method``, ``process_group_backend``, ``timeout``); DDP's own are not
            taken (the model is not wrapped in DDP).

    One optimizer (``configure_optimizers``); the schedule, codec and options are checked here, before Lightning
    starts the other processes. :attr:`compression_state` holds the run (``stats()``: bytes next to plain DDP's).

    Example::

        strategy = DiLoCoStrategy(16, "qsgd", options={"bits": 2})
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy).fit(model)
    """

    def __init__(
        self,
        sync_every: int,
        codec: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        config: Config | None = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        outer_optimizer: Callable[[Any], Any] | None = None,
        diloco_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        what = f"{WHAT}.DiLoCoStrategy"
        ddp_only = [k for k in (*_REFUSED, "find_unused_parameters", "bucket_cap_mb", "static_graph") if k in kwargs]
        if ddp_only:
            raise ValueError(f"{what}: {ddp_only[0]} is not taken: the replicas are not wrapped in DDP")
        check_schedule(what, sync_every, fragments, delay, alpha)
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError(f"{what}: outer_optimizer must be a callable(parameters) -> optimizer, got "
                            f"{type(outer_optimizer).__name__}")  # fmt: skip
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(f"{what}: options must be a mapping of the codec's options, got {type(options).__name__}")
        cfg = diloco_config(what, codec, config, options or {})
        self._sylvie_config = _config(what, None, cfg, {}, "none", _check_codec)
        self._diloco: dict[str, Any] = {"sync_every": sync_every, "fragments": fragments, "delay": delay,
                                        "alpha": alpha}  # fmt: skip
        self._outer = outer_optimizer
        self._sylvie_timeout = diloco_timeout
        self._sylvie_init()
        super().__init__(**kwargs)

    def setup(self, trainer: pl.Trainer) -> None:
        self._sylvie_trainer = trainer
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"{WHAT}.DiLoCoStrategy: one optimizer is stepped by DiLoCo, the module configured "
                             f"{len(self.optimizers)}")  # fmt: skip
        module, opt = self.lightning_module, self.optimizers[0]
        assert module is not None
        outer = self._outer(module.parameters()) if self._outer is not None else None
        diloco = DiLoCo(module, opt, outer_optimizer=outer, config=self._sylvie_config, timeout=self._sylvie_timeout,
                        **self._diloco)  # fmt: skip
        self._sylvie_attach(ReplicaState(diloco), trainer)

    def configure_ddp(self) -> None:
        """The replicas train apart between outer steps: the model is not wrapped in DDP."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)  # rank 0's, from Lightning's own entry
        run = self._sylvie_state
        if isinstance(run, ReplicaState) and run.optimizer_state is not None:
            run.diloco.inner_optimizer.load_state_dict(run.optimizer_state)  # this rank's again
            run.optimizer_state = None


class CommHookCheck(pl.Callback):
    """Fail at the start of ``fit`` where a ``DDPStrategy(ddp_comm_hook=...)`` hook was not registered.

    Lightning 2.6 registers ``ddp_comm_hook`` only when the root device is CUDA and trains on without it
    otherwise (the CPU): gradients are then averaged by DDP's plain all-reduce. Add this callback to a trainer
    with a plain ``DDPStrategy`` to turn that into an error; :class:`CompressedDDPStrategy` registers its hook on
    every device.
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        hook = getattr(strategy, "_ddp_comm_hook", None)
        if hook is None:
            return
        hooks = getattr(strategy.model, "_comm_hooks", None)  # DDP's registered (hook, state) pairs
        registered = bool(hooks) if hooks is not None else strategy.root_device.type == "cuda"
        if not registered:
            name = getattr(hook, "__qualname__", repr(hook))
            raise RuntimeError(
                f"{WHAT}: DDPStrategy(ddp_comm_hook={name}) was not registered on the model: Lightning registers "
                f"ddp_comm_hook only when the root device is CUDA (DDPStrategy._register_ddp_hooks) and this run's "
                f"is {strategy.root_device}, so gradients would be averaged uncompressed; use "
                "sylvie_comm.lightning.CompressedDDPStrategy(codec, options=...), which registers on every device"
            )


class CompressionLog(pl.Callback):
    """Log the compression's figures every ``every_n_steps`` optimizer steps through ``pl_module.log_dict``: the
    compression ratio, the bytes sent and the monitor's per-tensor figures (``sylvie_comm/monitor/<tensor>/lag``,
    ``exact_cos``, ...; see :func:`sylvie_comm.algorithms.monitor.metrics`), rank 0's (every rank reads the same
    monitor figures). Needs a :class:`CompressedDDPStrategy` or :class:`CompressedModelParallelStrategy`.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"{WHAT}: CompressionLog every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(trainer.strategy, _CompressionCheckpoint):
            raise RuntimeError(
                f"{WHAT}: CompressionLog logs the compression of a sylvie_comm strategy, and this trainer's is "
                f"{type(trainer.strategy).__name__}: use CompressedDDPStrategy or CompressedModelParallelStrategy"
            )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        state = trainer.strategy.compression_state  # type: ignore[attr-defined]
        if state is None or trainer.global_step % self.every_n_steps:
            return
        pl_module.log_dict(metrics(state.stats()), rank_zero_only=True)


__all__ = [
    "KEY", "CommHookCheck", "CompressedDDPStrategy", "CompressedModelParallelStrategy", "CompressionLog",
    "DiLoCoStrategy",
]  # fmt: skip
