"""Griffe extension: read ``integrations/`` as ``sylvie_comm.integrations``, as the install maps it.

``setup.py`` installs the top-level ``integrations/`` folder as the package ``sylvie_comm.integrations``
(``package_dir``). Griffe reads sources from folders, so it finds ``sylvie_comm/`` but not that package,
and the short forms (``sylvie_comm.ddp``, ``sylvie_comm.fsdp``, ``sylvie_comm.horovod``), which re-export
it, would point nowhere. This extension visits the folder's modules statically (nothing is imported) and
attaches them under ``sylvie_comm`` once that package is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "integrations"


class IntegrationsPackage(griffe.Extension):
    """Attach ``integrations/*.py`` to the ``sylvie_comm`` package as ``sylvie_comm.integrations``."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "sylvie_comm" or "integrations" in pkg.members:
            return
        package = self._visit("integrations", FOLDER / "__init__.py", pkg, loader)
        for path in sorted(FOLDER.glob("*.py")):
            if path.stem != "__init__":
                self._visit(path.stem, path, package, loader)

    @staticmethod
    def _visit(name: str, path: Path, parent: griffe.Module, loader: griffe.GriffeLoader) -> griffe.Module:
        code = path.read_text(encoding="utf-8")
        loader.lines_collection[path] = code.splitlines(keepends=False)
        module = griffe.visit(
            name,
            filepath=path,
            code=code,
            extensions=loader.extensions,
            parent=parent,
            docstring_parser=loader.docstring_parser,
            docstring_options=loader.docstring_options,
            lines_collection=loader.lines_collection,
            modules_collection=loader.modules_collection,
        )
        parent.set_member(name, module)
        return module
