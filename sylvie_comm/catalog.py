"""The tables of codecs and algorithms, rendered from the registries: one fact in one place.

Every table or list of the registered codecs and algorithms that a reader sees is rendered here from
:data:`sylvie_comm.algorithms.registry.ALGORITHMS`, :data:`sylvie_comm.codecs.CODECS`,
:data:`sylvie_comm.registry.HALO_FORMS` and the configuration's defaults (:class:`sylvie_comm.config.Config`): the
README's and the codec guide's algorithm table, the codec table, the capability table, the lists of names on the
home page, and the lines ``sylvie-comm info`` prints (:func:`info_lines`). A new codec or algorithm shows in all of
them once it is registered.

The checked-in copies sit between marker comments, ``<!-- catalog:NAME -->`` and ``<!-- /catalog:NAME -->``, in
the files of :data:`PLACES`. ``python -m sylvie_comm.catalog --write`` rewrites them; ``--check`` (and
``tests/test_catalog.py``) fails naming each file and table that differs from what the code declares.

What an algorithm or a codec declares is read through one function, :func:`_declared`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from sylvie_comm import registry
from sylvie_comm.algorithms.registry import ALGORITHMS
from sylvie_comm.codecs import CODECS, Codec, codec_options
from sylvie_comm.config import MONITOR_DEFAULTS, Config

ROOT = Path(__file__).resolve().parents[1]

# The shape a codec's bytes per element are given for: a 1024 x 1024 fp32 matrix (per-row metadata counts at 1024).
CODEC_SHAPE = (1024, 1024)


def _declared(cls: type, field: str) -> Any:
    """What ``cls`` declares under ``field``: a registered algorithm's record's field
    (:class:`~sylvie_comm.algorithms.record.Record`), a codec's class attribute. Every table reads declarations
    here only."""
    record = getattr(cls, "record", None)
    if record is not None and hasattr(record, field):
        return getattr(record, field)
    return getattr(cls, field)


# ---------------------------------------------------------------------------------------------------- formatting


def _value(v: Any) -> str:
    """An option's value as a reader types it (YAML's spelling)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (tuple, list)):
        return ", ".join(_value(x) for x in v)
    if isinstance(v, float):
        small_fraction = 0 < v < 0.05 and (1 / v).is_integer()
        return f"1/{int(1 / v)}" if small_fraction else f"{v:g}"
    return str(v)


def _options(defaults: Mapping[str, Any]) -> str:
    return ", ".join(f"`{k}` (`{_value(v)}`)" for k, v in defaults.items())


def _number(x: float) -> str:
    """Bytes per element: a fraction where it is one of a small power of two, else four significant figures."""
    for d in (2, 4, 8, 16, 32):
        if x > 0 and x * d == round(x * d) and x < 1:
            return f"{round(x * d)}/{d}"
    return f"{x:.4g}"


def _summary(cls: type) -> str:
    """The first paragraph of the class's docstring, on one line (reST roles and literals as Markdown code)."""
    doc = inspect.getdoc(cls) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    text = re.sub(r":[a-z]+:`~?([^`<]*?)(?: <[^>]*>)?`", r"`\1`", text)
    parts = text.replace("``", "`").split("`")
    # A pipe would end a table cell: escaped outside code spans (a code span in a table keeps its pipes).
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _yes(flag: Any) -> str:
    return "yes" if flag else ""


# ---------------------------------------------------------------------------------------------------- facts


def codec_defaults(cls: type[Codec]) -> dict[str, Any]:
    """A codec class's options with their defaults (its constructor's named parameters)."""
    params = inspect.signature(cls).parameters
    return {n: params[n].default for n in codec_options(cls)}


def codec_bytes_per_element(cls: type[Codec]) -> float:
    """Wire bytes per element of a :data:`CODEC_SHAPE` fp32 matrix under the codec's defaults."""
    codec = cls(**codec_defaults(cls))
    return float(codec.payload_bytes(CODEC_SHAPE)) / math.prod(CODEC_SHAPE)


def algorithm_codec(cls: type) -> str:
    """The registered codec an algorithm encodes with, or what it sends instead."""
    codec = _declared(cls, "codec_name")
    if codec is not None:
        return f"`{codec}`"
    if _declared(cls, "delegates"):
        return "its candidate's"
    if _declared(cls, "low_rank"):
        return "own (low-rank factors)"
    return "own format"


