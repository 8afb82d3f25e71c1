"""The low-rank kernels' test data and bounds (``test_triton_lowrank.py``): random factors, bit comparisons, and
the rounding bounds of :mod:`sylvie_comm.kernels.ordered` against the references' ``torch.matmul``."""

from __future__ import annotations

import torch

from sylvie_comm.kernels.triton import interpreted

DEVICE = "cuda" if torch.cuda.is_available() and not interpreted() else "cpu"
U = 2.0**-24
TINY = 2.0**-149


def g32(d: int) -> float:
    return d * U / (1 - d * U)


def roundings(m: int, lanes: int) -> int:
    """The most roundings a term of an ``m``-term ordered sum over ``lanes`` lanes passes through: its product,
    its lane's adds, the tree's levels."""
    return 1 + -(-m // lanes) + lanes.bit_length() - 1


def slack(m: int) -> float:
    """The most a bound computed in float64 (sums of ``m`` terms) can fall short of its exact value."""
    return 1 + (m + 8) * 2.0**-52


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal bits, NaN for NaN (a NaN's payload is the one thing the devices may choose differently)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN in different places"
    g, w = got.masked_fill(nan, 0.0), want.masked_fill(nan, 0.0)
    if not torch.equal(bits(g), bits(w)):
        idx = (bits(g) != bits(w)).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: bits differ first at {idx}: {g[tuple(idx)].item()!r} != {w[tuple(idx)].item()!r}"
        )


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    diff = (got.double() - want.double()).abs()
    excess = diff - bound
    assert bool((excess <= 0).all()), f"{what}: exceeds its bound by {float(excess.max())!r}"


def dot_bound(
    ours: torch.Tensor, a_ours: torch.Tensor, a_ref: torch.Tensor, b: torch.Tensor, lanes: int
) -> torch.Tensor:
    """``|ours - reference|`` at most, for ``ours`` = the ordered ``a_ours @ b`` over ``lanes`` lanes and the
    reference ``torch.matmul(a_ref, b)`` in fp32 (module docstring)."""
    m = a_ours.shape[1]
    ab, bb = a_ours.double().abs(), b.double().abs()
    t_ours, t_ref = ab @ bb, a_ref.double().abs() @ bb
    moved = (a_ours.double() - a_ref.double()).abs() @ bb
    bound = g32(roundings(m, lanes)) * t_ours + g32(m) * t_ref + moved + (m + 1) * TINY
    return bound * slack(m)


def outer_bound(
    ours: torch.Tensor,
    theirs: torch.Tensor,
    base_ours: torch.Tensor | None,
    base_ref: torch.Tensor | None,
    p_ours: torch.Tensor,
    p_ref: torch.Tensor,
    qa_ours: torch.Tensor,
    qa_ref: torch.Tensor,
) -> torch.Tensor:
    """``|ours - theirs|`` at most, for ``ours = base + (+0.0 + sum_t p qa)`` (fp32, in order: no term through
    more than ``r + 1`` roundings) and ``theirs = fp32(base + fp32(torch.matmul(p, qa^T)))`` (without ``base``:
    ``theirs = fp32(matmul)``)."""
    r = p_ours.shape[1]
    pa, qa = p_ours.double().abs(), qa_ours.double().abs()
    t_ours, t_ref = pa @ qa.T, p_ref.double().abs() @ qa_ref.double().abs().T
    moved = (p_ours.double() - p_ref.double()).abs() @ qa.T
    moved += p_ref.double().abs() @ (qa_ours.double() - qa_ref.double()).abs().T
    bound = g32(r) * t_ref + moved + (r + 2) * TINY
    if base_ours is None or base_ref is None:
        bound += g32(r) * t_ours
    else:
        bound += g32(r + 1) * (base_ours.double().abs() + t_ours)
        bound += U * theirs.double().abs() + (base_ours.double() - base_ref.double()).abs()
    return bound * slack(r)


def randn(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE)


def data(n: int, k: int, r: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Residual, gradient, factors and a pending update (rank 2) of mixed magnitudes."""
    e = randn(n, k, seed=seed)
    if n * k:  # magnitudes across six orders in every row and column: sums with cancellation
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        e = e * torch.logspace(-3, 3, n * k, dtype=torch.float32).view(n, k)[:, perm].to(DEVICE)
    return {
        "e": e,
        "g": randn(n, k, seed=seed + 1),
        "q": randn(k, r, seed=seed + 2),
        "p": randn(n, r, seed=seed + 3),
        "pp": randn(n, 2, seed=seed + 4),
        "pq": randn(k, 2, seed=seed + 5),
    }


def empty(*shape: int) -> torch.Tensor:
    """Filled with NaN: an element the kernel forgets to write shows."""
    return torch.full(shape, float("nan"), device=DEVICE)
