"""ARCHITECTURE.md's import rules, checked against the code: a layer imports only its own and lower layers.

Every ``import``/``from ... import`` of a ``sylvie_comm`` module in the
package and in ``integrations/`` is read with ``ast`` (nothing is imported).
An import at module level must point down (or sideways, within the layer); an
import inside a function may point up only where ARCHITECTURE.md lists it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("sylvie_comm._deps", "sylvie_comm._ops", "sylvie_comm.config", "sylvie_comm.kernels",
              "sylvie_comm.registry")),
    ("collectives", ("sylvie_comm.collectives",)),
    ("codecs", ("sylvie_comm.codecs",)),
    ("algorithms", ("sylvie_comm.algorithms",)),
    ("optim", ("sylvie_comm.optim",)),
    ("gnn", ("sylvie_comm.gnn",)),
    ("integrations", ("sylvie_comm.integrations",)),
    ("apps", ("sylvie_comm", "sylvie_comm.gnn.train", "sylvie_comm.gnn.gpu_check", "sylvie_comm.demo",
              "sylvie_comm.bench", "sylvie_comm.cli", "sylvie_comm.ddp", "sylvie_comm.fsdp",
              "sylvie_comm.horovod")),
]  # fmt: skip

# Upward imports allowed inside a function (ARCHITECTURE.md, "Imports that point up").
LAZY_UP = {
    ("sylvie_comm.registry", "sylvie_comm.codecs"),
    ("sylvie_comm.registry", "sylvie_comm.algorithms.registry"),
}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best >= 0, f"{module} is in no layer of ARCHITECTURE.md"
    return best


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "sylvie_comm").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        parts = ("sylvie_comm", *path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported sylvie_comm module, inside a function, line) for every import in ``path``."""
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, inner, child.lineno) for a in child.names if a.name.startswith("sylvie_comm"))
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("sylvie_comm"):
                for a in child.names:
                    sub = f"{child.module}.{a.name}"
                    # ``from sylvie_comm import _deps`` imports the module _deps, not the package's __init__.
                    out.append((sub if sub in known else child.module, inner, child.lineno))
            if not isinstance(child, (ast.Import, ast.ImportFrom)):
                visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return out


def test_every_import_points_down_or_is_a_listed_lazy_one():
    found = modules()
    known = set(found)
    wrong = []
    for module, path in found.items():
        mine = layer_of(module)
        for target, nested, line in imports(path, known):
            if layer_of(target) <= mine or (nested and (module, target) in LAZY_UP):
                continue
            where = "inside a function" if nested else "at module level"
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine][0]}) imports {target} "
                         f"({LAYERS[layer_of(target)][0]}) {where}")  # fmt: skip
    assert not wrong, "imports against ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_the_layers_named_here_are_the_ones_architecture_md_names():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    for name, prefixes in LAYERS:
        assert f"**{name}**" in text, name
        for p in prefixes:
            assert f"`{p}`" in text, p
    for a, b in LAZY_UP:
        assert f"`{a}` -> `{b}`" in text, (a, b)


def test_the_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from sylvie_comm.integrations.ddp import register\n")
    ((target, nested, _),) = imports(bad, {"sylvie_comm.integrations.ddp"})
    assert layer_of(target) > layer_of("sylvie_comm.codecs.base") and not nested
