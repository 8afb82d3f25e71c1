"""What the compressed reduce-scatter forms share (``qsgd``, ``onebit``): each rank's row for each peer.

A rank sends peer ``r`` one row of bytes for shard ``r``: fp32 words (scales, raw values), then the codes.
Every peer decides a step from what it receives, so a non-finite value bound for one peer is made visible to
all of them: the first word of every row turns NaN when anything this rank encodes is not finite.

The residuals are changed only once that decision is known, after the decode (:func:`update_residual`), so a
skipped step leaves them as they were without a copy: these forms keep no guard copy between steps and no
copy of a whole unit within one (the compensated values live in a temporary of one segment at a time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from sylvie_comm import kernels
from sylvie_comm.algorithms.base import Segment, ShardLayout
from sylvie_comm.algorithms.guard import StepGuard, nonfinite, poison
from sylvie_comm.codecs import ErrorFeedback


def residual_shape(segment: Segment, world_size: int) -> tuple[int, int]:
    """The reduce-scatter residual of a segment: its slice of every shard, as rows."""
    return (world_size * segment.numel // segment.row, segment.row)


def check_residuals(name: str, feedback: ErrorFeedback, key: str, segments: Iterable[Segment], world_size: int) -> None:
    """A ValueError naming the first segment whose stored residual does not fit this layout."""
    for seg in segments:
        res = feedback.residual(seg.name)
        if res is not None and tuple(res.shape) != residual_shape(seg, world_size):
            raise ValueError(
                f"{name}: shard layout {key!r}, segment {seg.name!r}: its residual has shape "
                f"{tuple(res.shape)}, this layout's slice of it needs {residual_shape(seg, world_size)} "
                f"(world_size * numel // row, row): a checkpoint or a layout of another shape"
            )


def residual_state(feedback: ErrorFeedback) -> object:
    """Return what a check of the residuals against a layout (:func:`check_residuals`) holds for: ``feedback``'s
    mapping of residuals, compared by identity. A loaded checkpoint replaces that mapping
    (:meth:`ErrorFeedback.load_state_dict`), with residuals of any shape, so it is checked again; the steps' own
    updates and resets keep it and write residuals of the layout's shapes (or none), so a plan checked once in
    this mapping needs no check at the next step."""
    return feedback._residuals


class _Piece(Protocol):
    segment: Segment


P = TypeVar("P", bound=_Piece)
# How a form places a segment in the row: ``(segment, its options checked, None where it travels uncompressed, fp32
# words before it, code bytes before it) -> (its piece, the words and code bytes after it)``.
Place = Callable[[Segment, "dict[str, Any] | None", int, int], "tuple[P, int, int]"]


@dataclass(eq=False)
class RowPlan(Generic[P]):
    """A layout's peer row: ``words`` fp32 words (scales, minimums, the uncompressed segments' values), then the
    codes, padded to whole words: a piece per segment with values. ``residuals`` is the residual mapping its
    segments' residuals were checked in (:func:`residual_state`; None: not yet)."""

    layout: ShardLayout
    shard: int
    pieces: list[P]
    words: int
    row_bytes: int
    residuals: object = None

    def compressed(self) -> Iterator[Segment]:
        """The compressed segments (those that keep a residual), in order."""
        return (p.segment for p in self.pieces if p.segment.compress)


class RowPlanner(dict[tuple[str, int], RowPlan[P]]):
    """The row plans of one algorithm's reduce-scatter form, by (layout key, shard size), each built and checked
    (valid per-name options) once per layout object: a caller that keeps its layout (an FSDP unit) finds it by
    identity, in O(1); another object, even an equal one (the monitor's rewritten options), builds it again.

    Args:
        name: the algorithm's, for messages.
        options: a segment's per-name options -> the options it runs with (a ValueError where one is invalid).
        place: the form's placement of one segment (:data:`Place`).
    """

    def __init__(self, name: str, options: Callable[[Mapping[str, Any]], dict[str, Any]], place: Place[P]) -> None:
        self.name = name
        self._options = options
        self._place = place

    def plan(self, layout: ShardLayout, shard: int) -> RowPlan[P]:
        """The plan of ``layout`` for shards of ``shard`` elements."""
        cached = self.get((layout.key, shard))
        if cached is not None and cached.layout is layout:
            return cached
        pieces: list[P] = []
        words = codes = 0
        for seg in layout.segments:
            if not seg.numel:
                continue  # nothing to send, nothing to average
            opts = None
            if seg.compress:
                try:
                    opts = self._options(seg.options)
                except ValueError as exc:
                    raise ValueError(f"{self.name}: shard layout {layout.key!r}, segment {seg.name!r}: {exc}") from None
            piece, words, codes = self._place(seg, opts, words, codes)
            pieces.append(piece)
        row = 4 * words + codes
        plan = self[(layout.key, shard)] = RowPlan(layout, shard, pieces, words, row + (-row) % 4)
        return plan


