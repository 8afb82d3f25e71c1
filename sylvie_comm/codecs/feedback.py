"""Error feedback: remember what compression dropped and add it back next time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from sylvie_comm.codecs.base import Codec, Encoded, check_tensor


class ErrorFeedback:
    """Per-name residual memory (Seide et al. 2014; Karimireddy et al. 2019).

    For each named tensor: ``compensated = tensor + residual``, the codec
    encodes ``compensated``, and ``residual <- compensated - decode(encoded)``,
    so ``decoded + residual == compensated`` holds exactly after every step.
    Residuals are fp32 whatever the tensor dtype (a bf16 residual would drop the
    small errors it exists to keep).

    Example::

        ef = ErrorFeedback()
        enc = ef.encode(codec, "layer1.weight", grad)   # residual updated
        ...  # send enc.payload
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._arenas: dict[Hashable, _Arena] = {}
        self._owner: dict[str, Hashable] = {}  # a name's arena, where its residual is a row of one

    def __contains__(self, name: str) -> bool:
        return name in self._residuals

    def __iter__(self) -> Iterator[str]:
        return iter(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)

    def residual(self, name: str, device: torch.device | None = None) -> torch.Tensor | None:
        """The current residual of ``name`` (None before its first update); with ``device``, on that device
        (a residual loaded from a checkpoint written on another device moves there, once)."""
        res = self._residuals.get(name)
        if res is not None and device is not None and res.device != device:
            res = self._residuals[name] = res.to(device)
            self._detach(name)
        return res

    def arena(self, key: Hashable, names: Sequence[str], shapes: Sequence[torch.Size], width: int,
              device: torch.device) -> torch.Tensor:  # fmt: skip
        """A ``(len(names), width)`` fp32 tensor whose row ``i`` begins with the residual of ``names[i]``: that
        residual *is* the row's first ``numel`` elements (a view of shape ``shapes[i]``), so a kind of tensors
        is compensated, encoded and updated as one batch, in place, with no copy in or out. The rest of a row is
        padding: zeros, which stay zeros while the caller adds zeros there. Made once per ``key`` (a group's
        kind) and kept while every name's residual is still its row: a name reset, loaded, replaced or claimed by
        another arena since makes it again, its rows holding the residuals as they stand (zeros where a name has
        none). Checked in O(1) on the hot path."""
        got = self._arenas.get(key)
        if got is not None and got.live and got.names == tuple(names) and got.tensor.device == device:
            return got.tensor
        out = torch.zeros(len(names), width, dtype=torch.float32, device=device)
        for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
            numel = math.prod(shape)
            if numel > width:
                raise ValueError(f"ErrorFeedback.arena: '{name}' has {numel} elements, over the row's {width}")
            row = out[i, :numel].view(shape)
            res = self._residuals.get(name)
            if res is not None:
                _check_shape(name, res, row)
                row.copy_(res)
            self._detach(name)
            self._residuals[name] = row
            self._owner[name] = key
        self._arenas[key] = _Arena(tuple(names), out)
        return out

    def _detach(self, name: str) -> None:
        """``name``'s residual is no longer the row of an arena: that arena is made again when next asked for."""
        owner = self._owner.pop(name, None)
        if owner is not None:
            arena = self._arenas.pop(owner, None)
            if arena is not None:
                arena.live = False
                for other in arena.names:
                    if self._owner.get(other) == owner:
                        del self._owner[other]

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor + residual`` as a new fp32 tensor (the input is not modified)."""
        check_tensor(tensor, "ErrorFeedback.compensate")
        res = self.residual(name, tensor.device)
        if res is None:
            return tensor.to(torch.float32, copy=True)
        _check_shape(name, res, tensor)
        return torch.add(res, tensor)

    def compensate_(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``residual += tensor`` in the residual's own buffer (a fp32 copy of ``tensor`` becomes the residual the
        first time) and return that buffer: the caller encodes it, then subtracts what was sent from it, so that it
        holds ``compensated - decoded`` again (what :meth:`encode` does)."""
        res = self.residual(name, tensor.device)
        if res is None:
            comp = self._residuals[name] = tensor.to(torch.float32, copy=True)
            self._detach(name)
            return comp
        _check_shape(name, res, tensor)
        return res.add_(tensor)

    def update(self, name: str, compensated: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """Store ``compensated - decoded`` as the residual of ``name`` and return it."""
        res = self._residuals.get(name)
        if res is not None and res.shape == compensated.shape and res.device == compensated.device:
            torch.sub(compensated, decoded, out=res)  # reuse the buffer: no per-step allocation
        else:
            res = compensated.to(torch.float32) - decoded.to(torch.float32)
            self._residuals[name] = res
            self._detach(name)
        return res

    def encode(self, codec: Codec, name: str, tensor: torch.Tensor, bound_rows: bool = False) -> Encoded:
        """Compensate, encode, decode locally and update the residual; return the encoding.

        Works in the residual's own buffer: after the first step no memory of
        the tensor's size is allocated here besides what the codec allocates.
        With ``bound_rows`` the compensated tensor is clamped into each row's
        range of ``tensor`` before encoding (see :func:`clamp_rows`): use it
        with q-bit, whose 1-bit stochastic rounding makes plain error feedback
        diverge.
        """
        check_tensor(tensor, "ErrorFeedback.encode")
        comp = self.compensate_(name, tensor)
        encoded = codec.encode(clamp_rows(comp, tensor) if bound_rows else comp)
        storage = comp.untyped_storage().data_ptr()
        payload = tuple(p.clone() if p.untyped_storage().data_ptr() == storage else p for p in encoded.payload)
        comp.sub_(codec.decode(encoded))  # comp is the residual buffer: it now holds comp - decoded
        return Encoded(payload, dataclasses.replace(encoded.ctx, dtype=tensor.dtype))

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name`` (or all residuals)."""
        if name is None:
            self._residuals.clear()
            self._dissolve()
        else:
            self._residuals.pop(name, None)
            self._detach(name)

    def _dissolve(self) -> None:
        for arena in self._arenas.values():
            arena.live = False
        self._arenas.clear()
        self._owner.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.detach().clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        residuals = state.get("residuals") if isinstance(state, Mapping) else None
        if not isinstance(residuals, Mapping):
            raise ValueError("ErrorFeedback.load_state_dict: expected {'residuals': {name: tensor}}")
        for k, v in residuals.items():
            if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
                raise ValueError(f"ErrorFeedback.load_state_dict: residual '{k}' must be a float32 tensor")
        self._residuals = {k: v.detach().clone() for k, v in residuals.items()}
        self._dissolve()


@dataclasses.dataclass(eq=False)
class _Arena:
    """The rows of :meth:`ErrorFeedback.arena`: ``live`` while every name's residual is still its row."""

    names: tuple[str, ...]
    tensor: torch.Tensor
    live: bool = True


def _check_shape(name: str, residual: torch.Tensor, tensor: torch.Tensor) -> None:
    if residual.shape != tensor.shape:
        raise ValueError(
            f"ErrorFeedback: '{name}' has shape {tuple(tensor.shape)} but its residual has "
            f"{tuple(residual.shape)}; call reset('{name}') if the tensor changed on purpose"
        )


def clamp_rows(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` clamped, row by row (first dimension), into the ``[min, max]`` of the rows of ``like``.

    Error feedback for range-based quantizers (q-bit): quantizing
    ``clamp_rows(x + residual, x)`` keeps the residual bounded where plain error
    feedback with 1-bit stochastic rounding grows without bound.
    """
    if like.dim() < 2 or like.shape[1] == 0 or like.shape[0] == 0:
        return x
    flat = like.reshape(like.shape[0], -1)
    lo = flat.amin(1).view(-1, *([1] * (like.dim() - 1)))
    hi = flat.amax(1).view(-1, *([1] * (like.dim() - 1)))
    return torch.maximum(torch.minimum(x, hi), lo)
