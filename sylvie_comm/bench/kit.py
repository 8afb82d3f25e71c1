"""What the training benchmarks share: measuring steps, merging ranks and rounds, describing the machine, plotting.

The DDP link benchmark (:mod:`sylvie_comm.bench.link`), its Horovod rows (:mod:`sylvie_comm.bench.horovod`) and the
FSDP2 benchmark (:mod:`sylvie_comm.bench.fsdp`) train the same workloads the same way: :func:`measure_steps` times
each step on each rank, :func:`merge_rounds` turns every rank's figures of every round into one row (a step takes
as long as its slowest rank), and the step, warm-up and optimizer settings below are theirs, so their rows
compare. Kept apart from each benchmark, so that none imports another for them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sylvie_comm.bench.timing import cpu_model

HOOK_WARMUP = 2  # the hooks' uncompressed steps (PyTorch's start_powerSGD_iter, our warmup_steps)
WARMUP = 3  # steps not measured: the hooks' warm-up and one compressed step
LR = 0.01
MOMENTUM = 0.9
NO_MATPLOTLIB = "matplotlib is not installed: no plot (pip install matplotlib to get one)"


# ---------------------------------------------------------------------- measuring


def eth0_tx_bytes() -> int | None:
    """Bytes sent so far on this network namespace's eth0 (/proc/net/dev is per namespace); None without one."""
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, data = line.partition(":")
        if name.strip() == "eth0":
            return int(data.split()[8])
    return None


class StepFigures:
    """The measured steps' seconds and, where ``stats`` is given, what our algorithm reported for each in its
    ``stats()["last_step"]``: encode + decode seconds and bytes sent (PyTorch's and Horovod's own report none)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.encode_decode: list[float] = []
        self.sent: list[int] = []

    def add(self, seconds: float, stats: Any) -> None:
        self.seconds.append(seconds)
        if stats is not None:
            last = stats.stats()["last_step"]
            self.encode_decode.append(last["encode_seconds"] + last["decode_seconds"])
            self.sent.append(int(last["bytes_sent"]))

    def medians(self) -> dict[str, Any]:
        """``backward_s``, ``encode_decode_s`` and ``bytes_sent``: medians over the steps (None: none reported)."""
        return {
            "backward_s": statistics.median(self.seconds),
            "encode_decode_s": statistics.median(self.encode_decode) if self.encode_decode else None,
            "bytes_sent": statistics.median(self.sent) if self.sent else None,
        }


def measure_steps(model: Any, opt: Any, work: Any, gen: torch.Generator, warmup: int, steps: int,
                  barrier: Callable[[], Any], stats: Any, progress: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    """``warmup + steps`` training steps, each after ``barrier()``; the figures of the last ``steps``.

    A step is ``zero_grad``, forward, backward and ``opt.step()`` (which, for DDP and Horovod alike,
    includes the wait for the averaged gradients). ``stats``: an object whose ``stats()["last_step"]``
    reports our encode/decode seconds and bytes (None for PyTorch's and Horovod's own).
    """
    figures = StepFigures()
    losses: list[float] = []
    tx0 = None
    for step in range(warmup + steps):
        x, y = work.batch(gen)
        barrier()
        if step == warmup:
            tx0 = eth0_tx_bytes()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = work.loss(model(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if step >= warmup:
            figures.add(dt, stats)
        progress()
    barrier()
    tx1 = eth0_tx_bytes()
    return {
        "step_s": figures.seconds,
        "encode_decode_s": figures.medians()["encode_decode_s"],
        "hook_bytes": statistics.fmean(figures.sent) if figures.sent else None,  # mean, as eth0's: total / steps
        "eth0_tx_bytes": None if tx0 is None or tx1 is None else (tx1 - tx0) / steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


# ---------------------------------------------------------------------- merging


def merge_rounds(rounds: list[list[dict[str, Any]]], world: int, batch: int, label: str) -> dict[str, Any]:
    """One row's figures from every round's :func:`measure_steps` of every rank: a step takes as long as its
    slowest rank."""
    per_round = [[max(col) for col in zip(*(p["step_s"] for p in per_rank), strict=True)] for per_rank in rounds]
    steps = [t for r in per_round for t in r]
    per_rank = [p for r in rounds for p in r]
    q1, _, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else (steps[0], steps[0], steps[0])
    med = statistics.median(steps)

    def mean(key: str) -> float | None:
        vals = [p[key] for p in per_rank if p[key] is not None]
        return sum(vals) / len(vals) if vals else None

    auto = [p["auto"]["choices"] for p in per_rank if "auto" in p]
    return {
        **({"auto_choices": auto[0]} if auto else {}),  # every rank agrees (tested); rank 0's first round
        "label": label,
        "step_s": steps,
        "round_median_s": [statistics.median(r) for r in per_round],
        "median_s": med,
        "min_s": min(steps),
        "max_s": max(steps),
        "q1_s": q1,
        "q3_s": q3,
        "samples_per_s": world * batch / med,
        "hook_bytes_per_step": mean("hook_bytes"),
        "eth0_tx_bytes_per_step": mean("eth0_tx_bytes"),
        "encode_decode_s": mean("encode_decode_s"),
        "loss_first": per_rank[0]["loss_first"],
        "loss_last": per_rank[0]["loss_last"],
    }


def machine() -> dict[str, Any]:
    """The machine a record was measured on: CPUs, platform, Python, torch and sylvie_comm."""
    import sylvie_comm

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sylvie_comm": sylvie_comm.__version__,
    }


def fmt_mb(value: float | None) -> str:
    """Bytes as megabytes with two decimals for a table; ``-`` for none."""
    return "-" if value is None else f"{value / 1e6:.2f}"


def fmt_x(value: float | None) -> str:
    """A ratio as ``1.23x`` for a table; ``-`` for none."""
    return "-" if value is None else f"{value:.2f}x"


# ---------------------------------------------------------------------- plotting


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None where matplotlib is not installed."""
    import importlib

    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        return None
    mpl.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(plt: Any, fig: Any, out: str | Path) -> tuple[Path, str]:
    """Lay ``fig`` out tight, write it to ``out`` (a PNG, its folder made) and close it; the path and a line saying
    so."""
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, f"wrote {path}"


