"""A DDP bucket through every hook, on the device: the whole hook's time, ours next to PyTorch's on the same bucket.

One process (world size 1: NCCL on a GPU, gloo on the CPU), one bucket holding every parameter of
:func:`bucket_model` (25 MiB, DDP's default ``bucket_cap_mb``: four 1,280 x 1,280 weights and their biases), handed
to each hook as DDP hands it (a stand-in for DDP's ``GradBucket`` with the parts the hooks read), refilled with the
same gradient before each call: the median wall time from the call to the decoded bucket on the device (encode, the
collective, decode; the device synchronized before and after), each next to PyTorch's ``fp16_compress_hook`` and
``powerSGD_hook`` (:mod:`sylvie_comm.bench.hooks`' rows). Part of :mod:`sylvie_comm.bench.cuda`'s record.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch import nn

from sylvie_comm.bench import hooks
from sylvie_comm.bench.timing import sync


class _Bucket:
    """What a DDP communication hook reads of DDP's ``GradBucket`` (ours and PyTorch's): one bucket holding every
    parameter of a model, the last of its step."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor) -> None:
        self._params, self._buffer = params, buffer
        self._grads, at = [], 0
        for p in params:
            self._grads.append(buffer[at : at + p.numel()].view_as(p))
            at += p.numel()

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def is_last(self) -> bool:
        return True


class _Rebuilt:
    """DDP's flag as our hook reads it: the buckets are final (after DDP's first iteration), so a bucket's plan is
    reused without reading its parameters again, as under DDP."""

    _has_rebuilt_buckets = True


BUCKET_LAYERS = 4


def bucket_model(bucket_mb: float) -> nn.Module:
    """:data:`BUCKET_LAYERS` square linear layers whose weights fill ``bucket_mb`` MiB of fp32 (with their biases,
    a little more): 1,280 x 1,280 at DDP's default 25."""
    width = max(2, math.isqrt(int(bucket_mb * (1 << 20)) // (4 * BUCKET_LAYERS)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(BUCKET_LAYERS)])


HOOK_WARMUP = 4  # calls before timing: the hooks' uncompressed steps (2), the first compressed ones (compiling)


def measure(
    device: torch.device, bucket_mb: float = 25.0, repeats: int = 10, deadline: float | None = None
) -> dict[str, Any]:
    """A bucket of ``bucket_mb`` MiB through every hook of :mod:`sylvie_comm.bench.hooks` (PyTorch's two and ours),
    one process (NCCL on a GPU, gloo on the CPU): the median wall time from the call to the decoded bucket on the
    device, after :data:`HOOK_WARMUP` calls, each next to PyTorch's two; the bucket refilled with the same gradient
    before each call. A hook that raises is recorded under ``errors`` and the others still run; none starts after
    ``deadline`` (``time.monotonic()``): those are listed under ``not_reached``."""
    model = bucket_model(bucket_mb).to(device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(numel, generator=gen, device=device).mul_(0.01)
    rebuilt = _Rebuilt()  # held here: our hooks keep only a weak reference to it, as to DDP's model
    rows: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    late: list[str] = []
    with hooks.one_rank_group(device):
        for name in (*hooks.BASELINES, *hooks.OURS):
            if deadline is not None and time.monotonic() > deadline:
                late.append(name)
                continue
            buf = torch.empty_like(grad)
            bucket = _Bucket(params, buf)
            times = []
            ours = None
            try:
                state, hook, ours = hooks.make_hook(name, model)
                if ours is not None:
                    ours.watch(rebuilt)
                for i in range(HOOK_WARMUP + repeats):
                    buf.copy_(grad)
                    sync(device)
                    t0 = time.perf_counter()
                    hook(state, bucket).wait()
                    sync(device)
                    if i >= HOOK_WARMUP:
                        times.append(time.perf_counter() - t0)
            except Exception as exc:  # one hook's failure leaves the others to run
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                if ours is not None:
                    ours.close()
            rows[name] = {"ms": statistics.median(times) * 1e3}
    for r in rows.values():
        for base in hooks.BASELINES:
            if base in rows:
                r["x_" + base.replace("-", "_")] = r["ms"] / rows[base]["ms"]
    out = {
        "bucket_bytes": 4 * numel, "bucket_mb": bucket_mb, "parameters": [list(p.shape) for p in params],
        "backend": "nccl" if device.type == "cuda" else "gloo", "world_size": 1, "warmup": HOOK_WARMUP,
        "repeats": repeats, "torch_powersgd_rank": hooks.TORCH_POWERSGD_RANK, "rows": rows,
    }  # fmt: skip
    if errors:
        out["errors"] = errors
    if late:
        out["not_reached"] = late
    return out


def table(result: dict[str, Any]) -> list[str]:
    """The part as markdown lines: ms per bucket and the ratios to PyTorch's hooks of the same run."""
    lines = [
        f"A DDP bucket of {result['bucket_bytes']:,} bytes ({len(result['parameters'])} tensors) through each hook, "
        f"{result['backend']} world size 1: wall time from the call to the decoded bucket on the device, median of "
        f"{result['repeats']} after {result['warmup']} calls.",
        "",
        "| hook | ms | x torch fp16 | x torch PowerSGD |",
        "|---|---:|---:|---:|",
    ]
    for name, h in result["rows"].items():
        ratios = " | ".join(f"{h[k]:.2f}" if k in h else "" for k in ("x_torch_fp16", "x_torch_powersgd"))
        lines.append(f"| {name} | {h['ms']:.3f} | {ratios} |")
    return lines
