"""Horovod: compressors for ``hvd.DistributedOptimizer`` and an optimizer of our own.

Two ways in. With Horovod's own optimizer, pass one of our compressors::

    import sylvie_comm.horovod as sh
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(),
        compression=sh.Compression.acpsgd(model.named_parameters(), rank=4),
    )

Horovod all-reduces whatever ``compress`` returns, so only all-reduce-compatible
algorithms fit its contract: ``none``, ``fp16``, ``bf16`` and ``acpsgd``
(whose factors add up). Every algorithm of the registry (one-bit, top-k,
sign, QSGD and PowerSGD need all-gathers, all-to-alls or two dependent
all-reduces) runs through :class:`DistributedOptimizer`, which launches each
fusion group from gradient hooks on a
:class:`~sylvie_comm.collectives.horovod.HorovodTransport`::

    opt = sh.DistributedOptimizer(opt, model.named_parameters(), codec="onebit")

This module owns no math: both ways drive the algorithms of
:mod:`sylvie_comm.algorithms` (behind their policy) as the DDP hooks do. The compressors are in
:mod:`sylvie_comm.integrations.horovod_compression` (re-exported here).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.base import real_view
from sylvie_comm.algorithms.session import Session, SessionHolder, merge_config
from sylvie_comm.collectives.horovod import HorovodTransport
from sylvie_comm.config import Config
from sylvie_comm.integrations.horovod_compression import (
    ACPSGDCompressor,
    BF16Compressor,
    Compression,
    FP16Compressor,
    NoneCompressor,
    named_parameter_list,
)

Future = torch.futures.Future

# Keywords of hvd.DistributedOptimizer that have no meaning here, and why.
_HOROVOD_ONLY = {
    "compression": "the codec is the compression: pass codec='...' (or use hvd.DistributedOptimizer with "
    "sylvie_comm.horovod.Compression)",
    "op": "every algorithm averages (op=hvd.Average); Sum and Adasum are not supported",
    "gradient_predivide_factor": "the algorithms choose their own scaling (casts divide by the world size first)",
    "groups": "fusion groups are formed by compressed size: set bucket_cap_mb",
    "num_groups": "fusion groups are formed by compressed size: set bucket_cap_mb",
    "sparse_as_dense": "sparse gradients are not supported",
    "process_set": "only the global process set is supported",
}


# ---------------------------------------------------------------------------------------------------------------------
# Our optimizer: every algorithm, launched from gradient hooks on a HorovodTransport


class DistributedOptimizer(SessionHolder):
    """Average gradients with a sylvie_comm algorithm over Horovod, then step the wrapped optimizer.

    Each parameter's gradient hook (``register_post_accumulate_grad_hook``)
    marks it ready; a fusion group (parameters in reverse registration order,
    about ``bucket_cap_mb`` of compressed bytes each) is launched once all its
    parameters are ready and the groups before it are launched, so every rank
    issues the same collectives in the same order while backward goes on.
    :meth:`step` waits for every group (launching those whose parameters got no
    gradient, with zeros, as Horovod does), then steps the wrapped optimizer.

    Building one is a collective call: every rank must build it, and ranks that
    disagree on the configuration (codec, options, warm-up, seed, rules,
    ``bucket_cap_mb``, ``backward_passes_per_step``, parameter names and
    shapes) fail on every rank with a message naming the first difference.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to step (give LR schedulers ``.optimizer``).
        named_parameters: ``model.named_parameters()``; must name every parameter of ``optimizer``.
        codec: an algorithm of the registry (``acpsgd`` default, ``powersgd``, ``onebit``, ``topk``, ``sign``,
            ``qsgd``, ``fp16``, ``bf16``, ``none``).
        config: a :class:`~sylvie_comm.config.Config` (e.g. from YAML) instead of keywords.
        backward_passes_per_step: backward passes accumulated locally before the gradients travel (default 1).
        bucket_cap_mb: compressed megabytes per fusion group (default 25).
        **options: the algorithm's options (``rank``, ``chunk_size``, ``scale``, ``ratio``, ``bits``) and
            ``warmup_steps``, ``min_compression_rate``, ``seed``, as for the DDP hooks.

    Example::

        opt = sylvie_comm.horovod.DistributedOptimizer(opt, model.named_parameters(), "onebit")
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, nn.Parameter]],
        codec: str | None = None, *, config: Config | None = None, backward_passes_per_step: int = 1,
        bucket_cap_mb: float = 25.0, **options: Any,
    ) -> None:  # fmt: skip
        what = "sylvie_comm.horovod.DistributedOptimizer"
        for key in sorted(set(options) & set(_HOROVOD_ONLY)):
            raise ValueError(f"{what}: Horovod's option {key!r} is not supported: {_HOROVOD_ONLY[key]}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{what}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        bpps = backward_passes_per_step
        if isinstance(bpps, bool) or not isinstance(bpps, int) or bpps < 1:
            raise ValueError(f"{what}: backward_passes_per_step must be an integer >= 1, got {bpps!r}")
        cap = bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"{what}: bucket_cap_mb must be a positive number, got {cap!r}")
        self.optimizer = optimizer
        self.backward_passes_per_step = bpps
        self.bucket_cap_mb = float(cap)
        named = named_parameter_list(what, named_parameters)
        names = {id(p): n for n, p in named}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        missing = [tuple(p.shape) for p in params if id(p) not in names]
        if missing:
            raise ValueError(
                f"{what}: {len(missing)} parameter(s) of the optimizer (shapes {missing[:3]}) are not in "
                "named_parameters; pass the named parameters of the model the optimizer trains"
            )
        self._params = [(names[id(p)], p) for p in params]
        self.transport = HorovodTransport()  # every rank creates its transports in the same order

        def describe(session: Session) -> dict[str, Any]:
            shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in self._params)
            return {"optimizer": {"bucket_cap_mb": self.bucket_cap_mb, "backward_passes_per_step": bpps,
                                  "parameters": len(self._params),
                                  "parameter_digest": f"{zlib.crc32(shapes.encode()):08x}"}}  # fmt: skip

        self.session = Session.agreed(
            what, self.transport, lambda: merge_config(what, codec, config, options), describe=describe,
            prepare=lambda session: session.policy.check_parameters(self._params, what),
        )  # fmt: skip
        self.session.what = f"{what}[{self.name}]"
        # internal state
        self._groups = self._form_groups()
        self._group_of = {id(p): g for g, members in enumerate(self._groups) for _, p, _, _ in members}
        self._passes = {id(p): 0 for _, p in self._params}
        self._waiting = [len(m) for m in self._groups]  # parameters of each group still to be ready
        self._launched = 0  # groups launched this step, in order
        self._futures: list[Future[None]] = []
        self._synchronized = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self._params]

    # ------------------------------------------------------------------ groups

    def _wire_bytes(self, shape: torch.Size, compress: bool, options: Mapping[str, Any]) -> float:
        """The bytes a tensor sends, for sizing groups: fp32 raw, else the algorithm's rate for its shape (the
        low-rank ones) or its bytes per element with the tensor's options."""
        numel = math.prod(shape)
        if not compress:
            return 4.0 * numel
        rate = self.algorithm.compression_rate(shape, options)
        if math.isfinite(rate):
            return 4.0 * numel / rate
        return numel * self.algorithm.record.payload_per_element(options)

    def _form_groups(self) -> list[list[tuple[str, nn.Parameter, bool, Mapping[str, Any]]]]:
        """Greedy: parameters in reverse registration order (about backward's), ``bucket_cap_mb`` per group."""
        cap = self.bucket_cap_mb * 2**20
        groups: list[list[tuple[str, nn.Parameter, bool, Mapping[str, Any]]]] = []
        size = math.inf
        for name, p in reversed(self._params):
            shape = real_view(p.detach()).shape  # a complex parameter travels as its (re, im) pairs
            compress, options = self.policy.member_options(name, shape)
            nbytes = self._wire_bytes(shape, compress, options)
            if size + nbytes > cap and size > 0:
                groups.append([])
                size = 0.0
            groups[-1].append((name, p, compress, options))
            size += nbytes
        return groups

    def _on_grad(self, p: torch.Tensor) -> None:
        key = id(p)
        self._passes[key] += 1
        passes = self._passes[key]
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"sylvie_comm.horovod: gradients were computed {passes} times before step(), more than "
                f"backward_passes_per_step={self.backward_passes_per_step}; raise it to accumulate locally"
            )
        if passes == self.backward_passes_per_step:
            g = self._group_of[key]
            self._waiting[g] -= 1
            while self._launched < len(self._groups) and self._waiting[self._launched] == 0:
                self._launch(self._launched)

    def _launch(self, g: int) -> None:
        members = []
        for name, p, compress, options in self._groups[g]:
            if p.grad is None:  # no gradient on this rank: the others may have one (as Horovod does)
                p.grad = torch.zeros_like(p)
            members.append(Member(name, real_view(p.grad), compress, options))
        self._launched += 1
        self._futures.append(self.session.run(Group(g, members)))

    # ------------------------------------------------------------------ optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def synchronize(self) -> None:
        """Launch the groups not launched yet and wait until every gradient holds its average.

        Call :meth:`step` with ``skip_synchronize=True`` (or simply :meth:`step`: it does not average twice)
        after modifying the averaged gradients (clipping).
        """
        while self._launched < len(self._groups):
            self._launch(self._launched)
        futures, self._futures = self._futures, []
        try:
            for fut in futures:
                fut.wait()
        finally:
            for key in self._passes:
                self._passes[key] = 0
            self._waiting = [len(m) for m in self._groups]
            self._launched = 0
        self.transport.restart_names()  # nothing in flight: the next step's names repeat this one's
        self.session.advance()
        self._synchronized = True

    def step(self, closure: Callable[[], float] | None = None, *, skip_synchronize: bool = False) -> Any:
        """Average the gradients (unless :meth:`synchronize` already did), then step the wrapped optimizer."""
        if not (skip_synchronize or self._synchronized):
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._launched or any(self._passes.values()):
            raise RuntimeError(
                "sylvie_comm.horovod: zero_grad() was called after backward() but before step() or "
                "synchronize(): the gradients are being averaged in place"
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def step_count(self) -> int:
        """Communication rounds done (the policy's step)."""
        return self.session.step

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and the algorithm's per-parameter state, keyed by parameter name."""
        return {"optimizer": self.optimizer.state_dict(), "sylvie_comm": self.session.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own); every field is
        checked first, and the ranks agree on the step (see ``sylvie_comm.ddp.HookState.load_state_dict``)."""
        if not isinstance(state, Mapping) or "optimizer" not in state or "sylvie_comm" not in state:
            raise ValueError(f"{self.session.what}: expected a dict from DistributedOptimizer.state_dict() "
                             "with 'optimizer' and 'sylvie_comm' entries")  # fmt: skip
        shapes = [(n, real_view(p.detach()).shape) for n, p in self._params]
        self.session.load_state_dict(state["sylvie_comm"], shapes)
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Remove the gradient hooks, stop the algorithm's thread and the transport's waiter (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.session.close()

    def __repr__(self) -> str:
        return f"sylvie_comm.horovod.DistributedOptimizer({self.name}, {len(self._groups)} groups, {self.optimizer!r})"


__all__ = [
    "ACPSGDCompressor",
    "BF16Compressor",
    "Compression",
    "Config",
    "DistributedOptimizer",
    "FP16Compressor",
    "NoneCompressor",
]
