"""The compiled form of every Triton kernel, checked without a GPU (:mod:`sylvie_comm.kernels.triton.form`).

Every op of ``torch.ops.sylvie_comm_triton`` is called at the benchmark's shapes with its launches recorded, not
run; each distinct launch is compiled for sm_90 with the specialisation a real launch makes, and its PTX and
``ptxas -v`` figures must keep the rules of the module's docstring. The checker itself is shown to fail: small
kernels that break each rule (``compiled_form_bad.py``) go through it too.

The compilations run in worker processes (where the kernel modules import compiled, not interpreted): the
integration tier (``multiprocess``), which CI runs. Everything that needs the real kernels' figures is one test, so
that pytest-xdist does not compile them once per worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from sylvie_comm.kernels.triton import form, interpreted

BAD = "tests.kernels.compiled_form_bad"
F32 = {"tensor": "float32", "mod16": 0}
U8 = {"tensor": "uint8", "mod16": 0}


def _report(tmp_path: Path) -> form.Report:
    """The real kernels' report: captured here under the interpreter (CI), or by the command in a child process
    that selects it (a GPU machine, where this process compiled the kernel modules for the GPU)."""
    if interpreted():
        return form.report()
    out = tmp_path / "form.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-m", "sylvie_comm.kernels.triton.form", "--json", str(out)], env=env,
                   check=True, capture_output=True)  # fmt: skip
    return form.Report.from_json(json.loads(out.read_text()))


def _problems(rep: form.Report) -> list[str]:
    """Everything wrong with a report, one line each: notes that are errors, compile errors, rules broken."""
    bad_notes = [n for n in rep.notes if not n.startswith("GPU choice applied")]
    launched = {launch.name for launch in rep.launches}
    stale = [f"TAIL_KERNELS names {k}, which no op launches" for k in form.TAIL_KERNELS if k not in launched]
    stale += [f"EXCUSED names {k}, which no op launches" for k in form.EXCUSED if k not in launched]
    unused = [f"OP_CALLS has {op}, which is not an op of the namespace" for op in set(form.OP_CALLS) - set(
        form.registered_ops())]  # fmt: skip
    silent = [f"{op} launched no kernel" for op in form.OP_CALLS if op not in {x.op for x in rep.launches}]
    broken = [f"{v['rule']}: {v['id']} {v['kernel']}" + (f" ({v['op']} [{v['case']}])" if "op" in v else "")
              + f": {v['how']}" for v in rep.violations]  # fmt: skip
    return bad_notes + stale + unused + silent + broken


@pytest.mark.multiprocess
def test_every_kernel_keeps_the_rules(tmp_path: Path) -> None:
    """Every op is covered, none raises or reads a kernel's output on the host, every kernel compiles, and every
    compiled kernel keeps every rule at both shapes."""
    rep = _report(tmp_path)
    assert rep.kernels, "no kernel was launched"
    problems = _problems(rep)
    assert not problems, "the compiled form breaks its rules (python -m sylvie_comm.kernels.triton.form):\n" + (
        "\n".join(problems)
    )


def _launch(kernel: str, grid: int, n: int, out: dict[str, object] = F32, block: int = 4096) -> form.Launch:
    args = [F32, out, n]
    return form.Launch("test", kernel, form.BIG, f"{BAD}:{kernel}", (grid, 1, 1), args, {"BLOCK": block},
                       {"num_warps": 4 if block <= 4096 else 1})  # fmt: skip


@pytest.mark.multiprocess
def test_the_checker_fails_bad_kernels() -> None:
    """Each bad kernel breaks its rule, and only that one (an approximate division: ieee-arithmetic); a plain copy
    breaks none (but launched on too few
    programs, fills-the-gpu); a length that is not a multiple of 16 makes byte stores scalar."""
    n = 1 << 26
    rep = form.check([
        _launch("copy_kernel", n // 4096, n),
        _launch("copy_kernel", 64, n),
        _launch("f64_loop_kernel", 1024, n, block=1024),
        _launch("byte_store_kernel", n // 4096, n + 1, out=U8),
        _launch("spill_kernel", n // 16384, n, block=16384),
        _launch("approx_div_kernel", n // 4096, n),
    ])  # fmt: skip
    broken = {(v["kernel"].rsplit(".", 1)[1], v["rule"]) for v in rep.violations}
    assert broken == {
        ("copy_kernel", form.GRID_RULE),
        ("f64_loop_kernel", "no-f64-in-loops"),
        ("byte_store_kernel", "wide-access"),
        ("spill_kernel", "no-local-memory"),
        ("approx_div_kernel", "ieee-arithmetic"),
    }, rep.violations
    grid = [v for v in rep.violations if v["rule"] == form.GRID_RULE]
    assert len(grid) == 1 and "64 programs" in grid[0]["how"]


PTX = """
.visible .entry k(
    .param .u64 k_param_0
)
{
    .reg .f64 %fd<4>;
    ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
    add.f64 %fd1, %fd2, %fd3;
$L__BB0_1:
    @%p1 ld.global.b8 {%rs1}, [%rd2];
    fma.rn.f64 %fd1, %fd2, %fd3, %fd1;
    bar.sync 0;
    @!%p2 bra $L__BB0_1;
    st.global.b16 [%rd3], {%rs2};
    cp.async.cg.shared.global [%r5], [%rd4], 16;
    div.s64 %rd5, %rd6, %rd7;
    ret;
}
    .section .debug_info
    {
.b8 1
    }
