"""The host's view of a compressed optimizer's steps: each step's verdict, read one step late, and the set of
parameters with a gradient that the ranks agreed on (:class:`StepAgreement`).

Every rank must send a payload of the same size each step, and that size follows which parameters have a gradient.
A check every step would cost a host read of the device per step, so the ranks compare their sets (a host
all-gather) only when some rank can know it is needed:

* at the first step (after construction or a load), and every step while the agreed set is empty;
* on a rank whose set differs from the agreed one: it first sends a *probe*, the payload of the agreed set filled
  with NaN, so that its collectives pair with those of the ranks whose set did not change; the step is then skipped
  on every rank, and they compare at their next step (below); if every rank's set changed alike, all of them
  compared now and the step is sent again with the new set;
* after a skipped step (its verdict, read on the host one step late: :meth:`StepAgreement.settle`): on a rank whose
  set did not change, this is where it learns that another's did.

So a step with the agreed set costs nothing, and a new set (every rank's) one more collective round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from sylvie_comm.algorithms.session import Session

Mask = tuple[bool, ...]  # per parameter, in the optimizer's order: whether it has a gradient


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class StepAgreement:
    """What the host knows of a compressed optimizer's steps: the last step's verdict (taken on every rank, or
    skipped for a NaN or an Inf, decided on the device) and the set of parameters with a gradient the ranks agreed
    on (see the module docstring).

    Args:
        session: the optimizer's session: its object all-gather, and its step count, which leaves a skipped
            warm-up step out of the policy's (:meth:`~sylvie_comm.algorithms.session.Session.discount`).
        names: the parameters' names, in the masks' order.
        what: the optimizer's name in messages (``CompressedAdamW[onebit]``).
    """

    def __init__(self, session: Session, names: Sequence[str], what: str) -> None:
        self.session = session
        self.names = names
        self.what = what
        self.probes = 0  # probe steps, counted by the guard as skipped: not in skipped_nonfinite
        self._verdict_host: torch.Tensor | None = None  # pinned memory the verdict of a CUDA step is copied to
        self.reset()

    def reset(self) -> None:
        """Nothing pending: the ranks compare their gradients again at the next step (after a load, or a refusal)."""
        self._verdict: tuple[Any, bool] | None = None  # the last step's verdict, not read yet, and its phase
        self._recheck = False  # the last step was skipped: the ranks compare the gradients they had in it
        self._agreed: Mask | None = None  # which parameters have a gradient, as the ranks agreed
        self._sent: Mask | None = None  # which had one on this rank in the last step

    def remember(self, ok: torch.Tensor, warm: bool, mask: Mask) -> None:
        """Keep the step's verdict (``ok``: taken on every rank) for the host to read at the next step. On CUDA it
        is copied to pinned memory behind the step's work, so reading it then waits for nothing still running."""
        if ok.device.type == "cuda":
            if self._verdict_host is None:
                self._verdict_host = torch.empty((), dtype=torch.bool, pin_memory=True)
            with torch.cuda.device(ok.device):
                self._verdict_host.copy_(ok, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            self._verdict = (event, warm)
        else:
            self._verdict = (ok, warm)
        self._sent = mask

    def settle(self) -> None:
        """Read the last step's verdict on the host: a skipped warm-up step does not count towards the warm-up, and
        after any skipped step the ranks compare the gradients they had in it (:meth:`agree`).

        This is the one host read per step, one step late: on the CPU the value is at hand; on CUDA it waits for
        the copy queued behind the last step's collective (done, in a training loop, while the host queued the
        forward and backward passes since), not for the work queued after it. A ``meta`` tensor has no value:
        there nothing is found non-finite."""
        if self._verdict is None:
            return
        held, warm = self._verdict
        self._verdict = None
        if isinstance(held, torch.cuda.Event):
            held.synchronize()
            taken = bool(cast(torch.Tensor, self._verdict_host).item())
        else:
            taken = held.device.type == "meta" or bool(held.item())
        if not taken:
            self._recheck = True
            if warm:
                self.session.discount()

    def agree(self, mask: Mask, probe: Callable[[Mask], None]) -> None:
        """Fail on every rank, naming the parameter, where the ranks differ in which parameters have a gradient
        (``mask``, this rank's at this step); ``probe(agreed)`` sends the payload of the agreed set, poisoned, where
        this rank's set changed (see the module docstring)."""
        if self._recheck:
            self._recheck = False
            self._compare(cast(Mask, self._sent))
        if self._agreed is None or not any(self._agreed):
            self._compare(mask)
        elif mask != self._agreed:
            probe(self._agreed)
            self._compare(mask)
            self.probes += 1
        self._agreed = mask

    def _compare(self, mask: Mask) -> None:
        """Every rank's set of parameters with a gradient; a ValueError on every rank where they differ."""
        masks = self.session.objects.all_gather_object(mask)
        for i, name in enumerate(self.names):
            having = [r for r, m in enumerate(masks) if m[i]]
            if 0 < len(having) < len(masks):
                lacking = [r for r in range(len(masks)) if r not in having]
                self.reset()
                raise ValueError(
                    f"{self.what} step: parameter '{name}' has a gradient on {ranks_text(having)} but "
                    f"none (grad None) on {ranks_text(lacking)}; every rank must hold gradients for the same "
                    "parameters (give an unused parameter a zero gradient on the ranks that did not use it, e.g. "
                    "zero_grad(set_to_none=False), or build the optimizer without it)"
                )


__all__ = ["Mask", "StepAgreement", "ranks_text"]
