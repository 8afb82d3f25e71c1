"""The host time a DDP hook spends per bucket, ours next to PyTorch's, with nothing to compute.

On a GPU a bucket's backward can take well under a millisecond, and what the host spends in the hook
(Python, kernel launches, bookkeeping) is then what is left of it. Measured on the CPU with tiny tensors,
where the arithmetic is nothing: one process (gloo, world size 1), a model of ``layers`` linear layers of
``width`` x ``width`` (16 by default), SGD momentum 0.9, in two layouts: one bucket per parameter (``many``),
and the whole model in one bucket (``one``). Each hook call is timed from the call to its return (not the
collective's completion); the median over ``steps`` steps after warm-up is reported per hook and layout, next to
PyTorch's
``fp16_compress_hook`` and ``powerSGD_hook`` in the same run. PyTorch's ``powerSGD_hook`` runs in the
one-bucket layout only: with two or more buckets on gloo it launches its second all-reduce from a
callback and deadlocks.

The record also holds, from the same run, an FSDP2 unit's reduce-scatter next to FSDP2's own
(:mod:`sylvie_comm.bench.hooks_fsdp`) and a GNN halo layer next to the same layer without an exchange, with an
epoch of our layers next to PyG's (:mod:`sylvie_comm.bench.hooks_halo`); ``--only ddp`` (or ``fsdp``, ``halo``)
runs one part. On ``--device cuda`` it also holds a whole training step of ResNet-50 and a GPT-2-sized decoder per
hook (:mod:`sylvie_comm.bench.step`, the ``step`` part, run in a process of its own); ``--only step`` runs that part
on the CPU too, with tiny models and its one-process part only.

Run ``python -m sylvie_comm.bench.hooks`` (``--layers``, ``--width``, ``--steps``; ``--out FILE.json`` writes the
record and ``FILE.md``, its tables with the ratios to the baselines of the same run). CI runs it after the tests
and prints the tables: a report of ratios, not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sylvie_comm.algorithms import ALGORITHMS
from sylvie_comm.bench import hooks_fsdp, hooks_halo
from sylvie_comm.bench.kit import bench_device, machine, print_and_write
from sylvie_comm.bench.timing import sync

# Every algorithm with an encoding of its own (``auto`` runs one of these per bucket).
OURS = tuple(name for name, cls in ALGORITHMS.items() if not cls.record.delegates)
PARTS = ("ddp", "fsdp", "halo", "step")
CPU_PARTS = ("ddp", "fsdp", "halo")  # the parts run on the CPU unless --only names them: ``step`` on CUDA only


def _model(layers: int, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _timed(hook: Callable[[Any, Any], Any], record: list[float]) -> Callable[[Any, Any], Any]:
    def wrapped(state: Any, bucket: Any) -> Any:
        t0 = time.perf_counter()
        fut = hook(state, bucket)
        record.append(time.perf_counter() - t0)
        return fut

    wrapped.__annotations__ = dict(getattr(hook, "__annotations__", {}))
    return wrapped


BASELINES = ("torch-fp16", "torch-powersgd")  # PyTorch's hooks, the rows every other row is compared with
TORCH_POWERSGD_RANK = 4


def make_hook(name: str, model: nn.Module) -> tuple[Any, Callable[[Any, Any], Any], Any]:
    """``(state, hook, ours)`` of a row: PyTorch's ``fp16_compress_hook`` (``torch-fp16``) or ``powerSGD_hook`` at
    rank :data:`TORCH_POWERSGD_RANK` from its third step (``torch-powersgd``), or ours (an algorithm of
    :data:`OURS`) for ``model`` (DDP's, or the module it wraps); ``ours`` is our hook's state (to close), else None.
    A collective: the default process group must be up."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from sylvie_comm.integrations import ddp as sc_ddp

    if name == "torch-fp16":
        return None, default_hooks.fp16_compress_hook, None
    if name == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=TORCH_POWERSGD_RANK, start_powerSGD_iter=2
        )
        return state, powerSGD_hook.powerSGD_hook, None
    if name not in OURS:
        raise ValueError(f"bench hooks: unknown hook {name!r}; expected one of {', '.join((*BASELINES, *OURS))}")
    ours, hook = sc_ddp.make_hook(name, model=model)
    return ours, hook, ours


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """The default process group of this process alone (NCCL for a CUDA device, else gloo; world size 1, on a free
    loopback port), destroyed on exit; where one is up already, that one, left as it is."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as sock:  # a free port on loopback
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(name: str, layers: int, steps: int, bucket_mb: float, device: torch.device,
         width: int = 16) -> dict[str, float]:  # fmt: skip
    model = _model(layers, width).to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_mb)
    record: list[float] = []
    state, hook, ours = make_hook(name, ddp)
    ddp.register_comm_hook(state, _timed(hook, record))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per_bucket: list[float] = []
    per_step: list[float] = []
    buckets = 0
    gen = torch.Generator().manual_seed(0)
    for step in range(steps + 4):
        x = torch.randn(8, width, generator=gen).to(device)
        record.clear()
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        sync(device)
        if step >= 4:  # after the warm-up (2 steps) and DDP's bucket rebuild
            per_step.append(time.perf_counter() - t0)
            per_bucket.extend(record)
            buckets = len(record)
    if ours is not None:
        ours.close()
    return {
        "us_per_bucket": statistics.median(per_bucket) * 1e6, "buckets": buckets,
        "us_per_step": statistics.median(per_step) * 1e6,
    }  # fmt: skip


def measure(
    layers: int = 32,
    steps: int = 20,
    parts: tuple[str, ...] | None = None,
    device: str | torch.device = "cpu",
    width: int = 16,
) -> dict[str, Any]:
    """Every hook, one after the other in one process (a group of one rank), then the FSDP2 and halo parts, and on
    CUDA the whole-step part (``parts`` None: those; on the CPU, :data:`CPU_PARTS`).

    On ``device="cuda"`` the DDP and FSDP2 parts run on the GPU over NCCL (the halo part stays on the CPU)."""
    dev = bench_device("bench hooks", device)
    out: dict[str, Any] = {
        "benchmark": "hooks", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
        "layers": layers, "width": width, "steps": steps, "threads": torch.get_num_threads(), "layouts": {},
        "device": str(dev),
    }  # fmt: skip
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
    if parts is None:
        parts = PARTS if dev.type == "cuda" else CPU_PARTS
    if "ddp" in parts:
        out["layouts"] = _ddp(layers, steps, dev, width)
    if "fsdp" in parts:
        out["fsdp"] = hooks_fsdp.measure((8, 32), steps, device=dev)
    if "halo" in parts:
        out["halo"] = hooks_halo.halo_rows(max(1, steps // 2))
    if "step" in parts:
        out["step"], out["step_md"] = step_part(dev, steps)
    return out


def step_part(device: torch.device, steps: int) -> tuple[dict[str, Any], str]:
    """The whole-step bench's record and tables (``python -m sylvie_comm.bench.step``, in a process of its own: it
    imports this module's hooks, and starts the ranks of its 2-process part): full-sized models on CUDA, tiny ones
    on the CPU, where it runs its one-process part only. A run that writes no record is an error of the part."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "step.json"
        command = [sys.executable, "-m", "sylvie_comm.bench.step", "--device", str(device), "--steps", str(steps),
                   "--out", str(out), *(() if device.type == "cuda" else ("--procs", "0"))]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True)
        if not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            return {"errors": {"step": f"exit status {proc.returncode}: {' / '.join(tail)}"}}, ""
        return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def _ddp(layers: int, steps: int, device: torch.device, width: int = 16) -> dict[str, Any]:
    # PyTorch's PowerSGD hook with two or more buckets deadlocks on gloo only (module docstring).
    many = (*BASELINES, *OURS) if device.type == "cuda" else ("torch-fp16", *OURS)
    layouts = {"many": (1e-4, many), "one": (100.0, (*BASELINES, *OURS))}
    out: dict[str, Any] = {}
    with one_rank_group(device):
        for layout, (bucket_mb, names) in layouts.items():
            rows = {name: _run(name, layers, steps, bucket_mb, device, width) for name in names}
            for r in rows.values():
                r["x_torch_fp16"] = r["us_per_bucket"] / rows["torch-fp16"]["us_per_bucket"]
                if "torch-powersgd" in rows:
                    r["x_torch_powersgd"] = r["us_per_bucket"] / rows["torch-powersgd"]["us_per_bucket"]
            out[layout] = rows
    return out


