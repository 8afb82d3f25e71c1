"""A partition folder is checked before it is used: a tampered, truncated or mismatched part file raises a
ValueError naming the file and the field, never reaches coalesce()/to_sparse_csr() or the halo exchange, and a
damaged folder is not reused by shared_partition (it is rebuilt).

Each tampered file gets a matching SHA-256 in meta.json (as an attacker who can write the folder would
give it), so it is the field checks, not the digest, that catch it; the digest tests change bytes only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn import partition as partition_mod
from sylvie_comm.gnn.partition import (
    load_partition,
    partition,
    recorded_inputs,
    save_partitions,
    shared_partition,
)

N = 300


def small_graph():
    return gdata.csbm(num_nodes=N, num_classes=3, feat_dim=4, avg_degree=6, seed=1)


@pytest.fixture()
def saved(tmp_path):
    g = small_graph()
    parts = partition((g.src, g.dst), 3, "random", num_nodes=N, ndata=g.ndata)
    folder = tmp_path / "parts"
    save_partitions(parts, folder, {"graph": "small", "seed": 0})
    return folder, parts


def version_of(folder: Path) -> Path:
    pointer = folder / "CURRENT"
    return folder / pointer.read_text().strip() if pointer.exists() else folder  # older layout: the folder itself


def tamper(folder: Path, rank: int, edit) -> Path:
    """Apply ``edit`` to part ``rank``'s saved fields, save them back and record the new file's digest."""
    version = version_of(folder)
    path = version / f"part{rank}.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    rehash(version, rank)
    return path


def rehash(version: Path, rank: int) -> None:
    meta_path = version / "meta.json"
    meta = json.loads(meta_path.read_text())
    if "parts" in meta:
        data = (version / f"part{rank}.pt").read_bytes()
        meta["parts"][rank].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        meta_path.write_text(json.dumps(meta))


def setitem(key, value):
    def edit(state):
        state[key] = value(state) if callable(value) else value

    return edit


def set_element(key, index, value, peer=None):
    def edit(state):
        t = state[key] if peer is None else state[key][peer]
        t[index] = value(state) if callable(value) else value

    return edit


def n_src(state):
    return state["inner"].numel() + state["halo"].numel()


def drop_an_edge(state):
    """A consistent part with one edge fewer than meta.json records."""
    state["src"], state["dst"] = state["src"][1:], state["dst"][1:]
    state["in_degree"] = torch.bincount(state["dst"], minlength=state["inner"].numel())


# (what is changed in part 1, the field the error must name, what it must say was expected)
TAMPERED = [
    ("src beyond the block", set_element("src", 0, lambda s: n_src(s) + 1000), r"field 'src' must hold ids in \[0, "),
    ("a negative src", set_element("src", -1, -1), r"field 'src' must hold ids in \[0, \d+\), got ids in \[-1, "),
    ("dst beyond the inner nodes", set_element("dst", 3, lambda s: s["inner"].numel()),
     r"field 'dst' must hold ids in \[0, \d+\)"),
    ("a negative dst", set_element("dst", 0, -7), r"field 'dst' must hold ids in \[0, \d+\), got ids in \[-7, "),
    ("send_idx beyond the inner nodes", set_element("send_idx", 0, 10**9, peer=2),
     r"field 'send_idx\[2\]' must hold ids in \[0, \d+\)"),
    ("a negative send_idx", set_element("send_idx", 0, -1, peer=0), r"field 'send_idx\[0\]' must hold ids in"),
    ("send_idx to itself", lambda s: s["send_idx"].__setitem__(1, torch.tensor([0])),
     r"field 'send_idx\[1\]' must be empty"),
    ("an inner id beyond the graph", set_element("inner", -1, N), r"field 'inner' must hold ids in \[0, 300\)"),
    ("inner out of order", lambda s: s.__setitem__("inner", s["inner"].flip(0)), r"'inner' must be strictly ascending"),
    ("a halo id beyond the graph", set_element("halo", 0, -5), r"field 'halo' must hold ids in \[0, 300\)"),
    ("an inner node in the halo", set_element("halo", 0, lambda s: int(s["inner"][0])),
     r"'halo' holds ids that are also in 'inner'"),
    ("halo_counts that do not add up", set_element("halo_counts", 0, lambda s: s["halo_counts"][0] + 1),
     r"field 'halo' must hold \d+ ids"),
    ("halo_counts too short", setitem("halo_counts", [0, 0]), r"'halo_counts' must be a list of 3 counts"),
    ("halo from its own rank", lambda s: s["halo_counts"].__setitem__(1, 1), r"'halo_counts' must be 0 for the part's"),
    ("src as int32", setitem("src", lambda s: s["src"].int()), r"field 'src' must be a 1-D int64 tensor, got a "
     r"torch\.int32"),
    ("src as floats", setitem("src", lambda s: s["src"].double()), r"field 'src' must be a 1-D int64 tensor"),
    ("inner as 2-D", setitem("inner", lambda s: s["inner"][:, None]), r"field 'inner' must be a 1-D int64"),
    ("sparse dst", setitem("dst", lambda s: s["dst"].to_sparse()), r"field 'dst' must be a 1-D int64 tensor"),
    ("src and dst of different lengths", setitem("dst", lambda s: s["dst"][:-1]), r"field 'dst' must hold \d+ ids"),
    ("a missing field", lambda s: s.pop("halo"), r"lacks the fields \['halo'\]"),
    ("an unexpected field", setitem("extra", 1), r"has unexpected fields \['extra'\]"),
    ("another rank", setitem("rank", 2), r"field 'rank' must be the integer 1, got int 2"),
    ("rank as a bool", setitem("rank", True), r"field 'rank' must be the integer 1, got bool True"),
    ("another node count", setitem("num_nodes", N + 1), r"field 'num_nodes' must be the integer 300"),
    ("another part count", setitem("num_parts", 4), r"field 'num_parts' must be the integer 3"),
    ("in_degree that is not the block's", set_element("in_degree", 0, 10**6), r"field 'in_degree' must count"),
    ("out_degree below the block's", setitem("out_degree", lambda s: torch.zeros_like(s["out_degree"])),
     r"field 'out_degree' must be at least"),
    ("out_degree of another length", setitem("out_degree", lambda s: s["out_degree"][1:]),
     r"field 'out_degree' must hold \d+ ids"),
    ("features of too few rows", lambda s: s["ndata"].__setitem__("feat", s["ndata"]["feat"][1:]),
     r"field 'ndata\['feat'\]' must be a dense tensor of \d+ rows"),
    ("labels as floats", lambda s: s["ndata"].__setitem__("label", s["ndata"]["label"].float()),
     r"field 'ndata\['label'\]' must be a integer tensor of shape \(n_inner,\)"),
    ("a mask of ints", lambda s: s["ndata"].__setitem__("train_mask", s["ndata"]["train_mask"].long()),
     r"field 'ndata\['train_mask'\]' must be a bool tensor"),
    ("not a dict", lambda s: s.clear(), r"lacks the fields"),
    ("an edge fewer than recorded", drop_an_edge, r"its n_edges is \d+ but meta\.json records \d+"),
]  # fmt: skip


@pytest.mark.parametrize("what,edit,message", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_a_tampered_part_is_refused_naming_file_and_field(saved, what, edit, message):
    folder, parts = saved
    path = tamper(folder, 1, edit)
    with pytest.raises(ValueError, match=message) as info:
        load_partition(folder, 1)
    assert f"partition: {path}:" in str(info.value)
    assert torch.equal(load_partition(folder, 0).inner, parts[0].inner)  # the other parts still load


def test_checks_cost_a_few_passes_over_the_edges(saved):
    """The check is vectorized: a part's fields pass without a Python loop over elements (sanity: a large
    part checks in a fraction of a second)."""
    g = gdata.csbm(num_nodes=50_000, num_classes=4, feat_dim=4, avg_degree=40, seed=0)
    big = partition((g.src, g.dst), 2, "random", num_nodes=g.num_nodes, ndata=g.ndata)[0]
    assert big.src.numel() > 900_000
    import time

    t0 = time.perf_counter()
    partition_mod.check_partition(big)
    assert time.perf_counter() - t0 < 5.0


def test_changed_bytes_fail_the_digest(saved):
    folder, _ = saved
    path = version_of(folder) / "part2.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{path} has SHA-256 [0-9a-f]{{64}} but meta\.json records [0-9a-f]{{64}} "
                                         r"\(damaged or altered\)"):  # fmt: skip
        load_partition(folder, 2)
    assert recorded_inputs(folder) is None


@pytest.mark.parametrize("keep", [0, 0.5])
def test_a_truncated_or_empty_part_file_names_the_file(saved, keep):
    folder, _ = saved
    path = version_of(folder) / "part1.pt"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=rf"{path} holds {int(len(data) * keep)} bytes but meta\.json records "
                                         rf"{len(data)} \(truncated or replaced\)"):  # fmt: skip
        load_partition(folder, 1)
    assert recorded_inputs(folder) is None  # not complete: shared_partition rebuilds it


def test_a_part_file_that_is_no_torch_file_names_the_file(saved):
    """Even with a matching digest: garbage is a ValueError naming the file, not an unpickling traceback."""
    folder, _ = saved
    version = version_of(folder)
    (version / "part0.pt").write_bytes(b"not a torch file at all")
    rehash(version, 0)
    with pytest.raises(ValueError, match=r"part0\.pt is not a readable partition file \("):
        load_partition(folder, 0)


def test_a_part_file_with_a_payload_runs_nothing(saved, tmp_path):
    import builtins

    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (builtins.exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    folder, _ = saved
    version = version_of(folder)
    torch.save({"rank": Payload()}, version / "part0.pt")
    rehash(version, 0)
    with pytest.raises(ValueError, match=r"part0\.pt is not a readable partition file \(UnpicklingError"):
        load_partition(folder, 0)
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.update(num_nodes=301), r"parts hold 300 inner nodes; expected num_nodes 301"),
        (lambda m: m.update(format=1), r"is format 1; expected format 2"),
        (lambda m: m.update(num_parts=2), r"'parts' must list 2 part records"),
        (lambda m: m["parts"][1]["send_counts"].__setitem__(0, 10**6), r"part 1 sends 1000000 rows to part 0, which "
                                                                       r"expects \d+"),
        (lambda m: m["parts"][0].update(sha256="x"), r"record of part 0 must hold a 'sha256' of 64 hex digits"),
        (lambda m: m["parts"][2].update(file="../part2.pt"), r"record of part 2 must be an object with 'file': "
                                                             r"'part2\.pt'"),
    ],
)  # fmt: skip
def test_a_tampered_meta_json_is_refused(saved, edit, message):
    folder, _ = saved
    meta_path = version_of(folder) / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=message) as info:
        load_partition(folder, 0)
    assert str(meta_path) in str(info.value)
    assert recorded_inputs(folder) is None


def test_a_pointer_outside_the_folder_is_refused(saved):
    folder, _ = saved
    (folder / "CURRENT").write_text("../../etc\n")
    with pytest.raises(ValueError, match=r"CURRENT names '\.\./\.\./etc'; expected a version folder"):
        load_partition(folder, 0)
    assert recorded_inputs(folder) is None


def test_an_older_format_folder_says_so(tmp_path):
    """A folder written by an older sylvie-comm (format 1, no digests) is not read, and is rebuilt."""
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"num_parts": 2, "num_nodes": N, "format": 1}))
    for r, p in enumerate(partition((small_graph().src, small_graph().dst), 2, "random", num_nodes=N)):
        torch.save(p.state(), folder / f"part{r}.pt")
    with pytest.raises(ValueError, match=r"holds a partition of format 1 \(written by an older sylvie-comm: "):
        load_partition(folder, 0)
    assert recorded_inputs(folder) is None
    part = shared_partition(small_graph, 0, 2, folder, "random")
    assert sorted(p.name for p in folder.iterdir())[:2] == [".lock", "CURRENT"]  # the old files are gone
    assert not (folder / "meta.json").exists() and part.num_nodes == N


def test_shared_partition_rebuilds_a_damaged_folder(tmp_path, monkeypatch):
    calls = []
    real = partition_mod.partition

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(partition_mod, "partition", counting)
    folder = tmp_path / "parts"
    first = shared_partition(small_graph, 0, 2, folder, "random")
    shared_partition(small_graph, 0, 2, folder, "random")
    assert len(calls) == 1  # intact: reused
    path = version_of(folder) / "part0.pt"
    path.write_bytes(path.read_bytes()[:100])
    again = shared_partition(small_graph, 0, 2, folder, "random")
    assert len(calls) == 2  # truncated: rebuilt, not used
    assert torch.equal(again.inner, first.inner) and torch.equal(again.src, first.src)


def test_save_checks_the_parts_it_writes(tmp_path):
    g = small_graph()
    parts = partition((g.src, g.dst), 2, "random", num_nodes=N)
    parts[1].src[0] = -3
    with pytest.raises(ValueError, match=r"partition: part 1: field 'src' must hold ids in \[0, \d+\), got ids in "
                                         r"\[-3, "):  # fmt: skip
        save_partitions(parts, tmp_path / "parts")
    with pytest.raises(ValueError, match=r"parts\[0\] is part 1 of 2 .* expected part 0 of 1"):
        save_partitions(parts[1:], tmp_path / "parts")
    assert not (tmp_path / "parts").exists()
