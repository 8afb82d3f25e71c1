"""The demo's GNN part partitions with what the base install has (no pymetis) and says which partitioner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sylvie_comm.demo as demo
from sylvie_comm.gnn.partition import METHODS

ROOT = Path(__file__).resolve().parents[2]

# The GNN module in a child process where pymetis (and DGL) do not exist as far as sylvie_comm can tell.
_CHILD = textwrap.dedent(
    """
    import sys
    from sylvie_comm import _deps
    real = _deps._has
    _deps._has = lambda name: name not in ("pymetis", "dgl") and real(name)
    from sylvie_comm.demo import gnn_full_graph
    gnn_full_graph.main(sys.argv[1:])
    """
)


@pytest.mark.multiprocess
def test_the_gnn_module_partitions_without_pymetis_by_default(tmp_path):
    out = tmp_path / "gnn.json"
    args = ["--nodes", "300", "--epochs", "1", "--backend", "torch", "--parts-dir", str(tmp_path / "parts"),
            "--no-progress", "--json-out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["partition"] == "bfs" and result["nodes"] == 300
    assert "on 1 ranks (bfs partition)" in proc.stdout


def test_the_demo_runs_its_gnn_part_with_a_base_install_partitioner(monkeypatch):
    commands = []

    def fake_torchrun(module, nproc, args, timeout=None):
        commands.append((module, list(args)))
        if module == demo.GNN_MODULE:
            return {"test_acc": 50.0, "epoch_seconds": 0.1, "halo_bytes_per_epoch": 1000.0 / (1 + len(commands))}
        return {"codec": args[1], "accuracy": 50.0, "bytes_sent": 1000 - len(commands), "seconds": 1.0,
                "encode_seconds": 0.0, "decode_seconds": 0.0}  # fmt: skip

    monkeypatch.setattr(demo, "torchrun", fake_torchrun)
    monkeypatch.setattr(demo.shutil, "which", lambda name: None)
    said = []
    demo.run(steps=1, epochs=1, gnn_nproc=2, echo=said.append, lab=False)
    gnn = [args for module, args in commands if module == demo.GNN_MODULE]
    assert len(gnn) == len(demo.GNN_RUNS)
    assert all(args[args.index("--partition") + 1] == demo.GNN_PARTITION for args in gnn)
    assert demo.GNN_PARTITION == "bfs" and demo.GNN_PARTITION in METHODS
    assert any(line.startswith("   partitioner: bfs (") for line in said), said
