"""ACP-SGD: alternating low-rank compression, one collective per group per step."""

from __future__ import annotations

from typing import Any

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Future, Group, then
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.lowrank import LOW_RANK, Factors, LowRankAlgorithm
from sylvie_comm.codecs import lowrank
from sylvie_comm.collectives import Meter


class ACPSGDAlgorithm(LowRankAlgorithm):
    """ACP-SGD: one factor per step, alternating P and Q, with error feedback.

    P step: ``Q <- orth(Q_sum of the last step)``, ``P <- (M + E) Q``,
    ``E <- M + E - P Q^T``, all-reduce P. Q step: ``P <- orth(P_sum)``,
    ``Q <- (M + E)^T P``, ``E <- M + E - P Q^T``, all-reduce Q. The tensor
    becomes ``P Q^T / w``. One collective per group per step: the factors and
    the raw 1-D/small tensors share a buffer. Even steps are P steps.

    The Q step's ``E <- E - P Q^T`` needs every row of ``E`` twice (``Q`` sums
    all of them first), so it is owed, with copies of ``P`` and this rank's
    ``Q``, and applied row by row in the next P step's one pass over ``E``
    (``state_dict`` applies it to the copy it returns, with the same bits).

    Each step projects on the subspace found the step before, so it keeps less
    of the gradient than PowerSGD at the same rank: with Adam, or plain SGD at a
    large learning rate, rank 8 is safer than rank 4, and the default ``rank: auto`` gives each matrix a rank
    from its shape (see the codec guide, ``docs/guide/codecs.md``).
    """

    name = "acpsgd"
    record = LOW_RANK
    alternate = True

    def _step(self, group: Group, layout: Factors, step: int, meter: Meter) -> Future[None]:
        p_step = step % 2 == 0
        comp = group.compressed
        buf, raw_at = (layout.pbuf, layout.raw_p) if p_step else (layout.qbuf, layout.raw_q)

        def encode() -> None:
            if comp:
                self._guard_factors(layout)
            fixed = [self._factors[m.name][1 if p_step else 0] for m in comp]
            lowrank.orthogonalize_(fixed)
            for m in comp:
                p, q = self._factors[m.name]
                owed = self._pending.pop(m.name, None)
                res, mat = self._residuals[m.name], self._matrix(m)
                # The plan made every argument but the gradient: that one is checked here, the rest not per call.
                checked = not kernels.plain_f32(mat, res)
                if p_step:  # E <- E - P' Q'^T (owed), E <- M + E, P <- E Q, E <- E - P Q^T: one pass
                    saved = self._saved_slot(m.name)  # E as it was, written by the same pass
                    kernels.lowrank_project(res, mat, q, p, subtract=True, pending=owed, saved=saved, checked=checked)
                    if owed is not None:
                        self._reapply_if_skipped(m.name, owed)
                else:  # E <- M + E, Q <- E^T P: one pass; E <- E - P Q^T is owed to the next P step
                    if owed is not None:  # a tensor that missed the P step (absent from its bucket then)
                        kernels.lowrank_outer_into(res, owed[0], owed[1], -1.0, accumulate=True, checked=False)
                    # E saved owing nothing: a skipped step owes nothing either
                    kernels.lowrank_gram(res, mat, p, q, saved=self._saved_slot(m.name), checked=checked)
                    self._defer_update(m.name, p, q)
            self._fill_raw(group, buf, raw_at)

        meter.timed("encode", encode)

        def decode(_: Future[Any]) -> None:
            def run() -> None:
                # The factors and raw values every rank sent, summed: non-finite where any rank's input was.
                bad = nonfinite(buf)
                self.guard.report(bad)
                for m in comp:
                    p, q = self._factors[m.name]
                    self._write_approx(m, p, q, 1.0 / self.world_size)
                self._read_raw(group, buf, raw_at)
                poison((m.tensor for m in comp), bad)

            meter.timed("decode", run)

        return then(self._all_reduce(buf, meter), decode)


__all__ = ["ACPSGDAlgorithm"]
