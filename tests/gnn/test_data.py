from __future__ import annotations

import gzip
import subprocess
import sys
import textwrap

import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata


def test_csbm_is_deterministic_homophilous_and_symmetric():
    a, b = gdata.csbm(num_nodes=1000, seed=5), gdata.csbm(num_nodes=1000, seed=5)
    assert torch.equal(a.src, b.src) and torch.equal(a.ndata["feat"], b.ndata["feat"])
    y = a.ndata["label"]
    same = (y[a.src] == y[a.dst]).float().mean().item()
    assert same > 0.6  # homophily 0.7 plus chance
    edges = set(zip(a.src.tolist(), a.dst.tolist(), strict=True))
    assert all((d, s) in edges for s, d in list(edges)[:500])
    masks = a.ndata["train_mask"].int() + a.ndata["val_mask"].int() + a.ndata["test_mask"].int()
    assert (masks == 1).all()


def test_digits_knn():
    g = gdata.digits_knn(k=5)
    assert g.num_nodes == 1797 and g.ndata["feat"].shape == (1797, 64) and g.num_classes == 10
    y = g.ndata["label"]
    assert (y[g.src] == y[g.dst]).float().mean() > 0.9  # neighbours in pixel space share digits


# The rows of ogb 1.3.6's nodeproppred/master.csv that decide the on-disk layout.
OGB_LAYOUT = {
    "ogbn-arxiv": {"split": "time", "add_inverse_edge": False, "classes": 40, "extra": "node_year"},
    "ogbn-products": {"split": "sales_ranking", "add_inverse_edge": True, "classes": 47, "extra": None},
}


def write_csv(path, rows):
    with gzip.open(path, "wt") as fh:
        for r in rows:
            fh.write(",".join(str(v) for v in (r if isinstance(r, (list, tuple)) else [r])) + "\n")


def write_tiny_ogb(root, name="ogbn-arxiv", n=60, f=8, m=200, seed=0, release=False):
    """A tiny data set in OGB's raw on-disk layout (as its zip extracts, no processed/): raw/edge.csv.gz (one
    "src,dst" row per edge), num-node-list.csv.gz, num-edge-list.csv.gz, node-feat.csv.gz, node-label.csv.gz
    (and arxiv's node_year.csv.gz), split/<type>/{train,valid,test}.csv.gz; RELEASE_v1.txt only with
    ``release`` (without it ogb's own class asks whether to update). Returns the edges."""
    layout = OGB_LAYOUT[name]
    gen = torch.Generator().manual_seed(seed)
    folder = root / name.replace("-", "_")
    (folder / "raw").mkdir(parents=True)
    split = folder / "split" / layout["split"]
    split.mkdir(parents=True)
    src = torch.randint(0, n, (m,), generator=gen)
    dst = torch.randint(0, n, (m,), generator=gen)
    write_csv(folder / "raw" / "edge.csv.gz", list(zip(src.tolist(), dst.tolist(), strict=True)))
    write_csv(folder / "raw" / "num-node-list.csv.gz", [n])
    write_csv(folder / "raw" / "num-edge-list.csv.gz", [m])
    write_csv(folder / "raw" / "node-feat.csv.gz", torch.randn(n, f, generator=gen).tolist())
    write_csv(folder / "raw" / "node-label.csv.gz", torch.randint(0, layout["classes"], (n,), generator=gen).tolist())
    if layout["extra"]:
        write_csv(folder / "raw" / f"{layout['extra']}.csv.gz", [2020] * n)
    write_csv(split / "train.csv.gz", list(range(0, 40)))
    write_csv(split / "valid.csv.gz", list(range(40, 50)))
    write_csv(split / "test.csv.gz", list(range(50, n)))
    if release:
        (folder / "RELEASE_v1.txt").write_text("")
    return src, dst


def write_tiny_arxiv(root, n=60, f=8, seed=0):
    """A tiny data set in ogbn-arxiv's on-disk layout (no RELEASE_v1.txt, no processed/)."""
    return write_tiny_ogb(root, "ogbn-arxiv", n=n, f=f, seed=seed)


def same_graph(a, b):
    return (a.num_nodes == b.num_nodes and a.num_classes == b.num_classes and torch.equal(a.src, b.src)
            and torch.equal(a.dst, b.dst) and a.ndata.keys() == b.ndata.keys()
            and all(torch.equal(a.ndata[k], b.ndata[k]) for k in a.ndata))  # fmt: skip


needs_ogb = pytest.mark.skipif(not _deps.WITH_OGB, reason="ogb not installed")


