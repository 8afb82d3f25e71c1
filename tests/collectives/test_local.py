"""The in-process transport: collectives' semantics, determinism and failure."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reduce_scatter_gives_each_rank_its_shard_of_the_sum(world):
    def body(tr):
        shard = torch.empty(3)
        tr.reduce_scatter(shard, torch.arange(3.0 * world) * (tr.rank + 1)).wait()
        return shard

    coef = sum(range(1, world + 1))
    for rank, shard in enumerate(run_local(world, body)):
        assert torch.equal(shard, torch.arange(3.0 * rank, 3.0 * rank + 3) * coef)


def test_reduce_scatter_refuses_buffers_that_do_not_fit_before_issuing():
    def body(tr):
        with pytest.raises(ValueError, match=re.escape("the input has 5 elements, expected world_size * out.numel()")):
            tr.reduce_scatter(torch.empty(2), torch.zeros(5))
        with pytest.raises(ValueError, match=re.escape("must share dtype and device, got torch.float32 on cpu and")):
            tr.reduce_scatter(torch.empty(2, dtype=torch.float16), torch.zeros(4))
        with pytest.raises(ValueError, match="contiguous"):
            tr.reduce_scatter(torch.empty(2), torch.zeros(2, 2).t())
        tr.all_reduce(torch.ones(1)).wait()  # nothing was issued: the ranks still pair

    run_local(2, body)


def test_reduce_scatter_volume_is_half_an_all_reduce():
    from sylvie_comm.collectives import wire_bytes

    assert wire_bytes("reduce_scatter", 4096, 4) == 3072 == wire_bytes("all_reduce", 4096, 4) // 2
    assert wire_bytes("reduce_scatter", 4096, 1) == 0
    with pytest.raises(ValueError, match="expected all_reduce, reduce_scatter, all_gather or all_to_all"):
        wire_bytes("reduce", 4, 2)


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


def test_forks_are_independent_channels_whatever_order_ranks_use_them_in():
    """Rank 0 issues on the fork first, rank 1 on the parent first: each pairs with its own channel.
    On one shared channel the two all-reduces would pair crosswise (sizes differ: it would fail)."""

    def body(tr):
        fork = tr.fork()
        a, b = torch.ones(2) * (tr.rank + 1), torch.ones(5) * (tr.rank + 1)
        futs = [fork.all_reduce(b), tr.all_reduce(a)] if tr.rank == 0 else [tr.all_reduce(a), fork.all_reduce(b)]
        for f in futs:
            f.wait()
        return a, b, fork.fork().all_gather_object(tr.rank)

    for a, b, objs in run_local(2, body):
        assert torch.equal(a, torch.full((2,), 3.0)) and torch.equal(b, torch.full((5,), 3.0))
        assert objs == [0, 1]


def test_trainer_gradient_average_matches_the_mean_and_resumes():
    """The GNN trainer's gradient average on any transport (here in-process): the exact mean for ``none``;
    ACP-SGD averages exactly during warm-up, then sends less, and a fresh average loaded with its
    state_dict continues bit-identically."""
    from torch import nn

    from sylvie_comm.gnn.train import GradientAverage

    def grads_of(model, step, rank):
        return [torch.randn(p.shape, generator=torch.Generator().manual_seed(7 * step + rank + 100 * i))
                for i, p in enumerate(model.parameters())]  # fmt: skip

    def run(avg, model, tr, steps):
        errors, out = [], []
        for step in steps:
            grads = grads_of(model, step, tr.rank)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
            avg.average()
            mean = [torch.stack(tr.all_gather_object(g)).mean(0) for g in grads]
            pairs = zip(model.parameters(), mean, strict=True)
            errors.append(max((p.grad - m).abs().max().item() for p, m in pairs))
            out.append([p.grad.clone() for p in model.parameters()])
        return errors, out

    def body(tr):
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))  # values unused: gradients are set
        res = {}
        for codec in ("none", "acpsgd"):
            avg = GradientAverage(model, tr.fork(), codec)
            errors, _ = run(avg, model, tr, range(4))
            state = avg.state_dict()
            _, cont = run(avg, model, tr, range(4, 6))
            resumed = GradientAverage(model, tr.fork(), codec)
            resumed.load_state_dict(state)
            _, again = run(resumed, model, tr, range(4, 6))
            res[codec] = (errors, avg.stats(), state, cont, again)
            avg.close()
            resumed.close()
        return res

    for res in run_local(2, body):
        assert res["none"][0] == [0.0] * 4
        errors, stats, state, cont, again = res["acpsgd"]
        assert errors[:2] == [0.0, 0.0] and min(errors[2:]) > 0  # two plain warm-up steps, then low-rank
        assert stats["bytes_sent"] < res["none"][1]["bytes_sent"]
        assert state["step"] == 4 and set(state["params"]) == {"0.weight", "1.weight"}
        for a, b in zip(cont, again, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
