"""Algorithms with one error-feedback residual per name."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from sylvie_comm.algorithms.base import Algorithm, Member
from sylvie_comm.codecs import Codec, ErrorFeedback
from sylvie_comm.codecs.base import Encoded
from sylvie_comm.collectives import Transport


class FeedbackAlgorithm(Algorithm):
    """Keeps what compression dropped, per name, and adds it back the next step (Karimireddy et al. 2019)."""

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        self.feedback = ErrorFeedback()
        self._batches: dict[tuple[int, Hashable], _Batch] = {}
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

    def _feedback_batches(
        self, key: Hashable, members: Sequence[Member], kinds: Sequence[K],
        encode: Callable[[K, torch.Tensor], torch.Tensor],
    ) -> None:  # fmt: skip
        """Error feedback a kind of tensors at a time (``kinds``: objects with ``members``, indices into
        ``members``, of one shape; ``key``: the group's): per kind its residuals are the rows of one
        :meth:`ErrorFeedback.arena`, guarded as one tensor, compensated with their gradients by one multi-tensor
        add; ``encode(kind, batch)`` returns what was sent, decoded, as a ``(T, numel)`` batch, and the arena less
        that is the new residuals. A few launches per kind, none per tensor; per tensor the bits of
        :meth:`ErrorFeedback.encode`."""
        for i, kind in enumerate(kinds):
            ms = [members[j] for j in kind.members]
            batch = self._arena(self.feedback, (key, i), [m.name for m in ms], [m.tensor.shape for m in ms],
                                ms[0].tensor.device)  # fmt: skip
            torch._foreach_add_(batch.views, [m.tensor for m in ms])
            batch.tensor.sub_(encode(kind, batch.tensor))

    def _arena(
        self, feedback: ErrorFeedback, key: Hashable, names: Sequence[str], shapes: Sequence[torch.Size],
        device: torch.device, width: int = 0, save: bool = True,
    ) -> _Batch:  # fmt: skip
        """The residual rows of ``names`` (:meth:`ErrorFeedback.arena`, ``width`` elements a row, default the
        first shape's size) and each row as a view of its shape; saved for the step guard as one tensor
        (``save=False``: the caller takes :meth:`StepGuard.slot` itself, for a kernel to write). Kept per ``key``
        while the arena stands: O(1) on the hot path."""
        width = width or math.prod(shapes[0])
        tensor = feedback.arena(key, names, shapes, width, device)
        batch = self._batches.get((id(feedback), key))
        if batch is None or batch.tensor is not tensor:
            views = [tensor[i, : math.prod(shape)].view(shape) for i, shape in enumerate(shapes)]
            batch = self._batches[(id(feedback), key)] = _Batch(tensor, views)
        if save:
            self.guard.save((id(feedback), "arena", key), tensor)
        return batch

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


@dataclass(eq=False)
class _Batch:
    """An arena of residual rows and each row as its member's view (what a multi-tensor op takes)."""

    tensor: torch.Tensor
    views: list[torch.Tensor]


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
