"""CompressedAdamW and CompressedSGD over DDP's process group or over Horovod: the optimizer's step is the only
collective.

DDP::

    model = DDP(net)
    opt = sylvie_comm.ddp.compressed_adamw(model, lr=1e-3, total_steps=10_000)   # DDP's all-reduce is off
    opt = sylvie_comm.ddp.compressed_sgd(model, lr=0.05, momentum=0.9, total_steps=10_000)   # or SGD

Horovod::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # as usual, the user's part
    opt = sylvie_comm.horovod.compressed_adamw(model, lr=1e-3, total_steps=10_000)
    opt = sylvie_comm.horovod.compressed_sgd(model, lr=0.05, momentum=0.9, total_steps=10_000)

Each builds a :class:`sylvie_comm.optim.MomentumOptimizer` (:class:`~sylvie_comm.optim.CompressedAdamW`, 1-bit
Adam, or :class:`~sylvie_comm.optim.CompressedSGD`: fp32 gradient averages for the warm-up, then the momentum
averaged by an error-feedback compressed all-reduce) on a transport of its own, named by the model's parameter
names. This module owns no math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.collectives import ProcessGroupTransport, Transport
from sylvie_comm.collectives.horovod import HorovodTransport
from sylvie_comm.optim import CompressedAdamW, CompressedSGD, MomentumOptimizer

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket


def local_gradients_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that sends nothing: the bucket comes back as this rank's own gradients (not divided)."""
    buf = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    )
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations at run time; this module's are strings (PEP 563).
local_gradients_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}

Opt = TypeVar("Opt", bound=MomentumOptimizer)
Named = list[tuple[str, nn.Parameter]]


def _over_ddp(
    what: str, ddp_model: nn.parallel.DistributedDataParallel, timeout: float | timedelta | None,
    build: Callable[[Named, Transport], Opt],
) -> Opt:  # fmt: skip
    """``build(named parameters, transport)`` on a process group of the DDP model's ranks, then DDP's all-reduce
    turned off; on any failure what was made is closed."""
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"{what}: expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    transport = ProcessGroupTransport(ddp_model.process_group, timeout=timeout)  # a collective: every rank
    try:
        opt = build(list(ddp_model.module.named_parameters()), transport)
    except BaseException:
        transport.close()
        raise
    try:
        ddp_model.register_comm_hook(None, local_gradients_hook)
    except BaseException:
        opt.close()
        raise
    return opt


def _over_horovod(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]], build: Callable[[Named, Transport], Opt]
) -> Opt:
    """``build(named parameters, transport)`` on a Horovod transport of its own (closed if it fails)."""
    named = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
    transport = HorovodTransport()  # every rank creates its transports in the same order
    try:
        return build(named, transport)
    except BaseException:
        transport.close()
        raise


def ddp_compressed_adamw(
    ddp_model: nn.parallel.DistributedDataParallel, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8, weight_decay: float = 1e-2, *, codec: str = "onebit", timeout: float | timedelta | None = None,
    **kwargs: Any,
) -> CompressedAdamW:  # fmt: skip
    """A :class:`~sylvie_comm.optim.CompressedAdamW` over the DDP model's process group, with DDP's gradient
    all-reduce turned off (a comm hook that hands each bucket back unchanged): a collective call.

    Call it before the first backward pass (DDP takes a comm hook only then). The optimizer talks on a
    process group of its own of the same ranks (created with ``timeout``, default 600 s) and closes it in
    ``close()``. DDP still broadcasts buffers (BatchNorm) before each forward pass, on its own group.

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        lr: as :class:`~sylvie_comm.optim.CompressedAdamW` (default 1e-3).
        betas: as :class:`~sylvie_comm.optim.CompressedAdamW` (default (0.9, 0.999)).
        eps: as :class:`~sylvie_comm.optim.CompressedAdamW` (default 1e-8).
        weight_decay: as :class:`~sylvie_comm.optim.CompressedAdamW` (default 0.01).
        codec: the algorithm that averages the momentum (default ``onebit``).
        **kwargs: the other arguments of :class:`~sylvie_comm.optim.CompressedAdamW` (``warmup`` or
            ``total_steps`` among them).
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks.
    """
    return _over_ddp(
        "ddp_compressed_adamw", ddp_model, timeout,
        lambda named, transport: CompressedAdamW(named, lr, betas, eps, weight_decay, transport=transport,
                                                 codec=codec, close_transport=True, **kwargs),
    )  # fmt: skip


