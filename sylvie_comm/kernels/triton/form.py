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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sylvie_comm.kernels.triton import INTERPRETER_LOCK, NAMESPACE, interpreted, load, load_error

Json = Any  # what json.loads returns
Shape = tuple[int, int]

# ---------------------------------------------------------------- the target, the shapes, the rules' constants

TARGET = ("cuda", 90, 32)  # GPUTarget: an H100 or H200 (sm_90), warps of 32 threads
SMS = 132  # streaming multiprocessors of an H100 SXM and of an H200
BIG = "8192x8192"
SHAPES: dict[str, Shape] = {BIG: (8192, 8192), "64K": (256, 256)}  # 1-D ops take them flattened
MIN_PROGRAMS = 2 * SMS
MIN_ACCESS_BYTES = 4
F64_OUTSIDE_LOOPS = 64

# The benchmark's choices.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CHUNK_SIZE = 2048  # one-bit chunk, with the norm scale
NORM_SCALE = True
QBIT_CASES = ((4, "fp32"), (4, "fp16"), (4, "bf16"), (2, "fp32"), (8, "fp32"))  # (bits, dtype)
RANK = 4
WORLD = 4  # one-bit rows averaged by onebit_mean_feedback_encode

# Kernels that move too few bytes for the bulk rules, by "family.kernel" name, with why.
TAIL_KERNELS: dict[str, str] = {
    "qbit._encode_meta_kernel": "combines each row's per-segment min/max keys into its scale: one key per segment",
    "lowrank._reduce_kernel": "adds gram's per-slab subtrees of q by the rest of the tree (k x rank values a slab)",
}

# Bulk kernels excused from one rule, each with the reason (shown in the report; a name no op launches fails the test).
EXCUSED: dict[str, dict[str, str]] = {
    "qbit._encode_quantize_kernel": {
        "no-barrier-in-loops": "the long-row path only (rows over 16,384 columns): one shared-memory round trip per "
        "4,096-column step to lay the packed words out for their stores, about an eighth of the input's bytes",
    },
}


# ---------------------------------------------------------------- the ops' calls at the benchmark's shapes


