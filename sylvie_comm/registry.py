"""Every name the library accepts, in one namespace.

A name means one thing wherever it is accepted. Three roles take names:

- **codec** (:func:`sylvie_comm.codecs.get_codec`): how one tensor is encoded;
- **algorithm** (``sylvie_comm.ddp.register(model, NAME)``, the Horovod
  optimizer, ``sylvie-comm demo --codec``): how gradients are averaged across
  ranks;
- **halo** (the GNN halo exchange's ``forward``/``backward`` precision): how
  boundary rows travel.

Where a name has several roles it is the same thing in each: the algorithm
``onebit`` averages with the codec ``onebit``, the halo precision ``fp16``
encodes rows with the codec ``fp16``; an algorithm that is not a codec's
all-reduce has a name no codec has (``acpsgd``, ``powersgd``: low-rank
factors; ``qsgd``: gradients in the ``qbit`` codec). Halo precisions are codec
names, plus the short forms ``fp32`` (= ``none``, no compression) and ``q1``/``q2``/``q4``/``q8``
(= ``qbit`` with that many bits). :func:`check` verifies all of this (a test
runs it), and :func:`unknown` writes the one error message for a wrong name:
the valid names of that role, and what the name is elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

ROLES = {
    "codec": "codec (sylvie_comm.codecs.get_codec)",
    "algorithm": "gradient algorithm (DDP hook, Horovod optimizer)",
    "halo": "halo precision (GNN halo exchange)",
}

# Halo precisions: codec name and options of each short form.
HALO_FORMS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "fp32": ("none", {}),
    "bf16": ("bf16", {}),
    "fp16": ("fp16", {}),
    **{f"q{b}": ("qbit", {"bits": b}) for b in (1, 2, 4, 8)},
}


def names(role: str) -> list[str]:
    """The sorted names ``role`` accepts (``"codec"``, ``"algorithm"`` or ``"halo"``)."""
    if role == "codec":
        from sylvie_comm.codecs import CODECS

        return sorted(CODECS)
    if role == "algorithm":
        from sylvie_comm.algorithms.registry import ALGORITHMS

        return sorted(ALGORITHMS)
    if role == "halo":
        return sorted(HALO_FORMS)
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def roles_of(name: object) -> list[str]:
    """The roles in which ``name`` is valid (empty when it is valid nowhere)."""
    return [role for role in ROLES if isinstance(name, str) and name in names(role)]


def unknown(
    name: object, role: str, noun: str | None = None, extra: str = "", exclude: Collection[str] = ()
) -> ValueError:
    """The error for a ``name`` that ``role`` does not accept: its valid names, and what ``name`` is elsewhere.

    ``noun`` is what the caller calls the name (DDP says "hook"); ``extra`` follows the valid names; ``exclude``:
    names of ``role`` the caller refuses too (``auto`` as a candidate of ``auto``), left out of the valid ones.
    """
    noun = noun or {"codec": "codec", "algorithm": "algorithm", "halo": "halo precision"}[role]
    valid = [n for n in names(role) if n not in exclude]
    message = f"unknown {noun} {name!r}; valid: {', '.join(valid)}{extra}"
    elsewhere = [ROLES[r] for r in roles_of(name) if r != role]
    if elsewhere:
        message += f" ({name!r} is a {' and a '.join(elsewhere)})"
    return ValueError(message)


def options_of(role: str) -> dict[str, list[str]]:
    """Each name of ``role`` (``"codec"`` or ``"algorithm"``) with the options it takes."""
    if role == "codec":
        from sylvie_comm.codecs import CODECS, codec_options

        return {n: codec_options(CODECS[n]) for n in sorted(CODECS)}
    if role == "algorithm":
        from sylvie_comm.algorithms.registry import ALGORITHMS

        return {n: sorted(ALGORITHMS[n].record.option_defaults) for n in sorted(ALGORITHMS)}
    raise ValueError(f"role {role!r} has no options; roles with options: codec, algorithm")


def takers(options: Iterable[str], role: str) -> str:
    """Which names of ``role`` take each of ``options`` (options some other name refused), for its message:
    ``bits is an option of qbit; no codec takes zap``."""
    every = options_of(role)
    parts = []
    for option in options:
        which = [n for n, opts in every.items() if option in opts]
        parts.append(f"{option} is an option of {', '.join(which)}" if which else f"no {role} takes {option}")
    return "; ".join(parts)


def table() -> list[tuple[str, list[str]]]:
    """Every name with its roles, sorted by name (``sylvie-comm names`` prints it)."""
    every = sorted({n for role in ROLES for n in names(role)})
    return [(n, roles_of(n)) for n in every]


def check() -> None:
    """Raise AssertionError where one name would mean two things."""
    from sylvie_comm.algorithms.registry import ALGORITHMS
    from sylvie_comm.codecs import CODECS

    for name, cls in ALGORITHMS.items():
        if "record" not in vars(cls):
            raise AssertionError(f"algorithm {name!r} declares no record of its own (it would read its base's)")
        codec = cls.record.codec_name
        if codec is not None and codec not in CODECS:
            raise AssertionError(f"algorithm {name!r} names codec {codec!r}, which is not registered")
        if name in CODECS and codec != name:
            raise AssertionError(f"{name!r} is a codec and an algorithm that encodes with {codec!r}")
    for form, (codec, _) in HALO_FORMS.items():
        if codec not in CODECS:
            raise AssertionError(f"halo precision {form!r} names codec {codec!r}, which is not registered")
        if form in CODECS and form != codec:
            raise AssertionError(f"{form!r} is a codec and a halo precision for codec {codec!r}")
        if form in ALGORITHMS and ALGORITHMS[form].record.codec_name != codec:
            raise AssertionError(f"{form!r} is a halo precision for codec {codec!r} and an algorithm for another")


__all__ = ["HALO_FORMS", "ROLES", "check", "names", "options_of", "roles_of", "table", "takers", "unknown"]
