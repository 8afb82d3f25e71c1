"""Pure-torch references of the Triton low-rank kernels: the arithmetic of ``lowrank_project``, ``lowrank_gram``
and ``lowrank_outer_into`` in the fixed order those kernels use, so they can be compared bit for bit.

Why a second reference: :mod:`sylvie_comm.kernels.reference` multiplies matrices with ``torch.matmul``, whose
summation order (blocking, fused multiply-adds, threads) is not defined and differs between BLAS libraries and
devices, so no kernel can promise its bits. The kernels of :mod:`sylvie_comm.kernels.triton.lowrank` instead
follow the order defined here, which depends on the shapes only (never on tile sizes, the launch grid, the
device, or Triton's interpreter versus a GPU); these functions compute the same thing with whole-tensor torch
operations, one elementwise float64 operation at a time, so they return the same bits on any device.

The order (``u = 2**-24``, the unit roundoff of fp32; every value below is fp32 unless it says float64):

* **Products** of two fp32 values are formed in float64, where they are exact (24-bit significands give at most
  48 bits; fp32 exponents cannot overflow or underflow float64). So an fma in float64 gives the same bits as a
  multiply and an add, and the GPU compiler may contract them.
* **A dot product over a long index** (``k`` for ``p = residual q``, ``n`` for ``q = residual^T p``) is
  :func:`ordered_matmul`'s two-level sum: the index is cut into chunks of :data:`CHUNK` consecutive indices;
  each chunk's partial sum starts at float64 ``+0.0`` and adds the chunk's products in index order; the total
  starts at ``+0.0`` and adds the partials in chunk order; it is rounded to fp32 once. The chunks let a kernel
  sum parts of the index in separate programs (``lowrank_gram`` on tall matrices) and still return these bits.
  An empty sum is ``+0.0``.
* **A rank-r outer product** ``out[i, j] (+)= sum_t p[i, t] qa[j, t]`` (:func:`ordered_outer`) starts at
  float64 ``+0.0`` and adds the products ``t = 0, 1, ..., r - 1`` left to right; with ``accumulate`` the fp32
  ``out[i, j]`` is then added to that float64 sum in float64; the result is rounded to fp32 once. The scaled
  factor ``qa = q * alpha`` is rounded to fp32 first, with ``alpha`` rounded to fp32 (``alpha == 1`` leaves ``q``
  as it is); ``alpha = -1`` negates exactly.
* ``residual += grad`` is one fp32 add, as in the reference.

A sum that starts at ``+0.0`` is never ``-0.0`` (round to nearest gives ``-0.0`` only for ``-0.0 + -0.0``), so
adding a ``+0.0`` or ``-0.0`` product anywhere changes no bits: kernels may pad the index with zeros.

Rounding against the exact value (``S`` the exact sum, ``T`` the sum of the terms' magnitudes, ``m`` the number
of terms, ``g64(m) = m 2**-53 / (1 - m 2**-53)``): the float64 sum is within ``g64(m + 1) T`` of ``S`` (no term
passes through more than ``m + 1`` float64 adds, chunks included), and the fp32 result within ``u`` of that,
relatively, plus half the smallest fp32 subnormal (``2**-150``) if it underflows. ``torch.matmul`` in fp32 is
within ``g32(m) T`` of ``S`` in any order (``g32(m) = m u / (1 - m u)``): the tests derive their bound against
:mod:`~sylvie_comm.kernels.reference` from these two.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "lowrank_gram", "lowrank_outer_into", "lowrank_project", "ordered_matmul", "ordered_outer"]

# Indices per chunk of a long dot product (part of the definition: the kernels' tiles divide it).
CHUNK = 256


def as_fp32(alpha: float) -> float:
    """``alpha`` rounded to fp32 (to nearest, overflowing to an infinity), as the kernels take it."""
    return float(torch.tensor(alpha, dtype=torch.float64).to(torch.float32))


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for fp32 ``a`` (m, K) and ``b`` (K, r), summed over ``K`` in the kernels' order: float64
    products, float64 partial sums over chunks of :data:`CHUNK` indices in index order, the partials added in
    chunk order, one rounding to fp32. Vectorized over the rows, the columns and the chunks; one Python step per
    index of a chunk and one per chunk."""
    m, kk = a.shape
    r = b.shape[1]
    chunks = -(-kk // CHUNK)
    width = min(kk, CHUNK)
    # Pad the index to whole chunks with zero products (no change: see the module docstring).
    a64 = torch.zeros(m, chunks * width, dtype=torch.float64, device=a.device)
    b64 = torch.zeros(chunks * width, r, dtype=torch.float64, device=a.device)
    a64[:, :kk] = a
    b64[:kk] = b
    a3 = a64.view(m, chunks, width)  # [i, c, jj]: index c * width + jj
    b3 = b64.view(chunks, width, r)
    part = torch.zeros(m, chunks, r, dtype=torch.float64, device=a.device)
    for jj in range(width):  # chunk partials, every chunk at once, indices in order
        part += a3[:, :, jj, None] * b3[None, :, jj, :]
    total = torch.zeros(m, r, dtype=torch.float64, device=a.device)
    for c in range(chunks):  # partials in chunk order
        total += part[:, c, :]
    return total.to(torch.float32)


def ordered_outer(p: torch.Tensor, q: torch.Tensor, alpha: float, base: torch.Tensor | None = None) -> torch.Tensor:
    """``p (alpha q)^T`` (``+ base`` when given) in the kernels' order: ``qa = q * alpha`` rounded to fp32,
    float64 products added ``t = 0 .. r - 1`` from ``+0.0``, ``base`` added in float64, one rounding to fp32."""
    alpha32 = as_fp32(alpha)
    qa = q if alpha32 == 1.0 else q * torch.tensor(alpha32, dtype=torch.float32, device=q.device)
    s = torch.zeros(p.shape[0], q.shape[0], dtype=torch.float64, device=p.device)
    for t in range(p.shape[1]):
        s += p[:, t, None].double() * qa[None, :, t].double()
    if base is not None:
        s = base.double() + s
    return s.to(torch.float32)


def _save(saved: torch.Tensor | None, residual: torch.Tensor) -> None:
    if saved is not None:
        saved.view(-1).copy_(residual.view(-1))


def lowrank_project(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    q: torch.Tensor,
    p: torch.Tensor,
    subtract: bool,
    pending: tuple[torch.Tensor, torch.Tensor] | None = None,
    saved: torch.Tensor | None = None,
) -> None:
    """:func:`sylvie_comm.kernels.reference.lowrank_project` in the kernels' order: ``saved <- residual``;
    ``residual -= P' Q'^T`` as :func:`lowrank_outer_into` ``(residual, P', Q', -1, True)``; ``residual += grad``
    (fp32); ``p = residual q`` (:func:`ordered_matmul`); with ``subtract``, ``residual -= p q^T`` as
    :func:`lowrank_outer_into` ``(residual, p, q, -1, True)`` with the fp32 ``p`` just written."""
    _save(saved, residual)
    if pending is not None:
        lowrank_outer_into(residual, pending[0], pending[1], -1.0, True)
    if grad is not None:
        residual.add_(grad.view(residual.shape))
    p.copy_(ordered_matmul(residual, q))
    if subtract:
        lowrank_outer_into(residual, p, q, -1.0, True)


def lowrank_gram(
    residual: torch.Tensor,
    grad: torch.Tensor | None,
    p: torch.Tensor,
    q: torch.Tensor,
    saved: torch.Tensor | None = None,
) -> None:
    """:func:`sylvie_comm.kernels.reference.lowrank_gram` in the kernels' order: ``saved <- residual``,
    ``residual += grad`` (fp32), ``q = residual^T p`` summed over the rows by :func:`ordered_matmul`."""
    _save(saved, residual)
    if grad is not None:
        residual.add_(grad.view(residual.shape))
    q.copy_(ordered_matmul(residual.T, p))


def lowrank_outer_into(
    out: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    alpha: float,
    accumulate: bool,
    when: torch.Tensor | None = None,
) -> None:
    """:func:`sylvie_comm.kernels.reference.lowrank_outer_into` in the kernels' order (:func:`ordered_outer`):
    ``out = p (alpha q)^T`` or, with ``accumulate``, ``out + p (alpha q)^T`` rounded once; with ``when`` (a
    one-element bool tensor) ``out`` changes only if it is true, decided on its device."""
    result = ordered_outer(p, q, alpha, out if accumulate else None)
    if when is not None:
        torch.where(when.reshape(()), result, out, out=out)
    else:
        out.copy_(result)
