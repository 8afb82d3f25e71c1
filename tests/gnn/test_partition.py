from __future__ import annotations

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.partition import load_partition, partition, save_partitions


def graph():
    g = gdata.csbm(num_nodes=500, num_classes=4, feat_dim=8, avg_degree=6, seed=3)
    # Directed extra edges and an isolated node make it less regular.
    src = torch.cat([g.src, torch.tensor([1, 2, 3])])
    dst = torch.cat([g.dst, torch.tensor([7, 7, 7])])
    keep = (src != 499) & (dst != 499)
    return src[keep], dst[keep], g


def check_invariants(parts, src, dst, n):
    owner = torch.empty(n, dtype=torch.int64)
    for p in parts:
        owner[p.inner] = p.rank
    assert sum(p.n_inner for p in parts) == n
    in_deg, out_deg = torch.bincount(dst, minlength=n), torch.bincount(src, minlength=n)
    for p in parts:
        glob = torch.cat([p.inner, p.halo])
        # The block holds exactly the in-edges of the inner nodes.
        local = set(zip(glob[p.src].tolist(), p.inner[p.dst].tolist(), strict=True))
        mine = owner[dst] == p.rank
        assert local == set(zip(src[mine].tolist(), dst[mine].tolist(), strict=True))
        # Halo: remote in-neighbours, grouped by owner, ascending inside a group.
        assert (owner[p.halo] != p.rank).all()
        key = owner[p.halo] * n + p.halo
        assert torch.equal(key, torch.sort(key).values)
        assert p.halo_counts == torch.bincount(owner[p.halo], minlength=len(parts)).tolist()
        assert torch.equal(p.in_degree, in_deg[p.inner]) and torch.equal(p.out_degree, out_deg[glob])
        for q in parts:
            # What p sends q is q's halo rows owned by p, in q's order.
            assert torch.equal(p.inner[p.send_idx[q.rank]], q.halo[owner[q.halo] == p.rank])


@pytest.mark.parametrize("num_parts", [1, 2, 4])
@pytest.mark.parametrize("method", ["random", "metis"])
def test_partition_invariants(num_parts, method):
    src, dst, g = graph()
    parts = partition((src, dst), num_parts, method, num_nodes=500, ndata=g.ndata)
    check_invariants(parts, src, dst, 500)
    for p in parts:
        assert torch.equal(p.ndata["feat"], g.ndata["feat"][p.inner])


def test_metis_through_pymetis_without_dgl(monkeypatch):
    if not _deps.WITH_PYMETIS:
        pytest.skip("pymetis not installed")
    monkeypatch.setattr(_deps, "with_dgl", lambda: False)
    src, dst, _ = graph()
    parts = partition((src, dst), 3, "metis", num_nodes=500)
    check_invariants(parts, src, dst, 500)
    cut = sum(p.n_halo for p in parts)
    random_cut = sum(p.n_halo for p in partition((src, dst), 3, "random", num_nodes=500))
    assert cut < random_cut  # METIS cuts fewer edges than a random split


def test_dgl_graph_input_carries_ndata():
    if not _deps.with_dgl():
        pytest.skip("DGL does not import")
    dgl = _deps.import_dgl()
    src, dst, g = graph()
    dg = dgl.graph((src, dst), num_nodes=500)
    dg.ndata["feat"] = g.ndata["feat"]
    parts = partition(dg, 2, "metis")
    check_invariants(parts, src, dst, 500)
    assert torch.equal(parts[1].ndata["feat"], g.ndata["feat"][parts[1].inner])


def test_empty_halos_and_isolated_nodes():
    # Two components, each wholly inside one partition: no halo at all; node 5 is isolated.
    src, dst = torch.tensor([0, 1, 3, 4]), torch.tensor([1, 2, 4, 3])
    assign = torch.tensor([0, 0, 0, 1, 1, 1])
    parts = partition((src, dst), 2, assign, num_nodes=6)
    assert all(p.n_halo == 0 for p in parts) and parts[1].in_degree.tolist() == [1, 1, 0]
    check_invariants(parts, src, dst, 6)


def test_save_and_load_one_rank(tmp_path):
    src, dst, g = graph()
    parts = partition((src, dst), 3, "random", num_nodes=500, ndata=g.ndata)
    save_partitions(parts, tmp_path)
    mine = load_partition(tmp_path, 2)
    for k, v in parts[2].state().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, getattr(mine, k))
        elif k == "send_idx":
            assert all(torch.equal(a, b) for a, b in zip(v, mine.send_idx, strict=True))
        elif k != "ndata":
            assert v == getattr(mine, k)
    with pytest.raises(ValueError, match="rank 3 is outside the 3 partitions"):
        load_partition(tmp_path, 3)
    with pytest.raises(FileNotFoundError, match=r"no meta\.json"):
        load_partition(tmp_path / "nowhere", 0)


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        (((torch.tensor([0]), torch.tensor([1])), 3), {"num_nodes": 2}, ValueError, "cannot split 2 nodes into 3"),
        (((torch.tensor([0]), torch.tensor([1])), 0), {}, ValueError, "positive integer, got 0"),
        (((torch.tensor([0.0]), torch.tensor([1.0])), 1), {}, TypeError, "integer edge tensors"),
        (((torch.tensor([0, 5]), torch.tensor([1, 1])), 1), {"num_nodes": 3}, ValueError, r"lie in \[0, 3\)"),
        (((torch.tensor([0]), torch.tensor([1, 2])), 1), {}, ValueError, "equal length"),
        (((torch.tensor([0]), torch.tensor([1])), 2), {"method": "spectral"}, ValueError, "unknown method"),
        (((torch.tensor([0]), torch.tensor([1])), 1), {"ndata": {"feat": torch.zeros(3, 2)}}, ValueError, "has 3 rows"),
        (("not a graph", 1), {}, TypeError, "DGLGraph"),
    ],
)
def test_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        partition(*args, **kwargs)
