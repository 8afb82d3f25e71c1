"""Low-rank building blocks shared by PowerSGD and ACP-SGD.

PowerSGD (Vogels et al., NeurIPS 2019) approximates a gradient matrix ``M``
(``n x m``) by ``P Q^T`` with one step of subspace iteration per training step:
``P = M Q``, orthogonalize ``P``, ``Q = M^T P``. ACP-SGD (Zhang et al.,
"Evaluation and Optimization of Gradient Compression for Distributed Deep
Learning", ICDCS 2023) alternates: one step computes and all-reduces ``P``
only, the next ``Q`` only, reusing the other factor from the previous step.
These functions are the math both use; the hooks own the schedule.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Sequence

import torch


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The ``(n, m)`` matrix view of a tensor: ``(shape[0], numel / shape[0])``; 1-D is ``(n, 1)``."""
    if len(shape) == 0:
        return 1, 1
    n = shape[0]
    return n, (math.prod(shape[1:]) if len(shape) > 1 else 1)


AUTO = "auto"  # the rank option's value that chooses each tensor's rank from its shape (see auto_rank)
AUTO_RATE = 16.0  # rank "auto": each matrix this many times smaller than its fp32 gradient per step ...
AUTO_MIN, AUTO_MAX = 4, 32  # ... at a rank in this range (and at most min(n, m))


def auto_rank(shape: torch.Size | tuple[int, ...], alternate: bool = False) -> int:
    """The rank ``rank: auto`` gives the matrix view ``n x m`` of ``shape``: the largest that keeps it
    :data:`AUTO_RATE` times smaller than its fp32 gradient per step (``n m / (r (n + m))`` for PowerSGD, twice
    that for ACP-SGD, which sends one factor per step), clamped to ``AUTO_MIN..AUTO_MAX`` and to ``min(n, m)``.

    One number for all tensors gives a wide matrix a tiny share of its gradient and a narrow one a large
    share (rank 4 keeps 0.2% of a 2048 x 2048 matrix's elements, 14% of a 64 x 288 convolution's); a rank
    from the shape sends every matrix the same fraction of its size, within the bounds (at least rank 4, so
    small matrices keep what a fixed rank 4 gave them; at most 32, which bounds the encode's compute at 8x
    rank 4's). A function of the shape only: every rank computes the same without a collective.
    """
    n, m = matrix_shape(shape)
    budget = (2 if alternate else 1) * n * m / (AUTO_RATE * (n + m))
    return min(max(AUTO_MIN, math.floor(budget)), AUTO_MAX, n, m)


def check_rank(who: str, rank: object) -> int | str:
    """``rank`` if it is ``"auto"`` or an integer >= 1; a ValueError naming ``who`` and the value otherwise."""
    if rank != AUTO and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"{who}: rank must be 'auto' or an integer >= 1, got {rank!r}")
    return rank


def effective_rank(shape: torch.Size | tuple[int, ...], rank: int | str, alternate: bool = False) -> int:
    """``min(rank, n, m)`` for the matrix view of ``shape``; :func:`auto_rank` for ``rank="auto"``."""
    if rank == AUTO:
        return auto_rank(shape, alternate)
    n, m = matrix_shape(shape)
    return min(int(rank), n, m)


def compression_rate(shape: torch.Size | tuple[int, ...], rank: int | str, alternate: bool = False) -> float:
    """Elements of the dense gradient per element sent.

    PowerSGD sends ``(n + m) r`` per step; ACP-SGD (``alternate``) sends ``n r``
    and ``m r`` on alternate steps, ``(n + m) r / 2`` on average.
    """
    n, m = matrix_shape(shape)
    r = effective_rank(shape, rank, alternate)
    if r == 0:
        return 0.0
    sent = (n + m) * r / (2 if alternate else 1)
    return n * m / sent


def random_factor(rows: int, rank: int, generator: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``rows x rank`` fp32 Gaussian factor drawn on the CPU (same bits on every rank), then moved."""
    return torch.randn(rows, rank, generator=generator, dtype=torch.float32).to(device)


def seeded_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed & ((1 << 63) - 1))
    return gen


def orthogonalize_batch_(batch: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormalize the columns of each matrix of a ``(B, n, r)`` batch, in place.

    Rank <= 2 uses Gram-Schmidt with ``eps`` added to each norm, which keeps an
    all-zero column at zero instead of dividing by zero (as PyTorch's PowerSGD
    does); larger ranks use a batched QR.
    """
    if batch.dim() != 3:
        raise ValueError(f"orthogonalize_batch_: expected a (B, n, r) tensor, got shape {tuple(batch.shape)}")
    r = batch.shape[-1]
    if batch.numel() == 0:
        return batch
    if r <= 2:
        for i in range(r):
            col = batch[:, :, i : i + 1]
            col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True).add_(eps))
            if i + 1 < r:
                rest = batch[:, :, i + 1 :]
                rest.sub_(col * (col * rest).sum(dim=1, keepdim=True))
        return batch
    return batch.copy_(_qr(batch))


# PyTorch loads its GPU linear algebra library at a device type's first linalg call, and that first call is not
# thread-safe: a second thread entering it at once fails ("lazy wrapper should be called at most once"), as ranks
# run in threads of one process do (in-process ranks, a GNN pipeline's threads). The first QR per device type is
# taken under a lock; every later one runs freely.
_LINALG_LOCK = threading.Lock()
_LINALG_LOADED: set[str] = {"cpu"}


def _qr(batch: torch.Tensor) -> torch.Tensor:
    """The Q of ``batch``'s QR."""
    kind = batch.device.type
    if kind not in _LINALG_LOADED:
        with _LINALG_LOCK:
            if kind not in _LINALG_LOADED:
                q: torch.Tensor = torch.linalg.qr(batch)[0]
                _LINALG_LOADED.add(kind)
                return q
    out: torch.Tensor = torch.linalg.qr(batch)[0]
    return out


def orthogonalize_(matrices: Sequence[torch.Tensor], eps: float = 1e-8) -> None:
    """Orthonormalize the columns of every matrix, batching those of the same shape."""
    groups: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for mat in matrices:
        if mat.dim() != 2:
            raise ValueError(f"orthogonalize_: expected 2-D matrices, got shape {tuple(mat.shape)}")
        groups[(tuple(mat.shape), mat.dtype, mat.device)].append(mat)
    for mats in groups.values():
        if len(mats) == 1:
            orthogonalize_batch_(mats[0].unsqueeze(0), eps)
            continue
        batch = torch.stack(mats)
        orthogonalize_batch_(batch, eps)
        for mat, ortho in zip(mats, batch, strict=True):
            mat.copy_(ortho)


def p_step(m: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``P = M Q`` for ``M`` (n x m) and ``Q`` (m x r), or batched ``(B, n, m) @ (B, m, r)``."""
    return torch.matmul(m, q, out=out)


def q_step(m: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``Q = M^T P`` for ``M`` (n x m) and ``P`` (n x r), or batched."""
    return torch.matmul(m.transpose(-2, -1), p, out=out)


def reconstruct(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``P Q^T``, the low-rank approximation of ``M``."""
    return torch.matmul(p, q.transpose(-2, -1), out=out)
