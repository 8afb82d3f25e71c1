"""MkDocs hook: serve the records in ``benchmarks/`` (plots and JSON) under ``benchmarks/data/`` of the site.

The benchmarks write their records into the repository's ``benchmarks/`` folder, next to the code that made
them; the pages show the plots and link the raw data from there, with no copy kept under ``docs/``.
Markdown records are left out: the pages quote their tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks"
SUFFIXES = (".png", ".json")


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    for path in sorted(RECORDS.rglob("*")):
        if path.is_file() and path.suffix in SUFFIXES:
            uri = "benchmarks/data/" + path.relative_to(RECORDS).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