@pytest.mark.multiprocess
@needs_ogb
def test_ogb_loader_handles_ogb_traps(tmp_path):
    src, dst = write_tiny_arxiv(tmp_path)
    # Run in a child whose stdin is closed: ogb's update prompt would raise EOFError there.
    code = textwrap.dedent(
        f"""
        import torch
        from sylvie_comm.gnn.data import load_ogb
        first = load_ogb("ogbn-arxiv", r"{tmp_path}")
        second = load_ogb("ogbn-arxiv", r"{tmp_path}")   # reads processed/sylvie_comm_graph.pt
        assert torch.equal(first.src, second.src) and torch.equal(first.ndata["feat"], second.ndata["feat"])
        torch.save({{"src": first.src, "dst": first.dst, "feat": first.ndata["feat"], "label": first.ndata["label"],
                    "train": first.ndata["train_mask"], "classes": first.num_classes}}, r"{tmp_path}/out.pt")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    processed = tmp_path / "ogbn_arxiv" / "processed"
    assert (processed / gdata.OGB_CACHE).exists() and not (processed / "data_processed").exists()
    assert out["feat"].shape == (60, 8) and out["classes"] == 40 and out["train"].sum() == 40
    sym = gdata.symmetrize(src, dst, 60)
    assert torch.equal(out["src"], sym[0]) and torch.equal(out["dst"], sym[1])


@needs_ogb
@pytest.mark.parametrize("name", sorted(OGB_LAYOUT))
def test_ogb_raw_layout_then_the_cache_read_weights_only(tmp_path, monkeypatch, name):
    """A fake ogbn data set on disk in OGB's raw layout loads through ogb's own readers; the second load reads
    our cache with weights_only=True and never parses the CSV files again."""
    import ogb.io.read_graph_raw as ogb_raw

    src, dst = write_tiny_ogb(tmp_path, name)
    first = gdata.load_ogb(name, tmp_path)
    n = 60
    assert first.num_nodes == n and first.num_classes == OGB_LAYOUT[name]["classes"]
    assert torch.equal(torch.stack([first.src, first.dst]), torch.stack(gdata.symmetrize(src, dst, n)))
    directed = gdata.load_ogb(name, tmp_path, to_undirected=False)
    expected = torch.stack([src, dst])
    if OGB_LAYOUT[name]["add_inverse_edge"]:  # ogbn-products: ogb adds each edge's inverse after it
        expected = torch.stack([torch.stack([src, dst], 1).reshape(-1), torch.stack([dst, src], 1).reshape(-1)])
    assert torch.equal(torch.stack([directed.src, directed.dst]), expected)
    with gzip.open(tmp_path / name.replace("-", "_") / "raw" / "node-feat.csv.gz", "rt") as fh:
        feats = torch.tensor([[float(v) for v in line.split(",")] for line in fh])
    assert torch.allclose(first.ndata["feat"], feats) and first.ndata["feat"].dtype == torch.float32
    assert first.ndata["train_mask"].sum() == 40 and first.ndata["val_mask"][40:50].all()
    assert first.ndata["test_mask"][50:].all() and first.ndata["label"].shape == (n,)

    def no_csv(*args, **kwargs):
        raise AssertionError("the second load parsed OGB's CSV files again")

    loads = []
    original_load = torch.load

    def spy_load(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return original_load(*args, **kwargs)

    monkeypatch.setattr(ogb_raw, "read_csv_graph_raw", no_csv)
    monkeypatch.setattr(torch, "load", spy_load)
    second = gdata.load_ogb(name, tmp_path)
    assert same_graph(first, second)
    assert loads == [True]  # one load: the cache, weights_only
    monkeypatch.undo()

    # Changed raw files make the cache stale: it is rebuilt from them.
    label = tmp_path / name.replace("-", "_") / "raw" / "node-label.csv.gz"
    write_csv(label, [1] * n)
    third = gdata.load_ogb(name, tmp_path)
    assert (third.ndata["label"] == 1).all() and torch.equal(third.src, first.src)


@needs_ogb
def test_ogb_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="unknown OGB node-property data set 'ogbn-nothing'"):
        gdata.load_ogb("ogbn-nothing", tmp_path)
    with pytest.raises(ValueError, match="ogbn-mag is heterogeneous"):
        gdata.load_ogb("ogbn-mag", tmp_path)
    write_tiny_arxiv(tmp_path)
    raw = tmp_path / "ogbn_arxiv" / "raw"
    (raw / "node-feat.csv.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks .*node-feat\.csv\.gz"):
        gdata.load_ogb("ogbn-arxiv", tmp_path)
    write_csv(raw / "node-feat.csv.gz", [[0.5]] * 60)
    for f in (tmp_path / "ogbn_arxiv" / "split" / "time").iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"has no split 'time'"):
        gdata.load_ogb("ogbn-arxiv", tmp_path)


@needs_ogb
def test_ogb_loader_never_downloads(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        gdata.load_ogb("ogbn-products", tmp_path)


def test_load_dataset_names():
    assert gdata.load_dataset("csbm", num_nodes=100, num_classes=4).num_nodes == 100
    with pytest.raises(ValueError, match="unknown data set"):
        gdata.load_dataset("cora")
    with pytest.raises(ValueError, match="needs root"):
        gdata.load_dataset("ogbn-arxiv")
