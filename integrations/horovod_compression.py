"""Horovod's way in: compressors for ``hvd.DistributedOptimizer`` (``sylvie_comm.horovod.Compression``).

Horovod all-reduces whatever ``compress`` returns, so only all-reduce-compatible algorithms fit its
contract: ``none``, ``fp16``, ``bf16`` and ``acpsgd`` (whose factors add up). :func:`named_parameter_list`
serves :class:`~sylvie_comm.integrations.horovod.DistributedOptimizer` too; the configuration, the warm-up, the
statistics and the checkpoint are a :class:`~sylvie_comm.algorithms.session.Session`'s, as for every integration:
each gradient is a group of one that :meth:`Session.run <sylvie_comm.algorithms.session.Session.run>` averages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from sylvie_comm.algorithms import Group, Member
from sylvie_comm.algorithms.base import real_view
from sylvie_comm.algorithms.delegating import delegating
from sylvie_comm.algorithms.session import Session, SessionHolder, merge_config
from sylvie_comm.collectives.horovod import import_horovod, supports
from sylvie_comm.config import Config

Future = torch.futures.Future


def named_parameter_list(
    what: str, named_parameters: Iterable[tuple[str, nn.Parameter]]
) -> list[tuple[str, nn.Parameter]]:
    if isinstance(named_parameters, (str, bytes)) or not isinstance(named_parameters, Iterable):
        raise TypeError(
            f"{what}: named_parameters must be an iterable of (name, parameter) pairs such as "
            f"model.named_parameters(), got {type(named_parameters).__name__}"
        )
    named = list(named_parameters)
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):  # fmt: skip
            raise TypeError(f"{what}: named_parameters must yield (name, parameter) pairs, got {item!r:.80}")
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{what}: parameter names must be unique, repeated: {', '.join(dupes)}")
    if not named:
        raise ValueError(f"{what}: named_parameters is empty; pass model.named_parameters()")
    return named


# ---------------------------------------------------------------------------------------------------------------------
# Compressors for hvd.DistributedOptimizer: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx) -> tensor


class NoneCompressor:
    """No compression (Horovod's default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class _CastCompressor:
    """Divide by the world size, cast to a 16-bit float, all-reduce, cast back and multiply.

    Dividing first keeps the sum of ``w`` ranks from overflowing where each rank's values fit
    (fp16 overflows at 65504); multiplying afterwards restores what Horovod's op asked for
    (``Average`` and ``Sum`` alike).
    """

    dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.dtype, int] | None]:
        if not tensor.dtype.is_floating_point:
            return tensor, None
        hvd = import_horovod()
        if not supports("allreduce", cls.dtype):
            raise TypeError(
                f"sylvie_comm.horovod.Compression: this Horovod ({_horovod_version()}) has no {cls.dtype} all-reduce "
                "for PyTorch; use Compression.fp16, or sylvie_comm.horovod.DistributedOptimizer(codec='bf16'), "
                "which carries bf16 words through an all-gather"
            )
        w = hvd.size()
        return tensor.div(w).to(cls.dtype), (tensor.dtype, w)

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: tuple[torch.dtype, int] | None) -> torch.Tensor:
        if ctx is None:
            return tensor
        dtype, w = ctx
        return tensor.to(dtype).mul_(w)  # in the original precision, so the product is not rounded to 16 bits


def _horovod_version() -> str:
    import horovod

    return str(getattr(horovod, "__version__", "unknown version"))


class FP16Compressor(_CastCompressor):
    """fp16 all-reduce with pre-division by the world size."""

    dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """bf16 all-reduce with pre-division by the world size (needs a Horovod with bf16 PyTorch ops)."""

    dtype = torch.bfloat16


