"""docs/internals/layout.md against the tree: every package and top-level folder named, every module of each
package and every integration and example named in its folder's entry, and the pytest markers pyproject.toml's."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs/internals/layout.md"


def tree_block(text: str) -> list[str]:
    """The lines of the page's first code block: the tree."""
    return text.split("```\n", 2)[1].splitlines()


def entries(lines: list[str]) -> dict[str, str]:
    """Each entry of the tree (a name at indent 0 or 2) with its text: its lines up to the next entry at the same
    indent or less. Nested folders are named by their path from their parent entry (``kernels/triton/``)."""
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := re.match(r"( {0,2})(\S+)", line))]  # fmt: skip
    out: dict[str, str] = {}
    parent = ""
    for n, (i, indent, name) in enumerate(heads):
        end = next((j for j, ind, _ in heads[n + 1 :] if ind <= indent), len(lines))
        key = name if indent == 0 else parent + name
        if indent == 0:
            parent = name
        out[key] = "\n".join(lines[i:end])
    return out


def named(entry: str, filename: str) -> bool:
    return re.search(rf"(?<![\w/]){re.escape(filename)}(?!\w)", entry) is not None


def top_level_folders() -> list[str]:
    """The repository's folders, less hidden ones and those .gitignore names (build outputs)."""
    ignored = [p.strip().rstrip("/") for p in (ROOT / ".gitignore").read_text().splitlines() if p.strip()]
    return sorted(d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
                  and not any(fnmatch.fnmatch(d.name, p) for p in ignored))  # fmt: skip


def missing(text: str) -> list[str]:
    """What the page's tree leaves out of the repository (empty when it names everything)."""
    found = entries(tree_block(text))
    out = [f"top-level folder {d}/" for d in top_level_folders() if f"{d}/" not in found]
    packages = sorted(p.parent for p in (ROOT / "sylvie_comm").rglob("__init__.py"))
    for package in [*packages, ROOT / "integrations", ROOT / "examples"]:
        rel = package.relative_to(ROOT).as_posix()
        key = rel + "/" if "/" not in rel else "sylvie_comm/" + rel.removeprefix("sylvie_comm/") + "/"
        if key not in found:
            out.append(f"folder {rel}/")
            continue
        for module in sorted(package.glob("*.py")):
            if module.name != "__init__.py" and not named(found[key], module.name):
                out.append(f"{rel}/{module.name}")
    return out


def doc_markers(text: str) -> list[str]:
    m = re.search(r"pytest markers: ([a-z_, ]+)", text)
    assert m, "layout.md names no pytest markers"
    return [s.strip() for s in m.group(1).split(",")]


def pyproject_markers() -> list[str]:
    """The markers of pyproject.toml's ``markers = [...]`` (read as text: tomllib is Python 3.11's, the floor 3.10)."""
    block = (ROOT / "pyproject.toml").read_text().split("\nmarkers = [", 1)[1].split("\n]", 1)[0]
    return re.findall(r'^\s*"([a-z_]+):', block, re.MULTILINE)


def test_the_layout_names_every_folder_and_module_of_the_tree():
    left_out = missing(LAYOUT.read_text())
    assert not left_out, "docs/internals/layout.md leaves out:\n" + "\n".join(left_out)


def test_the_layout_names_pyproject_markers():
    assert doc_markers(LAYOUT.read_text()) == pyproject_markers()


def test_the_check_finds_a_module_left_out_and_a_folder_named_by_an_old_name():
    text = LAYOUT.read_text()
    assert "sylvie_comm/algorithms/monitor.py" in missing(
        text.replace("monitor.py (the compression monitor around", "")
    )
    without_triton = text.replace("  kernels/triton/ the GPU kernels", "  the GPU kernels")
    assert "folder sylvie_comm/kernels/triton/" in missing(without_triton)
    assert doc_markers("pytest markers: multiprocess, gpu, slow") != pyproject_markers()
