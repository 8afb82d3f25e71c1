"""Reading PTX and ``ptxas -v``: the figures the rules judge."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from sylvie_comm.kernels.triton.form.calls import MIN_ACCESS_BYTES, Json

# ---------------------------------------------------------------- reading PTX and ptxas


_TYPE = re.compile(r"^[bfsu](\d+)$")
_VECTOR = re.compile(r"^v(\d+)$")


def _instructions(ptx: str) -> list[tuple[str, str]]:
    """``(opcode, operands)`` of each instruction in order, and ``("label", name)`` for each label."""
    out: list[tuple[str, str]] = []
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip().rstrip(";").strip()
        if not line or line[0] in ".{}()":  # directives (declarations, debug data), braces, the parameter list
            continue
        if line.endswith(":"):
            out.append(("label", line[:-1]))
            continue
        if line.startswith("@"):  # a predicate
            line = line.partition(" ")[2].strip() if " " in line else line.partition("\t")[2].strip()
        opcode, _, operands = line.replace("\t", " ").partition(" ")
        out.append((opcode, operands.strip()))
    return out


def _in_loops(code: list[tuple[str, str]]) -> list[bool]:
    """Whether each instruction lies in a loop: between a label and a later branch back to it."""
    at = {name: i for i, (op, name) in enumerate(code) if op == "label"}
    inside = [False] * len(code)
    for i, (op, operands) in enumerate(code):
        target = at.get(operands.split(",")[-1].strip()) if op.startswith("bra") else None
        if target is not None and target < i:
            for j in range(target, i + 1):
                inside[j] = True
    return inside


def _access_bytes(parts: list[str], operands: str) -> int:
    if parts[0] == "cp":  # cp.async ... [dst], [src], cp-size
        return int(operands.split(",")[2].strip()) if operands.count(",") >= 2 else 0
    vector = next((int(m.group(1)) for p in parts if (m := _VECTOR.match(p))), 1)
    bits = next((int(m.group(1)) for p in reversed(parts) if (m := _TYPE.match(p))), 0)
    return vector * bits // 8


def _count(widths: dict[str, int], width: int) -> None:
    widths[str(width)] = widths.get(str(width), 0) + 1


def read_ptx(ptx: str) -> dict[str, Json]:
    """Figures of a kernel's PTX: float64 instructions, global access widths (bytes per thread per instruction),
    shared-memory accesses, barriers, local memory; each also counted inside loops where it matters."""
    code = _instructions(ptx)
    loops = _in_loops(code)
    f = {"f64": 0, "f64_in_loops": 0, "bar_sync": 0, "bar_sync_in_loops": 0, "shared_accesses": 0,
         "local_accesses": 0, "narrow_loads_in_loops": 0, "atomics": 0, "tma": 0, "int64_divisions": 0,
         "approximate": 0, "fma_f32": 0}  # fmt: skip
    loads: dict[str, int] = {}
    stores: dict[str, int] = {}
    for (op, operands), in_loop in zip(code, loops, strict=True):
        parts = op.split(".")
        if "f64" in parts:
            f["f64"] += 1
            f["f64_in_loops"] += in_loop
        if parts[0] in ("bar", "barrier") and "warp" not in parts:
            f["bar_sync"] += 1
            f["bar_sync_in_loops"] += in_loop
        if parts[0] in ("ldmatrix", "stmatrix") or (parts[0] in ("ld", "st", "atom", "red") and "shared" in parts):
            f["shared_accesses"] += 1
        if parts[0] in ("ld", "st") and "local" in parts:
            f["local_accesses"] += 1
        if parts[0] in ("div", "rem") and ("s64" in parts or "u64" in parts):  # a long software sequence each
            f["int64_divisions"] += 1
        if parts[0] in ("atom", "red") and "global" in parts:
            f["atomics"] += 1
        # (a rounding conversion with ftz, tl.floor's cvt.rmi.ftz, differs only on a subnormal input: not counted)
        if parts[0] != "cvt" and ("approx" in parts or "full" in parts or ("ftz" in parts and "f32" in parts)):
            f["approximate"] += 1
        if parts[0] == "fma" and "f32" in parts:
            f["fma_f32"] += 1
        if parts[0] == "cp" and "bulk" in parts:
            f["tma"] += 1
        elif parts[0] in ("ld", "cp") and "global" in parts:
            width = _access_bytes(parts, operands)
            _count(loads, width)
            f["narrow_loads_in_loops"] += in_loop and width < MIN_ACCESS_BYTES
        elif parts[0] == "st" and "global" in parts:
            _count(stores, _access_bytes(parts, operands))
    return {**f, "global_loads": loads, "global_stores": stores, "ptx_lines": len(code)}


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def ptxas(ptx: str, fp_fusion: bool, extra: str | None = None) -> dict[str, Json]:
    """``ptxas -v`` on the PTX with the flags Triton's own build of the cubin uses (backends/nvidia/compiler.py)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        src = Path(folder, "kernel.ptx")
        src.write_text(ptx)
        cmd = [knobs.nvidia.ptxas.path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", *(extra.split() if extra else []), f"--gpu-name={sm_arch_from_capability(90)}",
               str(src), "-o", str(Path(folder, "kernel.o"))]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return parse_ptxas(done.stdout + done.stderr)


def parse_ptxas(log: str) -> dict[str, Json]:
    """Registers, stack frame, spills and static shared memory from ``ptxas -v``'s report."""
    return {k: sum(int(x) for x in rx.findall(log)) for k, rx in _PTXAS.items()}
