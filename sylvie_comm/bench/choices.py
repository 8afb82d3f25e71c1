"""The benchmarks' lists of names chosen on the command line (codecs, rows, links)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def unique_choices(
    names: Iterable[str], valid: Sequence[str] | Callable[[str], None], kind: str, *, allow_empty: bool = False
) -> list[str]:
    """``names`` in order without repeats; a ValueError naming the first unknown one (``valid``: the known names,
    or a check that raises for an unknown one) and, unless ``allow_empty``, an empty choice, listing the valid."""
    out: list[str] = []
    listed = ", ".join(valid) if not callable(valid) else ""
    for name in names:
        if callable(valid):
            valid(name)
        elif name not in valid:
            raise ValueError(f"unknown {kind} {name!r}; valid: {listed}")
        if name not in out:
            out.append(name)
    if not out and not allow_empty:
        raise ValueError(f"no {kind} given" + (f"; valid: {listed}" if listed else ""))
    return out


__all__ = ["unique_choices"]
