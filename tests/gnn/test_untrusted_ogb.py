"""An OGB data folder is data, not code: nothing in it runs, and loading it patches nothing process-wide.

Each malicious file below is a pickle whose ``__reduce__`` would create a marker file when unpickled
unrestricted (as ``torch.load(weights_only=False)`` does); the tests check that the marker never appears and
that the error names the file.
"""

from __future__ import annotations

import builtins
import re
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from sylvie_comm import _deps
from sylvie_comm.gnn import data as gdata
from tests.gnn.test_data import same_graph, write_tiny_arxiv

pytestmark = pytest.mark.skipif(not _deps.WITH_OGB, reason="ogb not installed")


class Payload:
    """Unpickled unrestricted, creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",))


def write_malicious(path, marker, what="data_processed"):
    """A file shaped like OGB's (torch.save'd dict of numpy arrays), one of them a payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "data_processed":
        obj = {"graph": Payload(marker), "labels": np.zeros((60, 1), dtype=np.int64)}
    elif what == "split":
        obj = {"train": Payload(marker), "valid": np.arange(40, 50), "test": np.arange(50, 60)}
    else:
        obj = Payload(marker)
    # ogb writes data_processed with protocol 4; torch.save's default (2) for everything else
    torch.save(obj, path, pickle_protocol=4 if what == "data_processed" else 2)


def arxiv(tmp_path):
    return tmp_path / "ogbn_arxiv"


def load_refused(tmp_path, marker, pattern):
    """load_ogb fails with a ValueError matching ``pattern``, and the payload has not run."""
    with pytest.raises(Exception) as info:
        gdata.load_ogb("ogbn-arxiv", tmp_path)
    assert not marker.exists(), f"the payload ran (then: {info.type.__name__}: {info.value})"
    assert info.type is ValueError and re.search(pattern, str(info.value)), str(info.value)


def test_a_folder_holding_only_data_processed_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    write_tiny_arxiv(tmp_path)
    for f in (arxiv(tmp_path) / "raw").iterdir():  # only the split CSVs and OGB's pickle are left
        f.unlink()
    path = arxiv(tmp_path) / "processed" / "data_processed"
    write_malicious(path, marker)
    load_refused(
        tmp_path,
        marker,
        r"data_processed could not be read as OGB's file of numpy arrays \("
        r"UnpicklingError: refused the global (__builtin__|builtins)\.exec",
    )


def test_a_split_dict_payload_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    write_tiny_arxiv(tmp_path)
    split = arxiv(tmp_path) / "split" / "time"
    for f in split.iterdir():
        f.unlink()
    write_malicious(split / "split_dict.pt", marker, "split")
    load_refused(
        tmp_path, marker, r"split_dict\.pt could not be read .*refused the global (__builtin__|builtins)\.exec"
    )


def test_pickles_beside_the_raw_files_are_never_opened(tmp_path):
    """With OGB's raw and split CSV files present, OGB's pickles are not read at all."""
    marker = tmp_path / "marker"
    write_tiny_arxiv(tmp_path)
    write_malicious(arxiv(tmp_path) / "processed" / "data_processed", marker)
    write_malicious(arxiv(tmp_path) / "split" / "time" / "split_dict.pt", marker, "split")
    try:
        g = gdata.load_ogb("ogbn-arxiv", tmp_path)
    finally:
        assert not marker.exists(), "the payload ran"
    assert g.num_nodes == 60 and g.ndata["train_mask"].sum() == 40


def test_our_cache_is_only_loaded_weights_only(tmp_path):
    marker = tmp_path / "marker"
    write_tiny_arxiv(tmp_path)
    gdata.load_ogb("ogbn-arxiv", tmp_path)
    cache = arxiv(tmp_path) / "processed" / gdata.OGB_CACHE
    assert cache.is_file()
    write_malicious(cache, marker, "cache")
    load_refused(tmp_path, marker, r"sylvie_comm_graph\.pt is not a readable cache \(UnpicklingError")


def test_a_tampered_cache_is_refused_naming_the_field(tmp_path):
    write_tiny_arxiv(tmp_path)
    gdata.load_ogb("ogbn-arxiv", tmp_path)
    cache = arxiv(tmp_path) / "processed" / gdata.OGB_CACHE
    state = torch.load(cache, weights_only=True)
    state["arrays"]["train"][0] = 10**6
    torch.save(state, cache)
    with pytest.raises(ValueError, match=r"sylvie_comm_graph\.pt: 'train' holds node ids outside \[0, 60\)"):
        gdata.load_ogb("ogbn-arxiv", tmp_path)
    state["arrays"]["train"][0] = 0
    state["arrays"]["edge_index"] = state["arrays"]["edge_index"].int()
    torch.save(state, cache)
    with pytest.raises(ValueError, match=r"'edge_index' must be a torch\.int64 tensor of shape \(2, \*\), got "
                                         r"torch\.int32"):  # fmt: skip
        gdata.load_ogb("ogbn-arxiv", tmp_path)


def test_loading_patches_nothing_process_wide(tmp_path, monkeypatch):
    """While load_ogb runs, torch.load, builtins.input and sys.stdout are the process's own, and a plain
    torch.load of an untrusted file elsewhere in the process (here: from inside ogb's CSV reading) still
    refuses to run its payload."""
    marker = tmp_path / "marker"
    untrusted = tmp_path / "untrusted.pt"
    write_malicious(untrusted, marker, "cache")
    write_tiny_arxiv(tmp_path)
    originals = (torch.load, builtins.input, sys.stdout)
    seen = []
    read_csv = pd.read_csv

    def probe(*args, **kwargs):
        if not seen:
            try:
                torch.load(untrusted)
                refused = False
            except Exception:
                refused = True
            seen.append({"same": (torch.load, builtins.input, sys.stdout) == originals, "refused": refused})
        return read_csv(*args, **kwargs)

    monkeypatch.setattr(pd, "read_csv", probe)
    g = gdata.load_ogb("ogbn-arxiv", tmp_path)
    assert g.num_nodes == 60
    assert seen == [{"same": True, "refused": True}]
    assert not marker.exists()


def _ogb_processed(tmp_path):
    """Let ogb 1.3.6's own NodePropPredDataset write processed/data_processed (in a child process; with
    RELEASE_v1.txt present it asks nothing)."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        f"""
        import torch
        from ogb.nodeproppred import NodePropPredDataset
        NodePropPredDataset(name="ogbn-arxiv", root=r"{tmp_path}")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.multiprocess
def test_ogbs_own_pickles_are_read_without_running_code(tmp_path):
    """Without raw files, the data_processed that ogb itself writes (protocol 4) and a split_dict.pt of numpy
    arrays are read by the numpy-only unpickler and give the same graph as the raw files."""
    write_tiny_arxiv(tmp_path)
    (arxiv(tmp_path) / "RELEASE_v1.txt").write_text("")
    (arxiv(tmp_path) / "processed").mkdir()
    _ogb_processed(tmp_path)
    assert (arxiv(tmp_path) / "processed" / "data_processed").is_file()
    from_raw = gdata.load_ogb("ogbn-arxiv", tmp_path)
    split = arxiv(tmp_path) / "split" / "time"
    torch.save({"train": np.arange(40), "valid": np.arange(40, 50), "test": np.arange(50, 60)},
               split / "split_dict.pt")  # fmt: skip
    for f in [*(arxiv(tmp_path) / "raw").iterdir(), *split.glob("*.csv.gz")]:
        f.unlink()
    from_pickles = gdata.load_ogb("ogbn-arxiv", tmp_path)
    assert same_graph(from_raw, from_pickles)
