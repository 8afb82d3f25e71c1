"""The methods of ``sylvie-comm bench tta``: their names, what each is in words, and how each is built on a model.

:data:`ATTACH` is the table of how a method other than our algorithms attaches to the DDP model (our algorithms go
through :func:`sylvie_comm.ddp.register`; the DiLoCo methods of :data:`DILOCO` wrap the workload's own optimizer,
no DDP); :func:`build` is what a worker of :mod:`sylvie_comm.bench.tta` runs to set one up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sylvie_comm.bench import quality
from sylvie_comm.bench.choices import unique_choices

PLAIN = quality.PLAIN  # plain DDP, no hook: the baseline
CADAMW = quality.COMPRESSED_ADAMW  # sylvie_comm.optim.CompressedAdamW
CSGD = "csgd"  # sylvie_comm.optim.CompressedSGD
BOUND = "no-comm"  # the bound: DDP with a hook that sends nothing
TORCH_HOOKS: dict[str, str] = {
    "bf16_hook": "PyTorch bf16_compress_hook",
    "fp16_hook": "PyTorch fp16_compress_hook",
    "powersgd_hook": "PyTorch powerSGD_hook",
}
# A compressed optimizer replaces the workload's optimizer: it runs only on workloads trained with that one.
OPTIMIZER_METHODS: dict[str, str] = {CADAMW: "adamw", CSGD: "sgd"}
POWERSGD_START_FRACTION = 0.1  # powerSGD_hook's docstring: start_powerSGD_iter at 10 % of the training steps
DILOCO_EVERY = 16  # the DiLoCo methods' sync_every unless run(sync_every=) says otherwise
DILOCO_OUTER_LR = 0.7  # their outer Nesterov SGD's learning rate (momentum 0.9) unless run(outer_lr=) says otherwise
# DiLoCo across the workers (sylvie_comm.diloco, no DDP): the outer step's codec and options. Run when named. The
# qsgd methods keep a scale per row (block 1), what their records measured before DiLoCo took block 2048 for qsgd.
DILOCO: dict[str, tuple[str, dict[str, Any]]] = {
    "diloco": ("none", {}),
    "diloco_qsgd8_noef": ("qsgd", {"bits": 8, "error_feedback": False, "block": 1}),
    "diloco_qsgd4": ("qsgd", {"bits": 4, "block": 1}),
    "diloco_qsgd2": ("qsgd", {"bits": 2, "block": 1}),
    "diloco_qsgd2_noef": ("qsgd", {"bits": 2, "error_feedback": False, "block": 1}),
    "diloco_sparseloco": ("sparseloco", {}),  # chunked top-k 1/64, 2-bit values, decaying error feedback
}

Attach = Callable[[Any, quality.Workload, Mapping[str, Any]], tuple[Any, Any]]


def known_methods() -> list[str]:
    """Every method the benchmark knows, in its order: plain, PyTorch's hooks, our algorithms, our optimizers,
    DiLoCo with the outer step's codecs."""
    from sylvie_comm.algorithms.registry import ALGORITHMS

    return [PLAIN, *TORCH_HOOKS, *ALGORITHMS, *OPTIMIZER_METHODS, *DILOCO]


def default_methods(optimizer: str) -> list[str]:
    """Every per-step method that applies to a workload trained with ``optimizer`` (``sgd`` or ``adamw``); the
    DiLoCo methods run when named."""
    return [m for m in known_methods() if OPTIMIZER_METHODS.get(m, optimizer) == optimizer and m not in DILOCO]


def check_methods(names: Sequence[str], optimizer: str) -> list[str]:
    """``names`` without repeats, ``plain`` first (added if missing: it sets the target); a ValueError naming an
    unknown method, or a compressed optimizer that does not replace ``optimizer``."""
    out = unique_choices(names, known_methods(), "method")
    for name in out:
        wants = OPTIMIZER_METHODS.get(name)
        if wants is not None and wants != optimizer:
            raise ValueError(
                f"method {name!r} replaces {wants} and this workload trains with {optimizer} "
                f"({'--optimizer adamw' if wants == 'adamw' else 'cnn --optimizer sgd'} for it)"
            )
    return [PLAIN, *(n for n in out if n != PLAIN)]


def csgd_missing() -> str | None:
    """Why ``csgd`` cannot run in this installation (None when it can)."""
    import sylvie_comm.ddp
    import sylvie_comm.optim

    if not hasattr(sylvie_comm.optim, "CompressedSGD"):
        return "sylvie_comm.optim has no CompressedSGD in this installation"
    if not hasattr(sylvie_comm.ddp, "compressed_sgd"):
        return "sylvie_comm.ddp has no compressed_sgd adapter in this installation"
    return None


def powersgd_start(steps: int) -> int:
    """``start_powerSGD_iter`` for a run of ``steps``: 10 % of them, at least 2 (PyTorch's minimum with error
    feedback: DDP rebuilds its buckets after the first iteration)."""
    return max(2, int(steps * POWERSGD_START_FRACTION))


