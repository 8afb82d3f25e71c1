"""Kernel throughput and memory, side by side with the references and memory ceilings.

For fp32 tensors of each size and each thread count, one run measures:

* ceilings: a read-only pass (``x.sum()``), a copy into a preallocated buffer
  (``y.copy_(x)``) and ``numpy.packbits(x >= 0)``;
* one-bit encode/decode and q-bit (1, 2, 4, 8 bits) encode/decode, compiled
  kernel and pure-torch reference.

Throughput is GB/s of fp32 input (or decoded output) processed. Decoding with
the kernel writes into a preallocated tensor, as the integrations do; the
reference allocates. References are measured on a prefix of at most
``ref_elems`` elements (their throughput does not depend on size, and at full
size they take minutes). Peak extra memory is what one call allocates, in bytes
and as a multiple of the input's size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sylvie_comm import _ops, kernels
from sylvie_comm.bench.timing import cpu_model, peak_numpy_bytes, peak_torch_bytes, seconds_per_call, threads
from sylvie_comm.kernels import reference as ref

DEFAULT_SIZES = (1 << 20, 16 << 20, 64 << 20)
CHUNK = 2048


@dataclass
class Case:
    """One op: a builder of the kernel call and of the reference call for an input tensor."""

    name: str
    kernel: Callable[[torch.Tensor], Callable[[], Any]]
    reference: Callable[[torch.Tensor], Callable[[], Any]]


def _onebit_cases() -> list[Case]:
    def enc_k(x: torch.Tensor) -> Callable[[], Any]:
        return lambda: kernels.onebit_encode(x, CHUNK, False)

    def enc_r(x: torch.Tensor) -> Callable[[], Any]:
        return lambda: ref.onebit_encode(x, CHUNK, False)

    def dec_k(x: torch.Tensor) -> Callable[[], Any]:
        packed, scales = kernels.onebit_encode(x, CHUNK, False)
        out = torch.empty_like(x)
        return lambda: kernels.onebit_decode(packed, scales, x.numel(), CHUNK, x.dtype, out=out)

    def dec_r(x: torch.Tensor) -> Callable[[], Any]:
        packed, scales = ref.onebit_encode(x, CHUNK, False)
        return lambda: ref.onebit_decode(packed, scales, x.numel(), CHUNK, x.dtype)

    return [Case("onebit encode", enc_k, enc_r), Case("onebit decode", dec_k, dec_r)]


def _qbit_cases(bits: int, row: int) -> list[Case]:
    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, row) if x.numel() % row == 0 else x.view(1, -1)

    def enc_k(x: torch.Tensor) -> Callable[[], Any]:
        x2 = rows(x)
        return lambda: kernels.qbit_encode(x2, bits, 1, 0)

    def enc_r(x: torch.Tensor) -> Callable[[], Any]:
        x2 = rows(x)
        return lambda: ref.qbit_encode(x2, bits, 1, 0)

    def dec_k(x: torch.Tensor) -> Callable[[], Any]:
        x2 = rows(x)
        packed, scale, minimum = kernels.qbit_encode(x2, bits, 1, 0)
        out = torch.empty_like(x2)
        return lambda: kernels.qbit_decode(packed, scale, minimum, bits, x2.shape[1], x2.dtype, out=out)

    def dec_r(x: torch.Tensor) -> Callable[[], Any]:
        x2 = rows(x)
        packed, scale, minimum = ref.qbit_encode(x2, bits, 1, 0)
        return lambda: ref.qbit_decode(packed, scale, minimum, bits, x2.shape[1], x2.dtype)

    return [Case(f"qbit{bits} encode", enc_k, enc_r), Case(f"qbit{bits} decode", dec_k, dec_r)]


def cases(row: int) -> list[Case]:
    out = _onebit_cases()
    for bits in (1, 2, 4, 8):
        out += _qbit_cases(bits, row)
    return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model() or "",
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "kernels": "compiled" if _ops.HAS_EXTENSION else f"reference only ({_ops.LOAD_ERROR})",
        "cpu_isa": _ops.cpu_isa(),
    }


def _ceilings(x: torch.Tensor, min_time: float) -> dict[str, float]:
    """Memory ceilings and the NumPy sign packer on the same input."""
    nbytes = 4 * x.numel()
    xn = x.numpy()
    y = torch.empty_like(x)
    return {
        "read_gbps": _gbps(nbytes, seconds_per_call(lambda: x.sum(), min_time)),
        "copy_gbps": _gbps(nbytes, seconds_per_call(lambda: y.copy_(x), min_time)),
        "packbits_gbps": _gbps(nbytes, seconds_per_call(lambda: np.packbits(xn >= 0), min_time)),
        "packbits_peak_bytes": peak_numpy_bytes(lambda: np.packbits(xn >= 0)),
    }


def run(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    thread_counts: tuple[int, ...] | None = None,
    row: int = 1024,
    ref_elems: int = 1 << 20,
    min_time: float = 0.2,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every case at every size and thread count; return a JSON-ready dict."""
    if thread_counts is None:
        cores = os.cpu_count() or 1
        thread_counts = (1, cores) if cores > 1 else (1,)
    results: dict[str, Any] = {"machine": machine(), "row": row, "ref_elems": ref_elems, "runs": []}
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=gen)
        xr = x[: min(n, ref_elems)].clone()
        for nt in thread_counts:
            if progress:
                progress(f"{n:,} elements, {nt} thread(s)")
            with threads(nt):
                nbytes = 4 * n
                ceil = _ceilings(x, min_time)
                ops = []
                for case in cases(row):
                    k_fn, r_fn = case.kernel(x), case.reference(xr)
                    k_gbps = _gbps(nbytes, seconds_per_call(k_fn, min_time))
                    r_gbps = _gbps(4 * xr.numel(), seconds_per_call(r_fn, min_time, max_calls=5))
                    k_peak = peak_torch_bytes(k_fn)
                    ops.append(
                        {
                            "op": case.name,
                            "kernel_gbps": k_gbps,
                            "reference_gbps": r_gbps,
                            "vs_reference": k_gbps / r_gbps,
                            "vs_packbits": k_gbps / ceil["packbits_gbps"],
                            "vs_read": k_gbps / ceil["read_gbps"],
                            "kernel_peak_bytes": k_peak,
                            "kernel_peak_x_input": k_peak / nbytes,
                            "reference_peak_x_input": peak_torch_bytes(r_fn) / (4 * xr.numel()),
                        }
                    )
                results["runs"].append({"elements": n, "threads": nt, **ceil, "ops": ops})
    return results


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table of a :func:`run` result."""
    m = results["machine"]
    lines = [
        f"kernels: {m['kernels']}, CPU ISA {m['cpu_isa']}; {m['cpu']} ({m['cores']} cores); torch {m['torch']}",
        f"GB/s of fp32 input; q-bit rows of {results['row']}; references on <= {results['ref_elems']:,} elements; "
        "kernel decode writes into a preallocated tensor",
    ]
    for r in results["runs"]:
        lines.append("")
        lines.append(
            f"{r['elements']:,} elements, {r['threads']} thread(s): read-only {r['read_gbps']:.1f} GB/s, "
            f"copy {r['copy_gbps']:.1f} GB/s, numpy.packbits(x >= 0) {r['packbits_gbps']:.1f} GB/s "
            f"(peak {r['packbits_peak_bytes'] / (4 * r['elements']):.2f}x input)"
        )
        lines.append(
            f"  {'op':<15}{'kernel':>9}{'reference':>11}{'x ref':>9}{'x packbits':>12}{'x read':>8}"
            f"{'peak kernel':>13}{'peak ref':>10}"
        )
        for o in r["ops"]:
            lines.append(
                f"  {o['op']:<15}{o['kernel_gbps']:>9.2f}{o['reference_gbps']:>11.3f}{o['vs_reference']:>9.1f}"
                f"{o['vs_packbits']:>12.2f}{o['vs_read']:>8.2f}"
                f"{o['kernel_peak_x_input']:>12.3f}x{o['reference_peak_x_input']:>9.2f}x"
            )
    return "\n".join(lines)


def save(results: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(results, indent=2))
    return p
