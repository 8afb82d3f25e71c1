"""The demo: data-parallel training under three gradient hooks (and Horovod), full-graph GNN training, a shaped link.

Both workloads are modules of this package, each a command line that runs
under torchrun or horovodrun (and in a single process without either)::

    torchrun --nproc_per_node 2 -m sylvie_comm.demo.ddp_train --codec acpsgd --rank 4
    horovodrun -np 2 python -m sylvie_comm.demo.ddp_train --codec acpsgd --rank 4
    torchrun --nproc_per_node 4 -m sylvie_comm.demo.gnn_full_graph --bits-fwd 1 --bits-bwd 1 --staleness 1

``examples/ddp_train.py`` and ``examples/gnn_full_graph.py`` are the same two
commands as scripts. :func:`run` (``sylvie-comm demo``) launches them one
configuration at a time and compares what rank 0 reports. Its last part runs the
communication-heavy MLP on a network lab link (:mod:`sylvie_comm.bench.link`, 1 Gbit/s,
4 workers in network namespaces when run as root, loopback otherwise, said so): S-SGD
against ``acpsgd``, ``onebit`` and ``auto``, a table and a plot.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sylvie_comm.demo.launch import horovodrun, torchrun

DDP_MODULE = "sylvie_comm.demo.ddp_train"
GNN_MODULE = "sylvie_comm.demo.gnn_full_graph"
# (hook, extra arguments): the same model, data and seed under each.
DDP_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (("none", ()), ("acpsgd", ("--rank", "4")), ("onebit", ()))
# Under horovodrun (when Horovod is installed): the same training, Horovod's collectives, our optimizer.
HOROVOD_RUN: tuple[str, tuple[str, ...]] = ("acpsgd", ("--rank", "4"))
GNN_NODES = 4000  # the generated CSBM graph
# The partitioner of the GNN part: plain torch and seeded, so the base install runs it and every machine gets
# the same parts (METIS needs pymetis, an extra; on this graph it cuts about as many edges).
GNN_PARTITION = "bfs"
# (label, extra arguments): halo precision and staleness.
GNN_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp32, synchronous", ()),
    ("1-bit, staleness 1", ("--bits-fwd", "1", "--bits-bwd", "1", "--staleness", "1")),
)
# The lab part: DDP's own all-reduce (S-SGD) against three of ours, on one shaped link.
LAB_CODECS = ("ddp", "acpsgd", "onebit", "auto")


def ddp_table(rows: list[dict[str, Any]]) -> str:
    """Accuracy, wire bytes (and the ratio to the first row), wall time and hook compute of DDP runs."""
    base = rows[0]["bytes_sent"]
    lines = [f"   {'hook':<16}{'accuracy':>10}{'MB sent':>10}{'vs plain':>10}{'wall s':>9}{'encode+decode s':>17}"]
    for r in rows:
        name = f"{r['codec']} (Horovod)" if r.get("launcher") == "horovodrun" else r["codec"]
        lines.append(
            f"   {name:<16}{r['accuracy']:>9.2f}%{r['bytes_sent'] / 1e6:>10.2f}"
            f"{base / r['bytes_sent']:>9.1f}x{r['seconds']:>9.1f}"
            f"{r['encode_seconds'] + r['decode_seconds']:>17.2f}"
        )
    return "\n".join(lines)


def gnn_table(rows: list[dict[str, Any]]) -> str:
    """Test accuracy, epoch time and halo bytes per epoch (and the ratio to the first row) of GNN runs."""
    base = rows[0]["halo_bytes_per_epoch"]
    lines = [f"   {'halo exchange':<24}{'test acc':>9}{'s/epoch':>9}{'halo MB/epoch':>15}{'vs fp32':>9}"]
    for r in rows:
        ratio = base / r["halo_bytes_per_epoch"] if r["halo_bytes_per_epoch"] else 0.0
        lines.append(
            f"   {r['label']:<24}{r['test_acc']:>8.2f}%{r['epoch_seconds']:>9.3f}"
            f"{r['halo_bytes_per_epoch'] / 1e6:>15.3f}{ratio:>8.1f}x"
        )
    return "\n".join(lines)


def lab_table(rec: dict[str, Any]) -> str:
    """Step time, speedup over S-SGD and bytes per step of the lab part (a record of ``bench.link.run``)."""
    lines = [f"   {'codec':<22}{'step s':>8}{'x S-SGD':>9}{'MB/step':>9}  chose"]
    for name, c in rec["codecs"].items():
        sent = c["eth0_tx_bytes_per_step"] if c["eth0_tx_bytes_per_step"] is not None else c["hook_bytes_per_step"]
        mb = "-" if sent is None else f"{sent / 1e6:.2f}"
        chose = ", ".join(sorted(set(c["auto_choices"].values()))) if c.get("auto_choices") else ""
        speedup = "-" if c["speedup_vs_ssgd"] is None else f"{c['speedup_vs_ssgd']:.2f}x"
        label = "S-SGD (DDP all-reduce)" if name == "ddp" else name
        lines.append(f"   {label:<22}{c['median_s']:>8.3f}{speedup:>9}{mb:>9}  {chose}".rstrip())
    return "\n".join(lines)


def run(
    steps: int = 1000,
    nproc: int = 2,
    epochs: int = 100,
    gnn_nproc: int = 4,
    echo: Callable[[str], None] = print,
    *,
    lab: bool = True,
    lab_link: str = "1gbit",
    lab_workers: int = 4,
    lab_steps: int = 8,
    lab_model: str = "mlp_17m",
    plot: str | Path | None = None,
) -> dict[str, Any]:
    """Run every configuration of both workloads, then the lab part; ``echo`` each section and table as it completes.

    Args:
        steps: DDP training steps per hook (default 1000).
        nproc: DDP processes (default 2).
        epochs: GNN epochs per configuration (default 100).
        gnn_nproc: GNN processes, one graph partition each (default 4).
        echo: receives the report, a few lines at a time.
        lab: run the lab part (DDP on a shaped link; default True).
        lab_link, lab_workers, lab_steps, lab_model: its link (``10mbit``, ``100mbit``, ``1gbit``, ``10gbit``,
            ``none``), workers, measured steps per codec and workload (``mlp_17m``, ``lm``, ``small``).
        plot: where the lab part saves its plot of speedup over S-SGD (PNG; None: no plot).

    Returns:
        ``{"ddp": [...], "gnn": [...], "lab": record}``: rank 0's results of each run, in order,
        and the lab's full record (``lab``: None when not run).
    """
    if lab:  # bad lab options fail before the first run, not after ten minutes of it
        _check_lab(lab_link, lab_model, lab_workers, lab_steps)
    results: dict[str, Any] = {
        "ddp": _ddp_part(steps, nproc, echo),
        "gnn": _gnn_part(epochs, gnn_nproc, echo),
        "lab": None,
    }
    echo("\nMB: bytes rank 0 put on the wire (ring all-reduce/all-gather/all-to-all volumes).")
    if lab:
        results["lab"] = _lab_part(lab_link, lab_workers, lab_steps, lab_model, plot, echo)
    return results


def _check_lab(link: str, model: str, workers: int, steps: int) -> None:
    """The lab part's options, checked: a ValueError naming a bad one."""
    from sylvie_comm.bench.lab import check_link
    from sylvie_comm.bench.workloads import check_workload

    check_link(link)
    check_workload(model)
    for what, value in (("lab_workers", workers), ("lab_steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"demo: {what} must be a positive integer, got {value!r}")


def _ddp_part(steps: int, nproc: int, echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """Part 1: the DDP example under each hook (and under horovodrun where Horovod is installed); its table."""
    runs: list[dict[str, Any]] = []
    echo(f"1) data-parallel training: {nproc} processes (gloo), scikit-learn digits, {steps} steps, "
         "the same model and data under three gradient hooks")  # fmt: skip
    for codec, extra in DDP_RUNS:
        echo(f"   running {codec} ...")
        runs.append(torchrun(DDP_MODULE, nproc, ["--codec", codec, *extra, "--steps", str(steps)]))
    codec, extra = HOROVOD_RUN
    if shutil.which("horovodrun") is not None:
        echo(f"   running {codec} under horovodrun (Horovod's collectives, sylvie_comm.horovod's optimizer) ...")
        runs.append(horovodrun(DDP_MODULE, nproc, ["--codec", codec, *extra, "--steps", str(steps)]))
    else:
        echo("   (Horovod is not installed, so no horovodrun run: scripts/horovod.sh builds and installs it)")
    echo("\n" + ddp_table(runs))
    return runs


def _gnn_part(epochs: int, gnn_nproc: int, echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """Part 2: the full-graph GNN example under each halo setting, on one partition of the graph; its table."""
    runs: list[dict[str, Any]] = []
    echo(f"\n2) full-graph GNN: {gnn_nproc} processes, generated CSBM graph ({GNN_NODES} nodes), GraphSAGE, "
         f"{epochs} epochs; halo exchange fp32 synchronous vs 1-bit with staleness 1")  # fmt: skip
    echo(f"   partitioner: {GNN_PARTITION} (greedy BFS region growing and balanced refinement, plain torch, "
         "seed 0: the same parts on every machine)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sylvie-comm-parts-") as parts:
        for label, extra in GNN_RUNS:
            echo(f"   running {label} ...")
            cmd = [*extra, "--nodes", str(GNN_NODES), "--epochs", str(epochs), "--partition", GNN_PARTITION,
                   "--parts-dir", parts]  # fmt: skip
            runs.append({"label": label, **torchrun(GNN_MODULE, gnn_nproc, cmd)})
    echo("\n" + gnn_table(runs))
    return runs


def _lab_part(link: str, workers: int, steps: int, model: str, plot: str | Path | None,
              echo: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Part 3: DDP on a shaped link (sylvie_comm.bench.link), S-SGD against our codecs; its table and plot."""
    from sylvie_comm.bench import link as bench_link

    echo(f"\n3) the same kind of training where the network is the bottleneck: {workers} workers on a "
         f"{link} link, {model}, S-SGD vs {', '.join(LAB_CODECS[1:])}")  # fmt: skip
    rec = bench_link.run(link, workers=workers, steps=steps, codecs=LAB_CODECS, model=model,
                         horovod=False, echo=lambda line: echo("   " + line), progress=False)  # fmt: skip
    echo("\n" + lab_table(rec))
    echo(
        f"\n   step s: median of {steps} steps after warm-up, the slowest worker's; MB/step: bytes that "
        "left each worker's network interface per step (lab) or that the hook sent (loopback);"
    )
    echo(
        "   auto times the candidates on its first steps, then keeps the fastest per fusion group; one that needs "
        "the monitor (acpsgd, onebit) is first judged beside the fastest that needs none, which carries the "
        "gradients meanwhile (the choices at the end of the run in the last column)."
    )
    if plot is not None:
        path, said = bench_link.plot(rec, plot)
        rec["plot"] = None if path is None else str(path)
        echo(f"   {said}")
    return rec
