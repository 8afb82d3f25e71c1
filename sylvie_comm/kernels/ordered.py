"""Pure-torch references of the Triton low-rank kernels: the arithmetic of ``lowrank_project``, ``lowrank_gram``
and ``lowrank_outer_into`` in the fixed order those kernels use, so they can be compared bit for bit.

Why a second reference: :mod:`sylvie_comm.kernels.reference` multiplies matrices with ``torch.matmul``, whose
summation order (blocking, fused multiply-adds, threads) is not defined and differs between BLAS libraries and
devices, so no kernel can promise its bits. The kernels of :mod:`sylvie_comm.kernels.triton.lowrank` instead
follow the order defined here, which depends on the shapes and two constants only (never on tile sizes, the
launch grid, the device, or Triton's interpreter versus a GPU); these functions compute the same thing with
whole-tensor torch operations, one elementwise fp32 operation at a time (a multiply, then an add: never fused), so
they return the same bits on any device.

The order (every value is fp32, every operation one IEEE fp32 operation rounded to nearest):

* **A product** of two values is rounded to fp32 before it is added (no fused multiply-add anywhere).
* **A dot product over a long index** (``k`` for ``p = residual q``, ``n`` for ``q = residual^T p``) is
  :func:`ordered_matmul`'s two-level sum over ``L`` lanes (:data:`PROJECT_LANES` for the sum over ``k``,
  :data:`GRAM_LANES` for the sum over ``n``): the product of index ``j`` goes to lane ``j mod L``; each lane starts
  at ``+0.0`` and adds its products in index order; then the lanes are combined by the adjacent-pair tree (lane
  ``2i`` plus lane ``2i + 1``, then the same on the halves, until one is left). An empty sum is ``+0.0``.
* **A rank-r outer product** ``out[i, j] (+)= sum_t p[i, t] qa[j, t]`` (:func:`ordered_outer`) starts at ``+0.0``
  and adds the products ``t = 0, 1, ..., r - 1`` left to right; with ``accumulate``, ``out[i, j] + that sum``. The
  scaled factor ``qa = q * alpha`` is rounded to fp32 first, with ``alpha`` rounded to fp32 (``alpha == 1`` leaves
  ``q`` as it is); ``alpha = -1`` negates exactly.
* ``residual += grad`` is one fp32 add, as in the reference.

Why this order: it is what a GPU sums fastest without giving up a fixed order. Lane ``j mod L`` of a long row is one
register of one thread across the row's tiles (a tile is ``L`` consecutive indices, one load of 16 bytes per
thread), so the lanes' sums are plain adds in registers; the tree is two adds in a thread, warp shuffles and a few
exchanges between warps, once per sum. Every step of it is a sum of two values, one IEEE addition on every backend,
so the interpreter and a GPU agree bit for bit. No value in these sums is ever ``-0.0`` (they start at ``+0.0``, and
round to nearest gives ``-0.0`` only for ``-0.0 + -0.0``), so padding a sum with ``+0.0`` terms changes no bits:
a kernel may pad the index to whole tiles, and a tree over fewer lanes (``min(L, 2**ceil(log2 m))`` for ``m``
indices) gives the tree over ``L`` lanes whose extra lanes are zeros. The tree is also cut anywhere on a power of
two: a kernel may sum aligned groups of lanes in separate programs and add their results by the rest of the tree.

Rounding against the exact value (``u = 2**-24``, the unit roundoff of fp32; ``S`` the exact sum, ``T`` the sum of
the terms' magnitudes, ``m`` the number of terms, ``g32(d) = d u / (1 - d u)``): no term of a dot product passes
through more than ``d = 1 + ceil(m / L) + log2(L)`` roundings (its product, its lane's adds, the tree's levels), so
the result is within ``g32(d) T`` of ``S``, plus half the smallest fp32 subnormal (``2**-150``) per product that
underflows; ``torch.matmul`` in fp32 is within ``g32(m) T`` of ``S`` in any order. For ``k = 8192`` that is
``g32(19)`` against ``g32(8192)``. The tests derive their bound against :mod:`~sylvie_comm.kernels.reference` from
these two.
"""

from __future__ import annotations

import torch

from sylvie_comm.kernels.reference import compensate

__all__ = [
    "GRAM_LANES",
    "PROJECT_LANES",
    "as_fp32",
    "lowrank_gram",
    "lowrank_outer_into",
    "lowrank_project",
    "ordered_matmul",
    "ordered_outer",
]

# Lanes of the sum over a row's ``k`` indices in ``lowrank_project`` (part of the definition: a kernel's tile of a
# row is this many indices wide, one load of 4 indices per thread of 8 warps).
PROJECT_LANES = 1024
# Lanes of the sum over a column's ``n`` indices in ``lowrank_gram`` (part of the definition: the rows a kernel
# strides by, taking a few lanes per program).
GRAM_LANES = 512