__all__ = [
    "HOOK_WARMUP",
    "LR",
    "MOMENTUM",
    "NO_MATPLOTLIB",
    "WARMUP",
    "StepFigures",
    "check_ints",
    "check_timeout",
    "eth0_tx_bytes",
    "fmt_mb",
    "fmt_x",
    "machine",
    "measure_steps",
    "merge_rounds",
    "pyplot",
    "save_figure",
]


def bench_device(what: str, device: str | torch.device) -> torch.device:
    """``device`` as a benchmark runs on it: the CPU, or a CUDA GPU with its index; a ValueError naming ``what``
    (``"bench hooks"``) and the value where it is neither, or CUDA where this torch sees no GPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what}: device must be 'cpu' or 'cuda', got {str(device)!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: device must be 'cpu' or 'cuda', got {str(device)!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}: device {str(device)!r} asked for, but this torch sees no CUDA GPU")
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    return dev


def print_and_write(result: dict[str, Any], text: str, out: str | Path | None,
                    markdown: Callable[[dict[str, Any]], str]) -> int:  # fmt: skip
    """A benchmark's end: print its report ``text`` and, given ``out``, write its record (:func:`write_record`);
    exit status 0."""
    print(text, end="")
    if out:
        write_record(out, result, markdown)
    return 0


def write_record(out: str | Path, result: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> None:
    """``result`` as JSON at ``out`` and its tables (``markdown(result)``) beside it, as ``.md``."""
    path = Path(out)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))


# ---------------------------------------------------------------------- arguments


def check_ints(command: str, *checks: tuple[str, Any, int]) -> None:
    """Each ``(what, value, low)``: ``value`` an integer (not a bool) >= ``low``; a ValueError
    ``"COMMAND: WHAT must be an integer >= LOW, got VALUE"`` for the first that is not."""
    for what, value, low in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{command}: {what} must be an integer >= {low}, got {value!r}")


def check_timeout(command: str, timeout: Any) -> None:
    """``timeout`` positive seconds; a ValueError naming it otherwise."""
    if not timeout > 0:
        raise ValueError(f"{command}: timeout must be positive seconds, got {timeout!r}")