class Pool:
    """CPU tensors by role, shape and dtype, made once (``torch.empty``: never written, so no memory is touched)."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = (role, shape, dtype)
        if key not in self._made:
            self._made[key] = torch.empty(shape, dtype=dtype)
        return self._made[key]


Calls = list[tuple[str, tuple[Any, ...]]]  # (label, the op's arguments)


def _onebit_coded(pool: Pool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = pool.get("packed", ((n + 7) // 8,), torch.uint8)
    return packed, pool.get("scales", (-(-n // CHUNK_SIZE),))


def _onebit_encode(pool: Pool, shape: Shape) -> Calls:
    return [(d, (pool.get("x", shape, t).view(-1), CHUNK_SIZE, NORM_SCALE)) for d, t in DTYPES.items()]


def _onebit_decode(pool: Pool, shape: Shape) -> Calls:
    n = shape[0] * shape[1]
    return [(d, (*_onebit_coded(pool, n), n, CHUNK_SIZE, t)) for d, t in DTYPES.items()]


def _onebit_decode_into(pool: Pool, shape: Shape) -> Calls:
    coded = _onebit_coded(pool, shape[0] * shape[1])
    return [(d, (*coded, CHUNK_SIZE, pool.get("out", shape, t).view(-1))) for d, t in DTYPES.items()]


def _onebit_feedback_encode(pool: Pool, shape: Shape) -> Calls:
    residual = pool.get("residual", shape).view(-1)
    coded = _onebit_coded(pool, residual.numel())
    return [(f"{d} grad", (residual, pool.get("grad", shape, t).view(-1), CHUNK_SIZE, NORM_SCALE, *coded))
            for d, t in DTYPES.items()]  # fmt: skip


def _onebit_mean_feedback_encode(pool: Pool, shape: Shape) -> Calls:
    residual = pool.get("residual", shape).view(-1)
    n = residual.numel()
    parts = pool.get("parts", (WORLD, (n + 7) // 8), torch.uint8), pool.get("part_scales", (WORLD, -(-n // CHUNK_SIZE)))
    coded = _onebit_coded(pool, n)
    return [(f"fp32, {WORLD} rows", (residual, *parts, CHUNK_SIZE, NORM_SCALE, *coded))]


def _qbit_coded(pool: Pool, shape: Shape, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed = pool.get(f"q{bits}", (shape[0], -(-shape[1] * bits // 8)), torch.uint8)
    return packed, pool.get("scale", (shape[0],)), pool.get("minimum", (shape[0],))


def _qbit_encode(pool: Pool, shape: Shape) -> Calls:
    calls: Calls = [(f"{d}, {b} bits", (pool.get("x", shape, DTYPES[d]), b, 1, 0, torch.float32))
                    for b, d in QBIT_CASES]  # fmt: skip
    # the same tensor as one row (a flattened bias, a whole bucket): the long-row path, split over programs
    calls.append(("fp32, 4 bits, one row", (pool.get("x", shape).view(1, -1), 4, 1, 0, torch.float32)))
    return calls


def _qbit_decode(pool: Pool, shape: Shape) -> Calls:
    return [(f"{d}, {b} bits", (*_qbit_coded(pool, shape, b), b, shape[1], DTYPES[d])) for b, d in QBIT_CASES]


def _qbit_decode_into(pool: Pool, shape: Shape) -> Calls:
    return [
        (f"{d}, {b} bits", (*_qbit_coded(pool, shape, b), b, pool.get("out", shape, DTYPES[d]))) for b, d in QBIT_CASES
    ]


def _pack_bits(pool: Pool, shape: Shape) -> Calls:
    return [(f"{b} bits", (pool.get("values", shape, torch.uint8), b)) for b in (4, 2, 8)]


def _unpack_bits(pool: Pool, shape: Shape) -> Calls:
    return [(f"{b} bits", (_qbit_coded(pool, shape, b)[0], b, shape[1])) for b in (4, 2, 8)]


def _copy_if(pool: Pool, shape: Shape) -> Calls:
    flag = pool.get("flag", (1,), torch.bool)
    return [("fp32", (pool.get("out", shape), pool.get("x", shape), flag))]


def _factors(pool: Pool, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.get("p", (shape[0], RANK)), pool.get("q", (shape[1], RANK))


def _lowrank_project(pool: Pool, shape: Shape) -> Calls:
    p, q = _factors(pool, shape)
    return [(f"fp32, rank {RANK}, grad, subtract", (pool.get("residual", shape), pool.get("grad", shape), q, p, True))]


def _lowrank_gram(pool: Pool, shape: Shape) -> Calls:
    p, q = _factors(pool, shape)
    return [(f"fp32, rank {RANK}", (pool.get("residual", shape), None, p, q))]


def _lowrank_outer_into(pool: Pool, shape: Shape) -> Calls:
    p, q = _factors(pool, shape)
    return [(f"fp32, rank {RANK}", (pool.get("out", shape), p, q, 1.0, False))]


# op -> its calls at one shape. Every op of the namespace must have an entry (the test checks both ways).
OP_CALLS: dict[str, Callable[[Pool, Shape], Calls]] = {
    "onebit_encode": _onebit_encode,
    "onebit_decode": _onebit_decode,
    "onebit_decode_into": _onebit_decode_into,
    "onebit_feedback_encode": _onebit_feedback_encode,
    "onebit_mean_feedback_encode": _onebit_mean_feedback_encode,
    "qbit_encode": _qbit_encode,
    "qbit_decode": _qbit_decode,
    "qbit_decode_into": _qbit_decode_into,
    "pack_bits": _pack_bits,
    "unpack_bits": _unpack_bits,
    "copy_if": _copy_if,
    "lowrank_project": _lowrank_project,
    "lowrank_gram": _lowrank_gram,
    "lowrank_outer_into": _lowrank_outer_into,
}


def registered_ops() -> list[str]:
    """The ops of ``torch.ops.sylvie_comm_triton`` (the families loaded first)."""
    load()
    prefix = f"{NAMESPACE}::"
    names = {s.name[len(prefix) :] for s in torch._C._jit_get_all_schemas() if s.name.startswith(prefix)}
    return sorted(names)


# ---------------------------------------------------------------- the GPU's host choices, made during the capture


@dataclasses.dataclass(frozen=True)
class CudaChoice:
    """A host function whose answer differs on a GPU, replaced during the capture by the GPU's answer."""

    module: str
    attribute: str
    make: Callable[[ModuleType], Callable[..., Any]]  # the module -> the replacement
    reason: str


