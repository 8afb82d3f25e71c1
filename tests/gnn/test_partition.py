from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn import partition as partition_mod
from sylvie_comm.gnn.partition import (
    load_partition,
    partition,
    partition_inputs,
    recorded_inputs,
    save_partitions,
    shared_partition,
)
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def graph():
    g = gdata.csbm(num_nodes=500, num_classes=4, feat_dim=8, avg_degree=6, seed=3)
    # Directed extra edges and an isolated node make it less regular.
    src = torch.cat([g.src, torch.tensor([1, 2, 3])])
    dst = torch.cat([g.dst, torch.tensor([7, 7, 7])])
    keep = (src != 499) & (dst != 499)
    return src[keep], dst[keep], g


def current_version(folder):
    """The version folder a partition folder's CURRENT pointer names."""
    return Path(folder) / (Path(folder) / "CURRENT").read_text().strip()


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
@pytest.mark.parametrize("method", ["random", "metis", "bfs"])
def test_partition_invariants(num_parts, method):
    src, dst, g = graph()
    parts = partition((src, dst), num_parts, method, num_nodes=500, ndata=g.ndata)
    check_invariants(parts, src, dst, 500)
    for p in parts:
        assert torch.equal(p.ndata["feat"], g.ndata["feat"][p.inner])


def assignment(parts):
    owner = torch.empty(parts[0].num_nodes, dtype=torch.int64)
    for p in parts:
        owner[p.inner] = p.rank
    return owner


def test_metis_does_not_depend_on_dgl(monkeypatch):
    """The same METIS parts whether DGL imports or not, and fewer cut edges than a random split."""
    src, dst, _ = graph()
    found = []
    for dgl_imports in (False, True):
        monkeypatch.setattr(_deps, "with_dgl", lambda v=dgl_imports: v)
        parts = partition((src, dst), 3, "metis", num_nodes=500)
        check_invariants(parts, src, dst, 500)
        found.append(assignment(parts))
    assert torch.equal(found[0], found[1])
    cut = sum(p.n_halo for p in partition((src, dst), 3, "metis", num_nodes=500))
    random_cut = sum(p.n_halo for p in partition((src, dst), 3, "random", num_nodes=500))
    assert cut < random_cut  # METIS cuts fewer edges than a random split


def test_metis_without_pymetis_names_it(monkeypatch):
    monkeypatch.setattr(_deps, "_has", lambda name: name != "pymetis")
    src, dst, _ = graph()
    with pytest.raises(ImportError, match="requires 'pymetis'"):
        partition((src, dst), 2, "metis", num_nodes=500)


@pytest.mark.parametrize("method", ["metis", "random", "bfs"])
def test_the_seed_chooses_the_partition(method):
    src, dst, _ = graph()

    def owners(seed):
        return assignment(partition((src, dst), 4, method, num_nodes=500, seed=seed))

    assert torch.equal(owners(2), owners(2))
    assert not torch.equal(owners(0), owners(2))


# Partitions csbm() (the embedded data set) into 4 parts, as a training run does, and prints a digest of
# every partition's node sets and block.
_PARTITION_SCRIPT = """
import hashlib, sys
from sylvie_comm.gnn import data, partition
g = data.csbm()
h = hashlib.sha256()
for p in partition.partition((g.src, g.dst), 4, sys.argv[1], num_nodes=g.num_nodes, seed=int(sys.argv[2])):
    for t in (p.inner, p.halo, p.src, p.dst, *p.send_idx):
        h.update(t.numpy().tobytes() + b"|")
print(h.hexdigest())
"""


def partition_digest_here(method, seed):
    g = gdata.csbm()
    h = hashlib.sha256()
    for p in partition((g.src, g.dst), 4, method, num_nodes=g.num_nodes, seed=seed):
        for t in (p.inner, p.halo, p.src, p.dst, *p.send_idx):
            h.update(t.numpy().tobytes() + b"|")
    return h.hexdigest()


def partition_digest_in_fresh_process(method, seed):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PARTITION_SCRIPT, method, str(seed)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.multiprocess
def test_metis_gives_the_same_partition_in_every_process():
    """Two fresh processes and this one partition the same graph with the same seed identically."""
    digests = [partition_digest_in_fresh_process("metis", 0) for _ in range(2)]
    digests.append(partition_digest_here("metis", 0))
    assert len(set(digests)) == 1, digests


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
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist; write a partition there"):
        load_partition(tmp_path / "nowhere", 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty holds no partition \(no CURRENT pointer, no meta\.json\)"):
        load_partition(tmp_path / "empty", 0)


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
        (((torch.tensor([0]), torch.tensor([1])), 1), {"seed": -1}, ValueError, r"seed must be an integer in \[0, "),
        (((torch.tensor([0]), torch.tensor([1])), 1), {"seed": 2**31}, ValueError, "got 2147483648"),
    ],
)
def test_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        partition(*args, **kwargs)


