from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from sylvie_comm.codecs import lowrank


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns(rank):
    mats = [torch.randn(20, rank) for _ in range(3)] + [torch.randn(7, rank)]
    lowrank.orthogonalize_(mats)
    for m in mats:
        torch.testing.assert_close(m.T @ m, torch.eye(rank), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_batched_equals_one_by_one(rank):
    mats = [torch.randn(12, rank) for _ in range(4)]
    singles = [m.clone() for m in mats]
    lowrank.orthogonalize_(mats)
    for s in singles:
        lowrank.orthogonalize_([s])
    for a, b in zip(mats, singles, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_zero_matrix_stays_finite():
    z = torch.zeros(5, 2)
    lowrank.orthogonalize_([z])
    assert torch.equal(z, torch.zeros(5, 2))


def test_full_rank_reconstruction_is_exact():
    # n x m with r = min(n, m): Q square orthogonal, so P Q^T = M Q Q^T = M.
    m = torch.randn(6, 4)
    r = lowrank.effective_rank(m.shape, 10)
    assert r == 4
    q = lowrank.random_factor(4, r, lowrank.seeded_generator(0))
    lowrank.orthogonalize_([q])
    p = lowrank.p_step(m, q)
    torch.testing.assert_close(lowrank.reconstruct(p, q), m, atol=1e-5, rtol=0)
    # One power step from the other side too.
    lowrank.orthogonalize_([p])
    q2 = lowrank.q_step(m, p)
    torch.testing.assert_close(lowrank.reconstruct(p, q2), m, atol=1e-5, rtol=0)


def test_seeded_factors_agree():
    a = lowrank.random_factor(30, 4, lowrank.seeded_generator(42))
    b = lowrank.random_factor(30, 4, lowrank.seeded_generator(42))
    c = lowrank.random_factor(30, 4, lowrank.seeded_generator(43))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_shapes_and_rates():
    assert lowrank.matrix_shape((8, 3, 3, 3)) == (8, 27)
    assert lowrank.matrix_shape((5,)) == (5, 1)
    assert lowrank.effective_rank((8, 3, 3, 3), 4) == 4
    assert lowrank.compression_rate((1000, 1000), 4) == pytest.approx(1000 * 1000 / (2000 * 4))
    assert lowrank.compression_rate((1000, 1000), 4, alternate=True) == pytest.approx(1000 * 1000 / (1000 * 4))


@pytest.mark.parametrize(
    "shape,alternate,rank",
    [
        ((2048, 2048), True, 32),  # the budget (1024 for ACP-SGD, 64 for PowerSGD) is capped at 32
        ((2048, 2048), False, 32),
        ((64, 32, 3, 3), True, 6),  # a 64 x 288 convolution: 2 * 64 * 288 / (16 * 352) = 6.5
        ((64, 32, 3, 3), False, 4),  # 3.3, raised to the floor of 4
        ((128, 1600), True, 14),  # 14.8
        ((128, 1600), False, 7),  # 7.4
        ((384, 128), True, 12),  # 12.0
        ((10, 128), True, 4),  # a small matrix keeps rank 4
        ((3, 5), True, 3),  # and never more than min(n, m)
        ((7,), True, 1),
    ],
)
def test_auto_rank_sends_each_matrix_a_sixteenth_of_its_size_within_the_bounds(shape, alternate, rank):
    assert lowrank.auto_rank(shape, alternate) == rank
    assert lowrank.effective_rank(shape, "auto", alternate) == rank
    n, m = lowrank.matrix_shape(shape)
    assert lowrank.compression_rate(shape, "auto", alternate) == pytest.approx(
        n * m / ((n + m) * rank / (2 if alternate else 1))
    )
    if lowrank.AUTO_MIN < rank < lowrank.AUTO_MAX:  # within the bounds: the largest rank at >= 16x
        assert lowrank.compression_rate(shape, rank, alternate) >= lowrank.AUTO_RATE
        assert lowrank.compression_rate(shape, rank + 1, alternate) < lowrank.AUTO_RATE


def test_orthogonalize_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        lowrank.orthogonalize_([torch.randn(3)])


def test_the_first_qr_on_a_device_type_runs_alone_and_later_ones_run_freely(monkeypatch) -> None:
    """PyTorch's first GPU linalg call loads a library and fails when a second thread enters it at once: ranks run
    as threads of one process must not make that first call together (every later call may overlap)."""
    inside, most, lock = [0], [0, 0], threading.Lock()
    real_qr = torch.linalg.qr

    def qr(batch: torch.Tensor) -> Any:
        with lock:
            inside[0] += 1
            first = "meta" not in seen
            most[0 if first else 1] = max(most[0 if first else 1], inside[0])
        time.sleep(0.05)  # long enough for every thread to arrive
        with lock:
            inside[0] -= 1
            seen.add("meta")
        return real_qr(batch)

    seen: set[str] = set()
    monkeypatch.setattr(torch.linalg, "qr", qr)
    monkeypatch.setattr(lowrank, "_LINALG_LOADED", {"cpu"})
    barrier = threading.Barrier(4)

    def rank() -> None:
        barrier.wait()
        lowrank.orthogonalize_batch_(torch.empty(2, 6, 3, device="meta"))
        barrier.wait()
        lowrank.orthogonalize_batch_(torch.empty(2, 6, 3, device="meta"))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 1, f"{most[0]} threads made the first QR on 'meta' together"
    assert most[1] > 1, "the later QRs were serialized too"
    assert sorted(lowrank._LINALG_LOADED) == ["cpu", "meta"]
