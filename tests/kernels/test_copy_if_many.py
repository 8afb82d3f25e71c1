"""``kernels.copy_if_many``: one flag restores many tensors, as ``copy_if`` does each, reading a CPU flag once and
never a device's (``meta`` has no values to read: a host read there fails)."""

from __future__ import annotations

import pytest
import torch

from sylvie_comm import kernels


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)), (torch.randn(7, generator=g), None)]


@pytest.mark.parametrize("flag", [True, False])
def test_many_is_each(flag: bool) -> None:
    many, each = _pairs(), _pairs()
    bad = torch.tensor(flag)
    kernels.copy_if_many(many, bad)
    for dst, src in each:
        kernels.copy_if(dst, src, bad)
    for (a, _), (b, _) in zip(many, each, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(many[1][0], torch.zeros(7)) == flag


def test_on_a_device_it_decides_there(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kernels.copy_if
    monkeypatch.setattr(kernels, "copy_if", lambda d, s, f: (calls.append(d.device.type), real(d, s, f)))
    dst, src = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    kernels.copy_if_many([(dst, src), (dst, None)], torch.empty((), dtype=torch.bool, device="meta"))
    assert calls == ["meta", "meta"]
