"""Griffe extension: show the docstrings' reStructuredText markup as Markdown on the site.

The docstrings are written for ``help()`` and Sphinx: cross-reference roles (``:class:`~pkg.Name```) and literal
blocks introduced by ``::``. The site renders Markdown, so for the pages only (the sources are not changed) a role
becomes inline code of the name it shows, and a literal block at the docstring's top level becomes a fenced code
block, which the Google-style parser leaves alone.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`~a.b.C` -> `C`; :func:`a.b.f` -> `a.b.f`; :meth:`text <target>` -> `text`.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|type):`(~?)([^`<]+?)(?:\s*<[^>]+>)?`")
SHELL = ("torchrun", "horovodrun", "python ", "python3 ", "sudo ", "sylvie-comm", "pip ", "$ ", "./", "bash ")


def _role(match: re.Match[str]) -> str:
    short, text = match.group(1), match.group(2).strip()
    return f"`{text.rsplit('.', 1)[-1] if short else text}`"


def _language(intro: str, block: list[str]) -> str:
    first = next((line.strip() for line in block if line.strip()), "")
    if "yaml" in intro.lower() or (re.match(r"^[\w-]+:\s", first) and "(" not in first):
        return "yaml"
    return "bash" if first.startswith(SHELL) else "python"


def markdown(text: str) -> str:
    """``text`` with roles as inline code and top-level ``::`` literal blocks as fenced code blocks."""
    lines = ROLE.sub(_role, text).split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        block_start = i + 1
        while block_start < len(lines) and not lines[block_start].strip():
            block_start += 1
        top_level = line.rstrip().endswith("::") and not line.startswith(" ")
        if top_level and block_start < len(lines) and lines[block_start].startswith(" "):
            end = block_start
            while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
                end += 1
            while end > block_start and not lines[end - 1].strip():
                end -= 1
            block = lines[block_start:end]
            indent = min(len(b) - len(b.lstrip()) for b in block if b.strip())
            intro = line.rstrip()[:-1]
            out += [intro, "", f"```{_language(intro, block)}", *(b[indent:] for b in block), "```"]
            i = end
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RstMarkup(griffe.Extension):
    """Rewrite every docstring of a loaded package with :func:`markdown`."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                obj.docstring.value = markdown(obj.docstring.value)
            stack.extend(m for m in obj.members.values() if not m.is_alias)
