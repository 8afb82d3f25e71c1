"""What DiLoCo checks: its outer step's configuration, the replica it is given (model, inner and outer optimizers),
its process group against the replica's, and a checkpoint before anything of it is loaded; each a ValueError or
TypeError naming the value and what was expected."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.algorithms.delegating import Delegating
from sylvie_comm.algorithms.session import merge_config
from sylvie_comm.collectives import ProcessGroupTransport, Transport
from sylvie_comm.config import Config, differences
from sylvie_comm.optim.fragments import Fragment, Named, check_schedule
from sylvie_comm.optim.momentum import is_integer

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# An outer codec's options where the config and the keywords leave them out (DiLoCo's defaults, not the codec's):
# qsgd 2-bit with a scale and minimum per 2,048 values or more, >= 250x fewer bytes than plain DDP at H=16 on the
# benchmarks' LM (the per-row scales of qsgd's own default reach 229x; docs/guide/diloco.md, Measured).
OUTER_DEFAULTS: dict[str, dict[str, Any]] = {"qsgd": {"bits": 2, "block": 2048}}


def diloco_config(what: str, codec: str | None, config: Config | None, options: Mapping[str, Any]) -> Config:
    """The outer step's configuration: ``config``, or ``codec`` (default ``none``) with ``options``, over DiLoCo's
    defaults for that codec (:data:`OUTER_DEFAULTS`: qsgd 2-bit, ``block=2048``); without a config no fp32 warm-up
    (``warmup_steps=0``) and no compression monitor (its per-step figures and thresholds are a gradient's), unless
    the options set them. An algorithm that chooses among others as it runs (``auto``,
    :class:`~sylvie_comm.algorithms.delegating.Delegating`) is refused, and so is the adaptive warm-up: both
    decide step by step, and outer steps are few and far between."""
    if config is None:
        options = {"warmup_steps": 0, "monitor": {"period": 0}, **options}
    cfg = merge_config(what, codec, config, options, default="none")
    outer_defaults = OUTER_DEFAULTS.get(cfg.codec)
    if outer_defaults:  # beneath what the config or the keywords name
        d = cfg.to_dict()
        d["options"] = {**outer_defaults, **d["options"]}
        cfg = Config.from_dict(d)
    cls = ALGORITHMS.get(cfg.codec)
    if cls is not None and issubclass(cls, Delegating):
        raise ValueError(f"{what}: codec {cfg.codec!r} measures the link step by step to choose a codec; name one "
                         "for the outer step (none, fp16, qsgd, topk, acpsgd, ...)")  # fmt: skip
    if cfg.warmup == "auto":
        raise ValueError(f"{what}: warmup 'auto' watches each gradient settle step by step; use warmup_steps (the "
                         "outer steps averaged in fp32 first)")  # fmt: skip
    return cfg


def check_replica(
    what: str, model: Any, inner: Any, outer: Any, sync_every: Any, fragments: Any, delay: Any, alpha: Any
) -> tuple[nn.Module, Any, Named, torch.optim.Optimizer, int]:
    """The replica DiLoCo is given, checked: the model (a DDP model's module, DDP's group kept), the inner
    optimizer stepping every trainable parameter, the outer one (default Nesterov SGD, lr 0.7, momentum 0.9)
    stepping exactly those, and the schedule. Returns the model, DDP's group (or None), the trainable parameters
    by name, the outer optimizer and the period (:func:`~sylvie_comm.optim.fragments.check_schedule`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: model must be a torch.nn.Module, got {type(model).__name__}")
    inner_group = None
    if isinstance(model, nn.parallel.DistributedDataParallel):  # DDP within a replica group, DiLoCo across
        inner_group = model.process_group
        model = model.module
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"{what}: inner_optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}")
    period = check_schedule(what, sync_every, fragments, delay, alpha)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{what}: model has no trainable parameters")
    if len(named) < fragments:
        raise ValueError(f"{what}: fragments ({fragments}) exceeds the model's {len(named)} trainable parameters")
    device = named[0][1].device
    for n, p in named:
        if p.dtype not in PARAM_DTYPES or p.is_complex():
            raise TypeError(f"{what}: parameter '{n}' is {p.dtype}; expected float32, float16 or bfloat16")
        if p.device != device:
            raise ValueError(f"{what}: parameters on {device} and {p.device} ('{n}'); one device per replica")
    inner_ids = {id(p) for g in inner.param_groups for p in g["params"]}
    missing = [n for n, p in named if id(p) not in inner_ids]
    if missing:
        raise ValueError(f"{what}: the inner optimizer does not step parameter '{missing[0]}' of the model")
    if outer is None:
        outer = torch.optim.SGD([p for _, p in named], lr=0.7, momentum=0.9, nesterov=True)
    elif not isinstance(outer, torch.optim.Optimizer):
        raise TypeError(f"{what}: outer_optimizer must be a torch.optim.Optimizer over the model's parameters, got "
                        f"{type(outer).__name__}")  # fmt: skip
    outer_ids, ids = {id(p) for g in outer.param_groups for p in g["params"]}, {id(p) for _, p in named}
    if outer_ids != ids:
        raise ValueError(
            f"{what}: outer_optimizer must step exactly the model's trainable parameters ({len(named)}), got "
            f"{len(outer_ids)} parameters of which {len(outer_ids & ids)} are the model's"
        )
    return model, inner_group, named, outer, period


def check_groups(what: str, transport: Transport, ddp_group: Any, params: list[torch.Tensor]) -> None:
    """Refuse a DiLoCo group that shares ranks with the replica's own (DDP's group, FSDP2's mesh): the replica
    group already averages every step, and DiLoCo belongs across groups."""
    group = getattr(transport, "group", None)
    if group is None or not isinstance(transport, ProcessGroupTransport):
        return
    import torch.distributed as dist

    inner: set[int] = set()
    if ddp_group is not None:
        inner = set(dist.get_process_group_ranks(ddp_group))
    mesh = getattr(params[0], "device_mesh", None)
    if mesh is not None:
        inner |= {int(r) for r in mesh.mesh.flatten().tolist()}
    shared = inner & set(dist.get_process_group_ranks(group))
    if len(shared) > 1:
        raise ValueError(
            f"{what}: its process group and the replica group (DDP's or FSDP2's) share ranks {sorted(shared)}; the "
            "replica group averages every step already: pass DiLoCo the group across replica groups (this rank and "
            "the ranks of the same position in the other groups)"
        )


def check_state(
    what: str, state: Any, fragments: list[Fragment], describe: Callable[[Fragment], Mapping[str, Any]]
) -> int:
    """A DiLoCo checkpoint checked against this run (its configuration, ``describe(fragment)``, fragments, global
    copies and averages in flight; a ValueError naming the first field that does not fit); its inner step."""
    if not isinstance(state, Mapping) or not {"inner_step", "fragments", "outer_optimizer"} <= set(state):
        raise ValueError(f"{what}: not a DiLoCo state_dict (expected inner_step, fragments, outer_optimizer)")
    step = state["inner_step"]
    if not is_integer(step) or step < 0:
        raise ValueError(f"{what}: the checkpoint's inner_step must be an integer >= 0, got {step!r}")
    saved_config = state.get("config")
    if not isinstance(saved_config, Mapping):
        raise ValueError(f"{what}: the checkpoint holds no DiLoCo configuration ('config'), expected a "
                         f"mapping, got {type(saved_config).__name__}")  # fmt: skip
    diff = differences(saved_config, describe(fragments[0]))
    if diff:
        fields = "; ".join(f"{field} is {a!r} in the checkpoint, {b!r} in this run" for field, a, b in diff)
        raise ValueError(f"{what}: the checkpoint was written with another configuration: {fields}")
    frags = state["fragments"]
    if not isinstance(frags, list) or len(frags) != len(fragments):
        got = len(frags) if isinstance(frags, list) else type(frags).__name__
        raise ValueError(f"{what}: the checkpoint has {got} fragments, this run {len(fragments)}")
    for frag, saved in zip(fragments, frags, strict=True):
        if not isinstance(saved, Mapping) or not {"outer", "session", "pending"} <= set(saved):
            raise ValueError(f"{what}: the checkpoint's fragment {frag.index} is not a mapping of outer, "
                             "session and pending")  # fmt: skip
        outer = saved["outer"]
        for (n, _), o in zip(frag.named, frag.outer, strict=True):
            t = outer.get(n) if isinstance(outer, Mapping) else None
            if not isinstance(t, torch.Tensor) or t.shape != o.shape or t.dtype != o.dtype:
                raise ValueError(f"{what}: the checkpoint's global copy of '{n}' is missing or of another "
                                 f"shape or dtype (expected {tuple(o.shape)} {o.dtype})")  # fmt: skip
        pending = saved["pending"]
        if pending is not None and (not isinstance(pending, torch.Tensor) or pending.numel() != frag.numel):
            raise ValueError(f"{what}: the checkpoint's average in flight of fragment {frag.index} must be "
                             f"None or a tensor of {frag.numel} values")  # fmt: skip
    return int(step)


__all__ = ["OUTER_DEFAULTS", "PARAM_DTYPES", "check_groups", "check_replica", "check_state", "diloco_config"]