def horovod_compressed_adamw(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8, weight_decay: float = 1e-2, *, codec: str = "onebit", **kwargs: Any,
) -> CompressedAdamW:  # fmt: skip
    """A :class:`~sylvie_comm.optim.CompressedAdamW` over Horovod (``hvd.init()`` first): a collective call.

    Use it instead of ``hvd.DistributedOptimizer`` (which would all-reduce the gradients a second time).
    Broadcast the initial parameters as usual (``hvd.broadcast_parameters(model.state_dict(), 0)``).

    Args:
        model: the model, or its ``named_parameters()``.
        lr: as :class:`~sylvie_comm.optim.CompressedAdamW` (default 1e-3).
        betas: as :class:`~sylvie_comm.optim.CompressedAdamW` (default (0.9, 0.999)).
        eps: as :class:`~sylvie_comm.optim.CompressedAdamW` (default 1e-8).
        weight_decay: as :class:`~sylvie_comm.optim.CompressedAdamW` (default 0.01).
        codec: the algorithm that averages the momentum (default ``onebit``).
        **kwargs: the other arguments of :class:`~sylvie_comm.optim.CompressedAdamW` (``warmup`` or
            ``total_steps`` among them).
    """
    return _over_horovod(
        model, lambda named, transport: CompressedAdamW(named, lr, betas, eps, weight_decay, transport=transport,
                                                        codec=codec, close_transport=True, **kwargs),
    )  # fmt: skip


def ddp_compressed_sgd(
    ddp_model: nn.parallel.DistributedDataParallel, lr: float, momentum: float = 0.9, dampening: float = 0.0,
    weight_decay: float = 0.0, nesterov: bool = False, *, codec: str = "onebit",
    timeout: float | timedelta | None = None, **kwargs: Any,
) -> CompressedSGD:  # fmt: skip
    """:func:`sylvie_comm.ddp.compressed_adamw` for SGD: a :class:`~sylvie_comm.optim.CompressedSGD` over the DDP
    model's process group, DDP's gradient all-reduce turned off; a collective call, made as that one is (before the
    first backward pass; the optimizer's process group of its own, of the same ranks, closed in ``close()``).

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        lr: as :class:`~sylvie_comm.optim.CompressedSGD`.
        momentum: as :class:`~sylvie_comm.optim.CompressedSGD` (default 0.9; must be > 0).
        dampening: as :class:`~sylvie_comm.optim.CompressedSGD` (default 0).
        weight_decay: as :class:`~sylvie_comm.optim.CompressedSGD` (default 0).
        nesterov: as :class:`~sylvie_comm.optim.CompressedSGD` (default False).
        codec: the algorithm that averages the momentum (default ``onebit``).
        timeout: seconds (or a ``timedelta``) a collective may wait for the other ranks.
        **kwargs: the other arguments of :class:`~sylvie_comm.optim.CompressedSGD` (``warmup`` or
            ``total_steps`` among them).
    """
    return _over_ddp(
        "ddp_compressed_sgd", ddp_model, timeout,
        lambda named, transport: CompressedSGD(named, lr, momentum, dampening, weight_decay, nesterov,
                                               transport=transport, codec=codec, close_transport=True, **kwargs),
    )  # fmt: skip


def horovod_compressed_sgd(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]], lr: float, momentum: float = 0.9, dampening: float = 0.0,
    weight_decay: float = 0.0, nesterov: bool = False, *, codec: str = "onebit", **kwargs: Any,
) -> CompressedSGD:  # fmt: skip
    """:func:`sylvie_comm.horovod.compressed_adamw` for SGD: a :class:`~sylvie_comm.optim.CompressedSGD` over Horovod
    (``hvd.init()`` first); a collective call, used as that one is (instead of ``hvd.DistributedOptimizer``, after
    the usual broadcast of the initial parameters).

    Args:
        model: the model, or its ``named_parameters()``.
        lr: as :func:`sylvie_comm.ddp.compressed_sgd`, as are ``momentum`` (default 0.9; must be > 0),
            ``dampening``, ``weight_decay``, ``nesterov``, ``codec`` (default ``onebit``) and ``**kwargs`` (the
            other arguments of :class:`~sylvie_comm.optim.CompressedSGD`).
    """
    return _over_horovod(
        model, lambda named, transport: CompressedSGD(named, lr, momentum, dampening, weight_decay, nesterov,
                                                      transport=transport, codec=codec, close_transport=True,
                                                      **kwargs),
    )  # fmt: skip


__all__ = [
    "ddp_compressed_adamw",
    "ddp_compressed_sgd",
    "horovod_compressed_adamw",
    "horovod_compressed_sgd",
    "local_gradients_hook",
]
