"""What ACP-SGD and PowerSGD share: per-name factors P, Q and residual E, fused per-group factor buffers."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Algorithm, Group, Member
from sylvie_comm.algorithms.record import Record
from sylvie_comm.codecs import lowrank
from sylvie_comm.collectives import Transport, fusion


@dataclass
class Factors:
    """One P buffer and one Q buffer per group: ``[factors..., raw values...]`` (one collective each)."""

    pbuf: torch.Tensor
    qbuf: torch.Tensor
    raw_p: int  # where the raw values start in pbuf
    raw_q: int  # and in qbuf


# What the low-rank algorithms declare: factors of the rank their ``rank`` option sets, an error-feedback residual,
# fp32's bytes per element before a matrix's shape sets them (``compression_rate``), no reduce-scatter form.
LOW_RANK = Record(
    payload=4.0,
    option_defaults={"rank": lowrank.AUTO},
    per_name_options=frozenset({"rank"}),
    error_feedback=True,
    low_rank=True,
    needs_monitor=True,
    no_shards_reason="it factors whole matrices and a reduce-scatter's shard is a slice of one: under sharded data "
    "parallel it belongs on the replica all-reduce of HSDP, where each rank's shard of a weight is a block of its rows",
)


class LowRankAlgorithm(Algorithm):
    """Per-name P, Q factors and residual E; each group's factors are views into two fused buffers.

    Args (options):
        rank: the rank of the approximation: ``"auto"`` (the default: each matrix's rank from its shape, see
            :func:`sylvie_comm.codecs.lowrank.auto_rank`) or an integer >= 1 for every matrix; capped per tensor
            by its shape.
    """

    alternate: ClassVar[bool]  # one factor per step (ACP-SGD) or both (PowerSGD): changes the compression rate

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        self._factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (P, Q), views into buffers
        self._residuals: dict[str, torch.Tensor] = {}
        # name -> (P', Q'): an update E <- E - P' Q'^T not yet applied to _residuals[name] (ACP-SGD
        # defers its Q step's to the next P step's pass over E); _pending_bufs holds the storage.
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_bufs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loaded: dict[str, Mapping[str, torch.Tensor]] = {}
        super().__init__(transport, options, seed=seed)

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate_options(options)
        lowrank.check_rank(cls.name, out["rank"])
        return out

    def compressible(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> bool:
        return len(shape) >= 2  # vectors cannot be factored: they travel raw in the fused buffer

    def compression_rate(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> float:
        return lowrank.compression_rate(shape, options.get("rank", self.options["rank"]), alternate=self.alternate)

    def state_spec(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        n, k = lowrank.matrix_shape(torch.Size(shape))
        r = lowrank.effective_rank(torch.Size(shape), {**self.options, **options}["rank"], self.alternate)
        return {"p": (n, r), "q": (k, r), "residual": (n, k)}

    def _rank_of(self, m: Member) -> int:
        return lowrank.effective_rank(m.tensor.shape, m.options.get("rank", self.options["rank"]), self.alternate)

    def _init_factors(self, m: Member) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = lowrank.matrix_shape(m.tensor.shape)
        r = self._rank_of(m)
        # Seeded by the agreed seed and the tensor's name: identical on every rank, whatever the group.
        gen = lowrank.seeded_generator(self.seed * 1_000_003 + zlib.crc32(m.name.encode()))
        return lowrank.random_factor(n, r, gen), lowrank.random_factor(k, r, gen)

    def _build(self, group: Group) -> Factors:
        comp = group.compressed
        shapes = [lowrank.matrix_shape(m.tensor.shape) for m in comp]
        ranks = [self._rank_of(m) for m in comp]
        sizes_p = [n * r for (n, _), r in zip(shapes, ranks, strict=True)]
        sizes_q = [k * r for (_, k), r in zip(shapes, ranks, strict=True)]
        raw = fusion.numel([m.tensor for m in group.raw])
        device = group.device
        pbuf = torch.zeros(sum(sizes_p) + raw, device=device)
        qbuf = torch.zeros(sum(sizes_q) + raw, device=device)
        op = oq = 0
        for m, (n, k), r in zip(comp, shapes, ranks, strict=True):
            p, q = pbuf[op : op + n * r].view(n, r), qbuf[oq : oq + k * r].view(k, r)
            # The factors it has: carried over from its last group, or a checkpoint's (whose residual owes
            # nothing: state_dict applied what was owed).
            old = self._factors.get(m.name)
            if old is None and m.name in self._loaded:
                old = (self._loaded[m.name]["p"], self._loaded[m.name]["q"])
            if old is not None and old[0].shape == p.shape:  # regrouped, or resumed: carried over
                p.copy_(old[0])
                q.copy_(old[1])
            elif old is not None:  # its rank changed (the monitor's adaptation, live or at a resume): keep what fits
                self._settle_owed(m.name)
                p0, q0 = self._init_factors(m)
                keep = min(r, old[0].shape[1])
                p.copy_(p0)
                q.copy_(q0)
                p[:, :keep].copy_(old[0][:, :keep])
                q[:, :keep].copy_(old[1][:, :keep])
            else:
                p0, q0 = self._init_factors(m)
                p.copy_(p0)
                q.copy_(q0)
            self._factors[m.name] = (p, q)
            if m.name not in self._residuals:
                loaded = self._loaded.get(m.name)
                res = (loaded["residual"].to(device, memory_format=torch.contiguous_format, copy=True) if loaded
                       else torch.zeros(n, k, device=device))  # fmt: skip
                self._residuals[m.name] = res
            op += n * r
            oq += k * r
        return Factors(pbuf, qbuf, op, oq)

    @staticmethod
    def _matrix(m: Member) -> torch.Tensor:
        return m.tensor.view(lowrank.matrix_shape(m.tensor.shape))

    def _fill_raw(self, group: Group, buf: torch.Tensor, at: int) -> None:
        fusion.pack([m.tensor for m in group.raw], out=buf, at=at)

    def _read_raw(self, group: Group, buf: torch.Tensor, at: int) -> None:
        fusion.unpack(buf, [m.tensor for m in group.raw], at=at, divide_by=self.world_size)

    def _write_approx(self, m: Member, p: torch.Tensor, q: torch.Tensor, scale: float) -> None:
        """tensor <- P (scale Q)^T, in fp32, written straight into the tensor (a view of the bucket).

        The scale multiplies the small factor, not the product: one write pass over the gradient.
        """
        mat = self._matrix(m)
        kernels.lowrank_outer_into(mat, p, q, scale, accumulate=False, checked=not kernels.plain_f32(mat, p))

    def persistent_tensors(self) -> list[torch.Tensor]:
        bufs = [t for _, f in self._layouts.values() for t in (f.pbuf, f.qbuf)]
        pending = [t for pq in self._pending_bufs.values() for t in pq]
        return bufs + list(self._residuals.values()) + pending

    def _defer_update(self, name: str, p: torch.Tensor, q: torch.Tensor, keep_owed: bool = False) -> None:
        """Owe ``E <- E - p q^T`` on ``name``'s residual (copies of p and q): the next consumer applies it.

        If the step is skipped, what is owed goes back to what it was: the update owed before this step where
        there is one (``keep_owed``: the saved residual still owes it), else nothing, both copies set to zero
        (zeroing one is not enough: ``0 q^T`` is NaN where this step's ``q`` holds the NaN or Inf that got the
        step skipped, as in ACP-SGD's Q steps and PowerSGD's first step). Copies left from before a
        :meth:`load_state_dict` are not owed: the loaded residual has their update applied.
        """
        bufs = self._pending_bufs.get(name)
        owed = self._pending.get(name) if keep_owed else None
        if bufs is None or bufs[0].shape != p.shape or bufs[1].shape != q.shape:
            bufs = self._pending_bufs[name] = (torch.empty_like(p), torch.empty_like(q))
            if owed is not None:  # the owed copies are not reused: a skipped step applies them to the saved E
                self._reapply_if_skipped(name, owed)
                owed = None
        if owed is not None:
            self.guard.save((id(self), "pending_p", name), bufs[0])
            self.guard.save((id(self), "pending_q", name), bufs[1])
        else:
            self.guard.zero_on_skip(bufs[0])
            self.guard.zero_on_skip(bufs[1])
        bufs[0].copy_(p)
        bufs[1].copy_(q)
        self._pending[name] = bufs

    def _guard_factors(self, layout: Factors) -> None:
        """Save a group's factor buffers before a step orthogonalizes or overwrites them."""
        self.guard.save((id(self), "pbuf", id(layout)), layout.pbuf)
        self.guard.save((id(self), "qbuf", id(layout)), layout.qbuf)

    def _saved_slot(self, name: str) -> torch.Tensor | None:
        """Where the kernel about to change ``name``'s residual writes it as it was (for the step guard)."""
        return self.guard.slot((id(self), "residual", name), self._residuals[name])

    def _reapply_if_skipped(self, name: str, owed: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A step consumed the owed update ``owed`` (no longer owed on the host) from a residual it saved
        before: if the step is skipped, the saved residual comes back and the update is applied to it,
        on the device."""
        res = self._residuals[name]  # every argument the plan's (the flag the guard's): no per-call check
        self.guard.on_skip(
            lambda bad: kernels.lowrank_outer_into(res, owed[0], owed[1], -1.0, True, when=bad, checked=False)
        )

    def _residual(self, name: str) -> torch.Tensor:
        """A copy of ``name``'s residual with any owed update applied (the same bits as applying it in place)."""
        res = self._residuals[name].clone()
        owed = self._pending.get(name)
        if owed is not None:
            kernels.lowrank_outer_into(res, owed[0], owed[1], -1.0, accumulate=True)
        return res

    def _settle_owed(self, name: str) -> None:
        """Apply the update owed to ``name``'s residual now (its factors change shape)."""
        owed = self._pending.pop(name, None)
        self._pending_bufs.pop(name, None)
        if owed is not None and name in self._residuals:
            kernels.lowrank_outer_into(self._residuals[name], owed[0], owed[1], -1.0, accumulate=True)

    def residual_inner(self, name: str, other: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``||E - P' Q'^T||^2`` and ``<E - P' Q'^T, other>`` without forming the owed product."""
        res = self._residuals.get(name)
        if res is None:
            res = self._loaded_residual(name)  # resumed, not placed in a group yet: it owes nothing
            if res is None:
                return None
            if other is not None:
                res = res.to(other.device)
        flat = res.reshape(-1)
        sq = torch.dot(flat, flat)  # one pass, no temporary
        dot = torch.zeros((), device=res.device)
        m = None if other is None or other.numel() != res.numel() else other.reshape(res.shape).float()
        if m is not None:
            dot = torch.dot(flat, m.reshape(-1))
        owed = self._pending.get(name)
        if owed is not None:
            p, q = owed
            sq = sq - 2 * ((res @ q) * p).sum() + ((p.T @ p) * (q.T @ q)).sum()
            if m is not None:
                dot = dot - ((m @ q) * p).sum()
        return sq, dot

    def _loaded_residual(self, name: str) -> torch.Tensor | None:
        """A checkpoint's residual of ``name`` not yet placed in a group (a copy), or None."""
        loaded = self._loaded.get(name)
        return None if loaded is None else loaded["residual"].clone()

    def forget(self, name: str) -> torch.Tensor | None:
        self.guard.settle()
        res = self._residual(name) if name in self._residuals else self._loaded_residual(name)
        for store in (self._factors, self._residuals, self._pending, self._pending_bufs, self._loaded):
            store.pop(name, None)
        self.relayout()
        return res

    def adapt(self, shape: tuple[int, ...], options: Mapping[str, Any], up: bool,
              floor: Mapping[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """The rank doubled (``up``, at most ``min(n, m)``) or halved, not below half of ``floor``'s."""
        n, k = lowrank.matrix_shape(torch.Size(shape))
        r = lowrank.effective_rank(shape, options.get("rank", self.options["rank"]), self.alternate)
        if up:
            new = min(2 * r, n, k)
        else:
            low = lowrank.effective_rank(shape, (floor or options).get("rank", self.options["rank"]), self.alternate)
            new = max(r // 2, max(1, low // 2))
        return None if new == r else {"rank": new}

    def state_dict(self) -> dict[str, Any]:
        """``{name: {"p", "q", "residual"}}``, including state loaded but not yet placed in a group."""
        self.guard.settle()
        out: dict[str, Any] = {n: {"p": p.clone(), "q": q.clone()} for n, (p, q) in self._factors.items()}
        for n in self._residuals:
            out.setdefault(n, {})["residual"] = self._residual(n)
        for n, s in self._loaded.items():
            out.setdefault(n, {k: v.clone() for k, v in s.items()})
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.guard.settle()
        for n, s in state.items():
            if not {"p", "q", "residual"} <= set(s):
                raise ValueError(f"{self.name}: checkpoint entry '{n}' needs p, q and residual")
        self._loaded = {n: dict(s) for n, s in state.items()}
        # Rebuild the group buffers from the loaded state at the next step.
        self._layouts.clear()
        self._factors.clear()
        self._residuals.clear()
        self._pending.clear()