def label(name: str, steps: int, sync_every: int = DILOCO_EVERY, outer_lr: float = DILOCO_OUTER_LR) -> str:
    """What a method is, in words."""
    if name in DILOCO:
        codec, options = DILOCO[name]
        opts = "".join(f", {k}={v!r}" for k, v in options.items())
        return (f"sylvie_comm.diloco.DiLoCo(sync_every={sync_every}, codec={codec!r}{opts}): no DDP, the replicas "
                f"apart between outer steps, Nesterov SGD outer steps (lr {outer_lr:g}, momentum 0.9)")  # fmt: skip
    if name == PLAIN:
        return "DDP fp32 all-reduce, no hook"
    if name == BOUND:
        return "DDP, a hook that sends nothing (bound; not data-parallel)"
    if name == "powersgd_hook":
        return (f"PyTorch powerSGD_hook (matrix_approximation_rank=1, start_powerSGD_iter={powersgd_start(steps)}, "
                "error feedback, warm start; 1 bucket)")  # fmt: skip
    if name in TORCH_HOOKS:
        return TORCH_HOOKS[name]
    if name == CADAMW:
        return "sylvie_comm.optim.CompressedAdamW (sylvie_comm.ddp.compressed_adamw, defaults)"
    if name == CSGD:
        return "sylvie_comm.optim.CompressedSGD (sylvie_comm.ddp.compressed_sgd, defaults)"
    return f"sylvie_comm.ddp.register(model, {name!r}), default options"


# ---------------------------------------------------------------------- building a method


def _plain(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    return None, None


def _bound(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    from sylvie_comm.integrations.optim import local_gradients_hook

    ddp.register_comm_hook(None, local_gradients_hook)
    return None, None


def _cast_hook(name: str) -> Attach:
    def attach(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, name))
        return None, None

    return attach


def _powersgd_hook(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    # PowerSGDState's defaults otherwise: min_compression_rate=2, use_error_feedback=True, warm_start=True.
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                             start_powerSGD_iter=powersgd_start(int(cfg["steps"])))  # fmt: skip
    ddp.register_comm_hook(state, ps.powerSGD_hook)
    return None, None


def _cadamw(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    import sylvie_comm.ddp

    if wl.adamw is None:
        raise ValueError(f"bench tta: {CADAMW} needs an AdamW workload, {wl.name} trains with SGD")
    opt = sylvie_comm.ddp.compressed_adamw(ddp, **wl.adamw, total_steps=int(cfg["steps"]),
                                           timeout=cfg["collective_timeout"])  # fmt: skip
    return None, opt


def _csgd(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    import sylvie_comm.ddp

    if wl.sgd is None:
        raise ValueError(f"bench tta: {CSGD} needs an SGD workload, {wl.name} trains with AdamW")
    make = getattr(sylvie_comm.ddp, "compressed_sgd", None)
    if make is None:
        raise ValueError(f"bench tta: {csgd_missing()}")
    return None, make(ddp, **wl.sgd, total_steps=int(cfg["steps"]))


# How each method other than our algorithms (which go through sylvie_comm.ddp.register) attaches to the DDP model:
# (hook state or None, the optimizer that replaces the workload's or None).
ATTACH: dict[str, Attach] = {
    PLAIN: _plain,
    BOUND: _bound,
    "bf16_hook": _cast_hook("bf16_compress_hook"),
    "fp16_hook": _cast_hook("fp16_compress_hook"),
    "powersgd_hook": _powersgd_hook,
    CADAMW: _cadamw,
    CSGD: _csgd,
}


def _register(name: str) -> Attach:
    def attach(ddp: Any, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[Any, Any]:
        import sylvie_comm.ddp

        return sylvie_comm.ddp.register(ddp, name, timeout=cfg["collective_timeout"]), None

    return attach


def build(name: str, model: nn.Module, wl: quality.Workload, cfg: Mapping[str, Any]) -> tuple[nn.Module, Any, Any]:
    """Method ``name`` on ``model`` (the default group is up): ``(the module to train, its hook state or DiLoCo or
    None, the optimizer that replaces the workload's or None)``. A TypeError from DDP where it refuses one of
    PyTorch's hooks here."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if name in DILOCO:  # no DDP: DiLoCo hooks the workload's own optimizer
        from sylvie_comm.diloco import DiLoCo

        codec, options = DILOCO[name]
        copt = wl.make_optimizer(model)
        outer = torch.optim.SGD(model.parameters(), lr=float(cfg["outer_lr"]), momentum=0.9, nesterov=True)
        state = DiLoCo(model, copt, sync_every=int(cfg["sync_every"]), codec=codec, outer_optimizer=outer,
                       timeout=cfg["collective_timeout"], **options)  # fmt: skip
        return model, state, copt
    ddp = DDP(model, bucket_cap_mb=1024 if name == "powersgd_hook" else 25)
    state, copt = ATTACH.get(name, _register(name))(ddp, wl, cfg)
    return ddp, state, copt