"""


def test_the_ptx_reader() -> None:
    """Loops are the ranges of backward branches; widths are vector x type bytes; predicates and debug data are
    skipped."""
    f = form.read_ptx(PTX)
    assert (f["f64"], f["f64_in_loops"], f["bar_sync"], f["bar_sync_in_loops"]) == (2, 1, 1, 1)
    assert f["global_loads"] == {"16": 2, "1": 1} and f["global_stores"] == {"2": 1}
    assert f["narrow_loads_in_loops"] == 1 and f["int64_divisions"] == 1


def test_the_rules_on_figures() -> None:
    """A flag (one narrow load outside loops) is allowed; a narrow store, a second narrow load, a narrow load in a
    loop are not; tail kernels are held to the rules that apply to every kernel only."""
    ok = {"spill_stores": 0, "spill_loads": 0, "stack_frame": 0, "local_accesses": 0, "f64": 0, "f64_in_loops": 0,
          "global_loads": {"1": 1, "16": 4}, "global_stores": {"16": 4}, "narrow_loads_in_loops": 0,
          "bar_sync_in_loops": 0}  # fmt: skip
    assert form.kernel_violations("x.k", ok) == []
    for change, rule in [
        ({"global_stores": {"1": 1}}, "wide-access"),
        ({"global_loads": {"1": 2}}, "wide-access"),
        ({"narrow_loads_in_loops": 1}, "wide-access"),
        ({"f64": 1, "f64_in_loops": 1}, "no-f64-in-loops"),
        ({"f64": form.F64_OUTSIDE_LOOPS + 1}, "no-f64-in-loops"),
        ({"bar_sync_in_loops": 1}, "no-barrier-in-loops"),
        ({"spill_stores": 4}, "no-local-memory"),
    ]:
        assert [r for r, _ in form.kernel_violations("x.k", ok | change)] == [rule], change
    tail = next(iter(form.TAIL_KERNELS))
    assert form.kernel_violations(tail, ok | {"f64": 999, "global_stores": {"1": 9}}) == []
    assert [r for r, _ in form.kernel_violations(tail, ok | {"stack_frame": 8})] == ["no-local-memory"]


def test_the_guide_names_every_rule() -> None:
    """docs/internals/kernels.md's table of rules has one row per rule of the checker, in its order."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "internals" / "kernels.md").read_text()
    table = page[page.index("| rule | applies to | what |") :].split("\n\n", 1)[0]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert rows == [r.name for r in form.RULES] + [form.GRID_RULE], rows