def ddp_table(result: dict[str, Any]) -> list[str]:
    """The DDP part as markdown lines: µs per bucket and the ratios to PyTorch's hooks of the same run."""
    many, one = result["layouts"]["many"], result["layouts"]["one"]
    device, w = result.get("device", "cpu"), result.get("width", 16)  # (a record of before the width was set: 16)
    where = (f"on {result.get('gpu', device)} (NCCL, world size 1)" if device.startswith("cuda")
             else "(gloo, world size 1)")  # fmt: skip
    lines = [
        f"Host time per bucket, {result['layers']} x Linear({w}, {w}), median of {result['steps']} steps, one process "
        f"{where}, {result['threads']} thread(s), torch {result['machine']['torch']}, {result['date']}.",
        "",
        "| hook | µs, a bucket per parameter | x torch fp16 | µs, one bucket | x torch fp16 | x torch PowerSGD |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in one.items():
        m = many.get(name)
        left = f"{m['us_per_bucket']:.0f} | {m['x_torch_fp16']:.2f}" if m else "(deadlocks on gloo) | "
        lines.append(f"| {name} | {left} | {r['us_per_bucket']:.0f} | {r['x_torch_fp16']:.2f} | "
                     f"{r['x_torch_powersgd']:.2f} |")  # fmt: skip
    if all("us_per_step" in r for r in (*one.values(), *many.values())):
        lines += [
            "",
            "A whole step (forward, backward with its hooks, SGD), wall time to the device's completion:",
            "",
            "| hook | µs a step, a bucket per parameter | x torch fp16 | µs a step, one bucket | x torch fp16 |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, r in one.items():
            m = many.get(name)
            left = (f"{m['us_per_step']:.0f} | {m['us_per_step'] / many['torch-fp16']['us_per_step']:.2f}"
                    if m else " | ")  # fmt: skip
            lines.append(f"| {name} | {left} | {r['us_per_step']:.0f} | "
                         f"{r['us_per_step'] / one['torch-fp16']['us_per_step']:.2f} |")  # fmt: skip
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The record as tables: each part with the ratios to its baseline of the same run."""
    lines: list[str] = []
    if result["layouts"]:
        lines += ddp_table(result)
    if "fsdp" in result:
        lines += ["", "```", hooks_fsdp.table(result["fsdp"]).rstrip("\n"), "```"]
    if "halo" in result:
        lines += ["", "```", hooks_halo.table(result["halo"]), "```"]
    if "step" in result:
        lines += ["", result["step_md"].rstrip("\n")]
        lines += [f"- {name}: {e}" for name, e in result["step"].get("errors", {}).items() if name == "step"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.bench.hooks", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=16, help="each layer is Linear(width, width)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", choices=PARTS, action="append",
                        help="run this part only (repeatable; step runs by default on cuda only)")  # fmt: skip
    parser.add_argument("--device", default="cpu",
                        help="cpu (gloo), or cuda: the DDP, FSDP2 and step parts on a GPU (NCCL)")  # fmt: skip
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.layers, args.steps, tuple(args.only) if args.only else None, args.device, args.width)
    return print_and_write(result, markdown(result), args.out, markdown)


if __name__ == "__main__":
    sys.exit(main())
