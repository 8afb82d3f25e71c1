"""The compiled form of every Triton kernel, read without a GPU: what each op launches at the benchmark's shapes,
compiled for an H100 / H200 (``GPUTarget("cuda", 90, 32)``), and the figures of its PTX and of ``ptxas -v``.

This checks the compiled form only: it runs no kernel and measures no time or bandwidth. It is the CPU-side
evidence that a kernel is built for bandwidth (the GPU run, ``python -m sylvie_comm.bench.cuda``, is the measure).

How. Under Triton's interpreter (``TRITON_INTERPRET=1``) every ``@triton.jit`` kernel is an interpreter object:
:func:`collect` calls each op of ``torch.ops.sylvie_comm_triton`` as :data:`OP_CALLS` says, at the shapes of
:data:`SHAPES` on CPU tensors that are never written or read, with the interpreter's launch replaced by a
recorder (the kernel, its grid, its arguments and its launch options; nothing runs). Each distinct launch is then
compiled for sm_90 in worker processes (where the kernel modules import compiled, not interpreted), with the
specialisation a real launch makes: Triton's own argument binder (``runtime/jit.py``) types and specialises the
recorded arguments (a pointer 16-byte aligned, an int divisible by 16: ``tt.divisibility`` 16; an int equal to 1:
a constant; ``do_not_specialize`` honoured), and the bundled ``ptxas -v`` runs on the PTX with Triton's flags.

Where the host code of an op chooses differently on a GPU than on CPU tensors, :data:`CUDA_CHOICES` makes the
GPU's choice during the capture (each one applied is listed in the report; one whose function is gone is reported
as not applied). Where host code reads a value back from a tensor a recorded (skipped) launch received, the read is
reported: its value is undefined here.

The rules (:data:`RULES`; ``tests/kernels/test_compiled_form.py`` asserts them, the figures table shows them):

* ``ieee-arithmetic`` (every kernel): no approximate or flush-to-zero fp32 instruction (``div.full``,
  ``div.approx``, ``sqrt.approx``, ``rcp.approx``, ``.ftz.f32`` arithmetic; ``tl.floor``'s ``cvt.rmi.ftz``
  differs only on a subnormal input and is not counted), no atomics, and no fp32 ``fma`` in a kernel
  launched with ``enable_fp_fusion=False``. Why: the kernels must return the interpreter's (the reference's) bits;
  plain ``/`` and ``tl.sqrt`` compile to approximate forms on a GPU and are exact in the interpreter, atomics run
  without races there, and an fma rounds once where the reference rounds twice.

* ``no-local-memory`` (every kernel): ``ptxas`` reports no spill stores or loads and no stack frame, and the PTX
  has no ``ld.local`` / ``st.local``. Why: local memory is device memory behind L1; a spill adds traffic on the
  path whose bytes the kernel is judged by, and it means the tile does not fit the registers.
* ``no-f64-in-loops`` (bulk kernels): no ``.f64`` instruction inside a loop of the PTX (a backward branch's
  range), and at most :data:`F64_OUTSIDE_LOOPS` outside loops. Why: an element loop in float64 runs at half the
  fp32 rate at best (H100 / H200: 67 vs 34 TFLOP/s; ``div.rn.f64`` and ``sqrt.rn.f64`` are long instruction
  sequences), holds every value in two registers (half the elements in flight), and the exactness contract keeps
  sums in fp32 lanes. A final scale in float64 is allowed, hence the budget outside loops: a few instructions per
  row or chunk, for each one a thread holds, stay under it (the q-bit tile encoder, 16 rows a program: 56), while
  a loop-free kernel's per-element float64 work unrolls into hundreds (the one-bit encoder: over a thousand).
* ``wide-access`` (bulk kernels): every global store moves at least :data:`MIN_ACCESS_BYTES` bytes per thread per
  instruction, and so does every global load but at most one narrow load outside loops (a one-byte flag). Why:
  memory moves 32-byte sectors; one byte per thread per instruction needs 4 to 16 times the instructions and
  store requests per byte of a 4- or 16-byte access, which bounds a kernel by issue before bandwidth (the one-byte
  stores the GPU run measured); a narrow access also shows a mask or an alignment that stopped vectorisation.
* ``fills-the-gpu`` (bulk kernels at ``8192x8192``): at least :data:`MIN_PROGRAMS` programs (2 per streaming
  multiprocessor of an H100 or H200, 132 SMs). Why: with one program per SM, an SM waits idle from its program's
  last loads to the end of the launch, and a second resident program keeps loads in flight across that gap.
* ``no-barrier-in-loops`` (bulk kernels): no ``bar.sync`` inside a loop. Why: a barrier in the main loop is a
  layout conversion through shared memory on every step (``tl.permute`` / ``tl.reshape`` / ``tl.split`` trees,
  a ``tl.sum`` whose result must be re-spread), which stalls every warp of the program on each step.

Bulk kernels are all but :data:`TAIL_KERNELS`, each named there with why it moves too few bytes to matter.
:data:`EXCUSED` names a bulk kernel let off one rule, with the reason (the report lists each).

Limits. What is checked is what the host code launches for CPU tensors, with :data:`CUDA_CHOICES` applied: where
an op takes another path on a GPU (``torch.matmul`` instead of a kernel), the kernel its CPU path launches is what
is checked, until a :class:`CudaChoice` makes the GPU's choice or :data:`TAIL_KERNELS` names the kernel. An
autotuned kernel is recorded once per configuration its wrapper launches. The host-read check sees reads of the
tensors a launch received (``item``, ``tolist``, ``bool``, ``int``, ``float``, ``numpy``), not of values computed
from them on the host first.

Run ``python -m sylvie_comm.kernels.triton.form`` (``--json PATH`` for the record) to print the figures.

The modules, in the order of the work: :mod:`.calls` (the target, the shapes, the rules' constants, a row of
:data:`OP_CALLS` per declared op, the GPU's host choices), :mod:`.record` (the launches captured under the
interpreter), :mod:`.build` (compiled for sm_90 in worker processes), :mod:`.ptx` (the figures of PTX and
``ptxas -v``), :mod:`.rules` (what a kernel must keep) and :mod:`.report` (the table, the violations, the command).
"""

