"""Every kernel op, declared once: its schema, its argument check, its fake and its reference.

An :class:`OpDecl` is all that is written about an op outside its implementations; the rest is generated from it:

* the schema, defined under every namespace that serves the op (:func:`define`): ``sylvie_comm_cpu`` (the C++ CPU
  kernels, which the extension registers as implementations only: ``csrc/cpu/kernels.cpp``, its
  ``TORCH_LIBRARY_IMPL``), ``sylvie_comm`` (the public ops, whose CPU kernel is the check then the C++ kernel:
  :mod:`sylvie_comm.kernels.compiled`) and ``sylvie_comm_triton`` (the Triton kernels,
  :mod:`sylvie_comm.kernels.triton`); the dispatcher compares the C++ kernels' signatures with the schema when it is
  defined, so a C++ kernel that disagrees with its declaration fails the import;
* the argument check (:mod:`sylvie_comm.kernels.checks`), run in Python before any kernel is entered: a bad
  argument is a ``RuntimeError`` raised there, never a C++ exception (see :mod:`sylvie_comm.kernels.checks`);
* the fake (shape-only) implementation, registered with each schema, so the ops trace (``torch.compile``) and
  propagate shapes without running a kernel;
* the dispatch of :mod:`sylvie_comm.kernels` (:mod:`sylvie_comm.kernels.dispatch`): which kernels run a call, and
  the reference that runs it where none can (``reference``, taking the op's own arguments).

The implementations are registered against the declaration: the C++ kernels by name in ``csrc/cpu/kernels.cpp``,
the Triton host functions by :func:`sylvie_comm.kernels.triton.register` from the ``family`` module named here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sylvie_comm.kernels import checks, reference

__all__ = ["DECLS", "OpDecl", "define"]


@dataclasses.dataclass(frozen=True)
class OpDecl:
    """One kernel op. ``schema``: its arguments and results as torch's schema language writes them (``"(Tensor
    values, int bits) -> Tensor"``); ``check``: its argument check, called as ``check(device_type, *arguments)``;
    ``reference``: its pure-torch semantics, taking the same arguments; ``fake``: the shapes of its results (None:
    it writes into its arguments only); ``family``: the Triton module that implements it; ``direct``: a plan may
    call its Triton host code unchecked (:func:`sylvie_comm.kernels.direct`)."""

    name: str
    schema: str
    check: Callable[..., None]
    reference: Callable[..., Any]
    family: str
    fake: Callable[..., Any] | None = None
    direct: bool = False

    @property
    def definition(self) -> str:
        """The schema with the op's name, as ``torch.library`` defines it."""
        return self.name + self.schema

    @functools.cached_property
    def arguments(self) -> tuple[str, ...]:
        """The names of the op's arguments, in order."""
        inside = self.schema[self.schema.index("(") + 1 : self.schema.index(") ->")]
        return tuple(part.split("=")[0].split()[-1] for part in inside.split(","))

    @functools.cached_property
    def main(self) -> int:
        """The position of the first tensor the op always takes: the one whose device decides its kernels."""
        inside = self.schema[self.schema.index("(") + 1 : self.schema.index(") ->")]
        types = [part.split()[0] for part in inside.split(",")]
        return next(i for i, t in enumerate(types) if t.startswith("Tensor") and not t.endswith("?"))


