"""Steps whose input is not finite on some rank: a non-finite average out, every rank's state as before.

Mixed precision overflows on purpose: ``torch.amp.GradScaler`` raises its scale
every ``growth_interval`` steps until the gradients overflow, skips that step
and lowers the scale. An error-feedback algorithm that lets the overflowed
step into its residuals or factors carries Inf/NaN into every later step, and
the scaler then skips all of them (horovod#1699 is the same pattern). So a
step whose input holds a NaN or an Inf on any rank

* hands back a non-finite average (the scaler sees it and skips the step),
* leaves every rank's state (residuals, factors, owed updates) exactly as it
  was before the step, and
* is decided identically on every rank, without the host reading a value on
  the hot path.

How:

* **The flag travels with the payload.** Every algorithm sends something in
  which a non-finite input shows: one-bit and sign scales (one per row),
  q-bit scales and minimums, the values top-k selects (NaN and Inf sort
  first), low-rank factors, the fp32 raw values, the cast values. After the
  collective each rank tests the received small tensors, identical on every
  rank, and :meth:`StepGuard.report` ors the group's flag (a bool tensor on
  the data's device) into the step's. Where a group's verdict is only
  counted, nothing poisoned by it (the plain and cast averages, the raw
  members), :meth:`StepGuard.check` keeps a witness instead (one ``aminmax``
  of what was received), tested at settle; a step that nothing restores is
  counted later still, its witnesses tested with those of up to 63 other such
  steps in a few ops.
* **The state update is masked.** Before an algorithm changes a state tensor in
  a step it :meth:`~StepGuard.save` s a copy (into a buffer kept for the next
  step). When the next step begins, or the state is read, :meth:`~StepGuard.settle`
  puts every saved tensor back where the step's flag is set, with
  :func:`sylvie_comm.kernels.copy_if`, which reads the flag on the device: no
  host synchronisation, and a step whose input was finite moves no memory
  there. Decisions are per step, not per group: a NaN in one bucket restores
  the state of every bucket (the scaler skips the whole step).
* **Counted**: ``skipped_nonfinite`` in the integrations' ``stats()``.

The price is one copy of the state a step changes (its residuals, a gradient's
size for the error-feedback algorithms), in memory (``memory_bytes()``) and in
one read and one write per step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from sylvie_comm import kernels

Future = torch.futures.Future


_SMALL = 1 << 16  # elements: up to here a boolean copy is cheaper than aminmax's two extra small ops
_FOLD = 64  # steps whose verdict only the skipped count reads, tested together (see StepGuard.settle)


def nonfinite(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    """A 0-dim bool tensor, true where any element of ``tensors`` is NaN or Inf (None when all are empty).

    One read of each tensor, on its device (``aminmax``: the smallest and the largest value are both finite
    only when every value is); a tensor of at most ``_SMALL`` elements through a boolean copy, in fewer ops.
    """
    flag: torch.Tensor | None = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        if t.numel() <= _SMALL:  # three small ops, where the boolean copy costs less than two more launches
            bad = torch.isfinite(t).all().logical_not_()
        else:
            lo, hi = torch.aminmax(t.reshape(-1))
            bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
        flag = bad if flag is None else flag | bad
    return flag


def _witnessed(steps: Sequence[dict[torch.dtype, list[torch.Tensor]]]) -> torch.Tensor:
    """Per step of ``steps`` (each with the same number of :meth:`StepGuard.check` witnesses of each dtype), a bool:
    whether one of its witnesses is not finite (0-dim for one step). A few ops for all the steps: each dtype's
    witnesses stacked step by row, ``w - w`` (0, or NaN where ``w`` is not finite), summed per row."""
    bad: torch.Tensor | None = None
    for dtype in steps[0]:
        w = torch.stack([v for step in steps for v in step[dtype]]).view(len(steps), -1)
        seen = w.sub(w).sum(dim=1).isnan()
        bad = seen if bad is None else bad | seen
    assert bad is not None
    return bad.view(()) if len(steps) == 1 else bad


def poison(tensors: Iterable[torch.Tensor], bad: torch.Tensor | None) -> None:
    """Where ``bad`` is set, write NaN into the first element of the first non-empty tensor (no host read).

    One NaN makes the group's average non-finite, which is what a scaler (or a norm) sees; one small op per
    group rather than per tensor keeps it off the launch count of models with many parameters."""
    if bad is None:
        return
    for t in tensors:
        if t.numel():
            t.view(-1)[:1].masked_fill_(bad, float("nan"))
            return


def _succeeded(fut: Future[Any]) -> bool:
    """Whether ``fut`` has completed with a value (one still running, or failed, has not)."""
    if not fut.done():
        return False
    try:
        fut.value()
    except Exception:
        return False
    return True


class StepGuard:
    """Saves what a step changes and puts it back when the step's input was not finite on some rank.

    Shared by every algorithm that serves one integration (``auto`` hands its own to its candidates),
    so a step is one decision over all its groups. A step's groups must complete (or fail) before the
    next step begins, as every integration waits for them; a group that failed counts as a bad step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: int | None = None
        self._saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (state, copy; None: zeros)
        self._keys: set[Hashable] = set()
        self._actions: list[Callable[[torch.Tensor], None]] = []
        self._settled: list[Callable[[torch.Tensor | None], None]] = []
        self._bad: torch.Tensor | None = None
        self._witnesses: dict[torch.dtype, list[torch.Tensor]] = {}  # :meth:`check`'s, by dtype, tested at settle
        self._device: torch.device | None = None
        self._begun = 0  # groups of this step
        self._done = 0  # ... that completed (counted by :meth:`finish`)
        self._tracked: list[Future[Any]] = []  # ... whose futures say, at settle, whether they completed
        self._buffers: dict[Hashable, torch.Tensor] = {}  # copies, reused step after step
        self._skipped: torch.Tensor | None = None  # device count of skipped steps
        self._pending: list[dict[torch.dtype, list[torch.Tensor]]] = []  # steps' witnesses, counted at a fold

    # ------------------------------------------------------------------ during a step

    def begin(self, step: int) -> None:
        """A group of step ``step`` starts (a new step number settles the step before)."""
        if self._step is not None and step != self._step:
            self.settle()
        with self._lock:
            self._step = step
            self._begun += 1

    def finish(self) -> None:
        """A group of the step completed (its collectives and decoding are done)."""
        with self._lock:
            self._done += 1

    def track(self, fut: Future[Any]) -> Future[Any]:
        """``fut`` itself, the group counted as completed at settle if it has succeeded by then.

        Read at settle rather than chained: a ``then`` per group is a future and a callback more on the hot
        path, and the integration has waited for every group of the step before the next begins."""
        with self._lock:
            self._tracked.append(fut)
        return fut

    def save(self, key: Hashable, state: torch.Tensor) -> None:
        """Copy ``state`` (once per step and key) before the step changes it in place."""
        buf = self.slot(key, state)
        if buf is not None:
            buf.copy_(state)

    def slot(self, key: Hashable, state: torch.Tensor) -> torch.Tensor | None:
        """A buffer for a kernel to write ``state`` into as it reads it (the fused ops' ``saved``), in place of
        :meth:`save`'s copy: one write and no second read. None when ``key`` is already saved this step.

        The buffer starts as zeros, so elements the kernel does not visit (padding) restore as zeros; it is
        kept for the next step (one allocation per key)."""
        with self._lock:
            return self._slot(key, state)

    def save_many(self, items: Sequence[tuple[Hashable, torch.Tensor]]) -> None:
        """:meth:`save` for every ``(key, state)`` of a group at once: one lock and one multi-tensor copy."""
        bufs, states = [], []
        with self._lock:
            for key, state in items:
                buf = self._slot(key, state)
                if buf is not None:
                    bufs.append(buf)
                    states.append(state)
        if bufs:
            torch._foreach_copy_(bufs, states)

    def _slot(self, key: Hashable, state: torch.Tensor) -> torch.Tensor | None:
        if key in self._keys:
            return None
        self._keys.add(key)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != state.shape or buf.dtype != state.dtype or buf.device != state.device:
            buf = self._buffers[key] = torch.zeros_like(state, memory_format=torch.contiguous_format)
        self._saved.append((state, buf))
        self._device = state.device
        return buf

    def zero_on_skip(self, state: torch.Tensor | None) -> None:
        """``state`` (created by this step, where before there was none) becomes zeros if the step is skipped."""
        if state is None:
            return
        with self._lock:
            self._saved.append((state, None))
            self._device = state.device

    def on_skip(self, action: Callable[[torch.Tensor], None]) -> None:
        """Run ``action(bad)`` when the step settles, after the saved tensors are back; it must change
        nothing unless ``bad`` (a 0-dim bool tensor) is set, and read no value on the host."""
        with self._lock:
            self._actions.append(action)

    def on_settle(self, action: Callable[[torch.Tensor | None], None]) -> None:
        """Run ``action(bad)`` when the step settles, skipped or not (``bad``: the step's 0-dim bool flag, None
        where no group reported one); it must read no value on the host (the monitor adds a step's figures
        where the step was taken)."""
        with self._lock:
            self._settled.append(action)

    def report(self, bad: torch.Tensor | None) -> None:
        """Or a group's flag (from what every rank received) into the step's."""
        if bad is None:
            return
        with self._lock:
            self._bad = bad.reshape(()).clone() if self._bad is None else self._bad | bad.reshape(())
            self._device = bad.device

    def check(self, tensor: torch.Tensor) -> None:
        """:meth:`report` whether ``tensor`` (what every rank received) holds a NaN or an Inf, tested at settle.

        One op now, ``aminmax`` (its smallest and largest values are both finite only when every value is;
        a NaN propagates into both), kept as the witness; one test of every witness of the step at settle. For a
        group that only counts its flag (nothing is poisoned by it), where :func:`nonfinite` costs a flag of its
        own per group."""
        if tensor.numel() == 0:
            return
        lo, hi = torch.aminmax(tensor)
        with self._lock:
            self._witnesses.setdefault(tensor.dtype, []).extend((lo, hi))
            self._device = tensor.device

    # ------------------------------------------------------------------ between steps

    def settle(self) -> None:
        """Decide the last step: put its saved state back if its flag is set (or a group failed); count it.

        A step whose only verdict is :meth:`check`'s witnesses, and which nothing restores or reads (no saved
        state, no action), is counted later: its witnesses wait with up to ``_FOLD`` such steps and are tested
        together, a few ops for all of them instead of a few per step."""
        with self._lock:
            saved, actions, bad, device = self._saved, self._actions, self._bad, self._device
            settled, tracked, finished, witnesses = self._settled, self._tracked, self._done, self._witnesses
            self._saved, self._actions, self._keys, self._bad, self._settled = [], [], set(), None, []
            self._tracked, self._witnesses = [], {}
            begun = self._begun
            self._begun = self._done = 0
            self._step = None
        failed = finished + sum(_succeeded(f) for f in tracked) < begun
        if device is not None and failed:  # a collective failed mid-step: whatever it changed goes back
            bad = torch.ones((), dtype=torch.bool, device=device)
        elif witnesses:
            if bad is None and not saved and not actions and not settled:
                with self._lock:
                    self._pending.append(witnesses)
                    full = len(self._pending) >= _FOLD
                if full:
                    self._fold()
                return
            seen = _witnessed([witnesses])
            bad = seen if bad is None else bad | seen
        if device is not None and bad is not None:
            if saved:
                kernels.copy_if_many(saved, bad)
            for action in actions:
                action(bad)
            self._count(bad.to(torch.int64))
        for done in settled:
            done(bad if device is not None else None)

    def _fold(self) -> None:
        """Count the skipped steps among those waiting (:meth:`settle`): steps of the same groups at once."""
        with self._lock:
            pending, self._pending = self._pending, []
        shapes: dict[tuple[tuple[torch.dtype, int], ...], list[dict[torch.dtype, list[torch.Tensor]]]] = {}
        for witnesses in pending:
            shapes.setdefault(tuple((d, len(v)) for d, v in witnesses.items()), []).append(witnesses)
        for steps in shapes.values():
            self._count(_witnessed(steps).sum())

    def _count(self, skipped: torch.Tensor) -> None:
        with self._lock:
            self._skipped = skipped if self._skipped is None else self._skipped + skipped

    def settle_before(self, step: int) -> None:
        """Settle the last step unless it is ``step`` itself: a later group of a step already begun must not
        decide it while its earlier groups are in flight (the step before was settled when the first began)."""
        with self._lock:
            current = self._step
        if current is not None and current != step:
            self.settle()

    def skipped(self) -> int:
        """Steps skipped so far (settles the last one; reads the count on the host: not for the hot path)."""
        self.settle()
        self._fold()
        return 0 if self._skipped is None else int(self._skipped.item())

    def memory_bytes(self) -> int:
        """Bytes of the copies kept for the next step."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


__all__ = ["StepGuard", "nonfinite", "poison"]