from __future__ import annotations

from sylvie_comm.kernels.triton.form.build import bind, compile_all, compile_spec, spec_key
from sylvie_comm.kernels.triton.form.calls import (
    BIG,
    CUDA_CHOICES,
    EXCUSED,
    F64_OUTSIDE_LOOPS,
    MIN_ACCESS_BYTES,
    MIN_PROGRAMS,
    OP_CALLS,
    SHAPES,
    TAIL_KERNELS,
    TARGET,
    CudaChoice,
    registered_ops,
)
from sylvie_comm.kernels.triton.form.ptx import parse_ptxas, ptxas, read_ptx
from sylvie_comm.kernels.triton.form.record import Launch, collect, describe, kernel_name, recording
from sylvie_comm.kernels.triton.form.report import Report, check, main, markdown, report
from sylvie_comm.kernels.triton.form.rules import GRID_RULE, RULES, Rule, is_bulk, kernel_violations, launch_violation

__all__ = [
    "BIG", "CUDA_CHOICES", "EXCUSED", "F64_OUTSIDE_LOOPS", "GRID_RULE", "MIN_ACCESS_BYTES", "MIN_PROGRAMS", "OP_CALLS",
    "RULES", "SHAPES", "TAIL_KERNELS", "TARGET", "CudaChoice", "Launch", "Report", "Rule", "bind", "check",
    "collect", "compile_all", "compile_spec", "describe", "is_bulk", "kernel_name", "kernel_violations",
    "launch_violation", "main", "markdown", "parse_ptxas", "ptxas", "read_ptx", "recording", "registered_ops",
    "report", "spec_key",
]  # fmt: skip
