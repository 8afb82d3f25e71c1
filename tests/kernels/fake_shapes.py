"""One check the fake (meta) implementations of the kernel ops share: an op run on fake tensors gives the outputs
a real run gives, in shape and dtype (and device)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def _flat(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out or ())


def assert_fake_gives_real_shapes(op: Any, args: Sequence[Any], *, device: bool = True) -> None:
    """Run ``op`` on clones of ``args``, then under ``FakeTensorMode`` on fakes of them; the outputs' shapes and
    dtypes (and devices, with ``device``) must agree."""
    real = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])

    def key(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.shape, t.dtype, t.device) if device else (t.shape, t.dtype)

    assert [key(t) for t in _flat(fake)] == [key(t) for t in _flat(real)]
