"""Algorithms with one error-feedback residual per name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sylvie_comm.algorithms.base import Algorithm
from sylvie_comm.codecs import ErrorFeedback
from sylvie_comm.collectives import Transport


class FeedbackAlgorithm(Algorithm):
    """Keeps what compression dropped, per name, and adds it back the next step (Karimireddy et al. 2019)."""

    error_feedback = True

    def __init__(self, transport: Transport, options: Mapping[str, Any] | None = None, *, seed: int = 0) -> None:
        self.feedback = ErrorFeedback()
        super().__init__(transport, options, seed=seed)

    def persistent_tensors(self) -> list[torch.Tensor]:
        return [r for r in (self.feedback.residual(n) for n in self.feedback) if r is not None]

    def state_dict(self) -> dict[str, Any]:
        return {n: {"residual": r.clone()} for n, r in self.feedback.state_dict()["residuals"].items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.feedback.load_state_dict({"residuals": {n: s["residual"] for n, s in state.items()}})
