"""Algorithms with one error-feedback residual per name."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from sylvie_comm.algorithms.base import Algorithm, Member
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
        res = _existing(feedback, key, like)
        if res is not None:
            self.guard.save((id(feedback), key), res)
        return res

    def _guard_created(self, feedback: ErrorFeedback, key: str, before: torch.Tensor | None) -> None:
        """A residual the step created (``before`` None) goes back to zeros if the step is skipped."""
        if before is None:
            self.guard.zero_on_skip(feedback.residual(key))

    def _guard_residuals(self, feedback: ErrorFeedback, items: Sequence[tuple[str, torch.Tensor]]) -> list[Any]:
        """:meth:`_guard_residual` for every ``(key, like)`` of a group at once (one lock, one multi-tensor copy):
        per item the residual saved, or None where the step will create it (give it to :meth:`_guard_created`)."""
        befores = [_existing(feedback, key, like) for key, like in items]
        self.guard.save_many([((id(feedback), key), res) for (key, _), res in zip(items, befores, strict=True)
                              if res is not None])  # fmt: skip
        return befores

    def _feedback_batches(
        self, members: Sequence[Member], kinds: Sequence[K], encode: Callable[[K, torch.Tensor], torch.Tensor]
    ) -> None:
        """Error feedback a kind of tensors at a time (``kinds``: objects with ``members``, indices into
        ``members``): per kind its residuals, each compensated with its gradient in its own buffer
        (:meth:`ErrorFeedback.compensate_`), stacked into one ``(T, numel)`` fp32 batch; ``encode(kind, batch)``
        returns what was sent, decoded, as such a batch; the batch less that goes back into the residuals. Every
        residual is guarded at once. Per tensor the bits of :meth:`ErrorFeedback.encode`."""
        befores = self._guard_residuals(self.feedback, [(m.name, m.tensor) for m in members])
        for kind in kinds:
            comps = [self.feedback.compensate_(members[i].name, members[i].tensor).view(-1) for i in kind.members]
            batch = torch.stack(comps)
            batch.sub_(encode(kind, batch))
            torch._foreach_copy_(comps, list(batch.unbind(0)))
        for m, before in zip(members, befores, strict=True):
            self._guard_created(self.feedback, m.name, before)

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


def _existing(feedback: ErrorFeedback, key: str, like: torch.Tensor) -> torch.Tensor | None:
    """``key``'s residual where it has ``like``'s shape (on ``like``'s device); None where the step will create it."""
    res = feedback.residual(key, like.device)
    return None if res is None or res.shape != like.shape else res


class _Kind(Protocol):
    members: list[int]


K = TypeVar("K", bound=_Kind)


def kinds_of(members: Sequence[Member], key: Callable[[Member], Hashable], make: Callable[[Member], K]) -> list[K]:
    """``members`` sorted into kinds by ``key``, in order of first appearance: ``make(member)`` for the first of
    each kind (an object with a ``members`` list), then each member's index appended to its kind's."""
    kinds: dict[Hashable, K] = {}
    for i, m in enumerate(members):
        k = key(m)
        kind = kinds.get(k)
        if kind is None:
            kind = kinds[k] = make(m)
        kind.members.append(i)
    return list(kinds.values())