# ---------------------------------------------------------------- fakes (shapes only)


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    return values.new_empty((values.shape[0], checks.packed_cols(values.shape[1], bits)), dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    return packed.new_empty((packed.shape[0], cols), dtype=torch.uint8)


def _onebit_encode(x: torch.Tensor, chunk_size: int, norm_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_chunk_size(chunk_size, "onebit_encode")  # the shapes need it
    n = x.numel()
    return x.new_empty(((n + 7) // 8,), dtype=torch.uint8), x.new_empty((-(-n // chunk_size),), dtype=torch.float32)


def _onebit_decode(packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int,
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return packed.new_empty((numel,), dtype=dtype)


def _qbit_encode(x: torch.Tensor, bits: int, seed: int, offset: int,
                 meta_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    rows, cols = x.shape
    packed = x.new_empty((rows, checks.packed_cols(cols, bits)), dtype=torch.uint8)
    return packed, x.new_empty((rows,), dtype=meta_dtype), x.new_empty((rows,), dtype=meta_dtype)


def _qbit_decode(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, cols: int,
                 dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return packed.new_empty((packed.shape[0], cols), dtype=dtype)


def _writes_only(*args: object, **kwargs: object) -> None:
    """The fake of an op that writes into its arguments only."""
    return None


def _lowrank_project_reference(residual: torch.Tensor, grad: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor,
                               subtract: bool, pending_p: torch.Tensor | None = None,
                               pending_q: torch.Tensor | None = None,
                               saved: torch.Tensor | None = None) -> None:  # fmt: skip
    """:func:`sylvie_comm.kernels.reference.lowrank_project` on the op's arguments (the pending factors apart)."""
    pending = None if pending_p is None or pending_q is None else (pending_p, pending_q)
    reference.lowrank_project(residual, grad, q, p, subtract, pending, saved)


# ---------------------------------------------------------------- the ops

# fmt: off
_SAVED = "Tensor(d!)? saved=None"
DECLS: dict[str, OpDecl] = {
    d.name: d
    for d in (
        # values: (rows, cols) uint8 < 2**bits -> (rows, ceil(cols * bits / 8)) uint8.
        OpDecl("pack_bits", "(Tensor values, int bits) -> Tensor", checks.pack_bits, reference.pack_bits, "bits",
               _pack_bits),
        OpDecl("unpack_bits", "(Tensor packed, int bits, int cols) -> Tensor", checks.unpack_bits,
               reference.unpack_bits, "bits", _unpack_bits),
        # Sign bits of the flattened input and one fp32 scale per chunk.
        OpDecl("onebit_encode", "(Tensor x, int chunk_size, bool norm_scale) -> (Tensor, Tensor)",
               checks.onebit_encode, reference.onebit_encode, "onebit", _onebit_encode),
        OpDecl("onebit_decode", "(Tensor packed, Tensor scales, int numel, int chunk_size, ScalarType dtype) -> Tensor",
               checks.onebit_decode, reference.onebit_decode, "onebit", _onebit_decode),
        # Decode into an existing contiguous tensor (no allocation, no first-touch page faults).
        OpDecl("onebit_decode_into", "(Tensor packed, Tensor scales, int chunk_size, Tensor(a!) out) -> ()",
               checks.onebit_decode_into, reference.onebit_decode_into, "onebit"),
        # Per-row stochastic quantization: (packed, scale, minimum).
        OpDecl("qbit_encode",
               "(Tensor x, int bits, int seed, int offset, ScalarType meta_dtype) -> (Tensor, Tensor, Tensor)",
               checks.qbit_encode, reference.qbit_encode, "qbit", _qbit_encode, direct=True),
        OpDecl("qbit_decode",
               "(Tensor packed, Tensor scale, Tensor minimum, int bits, int cols, ScalarType dtype) -> Tensor",
               checks.qbit_decode, reference.qbit_decode, "qbit", _qbit_decode, direct=True),
        # out: a contiguous (rows, cols) tensor.
        OpDecl("qbit_decode_into", "(Tensor packed, Tensor scale, Tensor minimum, int bits, Tensor(a!) out) -> ()",
               checks.qbit_decode_into, reference.qbit_decode_into, "qbit", direct=True),
        # Error-fed one-bit encode in place: residual += grad (when given), encode it into packed and scales,
        # residual -= its decode (fp32, contiguous). With `saved`, the residual as it was is written there first,
        # while it is read: what a step skipped for a non-finite input restores (likewise for the ops below).
        OpDecl("onebit_feedback_encode", "(Tensor(a!) residual, Tensor? grad, int chunk_size, bool norm_scale, "
               f"Tensor(b!) packed, Tensor(c!) scales, {_SAVED}) -> ()",
               checks.onebit_feedback_encode, reference.onebit_feedback_encode, "onebit"),
        # The same with residual += the mean of w one-bit rows (parts_packed (w, ceil(n / 8)) uint8, parts_scales
        # (w, chunks) fp32, each row contiguous, any row stride): decoded, summed in fp32 in row order, divided by w.
        OpDecl("onebit_mean_feedback_encode", "(Tensor(a!) residual, Tensor parts_packed, Tensor parts_scales, "
               f"int chunk_size, bool norm_scale, Tensor(b!) packed, Tensor(c!) scales, {_SAVED}) -> ()",
               checks.onebit_mean_feedback_encode, reference.onebit_mean_feedback_encode, "onebit"),
        # residual -= pending_p pending_q^T (when given; the bits of lowrank_outer_into(residual, pending_p,
        # pending_q, -1, true)), residual += grad (when given), p = residual q, and with subtract residual -= p q^T,
        # in one pass over the residual (saved: the residual before the pending update).
        OpDecl("lowrank_project", "(Tensor(a!) residual, Tensor? grad, Tensor q, Tensor(b!) p, bool subtract, "
               "Tensor? pending_p=None, Tensor? pending_q=None, Tensor(c!)? saved=None) -> ()",
               checks.lowrank_project, _lowrank_project_reference, "lowrank", direct=True),
        # residual += grad (when given), q = residual^T p.
        OpDecl("lowrank_gram", "(Tensor(a!) residual, Tensor? grad, Tensor p, Tensor(b!) q, "
               "Tensor(c!)? saved=None) -> ()", checks.lowrank_gram, reference.lowrank_gram, "lowrank",
               direct=True),
        # out = p (alpha q)^T, or out += p (alpha q)^T with accumulate; with `when` (a one-element bool tensor on
        # out's device, read there) nothing happens unless it is true.
        OpDecl("lowrank_outer_into", "(Tensor(a!) out, Tensor p, Tensor q, float alpha, bool accumulate, "
               "Tensor? when=None) -> ()", checks.lowrank_outer_into, reference.lowrank_outer_into, "lowrank",
               direct=True),
        # dst <- src (zeros without src) when `flag`, a one-element bool tensor on dst's device, is true; else
        # nothing. The flag is read on the device: no host synchronisation.
        OpDecl("copy_if", "(Tensor(a!) dst, Tensor? src, Tensor flag) -> ()", checks.copy_if, reference.copy_if,
               "bits"),
    )
}
# fmt: on


def define(namespace: str, impls: Mapping[str, Callable[..., Any]] | None = None, keys: Sequence[str] = ("CPU",),
           names: Sequence[str] | None = None) -> Any:  # fmt: skip
    """Define the ops ``names`` (all by default) under ``namespace`` with their declared schemas and fakes, and
    register ``impls[name]`` for each dispatch key of ``keys`` (none without ``impls``: implementations registered
    elsewhere, as the C++ ones are). Returns the ``torch.library.Library``, to be kept alive with its caller."""
    lib = torch.library.Library(namespace, "FRAGMENT")  # type: ignore[no-untyped-call]
    for name in names if names is not None else DECLS:
        decl = DECLS[name]
        lib.define(decl.definition)  # type: ignore[no-untyped-call]
        for key in keys if impls is not None else ():
            lib.impl(name, impls[name], key)  # type: ignore[no-untyped-call,index]
        torch.library.register_fake(f"{namespace}::{name}", decl.fake or _writes_only, lib=lib)
    return lib
