"""The in-process transport: collectives' semantics, determinism and failure."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm.collectives.local import LocalCollectiveError, LocalGroup, run_local


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_match_their_definitions(world):
    def body(tr):
        t = torch.arange(3.0) * (tr.rank + 1)
        tr.all_reduce(t).wait()
        out = torch.empty(world * 2)
        tr.all_gather(out, torch.full((2,), float(tr.rank))).wait()
        eq_in = torch.arange(world * 2.0).view(world, 2) + 10 * tr.rank
        eq_out = torch.empty(world, 2)
        tr.all_to_all(eq_out, eq_in).wait()
        in_splits = [tr.rank + 1] * world  # rank r sends r + 1 rows to everyone
        v_in = torch.arange(float(sum(in_splits))) + 100 * tr.rank
        out_splits = [r + 1 for r in range(world)]
        v_out = torch.empty(sum(out_splits))
        tr.all_to_all_v(v_out, v_in, out_splits, in_splits).wait()
        return t, out, eq_out, v_out, tr.all_gather_object(("rank", tr.rank))

    results = run_local(world, body)
    coef = sum(range(1, world + 1))
    for rank, (t, out, eq_out, v_out, objs) in enumerate(results):
        assert torch.equal(t, torch.arange(3.0) * coef)
        assert torch.equal(out, torch.arange(world).float().repeat_interleave(2))
        assert torch.equal(
            eq_out, torch.stack([torch.tensor([2.0 * rank, 2.0 * rank + 1]) + 10 * s for s in range(world)])
        )
        expected = torch.cat([torch.arange(s + 1).float() + rank * (s + 1) + 100 * s for s in range(world)])
        assert torch.equal(v_out, expected)
        assert objs == [("rank", r) for r in range(world)]


def test_sums_are_bitwise_identical_on_every_rank():
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(1000, generator=gen) * 10 ** (r - 2) for r in range(4)]

    def body(tr):
        t = data[tr.rank].clone()
        tr.all_reduce(t).wait()
        return t

    results = run_local(4, body)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], data[0] + data[1] + data[2] + data[3])


def test_mismatched_collectives_fail_on_every_rank():
    def body(tr):
        if tr.rank == 0:
            tr.all_reduce(torch.ones(2)).wait()
        else:
            tr.all_gather(torch.empty(4), torch.ones(2)).wait()

    with pytest.raises(RuntimeError, match="different collectives"):
        run_local(2, body)


def test_mismatched_all_to_all_splits_name_the_ranks():
    def body(tr):
        out_splits = [1, 1] if tr.rank == 0 else [2, 1]
        tr.all_to_all_v(torch.empty(sum(out_splits)), torch.zeros(2), out_splits, [1, 1]).wait()

    with pytest.raises(RuntimeError, match="rank 0 sends 1 rows to rank 1, which expects 2"):
        run_local(2, body)


def test_a_failing_rank_fails_the_others_instead_of_hanging():
    def body(tr):
        if tr.rank == 1:
            raise ValueError("rank one gives up")
        tr.all_reduce(torch.ones(1)).wait()

    with pytest.raises(RuntimeError, match="rank 1 of 3 failed: ValueError"):
        run_local(3, body, timeout=30)


def test_a_rank_that_never_arrives_times_out():
    def body(tr):
        if tr.rank == 0:
            tr.all_reduce(torch.ones(1)).wait()

    group_timeout = 0.5
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        run_local(2, body, timeout=group_timeout)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        LocalGroup(0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        LocalGroup(2).transport(2)
    assert issubclass(LocalCollectiveError, RuntimeError)
