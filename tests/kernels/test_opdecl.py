"""Every kernel op is declared once (:mod:`sylvie_comm.kernels.opdecl`), and everything else agrees with it: the
schemas of every namespace that serves it, its check's and its reference's arguments, the C++ kernels the extension
registers (implementations only: the C++ sources define no schema), the Triton families, the fakes' and the
compiled form's cases."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from sylvie_comm import _ops
from sylvie_comm.kernels import triton as kt
from sylvie_comm.kernels.opdecl import DECLS, OpDecl

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(DECLS)


def _schema(namespace: str, name: str) -> str:
    return str(getattr(getattr(torch.ops, namespace), name).default._schema)


def _namespaces() -> list[str]:
    served = ["sylvie_comm", _ops.CPU_NAMESPACE] if _ops.HAS_EXTENSION else []
    return served + ([kt.NAMESPACE] if kt.load() else [])


@pytest.mark.parametrize("name", NAMES)
def test_every_namespace_defines_the_declared_schema(name: str) -> None:
    namespaces = _namespaces()
    if not namespaces:
        pytest.skip("neither the extension nor Triton here")
    for namespace in namespaces:
        assert _schema(namespace, name) == f"{namespace}::{DECLS[name].definition}", namespace


@pytest.mark.parametrize("name", NAMES)
def test_the_check_and_the_reference_take_the_declared_arguments(name: str) -> None:
    decl = DECLS[name]
    assert decl.name == name
    assert tuple(inspect.signature(decl.check).parameters) == ("device_type", *decl.arguments)
    reference = list(inspect.signature(decl.reference).parameters.values())
    assert tuple(p.name for p in reference[: len(decl.arguments)]) == decl.arguments
    assert all(p.default is not inspect.Parameter.empty for p in reference[len(decl.arguments) :])


def test_the_main_tensor_is_the_first_one_always_given() -> None:
    assert {name: d.arguments[d.main] for name, d in DECLS.items() if d.arguments[d.main] not in ("x", "residual")} == {
        "pack_bits": "values", "unpack_bits": "packed", "onebit_decode": "packed", "onebit_decode_into": "packed",
        "qbit_decode": "packed", "qbit_decode_into": "packed", "lowrank_outer_into": "out", "copy_if": "dst",
    }  # fmt: skip


def test_a_wrong_declaration_is_refused_by_the_dispatcher() -> None:
    """A schema that is not torch's schema language fails where it is defined, naming it."""
    bad = OpDecl("sylvie_comm_test_bad", "(Tensor x, int) -> Tensor", DECLS["pack_bits"].check, lambda x: x, "bits")
    lib = torch.library.Library("sylvie_comm_test", "FRAGMENT")  # type: ignore[no-untyped-call]
    with pytest.raises(RuntimeError):
        lib.define(bad.definition)  # type: ignore[no-untyped-call]


def test_the_cpp_sources_define_no_schema() -> None:
    """The schemas are written once, in Python: the C++ side registers implementations only."""
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".cpp", ".h", ".inc"):
            text = path.read_text()
            assert "TORCH_LIBRARY(" not in text and not re.search(r'def\(\s*"[^"]*\) ->', text), path


@pytest.mark.skipif(not _ops.HAS_EXTENSION, reason="needs the compiled extension")
def test_the_extension_implements_every_declared_op_and_no_other() -> None:
    source = (ROOT / "csrc" / "cpu" / "kernels.cpp").read_text()
    assert set(re.findall(r'm\.impl\("(\w+)"', source)) == set(DECLS)
    for name in DECLS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{_ops.CPU_NAMESPACE}::{name}", "CPU"), name


def test_every_family_is_a_triton_module_and_every_direct_op_is_in_it() -> None:
    assert kt.FAMILIES == ("bits", "onebit", "qbit", "lowrank")
    assert {name: d.family for name, d in DECLS.items() if d.direct} == kt.UNCHECKED_OPS
    assert set(kt.UNCHECKED_OPS) == {"qbit_encode", "qbit_decode", "qbit_decode_into", "lowrank_project",
                                     "lowrank_gram", "lowrank_outer_into"}  # fmt: skip


def test_every_declared_op_has_a_fake_case_and_a_compiled_form_row() -> None:
    from sylvie_comm.kernels.triton import form
    from tests.kernels.test_fakes import CASES

    assert set(CASES) == set(DECLS)
    assert set(form.OP_CALLS) == set(DECLS)
