"""Recording the launches: every op of :data:`~.calls.OP_CALLS` called under the interpreter with its launches replaced
by a recorder (:func:`collect`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from sylvie_comm.kernels.triton import INTERPRETER_LOCK, NAMESPACE, interpreted, load, load_error
from sylvie_comm.kernels.triton.form.calls import OP_CALLS, SHAPES, Json, Pool, cuda_choices, registered_ops

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
    with cuda_choices(recorder.notes), recording(recorder):
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