def encode_rows(
    world_size: int, row_bytes: int, words: int, device: torch.device,
    fill: Callable[[torch.Tensor, torch.Tensor], None],
) -> torch.Tensor:  # fmt: skip
    """``(world_size, row_bytes)`` bytes, row ``r`` for peer ``r``: ``fill(words, codes)`` writes the fp32
    words and the codes of every row; a non-finite word then turns the first word of every row NaN."""
    send = torch.zeros(world_size, row_bytes, dtype=torch.uint8, device=device)
    if not row_bytes:
        return send
    head = send.view(torch.float32)[:, :words]
    fill(head, send[:, 4 * words :])
    flag = nonfinite(head)
    if flag is not None:
        head[:, :1].masked_fill_(flag, float("nan"))
    return send


def decode_rows(
    guard: StepGuard, shard: int, row_bytes: int, words: int, received: torch.Tensor, out: torch.Tensor,
    fill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> torch.Tensor | None:  # fmt: skip
    """The rows received from every peer into ``out``: ``fill(result, words, codes)`` writes the fp32 mean of
    this rank's shard; every peer's non-finite flag (the same on every rank) goes to the guard and to ``out``,
    and is returned (None: nothing was received)."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    result = out.view(-1) if direct else torch.empty(shard, device=out.device)
    if not row_bytes:
        return None
    head = received.view(torch.float32)[:, :words]
    bad = nonfinite(head)
    guard.report(bad)
    fill(result, head, received[:, 4 * words :])
    poison([result], bad)
    if not direct:
        out.copy_(result.view(out.shape))
    return bad


class StepVerdict:
    """Whether the reduce-scatter calls of a step so far had a non-finite input on some rank: the or of their
    flags (0-dim bool tensors on the data's device, the same on every rank), reset by a new step number.

    A call updates its residuals unless this is set, so a step that an earlier unit's NaN skips changes no
    later unit's residual either. (A unit decoded before the NaN arrives has updated its residuals by then:
    undoing that would take the copy these forms no longer keep.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: int | None = None
        self._bad: torch.Tensor | None = None

    def add(self, step: int, bad: torch.Tensor | None) -> torch.Tensor | None:
        """Or ``bad`` (None: no flag) into step ``step``'s; return the step's flag so far (None: none yet)."""
        with self._lock:
            if step != self._step:
                self._step, self._bad = step, None
            if bad is not None:
                flag = bad.reshape(())
                self._bad = flag.clone() if self._bad is None else self._bad | flag
            return self._bad


def update_residual(
    res: torch.Tensor, x: torch.Tensor, bad: torch.Tensor | None, subtract: Callable[[torch.Tensor], None]
) -> None:
    """``res += x``, then ``subtract(res)`` (which takes the decode of this rank's own codes off it): the
    residual's update, in the same fp32 operations as compensating, encoding and updating in one go. Where
    ``bad`` (a 0-dim bool tensor) is set ``res`` stays as it is: the update goes to a temporary of ``res``'s
    size that replaces it only where ``bad`` is false (read on the device: no host synchronisation)."""
    if bad is None:
        res.add_(x)
        subtract(res)
        return
    new = torch.add(res, x)
    subtract(new)
    kernels.copy_if(res, new, ~bad)


__all__ = [
    "RowPlan",
    "RowPlanner",
    "StepVerdict",
    "check_residuals",
    "decode_rows",
    "encode_rows",
    "residual_shape",
    "residual_state",
    "update_residual",
]