class _Deferred:
    """A Transport for one rank whose all-reduce Horovod performs later, outside.

    ``all_reduce(t)`` records ``t`` and returns an unfinished future;
    :class:`ACPSGDCompressor` hands ``t`` to Horovod as the compressed tensor
    and completes the future in ``decompress``, which runs the algorithm's
    decoding there and then. Its world size is 1: Horovod's op does the scaling
    (``Average`` returns the mean factor, ``Sum`` the sum, each with any pre- and
    post-scale factors), and ACP-SGD is linear in the reduced factor, so the
    decoded gradient is that op applied to the ranks' approximations.
    """

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.issued: list[tuple[torch.Tensor, Future[Any]]] = []

    def all_reduce(self, t: torch.Tensor) -> Future[Any]:
        fut: Future[Any] = torch.futures.Future()
        self.issued.append((t, fut))
        return fut

    def _only_all_reduce(self, kind: str) -> Future[Any]:
        raise ValueError(f"the Horovod compressor only all-reduces; an algorithm asked for {kind}")

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        return self._only_all_reduce("reduce_scatter")

    def all_gather(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        return self._only_all_reduce("all_gather")

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> Future[Any]:
        return self._only_all_reduce("all_to_all")

    def all_to_all_v(
        self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Future[Any]:
        return self._only_all_reduce("all_to_all_v")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def fork(self) -> _Deferred:
        raise ValueError("the Horovod compressor runs on Horovod's own all-reduce; it has no transport to fork")


class _Pending:
    """What ``decompress`` needs: the buffer Horovod reduces, the future that decodes it, the gradient."""

    __slots__ = ("buffer", "grad", "result", "wire")

    def __init__(self, buffer: torch.Tensor, wire: Future[Any], result: Future[None], grad: torch.Tensor) -> None:
        self.buffer = buffer
        self.wire = wire
        self.result = result
        self.grad = grad


class ACPSGDCompressor(SessionHolder):
    """ACP-SGD behind Horovod's ``compress``/``decompress`` (made by :meth:`Compression.acpsgd`).

    ``compress(grad)`` finds the parameter whose ``.grad`` is ``grad`` (Horovod
    passes no name) and hands that gradient, a group of one (state keyed by
    name), to :meth:`Session.run <sylvie_comm.algorithms.session.Session.run>`
    at the parameter's own step: the policy's warm-up, then ACP-SGD's
    encoding, whose one all-reduce is returned for Horovod to perform;
    ``decompress(buffer, ctx)`` completes it, which decodes into the gradient,
    and returns the gradient. Vectors, matrices below ``min_compression_rate``
    and the first ``warmup_steps`` of each parameter travel uncompressed.

    Works with any ``op`` but ``Adasum`` (which all-reduces parameter deltas, not
    gradients), ``backward_passes_per_step`` (compress runs once, after the last
    pass), ``groups`` and ``zero_grad(set_to_none=True)``. Horovod checks across
    ranks that every name has the same shape, so ranks configured with different
    ranks fail at the first compressed step.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], config: Config) -> None:
        what = "Compression.acpsgd"
        if config.codec != "acpsgd":
            raise ValueError(f"{what}: config is for codec {config.codec!r}, expected 'acpsgd'")
        if config.warmup != "fixed":
            raise ValueError(
                f"{what}: warmup {config.warmup!r} is not available in the compressor, whose parameters step "
                "one by one; use warmup 'fixed', or sylvie_comm.horovod.DistributedOptimizer for 'auto'"
            )
        self._params = named_parameter_list(what, named_parameters)
        self._keys = {n: i for i, (n, _) in enumerate(self._params)}
        self.transport = _Deferred()
        # Horovod's world: the checkpoint's and the byte accounting's (the transport has one rank).
        self._world: int | None = None
        self.session = Session(what, config, self.transport, objects=HorovodObjects())
        # No compression monitor: a check all-reduces an exact average beside the compressed one and the ranks
        # agree on its figures, while Horovod carries one tensor per gradient between them and nothing else (each
        # rank's figures, and so its decisions, would be its own).
        self.policy.monitor = None
        if (delegate := delegating(self.algorithm)) is not None:
            delegate.unmonitored()
        self.policy.check_parameters(self._params, what)
        self._by_grad: dict[int, tuple[str, torch.Tensor]] = {}
        self._steps: dict[str, int] = {}

    def _horovod_world(self) -> int:
        if self._world is None:
            hvd = import_horovod()
            self._world = hvd.size()
            self.session.world_size, self.session.rank = hvd.size(), hvd.rank()
        return self._world

    def _find(self, tensor: torch.Tensor) -> str:
        hit = self._by_grad.get(id(tensor))
        if hit is not None and hit[1].grad is tensor:
            return hit[0]
        # A miss: gradients were replaced (zero_grad(set_to_none=True), the first step): map them again.
        self._by_grad = {id(p.grad): (n, p) for n, p in self._params if p.grad is not None}
        hit = self._by_grad.get(id(tensor))
        if hit is not None and hit[1].grad is tensor:
            return hit[0]
        if any(p is tensor for _, p in self._params):
            raise ValueError(
                "Compression.acpsgd: compress() was given a parameter, not a gradient: op=hvd.Adasum "
                "all-reduces parameter deltas and is not supported; use op=hvd.Average or hvd.Sum"
            )
        raise ValueError(
            f"Compression.acpsgd: compress() got a tensor of shape {tuple(tensor.shape)} that is not the .grad of "
            "any parameter given to Compression.acpsgd(named_parameters); pass the named parameters of the model "
            "the optimizer trains (sparse_as_dense is not supported)"
        )

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Pending]:
        name = self._find(tensor)
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        self._horovod_world()
        view = real_view(tensor)  # a complex gradient as its (re, im) pairs
        compress, options = self.policy.member_options(name, view.shape)
        # The gradient is the group's flat buffer: a plain step (the warm-up) hands it to Horovod as it is.
        flat = view.view(-1) if view.is_contiguous() else None
        result = self.session.run(Group(self._keys[name], [Member(name, view, compress, options)], flat), step)
        ((buffer, wire),) = self.transport.issued  # the one all-reduce of the step, for Horovod to perform
        self.transport.issued.clear()
        return buffer, _Pending(buffer, wire, result, tensor)

    def decompress(self, tensor: torch.Tensor, ctx: _Pending) -> torch.Tensor:
        if tensor is not ctx.buffer:
            ctx.buffer.copy_(tensor)
        ctx.wire.set_result(None)  # runs the decoding, here: it writes the gradient
        ctx.result.wait()
        return ctx.grad

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, Any]:
        """Cumulative wire bytes, the fp32 equivalent, their ratio, encode/decode seconds and
        ``skipped_nonfinite`` (see the DDP hook)."""
        return self.session.stats(max(self._steps.values(), default=0))

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter steps and ACP-SGD state (factors, residuals) of this rank, keyed by parameter name, in
        every integration's format (``step`` holds the steps per name: the compressor counts each parameter's)."""
        self._horovod_world()
        return self.session.state_dict(step=dict(self._steps))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own); every field is
        checked first, and the ranks agree on the steps (see ``sylvie_comm.ddp.HookState.load_state_dict``)."""
        self._horovod_world()

        def known(state: Mapping[str, Any], step: int) -> None:
            steps = state["step"]
            if not isinstance(steps, Mapping):
                raise ValueError(f"Compression.acpsgd: checkpoint 'step' must map parameter names to their steps, "
                                 f"got {steps!r:.80}")  # fmt: skip
            unknown = sorted(set(steps) - set(self._keys))
            if unknown:
                raise ValueError(f"Compression.acpsgd: checkpoint steps name '{unknown[0]}', not a parameter of "
                                 "this model")  # fmt: skip

        shapes = [(n, real_view(p.detach()).shape) for n, p in self._params]
        steps = self.session.load_state_dict(_without_idle_monitor(state), shapes, check=known)
        self._steps = dict(steps)


def _without_idle_monitor(state: Any) -> Any:
    """``state`` without a ``monitor`` field that records nothing: what a compressor wrote while it kept a
    monitor it never ran (this one keeps none), read as none; any other field is left to the checks."""
    mon = state.get("monitor") if isinstance(state, Mapping) else None
    if not isinstance(mon, Mapping) or not mon or mon.get("checks") != 0 or mon.get("bytes") != 0:
        return state
    if any(mon.get(key) for key in ("tensors", "overrides", "raw", "flush", "carry", "cursor", "events")):
        return state
    return {k: v for k, v in state.items() if k != "monitor"}


class Compression:
    """Compressors for ``hvd.DistributedOptimizer(..., compression=...)``.

    ``none``, ``fp16`` and ``bf16`` are stateless; ``acpsgd(named_parameters, rank="auto", ...)``
    makes a stateful ACP-SGD compressor for one model (its ``state_dict()`` joins a checkpoint).
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def acpsgd(
        named_parameters: Iterable[tuple[str, nn.Parameter]], rank: int | str = "auto", *, config: Config | None = None,
        **options: Any,
    ) -> ACPSGDCompressor:  # fmt: skip
        """An ACP-SGD compressor for the parameters of one model.

        Args:
            named_parameters: ``model.named_parameters()`` of the model the optimizer trains.
            rank: factor rank: ``"auto"`` (the default: each matrix's from its shape) or an integer for every
                matrix; ignored when ``config`` sets it.
            config: a :class:`~sylvie_comm.config.Config` with ``codec: acpsgd`` (e.g. from YAML).
            **options: ``warmup_steps`` (default 2), ``min_compression_rate`` (default 2), ``seed``.
        """
        if config is None or "rank" not in config.options:
            options = {"rank": rank, **options}
        return ACPSGDCompressor(named_parameters, merge_config("Compression.acpsgd", "acpsgd", config, options))


class HorovodObjects:
    """Horovod's object all-gather, for agreeing across ranks where no transport of ours runs."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(import_horovod().allgather_object(obj))