def algorithm_bytes(cls: type) -> str:
    """Bytes per element it sends at its defaults, before anything is encoded."""
    if _declared(cls, "delegates"):
        return "its choice's"
    if _declared(cls, "low_rank"):
        return "by shape (`rank`)"
    return _number(_declared(cls, "payload_per_element")())


def shard_form(cls: type) -> str:
    """Whether it has a reduce-scatter form (FSDP2), or why not."""
    return "yes" if _declared(cls, "shards") else "no: " + _declared(cls, "no_shards_reason")


def _dtypes(cls: type) -> str:
    dtypes = _declared(cls, "gradient_dtypes")
    return "every float" if dtypes is None else ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def session_options() -> dict[str, Any]:
    """The options every algorithm takes (the session's: :class:`sylvie_comm.config.Config`), with their defaults."""
    skip = {"codec", "options", "rules"}
    return {f.name: Config().__getattribute__(f.name) for f in dataclasses.fields(Config) if f.name not in skip}


# ---------------------------------------------------------------------------------------------------- the tables


def algorithms_table() -> str:
    """Every registered algorithm: what it sends, its codec and its options with their defaults."""
    rows = [
        (f"`{name}`", _summary(cls), algorithm_codec(cls), _options(_declared(cls, "option_defaults")))
        for name, cls in ALGORITHMS.items()
    ]
    return _table(("name", "how it averages", "codec", "options (default)"), rows)


def common_options() -> str:
    """The sentence on the options every algorithm takes (the session's), with their defaults."""
    parts = []
    for key, value in session_options().items():
        if key == "monitor":
            period = MONITOR_DEFAULTS["period"]
            parts.append(f"`monitor` (on: an exact check every `period` = {period} compressed steps; "
                         "`{period: 0}` turns it off)")  # fmt: skip
        else:
            parts.append(f"`{key}` (`{_value(value)}`)")
    return f"Every algorithm also takes {', '.join(parts)} and per-name `rules`, as keywords or in YAML."


def capabilities_table() -> str:
    """Per algorithm, what it declares: the capability table of the docs."""
    head = ("name", "codec", "bytes per element at defaults", "reduce-scatter (FSDP2)", "averages momentum",
            "needs the monitor", "low-rank", "delegates", "variant of", "error feedback", "per-name options",
            "gradient dtypes")  # fmt: skip
    rows = []
    for name, cls in ALGORITHMS.items():
        variant = _declared(cls, "variant_of")
        per_name = sorted(_declared(cls, "per_name_options"))
        rows.append((
            f"`{name}`", algorithm_codec(cls), algorithm_bytes(cls), shard_form(cls),
            _yes(_declared(cls, "averages_momentum")), _yes(_declared(cls, "needs_monitor")),
            _yes(_declared(cls, "low_rank")), _yes(_declared(cls, "delegates")),
            f"`{variant}`" if variant else "", _yes(_declared(cls, "error_feedback")),
            ", ".join(f"`{o}`" for o in per_name), _dtypes(cls),
        ))  # fmt: skip
    return _table(head, rows)


def _users(codec: str) -> tuple[list[str], list[str]]:
    """The algorithms that encode with ``codec`` and the halo precisions that name it."""
    algorithms = [n for n, cls in ALGORITHMS.items() if _declared(cls, "codec_name") == codec]
    halo = [form for form, (name, _) in registry.HALO_FORMS.items() if name == codec]
    return algorithms, halo


def codecs_table() -> str:
    """Every registered codec: what it sends, its options, its bytes per element, who uses it."""
    rows = []
    for name, cls in CODECS.items():
        algorithms, halo = _users(name)
        rows.append((
            f"`{name}`", _summary(cls), _options(codec_defaults(cls)), _number(codec_bytes_per_element(cls)),
            _yes(_declared(cls, "allreduce_compatible")), ", ".join(f"`{a}`" for a in algorithms),
            ", ".join(f"`{h}`" for h in halo),
        ))  # fmt: skip
    head = ("codec", "what it sends", "options (default)", "bytes per element (1024 x 1024 fp32)",
            "all-reduce compatible", "algorithms", "halo precisions")  # fmt: skip
    return _table(head, rows)


def algorithm_names() -> str:
    return ", ".join(f"`{n}`" for n in ALGORITHMS)


def codec_names() -> str:
    return ", ".join(f"`{n}`" for n in CODECS)


