"""The GPU check of the GNN trainer: training on a CUDA GPU against training on the CPU, from one seed.

``python -m sylvie_comm.gnn.gpu_check --gpu-check OUTDIR`` trains the same partitions on both devices and
compares the losses, a resumed run, the halo exchange's rows and the peak memory at fp32 and 1-bit; it writes
``OUTDIR/gnn-gpu-check.json``. It sits above the trainer (:mod:`sylvie_comm.gnn.train`), which knows nothing of it.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

from sylvie_comm.collectives import Transport
from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn import data as gdata
from sylvie_comm.gnn.halo_exchanger import HaloExchanger
from sylvie_comm.gnn.halo_pipeline import HaloPipeline
from sylvie_comm.gnn.partition import Partition, partition
from sylvie_comm.gnn.train import TrainConfig, Trainer

GPU_CHECK_FILE = "gnn-gpu-check.json"
# Largest |loss_cuda - loss_cpu| of fp32 training: float rounding (CUDA's atomic index_add sums in any order),
# grown by a few Adam steps.
TOLERANCE = 1e-3
# Largest |straight - resumed| on CUDA: the same kernels, so only the order of atomic sums differs. Dropout masks
# drawn from a generator that was not restored move the 20,000-node check's losses by about 3e-3.
RESUME_TOLERANCE = 1e-4


class GPUUnavailableError(RuntimeError):
    """The GPU check needs a CUDA device and this process has none."""


def _train_run(part: Partition, config: TrainConfig, device: str, epochs: int) -> dict[str, Any]:
    tr = Trainer(part, config, device=device)
    try:
        history = [tr.train_epoch() for _ in range(epochs)]
    finally:
        tr.close()
    peaks = [h["peak_memory_mb"] for h in history if h["peak_memory_mb"] is not None]
    return {"losses": [h["loss"] for h in history], "peak_mb": max(peaks, default=None)}


def _resumed_run(part: Partition, config: TrainConfig, device: str, epochs: int) -> list[float]:
    """``epochs`` epochs with a checkpoint (through ``torch.save``/``torch.load``) and a fresh trainer half-way."""
    tr = Trainer(part, config, device=device)
    try:
        losses = [tr.train_epoch()["loss"] for _ in range(epochs // 2)]
        buf = io.BytesIO()
        torch.save(tr.state_dict(), buf)
    finally:
        tr.close()
    buf.seek(0)
    tr = Trainer(part, config, device=device)
    try:
        tr.load_state_dict(torch.load(buf, weights_only=True))
        losses += [tr.train_epoch()["loss"] for _ in range(epochs - epochs // 2)]
    finally:
        tr.close()
    return losses


def _halo_run(parts: list[Partition], precision: str, device: str, epochs: int, width: int,
              seed: int) -> dict[str, Any]:  # fmt: skip
    """Two in-process ranks exchange rows of ``width`` features through the pipeline (staleness 1), forward
    and backward for two layers per epoch, from the same random rows on every device."""

    def body(transport: Transport) -> list[torch.Tensor]:
        part = parts[transport.rank]
        pipeline = HaloPipeline(HaloExchanger(part, transport, precision, precision, seed=seed, device=device), 1)
        gen = torch.Generator().manual_seed(seed * 1009 + transport.rank)
        out: list[torch.Tensor] = []
        try:
            for epoch in range(epochs):
                pipeline.begin_epoch(epoch)
                for layer in (1, 2):
                    inner = torch.randn(part.n_inner, width, generator=gen).to(pipeline.device)
                    out.append(pipeline.features(layer, inner).cpu())  # read here for the comparison only
                for layer in (2, 1):
                    grad = torch.randn(part.n_halo, width, generator=gen).to(pipeline.device)
                    returned = pipeline.gradients(layer, grad)
                    if returned is not None:
                        out.append(returned.cpu())
        finally:
            pipeline.close()
        return out

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rows = run_local(2, body, timeout=600.0)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    return {"rows": [t for rank in rows for t in rank], "peak_mb": peak}


def _max_abs_diff(a: list[Any], b: list[Any]) -> float:
    """The largest absolute difference between two runs' losses (floats) or rows (tensors, of equal shapes)."""
    if len(a) != len(b):
        raise RuntimeError(f"gnn gpu check: the runs produced {len(a)} and {len(b)} results; expected as many")
    diffs = [
        (float((x - y).abs().max()) if x.numel() else 0.0) if isinstance(x, torch.Tensor) else abs(x - y)
        for x, y in zip(a, b, strict=True)
    ]
    return max(diffs, default=0.0)


