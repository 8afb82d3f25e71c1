"""The mark of the tests that need the network lab (root, network namespaces, shaped links): the lab tier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from sylvie_comm.bench import lab as bl

LAB_MISSING = bl.unavailable_reason()
lab_skip = pytest.mark.skipif(LAB_MISSING is not None, reason=f"no lab here: {LAB_MISSING}")
F = TypeVar("F", bound=Callable[..., Any])


def needs_lab(test: F) -> F:
    """Put ``test`` in the lab tier, skipped where the lab cannot be built (no root, no ``ip netns``)."""
    return pytest.mark.lab(lab_skip(test))  # type: ignore[no-any-return]