# Each table by marker name: its renderer, and whether it sits inside a line (a list of names) or on lines of its own.
TABLES: dict[str, tuple[Callable[[], str], bool]] = {
    "algorithms": (algorithms_table, False),
    "common-options": (common_options, False),
    "capabilities": (capabilities_table, False),
    "codecs": (codecs_table, False),
    "algorithm-names": (algorithm_names, True),
    "codec-names": (codec_names, True),
}

# Where each table is checked in (a file may hold others too: every marker found is rendered).
PLACES: dict[str, tuple[str, ...]] = {
    "README.md": ("algorithm-names", "algorithms", "common-options"),
    "docs/index.md": ("algorithm-names",),
    "docs/guide/codecs.md": ("algorithms", "common-options", "capabilities"),
    "docs/internals/codecs.md": ("codec-names", "codecs"),
}

_MARKED = re.compile(r"<!-- catalog:([a-z-]+) -->(.*?)<!-- /catalog:\1 -->", re.DOTALL)


def markers(text: str) -> list[str]:
    """The tables marked in ``text``, in order."""
    return [m.group(1) for m in _MARKED.finditer(text)]


def render(text: str) -> str:
    """``text`` with every marked table rendered afresh; a ValueError for a marker that names no table."""

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise ValueError(f"catalog: unknown table {name!r} in a marker; tables: {', '.join(TABLES)}")
        renderer, inline = TABLES[name]
        body = renderer() if inline else f"\n{renderer()}\n"
        return f"<!-- catalog:{name} -->{body}<!-- /catalog:{name} -->"

    return _MARKED.sub(fill, text)


def stale(root: Path = ROOT) -> list[str]:
    """``file: table`` for every checked-in table that differs from what the code declares (or is missing)."""
    out = []
    for rel, names in PLACES.items():
        text = (root / rel).read_text()
        found = markers(text)
        out += [f"{rel}: {n} (its markers are missing)" for n in names if n not in found]
        fresh = dict(zip(found, (m.group(0) for m in _MARKED.finditer(render(text))), strict=True))
        for m in _MARKED.finditer(text):
            if m.group(0) != fresh[m.group(1)]:
                out.append(f"{rel}: {m.group(1)}")
    return out


def write(root: Path = ROOT) -> list[str]:
    """Rewrite every checked-in table; the files changed."""
    changed = []
    for rel in PLACES:
        path = root / rel
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


# ---------------------------------------------------------------------------------------------------- sylvie-comm info


def info_lines() -> list[str]:
    """What ``sylvie-comm info`` prints about names, algorithms and codecs."""
    lines = ["names (one namespace: a name means the same thing in every role it has):"]
    lines += [f"  {name:10s} {', '.join(roles)}" for name, roles in registry.table()]
    lines.append("algorithms (codec; bytes per element at the defaults; options with their defaults):")
    for name, cls in ALGORITHMS.items():
        codec = algorithm_codec(cls).replace("`", "")
        options = ", ".join(f"{k}={_value(v)}" for k, v in _declared(cls, "option_defaults").items())
        lines.append(f"  {name:10s} {codec}; {algorithm_bytes(cls).replace('`', '')}; {options or 'no options'}")
    common = ", ".join(f"{k}={_value(v)}" for k, v in session_options().items() if k != "monitor")
    lines.append(f"  every one also takes: {common}, monitor (period={MONITOR_DEFAULTS['period']}), rules")
    lines.append(f"codecs (options with their defaults; bytes per element of a {CODEC_SHAPE[0]} x {CODEC_SHAPE[1]} "
                 "fp32 matrix):")  # fmt: skip
    for name, codec_cls in CODECS.items():
        options = ", ".join(f"{k}={_value(v)}" for k, v in codec_defaults(codec_cls).items())
        lines.append(f"  {name:10s} {options or 'no options'}; {_number(codec_bytes_per_element(codec_cls))}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sylvie_comm.catalog", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the checked-in tables")
    mode.add_argument("--check", action="store_true", help="exit 1 naming every table that differs")
    mode.add_argument("--print", choices=sorted(TABLES), help="print one table")
    args = parser.parse_args(argv)
    if args.print:
        print(TABLES[args.print][0]())
        return 0
    if args.write:
        for rel in write():
            print(f"rewrote {rel}")
        return 0
    differ = stale()
    for line in differ:
        print(f"stale: {line} (run python -m sylvie_comm.catalog --write)", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
