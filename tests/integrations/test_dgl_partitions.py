"""Partitions written by dgl.distributed.partition_graph, loaded as this package's Partition objects."""

from __future__ import annotations

import json

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn.partition import partition
from tests.gnn import workloads as gw

pytestmark = pytest.mark.skipif(not _deps.with_dgl(), reason="DGL does not import")


def dgl_partitioned(tmp_path, num_parts, method="random"):
    """A small graph partitioned by DGL; returns the graph, DGL's orig_nids and the config path."""
    dgl = _deps.import_dgl()
    data = gw.small_graph()
    g = dgl.graph((data.src, data.dst), num_nodes=data.num_nodes)
    for k, v in data.ndata.items():
        g.ndata[k] = v
    orig_nids, _ = dgl.distributed.partition_graph(g, "small", num_parts, str(tmp_path), part_method=method,
                                                   return_mapping=True)  # fmt: skip
    return data, orig_nids, tmp_path / "small.json"


def edge_set(part):
    ids = torch.cat([part.inner, part.halo])
    return sorted(zip(ids[part.src].tolist(), ids[part.dst].tolist(), strict=True))


@pytest.mark.parametrize("num_parts", [2, 3])
def test_dgl_partitions_load_as_partitions_of_the_same_graph(tmp_path, num_parts):
    from sylvie_comm.integrations.dgl import load_dgl_partitions

    data, orig, config = dgl_partitioned(tmp_path, num_parts)
    parts = load_dgl_partitions(config)
    ranges = json.loads(config.read_text())["node_map"]["_N"]
    # The same graph relabelled to DGL's ids, split by DGL's assignment with partition().
    new_id = torch.empty_like(orig)
    new_id[orig] = torch.arange(orig.numel())
    assign = torch.cat([torch.full((e - s,), r) for r, (s, e) in enumerate(ranges)])
    relabelled = {k: v[orig] for k, v in data.ndata.items()}
    ref = partition((new_id[data.src], new_id[data.dst]), num_parts, assign, num_nodes=data.num_nodes,
                    ndata=relabelled)  # fmt: skip
    assert len(parts) == num_parts
    total_edges = 0
    for r, (part, want) in enumerate(zip(parts, ref, strict=True)):
        assert (part.rank, part.num_parts, part.num_nodes) == (r, num_parts, data.num_nodes)
        assert torch.equal(part.inner, torch.arange(*ranges[r]))
        for name in ("inner", "halo", "in_degree", "out_degree"):
            assert torch.equal(getattr(part, name), getattr(want, name)), name
        assert part.halo_counts == want.halo_counts
        assert all(torch.equal(a, b) for a, b in zip(part.send_idx, want.send_idx, strict=True))
        assert edge_set(part) == edge_set(want)
        assert part.n_halo > 0  # a random split of this graph cuts edges: the halos are exercised
        # Node data follows the nodes: DGL id i is original node orig[i].
        assert set(part.ndata) == {"feat", "label", "train_mask", "val_mask", "test_mask"} & set(data.ndata)
        for k, v in part.ndata.items():
            assert torch.equal(v, data.ndata[k][orig[part.inner]]), k
        total_edges += part.src.numel()
        # Each peer expects from this rank exactly the rows this rank sends it.
        for p, peer in enumerate(parts):
            assert part.send_counts[p] == peer.halo_counts[r]
    assert total_edges == data.src.numel()


def test_dgl_partitions_carry_only_the_named_node_data(tmp_path):
    from sylvie_comm.integrations.dgl import load_dgl_partitions

    _, _, config = dgl_partitioned(tmp_path, 2)
    parts = load_dgl_partitions(config, ndata=["feat", "label"])
    assert all(set(p.ndata) == {"feat", "label"} for p in parts)
    with pytest.raises(ValueError, match=r"node data \['embedding'\] is not in the partitions"):
        load_dgl_partitions(config, ndata=["feat", "embedding"])


def test_dgl_partitions_reject_bad_configs(tmp_path):
    from sylvie_comm.integrations.dgl import load_dgl_partitions

    with pytest.raises(ValueError, match="is not a file; expected the JSON config"):
        load_dgl_partitions(tmp_path / "nothing.json")
    _, _, config = dgl_partitioned(tmp_path, 2)
    good = json.loads(config.read_text())
    cases = [
        ({"node_map": {"paper": good["node_map"]["_N"], "author": good["node_map"]["_N"]}},
         r"node types \['author', 'paper'\]; expected a homogeneous graph"),
        ({"node_map": {"_N": [[0, 10], [10, 20]]}}, r"covers 20 nodes, expected num_nodes=600"),
        ({"node_map": {"_N": [[0, 300], [301, 600]]}}, r"range 1 is \[301, 600\]; expected \[300, end\]"),
    ]  # fmt: skip
    for change, message in cases:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=message):
            load_dgl_partitions(bad)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"graph_name": "small"}))
    with pytest.raises(ValueError, match=r"lacks \['num_nodes', 'num_parts', 'node_map'\]"):
        load_dgl_partitions(broken)
