"""Algorithms with one error-feedback residual per name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm
from sylvie_comm.codecs import Codec, ErrorFeedback
from sylvie_comm.codecs.base import Encoded
from sylvie_comm.collectives import Transport


class FeedbackAlgorithm(Algorithm):
    """Keeps what compression dropped, per name, and adds it back the next step (Karimireddy et al. 2019)."""

    error_feedback = True
    gradient_dtypes = (torch.float32, torch.float16, torch.bfloat16)  # the codecs' (residuals are fp32)

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        self.feedback = ErrorFeedback()
        super().__init__(transport, options, seed=seed)

    def _guard_residual(self, feedback: ErrorFeedback, key: str, like: torch.Tensor) -> torch.Tensor | None:
        """Save ``key``'s residual for the step guard before the step changes it in place; None when it has
        none of ``like``'s shape yet (give what the step creates to :meth:`_guard_created`)."""
        res = feedback.residual(key, like.device)
        if res is None or res.shape != like.shape:
            return None
        self.guard.save((id(feedback), key), res)
        return res

    def _guard_created(self, feedback: ErrorFeedback, key: str, before: torch.Tensor | None) -> None:
        """A residual the step created (``before`` None) goes back to zeros if the step is skipped."""
        if before is None:
            self.guard.zero_on_skip(feedback.residual(key))

    def _guard_residuals(self, feedback: ErrorFeedback, items: Sequence[tuple[str, torch.Tensor]]) -> list[Any]:
        """:meth:`_guard_residual` for every ``(key, like)`` of a group at once (one lock, one multi-tensor copy):
        per item the residual saved, or None where the step will create it (give it to :meth:`_guard_created`)."""
        befores: list[Any] = []
        saves = []
        for key, like in items:
            res = feedback.residual(key, like.device)
            if res is None or res.shape != like.shape:
                befores.append(None)
            else:
                befores.append(res)
                saves.append(((id(feedback), key), res))
        self.guard.save_many(saves)
        return befores

    def _feedback_encode_all(self, items: Sequence[tuple[Codec, str, torch.Tensor]]) -> list[Encoded]:
        """:meth:`_feedback_encode` for every ``(codec, name, tensor)`` of a group, the residuals saved at once."""
        befores = self._guard_residuals(self.feedback, [(name, tensor) for _, name, tensor in items])
        out = []
        for (codec, name, tensor), before in zip(items, befores, strict=True):
            out.append(self.feedback.encode(codec, name, tensor))
            self._guard_created(self.feedback, name, before)
        return out

    def _feedback_encode(self, codec: Codec, name: str, tensor: torch.Tensor, **kwargs: Any) -> Encoded:
        """:meth:`ErrorFeedback.encode` on the worker residual of ``name``, with the residual guarded."""
        before = self._guard_residual(self.feedback, name, tensor)
        enc = self.feedback.encode(codec, name, tensor, **kwargs)
        self._guard_created(self.feedback, name, before)
        return enc

    def residual_inner(self, name: str, other: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        res = self.feedback.residual(name, None if other is None else other.device) if self.error_feedback else None
        if res is None:
            return None
        r = res.reshape(-1)
        same = other is not None and other.numel() == r.numel()
        dot = torch.dot(r, other.reshape(-1).float()) if same else torch.zeros((), device=r.device)  # type: ignore[union-attr]
        return torch.dot(r, r), dot

    def forget(self, name: str) -> torch.Tensor | None:
        self.guard.settle()
        res = self.feedback.residual(name)
        self.feedback.reset(name)
        return res

    def persistent_tensors(self) -> list[torch.Tensor]:
        return [r for r in (self.feedback.residual(n) for n in self.feedback) if r is not None]

    def state_spec(self, shape: torch.Size | tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return {"residual": tuple(shape)}

    def state_dict(self) -> dict[str, Any]:
        self.guard.settle()
        return {n: {"residual": r.clone()} for n, r in self.feedback.state_dict()["residuals"].items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.guard.settle()
        self.feedback.load_state_dict({"residuals": {n: s["residual"] for n, s in state.items()}})