CUDA_CHOICES = (
    CudaChoice(
        "sylvie_comm.kernels.triton.lowrank",
        "_target_programs",
        lambda m: lambda device: SMS * m.PROGRAMS_PER_SM,
        "the low-rank ops split a sum over more programs when too few would fill the GPU (SMs x PROGRAMS_PER_SM); "
        "for CPU tensors they never do",
    ),
    CudaChoice(
        "sylvie_comm.kernels.triton.qbit",
        "_nan_bf16",
        lambda m: lambda device: -1,
        "the q-bit decode's NAN_BF16 is -1 on a GPU (the GPU's own conversion), torch's CPU NaN bits on CPU tensors",
    ),
)


@contextlib.contextmanager
def _cuda_choices(notes: list[str]) -> Iterator[None]:
    undo: list[tuple[ModuleType, str, Any]] = []
    try:
        for choice in CUDA_CHOICES:
            module = sys.modules.get(choice.module)
            if module is None or not hasattr(module, choice.attribute):
                notes.append(f"GPU choice not applied ({choice.module}.{choice.attribute} is gone): {choice.reason}")
                continue
            undo.append((module, choice.attribute, getattr(module, choice.attribute)))
            setattr(module, choice.attribute, choice.make(module))
            notes.append(f"GPU choice applied ({choice.module}.{choice.attribute}): {choice.reason}")
        yield
    finally:
        for module, name, value in reversed(undo):
            setattr(module, name, value)


# ---------------------------------------------------------------- recording the launches


@dataclasses.dataclass
class Launch:
    """One kernel launch an op made (or one built by hand): enough to compile it as the launch would."""

    op: str
    case: str
    shape: str
    kernel: str  # "module:qualname" of the @triton.jit function
    grid: tuple[int, int, int]
    args: list[Json]  # positional arguments, described (:func:`describe`)
    kwargs: dict[str, Json]  # keyword arguments that are kernel parameters (constexprs mostly)
    options: dict[str, Json]  # launch options: num_warps, num_stages, enable_fp_fusion, ...
    key: str = ""  # the compilation it launches (set by :func:`check`): equal keys, one compiled kernel

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)


def kernel_name(ref: str) -> str:
    """``sylvie_comm.kernels.triton.onebit:_encode_kernel`` -> ``onebit._encode_kernel``."""
    module, qualname = ref.split(":")
    return f"{module.rsplit('.', 1)[-1]}.{qualname}"


def _function_ref(fn: Any) -> str:
    while not hasattr(fn, "__qualname__") or hasattr(fn, "fn"):  # interpreter / JIT / autotuner wrappers
        fn = fn.fn
    return f"{fn.__module__}:{fn.__qualname__}"


def describe(value: Any) -> Json:
    """A launch argument as JSON the compile worker can rebuild (a tensor: its dtype and address modulo 16)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "mod16": value.data_ptr() % 16}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple": [describe(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"torch_dtype": str(value).removeprefix("torch.")}
    kind = type(value).__name__
    if kind in ("InterpretedFunction", "JITFunction"):
        return {"jit": _function_ref(value)}
    if kind == "dtype" and hasattr(value, "primitive_bitwidth"):  # triton.language.dtype
        return {"tl_dtype": value.name}
    if kind == "constexpr":
        return describe(value.value)
    if hasattr(value, "item") and not hasattr(value, "shape"):  # a numpy scalar
        return describe(value.item())
    return {"unsupported": f"{type(value).__module__}.{kind}"}


def _grid(grid: Any, meta: dict[str, Any]) -> tuple[int, int, int]:
    g = tuple(int(x) for x in (grid(meta) if callable(grid) else grid))
    return (*g, 1, 1, 1)[:3]  # type: ignore[return-value]


class _Recorder:
    """What the capture has seen: the launches, the storages they received, and notes on host reads."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.notes: list[str] = []
        self.storages: list[tuple[int, int, str]] = []  # (start, end, kernel) of every tensor a launch received
        self.held: list[torch.Tensor] = []  # those tensors, kept so that no later tensor reuses their memory
        self.current = ("", "", "")  # op, case, shape

    def record(self, fn: Any, args: tuple[Any, ...], grid: Any, kwargs: dict[str, Any]) -> None:
        names = list(fn.arg_names)
        params = {k: v for k, v in kwargs.items() if k in names}
        options = {k: describe(v) for k, v in kwargs.items() if k not in names}
        ref = _function_ref(fn)
        op, case, shape = self.current
        meta = dict(zip(names, args, strict=False)) | params
        launch = Launch(op, case, shape, ref, _grid(grid, meta), [describe(a) for a in args],
                        {k: describe(v) for k, v in params.items()}, options)  # fmt: skip
        self.launches.append(launch)
        for value in (*args, *params.values()):
            if isinstance(value, torch.Tensor) and value.numel():
                self.held.append(value)
                start = value.untyped_storage().data_ptr()
                self.storages.append((start, start + value.untyped_storage().nbytes(), launch.name))

    def host_read(self, t: torch.Tensor, how: str) -> None:
        start = t.untyped_storage().data_ptr()
        end = start + t.untyped_storage().nbytes()
        for s, e, kernel in self.storages:
            if start < e and s < end:
                op, case, shape = self.current
                self.notes.append(f"{op} [{case}] at {shape}: the host read ({how}) a tensor that the skipped launch "
                                  f"of {kernel} received; the value it read is undefined here")  # fmt: skip
                return


_HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(owner)
    before = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


def _read_hook(recorder: _Recorder, how: str) -> Callable[..., Any]:
    original = getattr(torch.Tensor, how)

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder.host_read(self, how)
        return original(self, *args, **kwargs)

    return read


@contextlib.contextmanager
def recording(recorder: _Recorder) -> Iterator[None]:
    """Interpreted launches are recorded, not run; host reads of what they received are noted."""
    from triton.runtime.interpreter import InterpretedFunction

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if not warmup:
            recorder.record(self, args, grid, kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(INTERPRETER_LOCK)
        stack.enter_context(_patched(InterpretedFunction, "run", run))
        for how in _HOST_READS:
            stack.enter_context(_patched(torch.Tensor, how, _read_hook(recorder, how)))
        yield


def _ensure_interpreter() -> None:
    if not load():
        raise RuntimeError(f"the Triton kernels did not load: {load_error()}")
    if not interpreted():
        raise RuntimeError("capturing launches needs Triton's interpreter: set TRITON_INTERPRET=1 before the kernel "
                           "modules are imported (python -m sylvie_comm.kernels.triton.form does)")  # fmt: skip


def collect(shapes: Sequence[str] = tuple(SHAPES)) -> tuple[list[Launch], list[str]]:
    """Every launch of every op of :data:`OP_CALLS` at ``shapes``, recorded without running; and notes (GPU
    choices made, host reads of undefined values, ops that raised, ops without an entry)."""
    _ensure_interpreter()
    ops = getattr(torch.ops, NAMESPACE)
    recorder, pool = _Recorder(), Pool()
    with _cuda_choices(recorder.notes), recording(recorder):
        for shape in shapes:
            for op, calls in OP_CALLS.items():
                for case, args in calls(pool, SHAPES[shape]):
                    recorder.current = (op, case, shape)
                    try:
                        getattr(ops, op)(*args)
                    except Exception as exc:  # reported: the test fails on it
                        recorder.notes.append(f"{op} [{case}] at {shape} raised {type(exc).__name__}: {exc}")
    missing = sorted(set(registered_ops()) - set(OP_CALLS))
    recorder.notes += [f"op without an entry in OP_CALLS (not checked): {op}" for op in missing]
    return recorder.launches, recorder.notes


# ---------------------------------------------------------------- compiling (in worker processes)


class _Pointer:
    """A tensor argument as Triton's binder sees it: a dtype and an address (only its alignment matters)."""

    def __init__(self, dtype: torch.dtype, address: int) -> None:
        self.dtype = dtype
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def _resolve(ref: str) -> Any:
    module, qualname = ref.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild(desc: Json) -> Any:
    """The inverse of :func:`describe` (a tensor comes back as a :class:`_Pointer`)."""
    if not isinstance(desc, dict):
        return desc
    if "tensor" in desc:
        return _Pointer(getattr(torch, desc["tensor"]), desc["mod16"])
    if "tuple" in desc:
        return tuple(_rebuild(d) for d in desc["tuple"])
    if "torch_dtype" in desc:
        return getattr(torch, desc["torch_dtype"])
    if "jit" in desc:
        return _resolve(desc["jit"])
    if "tl_dtype" in desc:
        import triton.language as tl

        return tl.core.dtype(desc["tl_dtype"])
    raise TypeError(f"an argument of a type the checker cannot rebuild: {desc}")


_JITS: dict[str, Any] = {}


def _jit(ref: str) -> Any:
    """The ``JITFunction`` of a kernel; where the modules were imported for the interpreter, one made from the
    interpreter's function with its ``do_not_specialize`` lists."""
    if ref not in _JITS:
        from triton.runtime.jit import JITFunction

        obj = _resolve(ref)
        while not isinstance(obj, JITFunction) and type(obj).__name__ != "InterpretedFunction" and hasattr(obj, "fn"):
            obj = obj.fn  # autotuner / heuristics wrappers
        if not isinstance(obj, JITFunction):
            kw = obj.kwargs
            obj = JITFunction(obj.fn, do_not_specialize=kw.get("do_not_specialize"), debug=kw.get("debug"),
                              do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment"))  # fmt: skip
        _JITS[ref] = obj
    return _JITS[ref]


def _backend() -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget(*TARGET))


def bind(launch: Launch) -> dict[str, Json]:
    """What Triton compiles for this launch, by its own argument binder (runtime/jit.py, ``JITFunction.run``):
    the signature (types), the constexprs (declared, and ints equal to 1), the specialisation attributes (16-byte
    aligned pointers, ints divisible by 16), and the launch options."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kernel, backend = _jit(launch.kernel), _backend()
    kwargs = {k: _rebuild(v) for k, v in launch.kwargs.items()} | dict(launch.options)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*(_rebuild(a) for a in launch.args), **kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    names = [p.name for p in kernel.params]
    return {
        "kernel": launch.kernel,
        "signature": signature,
        "constexprs": sorted([list(path), describe(v)] for path, v in constexprs.items()),
        "attrs": sorted([list(path), a] for path, a in attrs.items() if a),
        "options": {k: kwargs[k] for k in (*launch.options, "debug", "instrumentation_mode")},
        "divisible_by_16": [names[p[0]] for p, a in attrs.items() if ["tt.divisibility", 16] in a],
        "equal_to_1": [names[p[0]] for p in constexprs if not kernel.params[p[0]].is_constexpr],
    }


def spec_key(spec: dict[str, Json]) -> str:
    keep = ("kernel", "signature", "constexprs", "attrs", "options")
    return json.dumps({k: spec[k] for k in keep}, sort_keys=True)


def compile_spec(spec: dict[str, Json]) -> dict[str, Json]:
    """Compile one bound launch (:func:`bind`) for :data:`TARGET`; its figures (or ``error``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        kernel, backend = _jit(spec["kernel"]), _backend()
        options = backend.parse_options(spec["options"])
        constexprs = {tuple(p): _rebuild(v) for p, v in spec["constexprs"]}
        attrs = {tuple(p): a for p, a in spec["attrs"]}
        source = ASTSource(kernel, spec["signature"], constexprs, attrs)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # ptxas's report, when Triton builds the cubin (not from its cache)
            compiled = triton.compile(source, target=GPUTarget(*TARGET), options=options.__dict__)
        ptx = compiled.asm["ptx"]
        meta = compiled.metadata
        used = parse_ptxas(log.getvalue()) if "Function properties" in log.getvalue() else None
        return {"num_warps": meta.num_warps, "num_stages": meta.num_stages, "shared": meta.shared,
                "fp_fusion": options.enable_fp_fusion, **read_ptx(ptx),
                **(used or ptxas(ptx, options.enable_fp_fusion, options.ptx_options))}  # fmt: skip
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _worker() -> int:
    """``--worker``: compile the specs on stdin, one JSON line each, and answer each with its figures as one JSON
    line on stdout (what Triton prints goes to stderr)."""
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v's report as it builds a cubin: no second run
    if not load():
        raise RuntimeError(f"the Triton kernels did not load: {load_error()}")
    answers = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        for line in sys.stdin:
            answers.write(json.dumps(compile_spec(json.loads(line))) + "\n")
            answers.flush()
    return 0


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"  # the kernel modules import compiled: triton.jit gives JITFunctions
    env.pop("SYLVIE_COMM_TRITON_CPU", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _serve(todo: queue.SimpleQueue[tuple[str, dict[str, Json]]], done: dict[str, dict[str, Json]]) -> None:
    """One worker process: compile specs from ``todo`` until it is empty (the workers share it: the load
    balances itself), their figures into ``done``."""
    cmd = [sys.executable, "-m", __spec__.name if __spec__ else "sylvie_comm.kernels.triton.form", "--worker"]
    with (
        tempfile.TemporaryFile("w+") as log,
        subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=_worker_env()
        ) as proc,
    ):
        assert proc.stdin is not None and proc.stdout is not None  # both piped
        while True:
            try:
                key, spec = todo.get_nowait()
            except queue.Empty:
                break
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
            if not answer:
                log.seek(0)
                raise RuntimeError(f"the compile worker stopped:\n{log.read()[-4000:]}")
            done[key] = json.loads(answer)
        proc.stdin.close()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_COMPILED: dict[str, dict[str, Json]] = {}  # spec key -> figures, for this process


def compile_all(specs: Sequence[dict[str, Json]]) -> dict[str, dict[str, Json]]:
    """Each distinct spec's figures by :func:`spec_key`, compiled once per process, over one process per core."""
    todo: queue.SimpleQueue[tuple[str, dict[str, Json]]] = queue.SimpleQueue()
    waiting = {key: spec for spec in specs if (key := spec_key(spec)) not in _COMPILED}
    for item in waiting.items():
        todo.put(item)
    if waiting:
        n = max(1, min(_cores(), len(waiting)))
        with ThreadPoolExecutor(n) as pool:
            for future in [pool.submit(_serve, todo, _COMPILED) for _ in range(n)]:
                future.result()
    return {key: _COMPILED[key] for key in map(spec_key, specs)}


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


# ---------------------------------------------------------------- the rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule of the compiled form: ``check(figures)`` says how a kernel breaks it (None: it does not)."""

    name: str
    statement: str
    bulk_only: bool
    check: Callable[[dict[str, Json]], str | None]


def _no_local(f: dict[str, Json]) -> str | None:
    local = (f["spill_stores"], f["spill_loads"], f["stack_frame"], f["local_accesses"])
    if any(local):
        return "spill stores {} B, spill loads {} B, stack frame {} B, {} local accesses".format(*local)
    return None


def _f64(f: dict[str, Json]) -> str | None:
    outside = f["f64"] - f["f64_in_loops"]
    if f["f64_in_loops"] or outside > F64_OUTSIDE_LOOPS:
        return f"{f['f64_in_loops']} .f64 instructions in loops, {outside} outside (at most {F64_OUTSIDE_LOOPS})"
    return None


def _narrow(widths: dict[str, int]) -> int:
    return sum(n for w, n in widths.items() if int(w) < MIN_ACCESS_BYTES)


def _wide(f: dict[str, Json]) -> str | None:
    stores, loads = _narrow(f["global_stores"]), _narrow(f["global_loads"])
    if stores or f["narrow_loads_in_loops"] or loads > 1:
        return (f"{stores} global stores and {loads} loads ({f['narrow_loads_in_loops']} in loops) under "
                f"{MIN_ACCESS_BYTES} bytes per thread")  # fmt: skip
    return None


def _ieee(f: dict[str, Json]) -> str | None:
    """The interpreter's arithmetic: no approximate or flush-to-zero fp32 instruction, no atomics, and no fp32 fma
    where the launch turned contraction off (``enable_fp_fusion=False``: an fma rounds once where the interpreter
    and the reference round twice)."""
    approximate, atomics = f.get("approximate", 0), f.get("atomics", 0)
    fma = 0 if f.get("fp_fusion", True) else f.get("fma_f32", 0)
    if approximate or atomics or fma:
        return f"{approximate} approximate or flush-to-zero instructions, {atomics} atomics, {fma} fp32 fma"
    return None


def _no_barrier_in_loops(f: dict[str, Json]) -> str | None:
    return f"{f['bar_sync_in_loops']} bar.sync in loops" if f["bar_sync_in_loops"] else None


RULES = (
    Rule("ieee-arithmetic", "no approximate or ftz fp32, no atomics, no fp32 fma where fusion is off", False, _ieee),
    Rule("no-local-memory", "no spills, no stack frame, no local loads or stores", False, _no_local),
    Rule("no-f64-in-loops", f"no .f64 in a loop, at most {F64_OUTSIDE_LOOPS} outside", True, _f64),
    Rule("wide-access", f">= {MIN_ACCESS_BYTES} B per thread per global access (one narrow load: a flag)", True, _wide),
    Rule("no-barrier-in-loops", "no bar.sync in a loop", True, _no_barrier_in_loops),
)
GRID_RULE = "fills-the-gpu"  # checked per launch: at least MIN_PROGRAMS programs at BIG, for bulk kernels


def is_bulk(name: str) -> bool:
    return name not in TAIL_KERNELS


def kernel_violations(name: str, figures: dict[str, Json]) -> list[tuple[str, str]]:
    """``(rule, how)`` for each rule of :data:`RULES` the compiled kernel breaks (a compile error breaks all)."""
    if "error" in figures:
        return [("compiles", figures["error"])]
    excused = EXCUSED.get(name, {})
    return [(r.name, how) for r in RULES
            if (is_bulk(name) or not r.bulk_only) and r.name not in excused and (how := r.check(figures))]  # fmt: skip


def launch_violation(launch: Launch) -> str | None:
    """How a launch breaks ``fills-the-gpu`` (None: it does not, or the rule does not apply to it)."""
    if launch.shape == BIG and is_bulk(launch.name) and launch.programs < MIN_PROGRAMS:
        return f"{launch.programs} programs at {BIG} (at least {MIN_PROGRAMS})"
    return None


# ---------------------------------------------------------------- the report


@dataclasses.dataclass
class Report:
    """The launches, each distinct compiled kernel's figures, the notes and every rule broken."""

    launches: list[Launch]
    kernels: list[dict[str, Json]]  # one per distinct compilation, with "id", "name" and "key"
    notes: list[str]
    violations: list[dict[str, str]]  # rule, kernel id, kernel name, how, and (grid rule) op / case

    def to_json(self) -> dict[str, Json]:
        return {
            "what": "the compiled form only (PTX and ptxas for sm_90): nothing was run or timed",
            "target": list(TARGET),
            "shapes": {k: list(v) for k, v in SHAPES.items()},
            "rules": [{"name": r.name, "statement": r.statement, "bulk_only": r.bulk_only} for r in RULES]
            + [{"name": GRID_RULE, "statement": f">= {MIN_PROGRAMS} programs at {BIG}", "bulk_only": True}],
            "tail_kernels": TAIL_KERNELS,
            "excused": EXCUSED,
            "notes": self.notes,
            "kernels": self.kernels,
            "launches": [dataclasses.asdict(launch) for launch in self.launches],
            "violations": self.violations,
        }

    @classmethod
    def from_json(cls, data: dict[str, Json]) -> Report:
        launches = [Launch(**{**d, "grid": tuple(d["grid"])}) for d in data["launches"]]
        return cls(launches, data["kernels"], data["notes"], data["violations"])


def _kernel_table(launches: Sequence[Launch], specs: dict[str, dict[str, Json]]) -> list[dict[str, Json]]:
    """One entry per distinct compilation, in launch order: an id, the name, the binding and the figures."""
    compiled = compile_all(list(specs.values()))
    kernels: dict[str, dict[str, Json]] = {}
    for launch in launches:
        if launch.key not in kernels:
            spec = specs[launch.key]
            bound = {k: spec[k] for k in ("signature", "divisible_by_16", "equal_to_1")}
            kernels[launch.key] = {"id": f"K{len(kernels) + 1}", "name": launch.name, "key": launch.key,
                                   **bound, **compiled[launch.key]}  # fmt: skip
    return list(kernels.values())


def _violations(launches: Sequence[Launch], kernels: list[dict[str, Json]]) -> list[dict[str, str]]:
    out = [{"rule": rule, "id": k["id"], "kernel": k["name"], "how": how}
           for k in kernels for rule, how in kernel_violations(k["name"], k)]  # fmt: skip
    ids = {k["key"]: k["id"] for k in kernels}
    for launch in launches:
        if how := launch_violation(launch):
            out.append({"rule": GRID_RULE, "id": ids[launch.key], "kernel": launch.name, "how": how,
                        "op": launch.op, "case": launch.case})  # fmt: skip
    return out


def report(shapes: Sequence[str] = tuple(SHAPES)) -> Report:
    """Capture every op's launches, compile them and check the rules (needs the interpreter in this process)."""
    launches, notes = collect(shapes)
    return check(launches, notes)


def check(launches: Sequence[Launch], notes: Sequence[str] = ()) -> Report:
    """Bind and compile ``launches`` (recorded, or built by hand) and check the rules."""
    specs: dict[str, dict[str, Json]] = {}
    for launch in launches:
        spec = bind(launch)
        launch.key = spec_key(spec)
        specs.setdefault(launch.key, spec)
    kernels = _kernel_table(launches, specs)
    return Report(list(launches), kernels, list(notes), _violations(launches, kernels))


def _widths(widths: dict[str, int]) -> str:
    return " ".join(f"{w}B x{n}" for w, n in sorted(widths.items(), key=lambda x: int(x[0]))) or "-"


def _launched_by(rep: Report) -> dict[str, str]:
    """Per compile key: ``op [case] shape: programs, ...`` for every launch of it."""
    by: dict[str, dict[tuple[str, str], list[str]]] = {}
    for launch in rep.launches:
        by.setdefault(launch.key, {}).setdefault((launch.op, launch.case), []).append(
            f"{launch.shape}: {launch.programs}"
        )
    return {key: "; ".join(f"{op} [{case}] {', '.join(g)}" for (op, case), g in ops.items()) for key, ops in by.items()}


def _kernel_row(k: dict[str, Json], launched: str, broken: str) -> str:
    if "error" in k:
        return f"| {k['id']} | {k['name']} | {launched} | compile error: {k['error'][:200]} |" + " |" * 10
    smem = max(k["shared"], k["static_smem"])
    f64 = f"{k['f64']} ({k['f64_in_loops']})"
    bars = f"{k['bar_sync']} ({k['bar_sync_in_loops']})"
    local = f"{k['spill_stores']}/{k['spill_loads']}/{k['stack_frame']}"
    return (f"| {k['id']} | {k['name']} | {launched} | {k['num_warps']} | {k['registers']} | {local} | {smem} | "
            f"{f64} | {_widths(k['global_loads'])} | {_widths(k['global_stores'])} | {bars} | "
            f"{k['shared_accesses']} | {broken or 'none'} |")  # fmt: skip


def markdown(rep: Report) -> str:
    """The figures as markdown: the kernels, the launches, the rules broken, the notes."""
    broken: dict[str, list[str]] = {}
    for v in rep.violations:
        broken.setdefault(v["id"], [])
        if v["rule"] not in broken[v["id"]]:
            broken[v["id"]].append(v["rule"])
    launched = _launched_by(rep)
    lines = [
        "# The compiled form of the Triton kernels",
        "",
        f"Compiled for sm_90 (`GPUTarget{TARGET}`, the H100 / H200) from the launches the ops make at the shapes "
        f"{', '.join(f'{k} ({v[0]} x {v[1]})' for k, v in SHAPES.items())}. **This checks the compiled form only "
        "(PTX and `ptxas -v`): nothing was run, nothing was timed.**",
        "",
        "Columns: the launches (op [case] shape: programs); warps per program; registers per thread; local memory as "
        "spill stores / spill loads / stack frame (bytes); shared memory (bytes); `.f64` instructions (in loops); "
        "global loads and stores as bytes per thread per instruction x instructions; `bar.sync` (in loops); "
        "shared-memory accesses; rules broken.",
        "",
        "| id | kernel | launched by | warps | regs | local | smem | f64 | global loads | global stores | bar.sync "
        "| shared | broken |",
        "|---|---|---|--:|--:|---|--:|---|---|---|---|--:|---|",
        *(_kernel_row(k, launched.get(k["key"], ""), ", ".join(broken.get(k["id"], []))) for k in rep.kernels),
        "",
        *_launch_lines(rep),
        "",
        *_violation_lines(rep),
        "",
        "## Notes",
        "",
        *(f"- {n}" for n in rep.notes),
    ]
    return "\n".join(lines) + "\n"


def _launch_lines(rep: Report) -> list[str]:
    ids = {k["key"]: k["id"] for k in rep.kernels}
    lines = ["## Launches", "", "| op | case | shape | kernel | grid | programs |", "|---|---|---|---|---|--:|"]
    for launch in rep.launches:
        grid = " x ".join(str(g) for g in launch.grid)
        lines.append(f"| {launch.op} | {launch.case} | {launch.shape} | {ids[launch.key]} {launch.name} | "
                     f"{grid} | {launch.programs} |")  # fmt: skip
    return lines


def _violation_lines(rep: Report) -> list[str]:
    lines = ["## Rules", ""]
    for rule in (*(r.name + ": " + r.statement for r in RULES), f"{GRID_RULE}: >= {MIN_PROGRAMS} programs at {BIG}"):
        lines.append(f"- {rule}")
    lines += ["", f"Tail kernels (bulk rules not applied): {', '.join(TAIL_KERNELS)}."]
    lines += [f"Excused: {k} from {r} ({why})." for k, rules in EXCUSED.items() for r, why in rules.items()]
    lines += ["", "## Broken", ""]
    for v in rep.violations:
        where = f" ({v['op']} [{v['case']}])" if "op" in v else ""
        lines.append(f"- {v['rule']}: {v['id']} {v['kernel']}{where}: {v['how']}")
    return lines + ([] if rep.violations else ["none"])


_SUMMARY = "Print the compiled form of every Triton kernel (PTX and ptxas figures for sm_90; nothing is run)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.kernels.triton.form", description=_SUMMARY)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="only these shapes (repeatable)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
    rep = report(args.shape or tuple(SHAPES))
    if args.json:
        Path(args.json).write_text(json.dumps(rep.to_json(), indent=1))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
