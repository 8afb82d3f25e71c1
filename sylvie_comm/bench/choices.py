"""The benchmarks' lists of names chosen on the command line (codecs, rows, links)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from typing import Any


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


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,key=value`` (``acpsgd:rank=8``) as the name and its options; a dotted key
    sets a field of a mapping option (``acpsgd:monitor.period=0``). Values read as booleans (``true``,
    ``false``), integers or floats where they are, else strings. A ValueError names the spec and the bad item."""
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"{spec!r}: no name before the options")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{spec!r}: option {item!r} is not key=value")
        outer, dot, inner = key.partition(".")
        if dot:
            if not isinstance(options.setdefault(outer, {}), dict):
                raise ValueError(f"{spec!r}: {outer!r} is given a value and fields")
            options[outer][inner] = _value(value)
        else:
            if isinstance(options.get(key), dict):
                raise ValueError(f"{spec!r}: {key!r} is given a value and fields")
            options[key] = _value(value)
    return name, options


def split_specs(text: str) -> list[str]:
    """A comma-separated list of specs whose options are comma-separated too: ``a,b:x=1,y=2,c`` is
    ``['a', 'b:x=1,y=2', 'c']`` (an item with ``=`` and no ``:`` continues the spec before it)."""
    out: list[str] = []
    for item in (c.strip() for c in text.split(",")):
        if not item:
            continue
        if out and "=" in item and ":" not in item and ":" in out[-1]:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def _value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


__all__ = ["parse_spec", "split_specs", "unique_choices"]


def at_least(low: int, meaning: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, refused as ``expected {meaning}`` (default: ``an integer >= low``)."""
    meaning = meaning or f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected {meaning}, got {text!r}")
        return value

    return parse