def gpu_check(out_dir: str | Path, epochs: int = 5, nodes: int = 20_000, seed: int = 0) -> dict[str, Any]:
    """Train the GNN on ``cuda:0`` and on the CPU from the same graph and seed, and compare (needs a CUDA GPU).

    Every part runs on ``cuda:0`` and on the CPU, on one CSBM graph (:func:`sylvie_comm.gnn.data.csbm`,
    ``nodes`` nodes, 64 features), one partition and one seed:

    - ``train``: one process trains SAGE, GCN and GAT (3 layers of 64, the ``torch`` backend) for ``epochs``
      epochs: the losses side by side, their largest absolute difference, and the largest per-epoch peak of
      GPU memory (``peak_memory_mb`` of :meth:`Trainer.train_epoch`).
    - ``resume``: SAGE with dropout 0.5, checkpointed half-way and resumed in a fresh trainer (the device's
      random generator travels in the checkpoint) against the same run straight through, on ``cuda:0``.
    - ``halo``: two in-process ranks exchange rows of 128 features through :class:`HaloPipeline`
      (staleness 1, two layers, forward and backward) in ``fp32`` and in ``q1``: the rows' largest
      difference from the CPU's, and the GPU's peak memory over the exchanges (both ranks' tensors), fp32
      against q1. In-process ranks do not *train* on one GPU: their CUDA backward passes share the device's
      one autograd thread, so a halo exchange in one rank's backward would wait for the other's forever
      (the Trainer refuses it).

    ``report["ok"]``: fp32 training losses within ``TOLERANCE`` of the CPU's, the resumed run within
    ``RESUME_TOLERANCE`` of the straight one, fp32 halo rows equal to the CPU's, and q1 halos peaking below
    fp32 ones. The report is returned and written to ``out_dir/gnn-gpu-check.json``.

    Raises:
        GPUUnavailableError: at once (before any work), when ``torch.cuda.is_available()`` is False.
        ValueError: ``epochs`` below 2 or ``nodes`` below 100.
    """
    if not torch.cuda.is_available():
        raise GPUUnavailableError(
            f"gnn gpu check: no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); run it on a machine with a GPU and a CUDA build of torch"
        )
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 2:
        raise ValueError(f"gnn gpu check: epochs must be an integer >= 2 (it resumes half-way), got {epochs!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 100:
        raise ValueError(f"gnn gpu check: nodes must be an integer >= 100, got {nodes!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = "cuda:0"
    g = gdata.csbm(num_nodes=nodes, feat_dim=64, seed=seed)
    (whole,) = partition((g.src, g.dst), 1, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=seed)
    halves = partition((g.src, g.dst), 2, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=seed)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "nodes": nodes, "epochs": epochs, "seed": seed,
                              "tolerance": TOLERANCE, "resume_tolerance": RESUME_TOLERANCE, "train": {},
                              "halo": {}}  # fmt: skip
    ok = True
    for model in ("sage", "gcn", "gat"):
        config = TrainConfig(model=model, hidden=64, layers=3, backend="torch", seed=seed)
        on_gpu, on_cpu = _train_run(whole, config, cuda, epochs), _train_run(whole, config, "cpu", epochs)
        diff = _max_abs_diff(on_gpu["losses"], on_cpu["losses"])
        ok = ok and diff <= TOLERANCE
        report["train"][model] = {"cuda_losses": on_gpu["losses"], "cpu_losses": on_cpu["losses"],
                                  "max_abs_diff": diff, "peak_gpu_mb": on_gpu["peak_mb"]}  # fmt: skip
    config = TrainConfig(model="sage", hidden=64, layers=3, dropout=0.5, backend="torch", seed=seed)
    straight = _train_run(whole, config, cuda, epochs)["losses"]
    resumed = _resumed_run(whole, config, cuda, epochs)
    diff = _max_abs_diff(straight, resumed)
    ok = ok and diff <= RESUME_TOLERANCE
    report["resume"] = {"straight_losses": straight, "resumed_losses": resumed, "max_abs_diff": diff}
    for precision in ("fp32", "q1"):
        on_gpu, on_cpu = (_halo_run(halves, precision, d, epochs, 128, seed) for d in (cuda, "cpu"))
        diff = _max_abs_diff(on_gpu["rows"], on_cpu["rows"])
        ok = ok and (diff == 0.0 if precision == "fp32" else diff == diff)  # q1: reported; NaN fails
        report["halo"][precision] = {"max_abs_diff": diff, "peak_gpu_mb": on_gpu["peak_mb"],
                                     "exchanges": len(on_gpu["rows"])}  # fmt: skip
    ok = ok and report["halo"]["q1"]["peak_gpu_mb"] < report["halo"]["fp32"]["peak_gpu_mb"]
    report["ok"] = ok
    (out / GPU_CHECK_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


def format_gpu_check(report: dict[str, Any]) -> str:
    """The GPU check's report as a few lines of text."""

    def mb(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} MB"

    lines = [f"gnn gpu check on {report['device']} (torch {report['torch']}, CUDA {report['cuda']}): "
             f"{'ok' if report['ok'] else 'FAILED'}"]  # fmt: skip
    for model, r in report["train"].items():
        lines.append(f"  train {model}: max |loss cuda - cpu| {r['max_abs_diff']:.3g} over {report['epochs']} "
                     f"epochs (tolerance {report['tolerance']:g}); peak GPU {mb(r['peak_gpu_mb'])}")  # fmt: skip
    lines.append(
        f"  resume (dropout 0.5, cuda): max |straight - resumed| {report['resume']['max_abs_diff']:.3g} "
        f"(tolerance {report['resume_tolerance']:g})"
    )
    for precision, r in report["halo"].items():
        lines.append(f"  halo {precision} (2 in-process ranks): max |rows cuda - cpu| {r['max_abs_diff']:.3g}; "
                     f"peak GPU {mb(r['peak_gpu_mb'])}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m sylvie_comm.gnn.gpu_check --gpu-check OUTDIR``: 0 when the check passes, 1 when it fails,
    2 without a CUDA device."""
    parser = argparse.ArgumentParser(
        prog="python -m sylvie_comm.gnn.gpu_check", description="Compare GNN training on a CUDA GPU with the CPU's."
    )
    parser.add_argument("--gpu-check", metavar="OUTDIR", required=True,
                        help=f"run the check and write OUTDIR/{GPU_CHECK_FILE}")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=5, help="epochs per run (default 5)")
    parser.add_argument("--nodes", type=int, default=20_000, help="nodes of the CSBM graph (default 20000)")
    args = parser.parse_args(argv)
    try:
        report = gpu_check(args.gpu_check, args.epochs, args.nodes)
    except GPUUnavailableError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(format_gpu_check(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
