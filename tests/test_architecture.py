"""ARCHITECTURE.md's import rules, checked against the code: a layer imports only its own and lower layers, and no
module imports itself back through others.

Every ``import``/``from ... import`` of a ``sylvie_comm`` module in the
package and in ``integrations/`` is read with ``ast`` (nothing is imported).
An import at module level must point down (or sideways, within the layer); an
import inside a function may point up only where ARCHITECTURE.md lists it.

Sideways imports can still close a loop within a layer, which the layer rule cannot see, so the imports also
form a graph that must have no cycle. Every import is an edge of it, at module level or inside a function (one
in a function is a dependency of the design even where Python tolerates the loop at run time), ``if
TYPE_CHECKING:`` blocks included; the upward look-ups ARCHITECTURE.md lists (:data:`LAZY_UP`) are the only edges
left out: the one namespace of names reads the codecs' and the algorithms' names when a name is looked up.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Mapping
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
    ("apps", ("sylvie_comm", "sylvie_comm.gnn.train", "sylvie_comm.gnn.gpu_check", "sylvie_comm.gnn.halo_accuracy",
              "sylvie_comm.demo",
              "sylvie_comm.bench", "sylvie_comm.cli", "sylvie_comm.ddp", "sylvie_comm.diloco", "sylvie_comm.fsdp",
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


# ---------------------------------------------------------------------------------------------------- import cycles

Graph = Mapping[str, Mapping[str, tuple[Path, int]]]  # module -> imported module -> (file, line of the first import)


def import_graph(found: Mapping[str, Path]) -> dict[str, dict[str, tuple[Path, int]]]:
    """Every import between ``found``'s modules (at module level and inside functions), less a module's imports of
    itself and the listed upward look-ups (:data:`LAZY_UP`)."""
    known = set(found)
    graph: dict[str, dict[str, tuple[Path, int]]] = {m: {} for m in found}
    for module, path in found.items():
        for target, _, line in imports(path, known):
            if target != module and target in known and (module, target) not in LAZY_UP:
                graph[module].setdefault(target, (path, line))
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm): the shortest way
    from the component's first module (by name) back to itself, as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in sorted(components, key=min):
        start = min(component)
        came: dict[str, str] = {}
        queue = deque([start])
        while queue:  # breadth first within the component: the shortest way back to ``start``
            v = queue.popleft()
            if start in graph.get(v, {}):
                path = [start, v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                out.append(path[::-1])
                break
            for w in sorted(graph.get(v, {})):
                if w in component and w not in came and w != start:
                    came[w] = v
                    queue.append(w)
    return out


def describe(cycle: list[str], graph: Graph) -> str:
    """``a -> b (file:line) -> ... -> a (file:line)``: each step with the import that makes it."""
    steps = [cycle[0]]
    for a, b in itertools.pairwise(cycle):
        path, line = graph[a][b]
        steps.append(f"{b} ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line})")
    return " -> ".join(steps)


def test_no_module_imports_itself_back_through_others():
    graph = import_graph(modules())
    found = [describe(c, graph) for c in cycles(graph)]
    assert not found, "import cycles (an import inside a function counts):\n" + "\n".join(found)


def test_the_cycle_check_finds_a_loop_through_a_function_and_a_type_only_import(tmp_path):
    (tmp_path / "a.py").write_text("from sylvie_comm.x.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from sylvie_comm.x.c import g\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sylvie_comm.x.a import A\n"
    )
    (tmp_path / "d.py").write_text("import sylvie_comm.x.a\n")  # into the loop, not part of it
    found = {f"sylvie_comm.x.{n}": tmp_path / f"{n}.py" for n in "abcd"}
    graph = import_graph(found)
    assert cycles(graph) == [["sylvie_comm.x.a", "sylvie_comm.x.b", "sylvie_comm.x.c", "sylvie_comm.x.a"]]
    said = describe(cycles(graph)[0], graph)
    assert said == "sylvie_comm.x.a -> sylvie_comm.x.b (a.py:1) -> sylvie_comm.x.c (b.py:2) -> sylvie_comm.x.a (c.py:3)"
    (tmp_path / "c.py").write_text("import torch\n")  # the loop broken: d still imports a, which nothing imports back
    assert cycles(import_graph(found)) == []


def test_the_cycle_check_leaves_out_the_listed_upward_look_ups_only():
    graph = import_graph(modules())
    for a, b in LAZY_UP:
        assert b not in graph[a], (a, b)
    assert "sylvie_comm.registry" in graph["sylvie_comm.algorithms.registry"]  # the way back down is an edge