def as_fp32(alpha: float) -> float:
    """``alpha`` rounded to fp32 (to nearest, overflowing to an infinity), as the kernels take it."""
    return float(torch.tensor(alpha, dtype=torch.float64).to(torch.float32))


def ordered_matmul(a: torch.Tensor, b: torch.Tensor, lanes: int) -> torch.Tensor:
    """``a @ b`` for fp32 ``a`` (m, K) and ``b`` (K, r), summed over ``K`` in the kernels' order: the product of
    index ``j`` (rounded to fp32) added to lane ``j mod lanes`` (each lane from ``+0.0``, in index order), the
    lanes combined by the adjacent-pair tree. ``lanes`` is a power of two. Vectorized over the rows, the columns and
    the lanes; one Python step per ``lanes`` indices and one per level of the tree."""
    if lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"lanes must be a power of two, got {lanes}")
    m, kk = a.shape
    r = b.shape[1]
    steps = -(-kk // lanes)
    # Pad the index to whole steps with zero products (no change: see the module docstring).
    a32 = torch.zeros(m, steps * lanes, dtype=torch.float32, device=a.device)
    b32 = torch.zeros(steps * lanes, r, dtype=torch.float32, device=a.device)
    a32[:, :kk] = a
    b32[:kk] = b
    a3 = a32.view(m, steps, lanes)  # [i, s, l]: index s * lanes + l
    b3 = b32.view(steps, lanes, r)
    acc = torch.zeros(m, lanes, r, dtype=torch.float32, device=a.device)
    for s in range(steps):  # every lane at once, its indices in order
        acc += a3[:, s, :, None] * b3[None, s]  # the product rounded, then the add
    while acc.shape[1] > 1:  # the adjacent-pair tree
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


def ordered_outer(p: torch.Tensor, q: torch.Tensor, alpha: float, base: torch.Tensor | None = None) -> torch.Tensor:
    """``p (alpha q)^T`` (``base +`` it when given) in the kernels' order: ``qa = q * alpha`` rounded to fp32, the
    fp32 products added ``t = 0 .. r - 1`` from ``+0.0``, then ``base`` plus that sum."""
    alpha32 = as_fp32(alpha)
    qa = q if alpha32 == 1.0 else q * torch.tensor(alpha32, dtype=torch.float32, device=q.device)
    s = torch.zeros(p.shape[0], q.shape[0], dtype=torch.float32, device=p.device)
    for t in range(p.shape[1]):
        s += p[:, t, None] * qa[None, :, t]
    return s if base is None else base + s


def lowrank_project(residual: torch.Tensor, grad: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor,
                    subtract: bool, pending: tuple[torch.Tensor, torch.Tensor] | None = None,
                    saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`sylvie_comm.kernels.reference.lowrank_project` in the kernels' order: ``saved <- residual``;
    ``residual -= P' Q'^T`` as :func:`lowrank_outer_into` ``(residual, P', Q', -1, True)``; ``residual += grad``
    (fp32); ``p = residual q`` (:func:`ordered_matmul` over :data:`PROJECT_LANES` lanes); with ``subtract``,
    ``residual -= p q^T`` as :func:`lowrank_outer_into` ``(residual, p, q, -1, True)`` with the ``p`` just written."""
    compensate(residual, grad, saved, pending, lowrank_outer_into)
    p.copy_(ordered_matmul(residual, q, PROJECT_LANES))
    if subtract:
        lowrank_outer_into(residual, p, q, -1.0, True)


def lowrank_gram(residual: torch.Tensor, grad: torch.Tensor | None, p: torch.Tensor, q: torch.Tensor,
                 saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`sylvie_comm.kernels.reference.lowrank_gram` in the kernels' order: ``saved <- residual``,
    ``residual += grad`` (fp32), ``q = residual^T p`` summed over the rows by :func:`ordered_matmul` over
    :data:`GRAM_LANES` lanes."""
    compensate(residual, grad, saved)
    q.copy_(ordered_matmul(residual.T, p, GRAM_LANES))


def lowrank_outer_into(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, alpha: float, accumulate: bool,
                       when: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`sylvie_comm.kernels.reference.lowrank_outer_into` in the kernels' order (:func:`ordered_outer`):
    ``out = p (alpha q)^T`` or, with ``accumulate``, ``out + p (alpha q)^T``; with ``when`` (a one-element bool
    tensor) ``out`` changes only if it is true, decided on its device."""
    result = ordered_outer(p, q, alpha, out if accumulate else None)
    if when is not None:
        torch.where(when.reshape(()), result, out, out=out)
    else:
        out.copy_(result)
