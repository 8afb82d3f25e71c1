"""PowerSGD (Vogels et al. 2019, https://arxiv.org/abs/1905.13727): rank-r power iteration with warm start."""

from __future__ import annotations

from dataclasses import replace

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Group
from sylvie_comm.algorithms.guard import nonfinite, poison
from sylvie_comm.algorithms.lowrank import LOW_RANK, Factors, LowRankAlgorithm
from sylvie_comm.codecs import lowrank
from sylvie_comm.collectives import Meter


class PowerSGDAlgorithm(LowRankAlgorithm):
    """PowerSGD with error feedback and warm start, two ordered collectives per group.

    ``P <- (M + E) Q``, all-reduce P (with the raw tensors), orthogonalize P
    (batched over same-shape factors), ``Q <- (M + E)^T P``,
    ``E <- M + E - P Q^T`` (this rank's Q), all-reduce Q, tensor
    ``P Q^T / w``; the averaged Q is kept for the next step (warm start).

    The residual is what this rank's ``M + E`` has outside the span of P, so
    ``||E|| <= ||M + E||``. Taking it against the averaged Q instead (as the
    paper and PyTorch's hook do) sums to the same over the ranks, hence gives
    the same updates, but leaves each rank its share of the ranks'
    disagreement, which grows without bound when the ranks' data differ (60x
    the gradient after 300 steps on the digits MLP of the tests).

    ``E <- E - P Q^T`` is owed (copies of P and this rank's Q) and applied
    inside the next step's pass over E, with the same bits; ``state_dict``
    applies it to the residual it returns.
    """

    name = "powersgd"
    record = replace(LOW_RANK, serial=True)
    alternate = False

    def _prepare(self, group: Group, layout: Factors, step: int, meter: Meter) -> None:
        if group.compressed:
            self._guard_factors(layout)
        for m in group.compressed:
            p, q = self._factors[m.name]
            # E <- E - P' Q'^T (owed by the last step), E <- M + E, P <- E Q in one pass; the new
            # residual waits for the averaged P. A skipped step puts back E, which then still owes P' Q'^T.
            # (The owed entry stays until the Q phase's _defer_update replaces it, saving it first.)
            owed = self._pending.get(m.name)
            res, saved, mat = self._residuals[m.name], self._saved_slot(m.name), self._matrix(m)
            kernels.lowrank_project(
                res, mat, q, p, subtract=False, pending=owed, saved=saved, checked=not kernels.plain_f32(mat, res)
            )  # the plan made the rest
        self._fill_raw(group, layout.pbuf, layout.raw_p)

    def _finish(self, group: Group, layout: Factors, step: int, meter: Meter, prepared: object) -> None:
        comp = group.compressed
        self._all_reduce(layout.pbuf, meter).wait()

        def q_phase() -> None:
            lowrank.orthogonalize_([self._factors[m.name][0] for m in comp])
            for m in comp:
                p, q = self._factors[m.name]
                res = self._residuals[m.name]
                kernels.lowrank_gram(res, None, p, q, checked=False)  # all the plan's
                # E <- M + E - P Q^T with this rank's Q, in the next pass
                self._defer_update(m.name, p, q, keep_owed=True)

        meter.timed("encode", q_phase)
        if comp:
            # Only the factors: the raw values travelled with P (the tail of qbuf serves ACP-SGD's Q steps).
            self._all_reduce(layout.qbuf[: layout.raw_q], meter).wait()

        def decode() -> None:
            # P and the raw values every rank sent, then Q, summed: non-finite where any rank's input was.
            bad = nonfinite(layout.pbuf, layout.qbuf[: layout.raw_q])
            self.guard.report(bad)
            for m in comp:
                p, q = self._factors[m.name]
                q.div_(self.world_size)  # the averaged Q: decoded tensor and next step's warm start
                self._write_approx(m, p, q, 1.0)
            self._read_raw(group, layout.pbuf, layout.raw_p)
            poison((m.tensor for m in comp), bad)

        meter.timed("decode", decode)