def test_save_replaces_a_partition_folder_and_nothing_else(tmp_path):
    src, dst, _ = graph()
    folder = tmp_path / "parts"
    save_partitions(partition((src, dst), 3, "random", num_nodes=500), folder)
    save_partitions(partition((src, dst), 2, "random", num_nodes=500, seed=4), folder)
    version = current_version(folder)
    # The pointer, the writers' lock and one version: no staging folder, no previous version left behind.
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "CURRENT", version.name]
    assert sorted(p.name for p in version.iterdir()) == ["meta.json", "part0.pt", "part1.pt"]
    assert json.loads((version / "meta.json").read_text())["num_parts"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["parts"]
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds entries that are not a partition's \(notes\.txt\)"):
        save_partitions(partition((src, dst), 2, "random", num_nodes=500), folder)
    assert (folder / "notes.txt").read_text() == "mine"


def test_a_failed_save_leaves_the_previous_partition(tmp_path, monkeypatch):
    src, dst, _ = graph()
    folder = tmp_path / "parts"
    before = partition((src, dst), 2, "random", num_nodes=500)
    save_partitions(before, folder, {"seed": 0})

    def crash(self, target):
        raise OSError("disk full")

    monkeypatch.setattr(partition_mod.Partition, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_partitions(partition((src, dst), 2, "random", num_nodes=500, seed=1), folder, {"seed": 1})
    assert recorded_inputs(folder) == {"seed": 0}
    assert torch.equal(load_partition(folder, 1).inner, before[1].inner)
    assert [p.name for p in tmp_path.iterdir()] == ["parts"]


class CountingPartition:
    """Wraps partition() and counts the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return partition(*args, **kwargs)


def small_csbm(seed=3):
    return gdata.csbm(num_nodes=500, num_classes=4, feat_dim=8, avg_degree=6, seed=seed)


def test_shared_partition_reuses_a_folder_with_the_same_inputs(tmp_path, monkeypatch):
    counting = CountingPartition()
    monkeypatch.setattr(partition_mod, "partition", counting)
    folder = tmp_path / "parts"
    first = shared_partition(small_csbm, 0, 2, folder, "metis", seed=0)
    again = shared_partition(small_csbm, 0, 2, folder, "metis", seed=0)
    assert counting.calls == 1
    assert torch.equal(first.inner, again.inner) and torch.equal(first.ndata["feat"], again.ndata["feat"])
    g = small_csbm()
    assert recorded_inputs(folder) == partition_inputs(g.src, g.dst, g.num_nodes, g.ndata, "metis", 2, 0)
    # Any recorded input that differs partitions again and replaces the folder.
    changes = [
        (lambda: small_csbm(seed=4), 2, "metis", 0),  # another graph
        (small_csbm, 2, "metis", 2),  # another seed
        (small_csbm, 2, "random", 2),  # another method
        (small_csbm, 3, "random", 2),  # another number of parts
    ]
    for calls, (make_graph, num_parts, method, seed) in enumerate(changes, start=2):
        part = shared_partition(make_graph, 0, num_parts, folder, method, seed)
        assert counting.calls == calls
        g = make_graph()
        assert torch.equal(part.ndata["feat"], g.ndata["feat"][part.inner])
        assert recorded_inputs(folder) == partition_inputs(g.src, g.dst, g.num_nodes, g.ndata, method, num_parts, seed)


def test_shared_partition_redoes_an_incomplete_folder(tmp_path, monkeypatch):
    counting = CountingPartition()
    monkeypatch.setattr(partition_mod, "partition", counting)
    folder = tmp_path / "parts"
    shared_partition(small_csbm, 0, 2, folder, "random")
    (current_version(folder) / "part1.pt").unlink()  # as if damaged by hand
    assert recorded_inputs(folder) is None
    shared_partition(small_csbm, 0, 2, folder, "random")
    assert counting.calls == 2 and (current_version(folder) / "part1.pt").is_file()


def test_node_data_is_part_of_the_recorded_inputs():
    g = small_csbm()
    base = partition_inputs(g.src, g.dst, g.num_nodes, g.ndata, "metis", 2, 0)
    ndata = {**g.ndata, "label": g.ndata["label"].clone()}
    ndata["label"][0] += 1
    assert partition_inputs(g.src, g.dst, g.num_nodes, ndata, "metis", 2, 0)["graph"] != base["graph"]
    assert partition_inputs(g.src.int(), g.dst.int(), g.num_nodes, g.ndata, "metis", 2, 0) == base


def _shared_worker(rank, world, folder):
    import sylvie_comm.gnn.partition as pm
    import sylvie_comm.gnn.partition_store as store

    counting = CountingPartition()
    pm.partition = counting
    if rank == 1:  # a slow reader: rank 0's next call must not rewrite the folder before it has loaded
        load = store._load

        def slow_load(*args, **kwargs):
            time.sleep(1.0)
            return load(*args, **kwargs)

        store._load = slow_load
    out = []
    for seed in (0, 0, 2):  # a run, the same run again, a run with another seed
        before = counting.calls
        part = shared_partition(small_csbm, rank, world, folder, "metis", seed)
        out.append({"inner": part.inner, "halo": part.halo, "partitioned": counting.calls - before})

    def broken_graph():
        raise ValueError("no such data set")

    try:
        shared_partition(broken_graph, rank, world, folder, "metis")
    except (ValueError, RuntimeError) as exc:
        out.append(str(exc))
    return out


@pytest.mark.multiprocess
def test_shared_partition_across_ranks(tmp_path):
    """Rank 0 partitions; every rank loads its own part; the same inputs again reuse the folder and give the
    same parts, another seed replaces it; when rank 0 cannot make the graph, every rank raises."""
    res = run_distributed(_shared_worker, 2, str(tmp_path / "parts"), timeout=120)
    assert res[0][3] == "no such data set"
    assert res[1][3] == "shared_partition: rank 0 could not make the partition (ValueError: no such data set)"
    assert [[call["partitioned"] for call in calls[:3]] for calls in res] == [[1, 0, 1], [0, 0, 0]]
    g = small_csbm()
    for seed, i in ((0, 0), (0, 1), (2, 2)):
        reference = partition((g.src, g.dst), 2, "metis", num_nodes=500, seed=seed)
        for rank, calls in enumerate(res):
            assert torch.equal(calls[i]["inner"], reference[rank].inner), (seed, i, rank)
            assert torch.equal(calls[i]["halo"], reference[rank].halo), (seed, i, rank)
    assert not torch.equal(res[0][2]["inner"], res[0][0]["inner"])
