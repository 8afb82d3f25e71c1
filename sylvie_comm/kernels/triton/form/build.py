"""Compiling the recorded launches for sm_90, in worker processes (where the kernel modules import compiled, not
interpreted)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import queue
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from sylvie_comm.kernels.triton import load, load_error
from sylvie_comm.kernels.triton.form.calls import TARGET, Json
from sylvie_comm.kernels.triton.form.ptx import parse_ptxas, ptxas, read_ptx
from sylvie_comm.kernels.triton.form.record import Launch, describe

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


def worker() -> int:
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
    cmd = [sys.executable, "-m", "sylvie_comm.kernels.triton.form", "--worker"]
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
