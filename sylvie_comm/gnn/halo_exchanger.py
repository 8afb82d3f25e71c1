"""The halo exchanger: boundary rows to the peers that need them, gradients back to their owners.

Per layer, forward: gather this rank's boundary rows (the union of what any
peer needs) once, encode them once (Sylvie's low-bit module: per-row min/max
stochastic quantization, or fp32/bf16/fp16), send each peer its rows in one
all-to-all with per-peer splits, decode into the halo buffer. Backward mirrors
it: halo-row gradients go back to their owners, who add them into their inner
rows. Each transfer is a job that :class:`~sylvie_comm.gnn.halo_pipeline.HaloPipeline`
runs (inline at staleness 0, on its communication thread above it).

Each layer's exchange in each direction runs a :class:`HaloPlan`, made at its
first call: the row format, the receive buffer and, forward, the ``[inner; halo]``
buffer the layer's rows are written into (see :meth:`HaloPlan.output`). The rows
travel in blocks, one per peer, whose parts the decoding reads where they were
received (:meth:`~sylvie_comm.gnn.halo_rows.RowFormat.pack`); forward, they are
decoded straight into the halo rows of the layer's buffer when the exchange runs
while the layer waits (``out`` of :meth:`HaloExchanger.features_job`). The bytes
each rank sends are counted in the shared accounting
(:class:`~sylvie_comm.collectives.Stats`, one table per direction).

``state_dict()``/``load_state_dict()`` hold the error-feedback residuals and the
noise offsets of the q-bit codecs, so a run restarted from a checkpoint continues
bit for bit.

Devices: the exchanger's index tensors, receive buffers and decoded rows live on
its ``device`` (the features' device); the per-peer row counts of the all-to-all
come from the partition, on the host, at set-up, so no step reads a value back
from the device.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from sylvie_comm.codecs import Encoded, ErrorFeedback
from sylvie_comm.collectives import Stats, Transport
from sylvie_comm.gnn.halo_checks import as_device, check_partitions, check_settings, check_state, partition_signature
from sylvie_comm.gnn.halo_rows import RowFormat, parse_precision
from sylvie_comm.gnn.partition import Partition


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors (and storage objects) hold ``t``'s memory, read on the host; None where this torch
    cannot tell (then no buffer is reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(t.untyped_storage()._cdata))


class HaloPlan:
    """What one layer's exchange in one direction needs, made at its first call and reused by every later one.

    A plan is keyed by direction (which sets the precision), layer key and feature width; a one-off exchange at
    another precision has a plan of its own for that call. It holds the row format (the codec
    and its noise offset), the receive buffer of the formats decoded inside the exchange (q-bit, bf16, fp16:
    the exchanges of one plan run one after the other, each decoding its rows before the next receives; fp32
    rows are received where they are needed instead), and, forward, the ``[inner; halo]`` buffer of
    :meth:`output`.
    """

    def __init__(self, direction: str, key: str, fmt: RowFormat, rows: int, device: torch.device) -> None:
        self.direction, self.key, self.fmt, self.rows, self.device = direction, key, fmt, rows, device
        self._recv: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._free: int | None = None  # the buffer's storage references when only this plan holds it
        # What the buffer's first rows hold: (the leaf written there, its version, the buffer's version then).
        self._written: tuple[weakref.ref[torch.Tensor], int, int] | None = None

    def receive_buffer(self) -> torch.Tensor:
        """The ``(rows, row_bytes)`` uint8 receive buffer, made on first use on the stream the exchange runs
        on and reused after (its rows are decoded before the plan's next exchange writes it)."""
        if self._recv is None:
            self._recv = torch.empty(self.rows, self.fmt.row_bytes, dtype=torch.uint8, device=self.device)
        return self._recv

    def output(self, inner: torch.Tensor, halo_rows: int) -> tuple[torch.Tensor, bool]:
        """The ``[inner; halo]`` buffer for this call, and whether its first rows hold ``inner``'s values already.

        The buffer (``inner``'s width, dtype and device) is reused while nothing but this plan holds its memory
        (read from the storage's reference count on the host: a graph that saved a view of an earlier call's
        buffer, an earlier output still referenced, or anyone else holding it, and a fresh one is made), so a
        buffer autograd may still read is never written again. The returned tensor is a new alias of the
        buffer, the one the caller hands to autograd; the plan keeps none of its history. The first rows hold
        ``inner`` already when ``inner`` is the leaf written there last, unchanged since (its version and the
        buffer's), as the model's fixed input features are: they are written once.
        """
        n, features = inner.shape
        buf = self._buffer
        if (
            buf is None
            or buf.shape != (n + halo_rows, features)
            or buf.dtype != inner.dtype
            or buf.device != inner.device
            or self._free is None
            or _storage_refs(buf) != self._free
        ):
            buf = self._buffer = torch.empty(n + halo_rows, features, dtype=inner.dtype, device=inner.device)
            self._free = _storage_refs(buf)
            self._written = None
        held = False
        if self._written is not None:
            source, version, buf_version = self._written
            held = source() is inner and inner._version == version and buf._version == buf_version
        return buf.detach(), held

    def written(self, inner: torch.Tensor | None) -> None:
        """Record that the buffer (its halo rows included) is written and its first rows hold ``inner``: a leaf
        a later call may hand in again; None, or a tensor made by an operation, is never looked for again."""
        if self._buffer is None or inner is None or inner.grad_fn is not None:
            self._written = None
        else:
            self._written = (weakref.ref(inner), inner._version, self._buffer._version)


class HaloExchanger:
    """The two halo transfers of one partition, with per-direction precision and optional error feedback.

    Args:
        part: this rank's partition.
        transport: the ranks (a :class:`~sylvie_comm.collectives.Transport`: process group, Horovod or in-process).
        forward, backward: precision of features and of gradients (see :func:`parse_precision`).
        meta_dtype: ``fp32`` or ``bf16`` for the per-row scale and minimum of q-bit rows.
        error_feedback: keep the quantization error of each sent row and add it next time.
        seed: noise seed of the stochastic rounding (offset by rank, layer and direction).
        smoothing: ``m`` in ``[0, 1)``: the halo feature rows a training pass uses are the running average
            ``a = m a + (1 - m) decoded`` of the rows received so far (Sylvie's and PipeGCN's feature correction,
            on the receiver, no bytes added): it averages out the noise of stochastic rounding, which error
            feedback turns into differences of successive errors, at the cost of a lag of ``m / (1 - m)``
            epochs. Evaluation passes use the rows received; 0 (the default) averages nothing.
        monitor_every: every this many exchanges of one layer and direction, the rows sent are decoded here
            and compared with what they encode (no communication: a peer decodes the same bits), see
            :meth:`errors`; 0 measures nothing.
        device: where the features (and so the index tensors, buffers and decoded rows) live; default
            the CPU. The partition itself stays on the host: its row counts are the all-to-all splits.
    """

    def __init__(
        self,
        part: Partition,
        transport: Transport,
        forward: str | int = "fp32",
        backward: str | int = "fp32",
        meta_dtype: str = "fp32",
        error_feedback: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
        monitor_every: int = 10,
        smoothing: float = 0.0,
    ) -> None:
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing < 1.0:
            raise ValueError(f"halo: smoothing must be a number in [0, 1) (0: none), got {smoothing!r}")
        self.smoothing = float(smoothing)
        # layer key -> the running average of the halo rows received in training passes (see _smooth)
        self._smoothed: dict[str, torch.Tensor] = {}
        if isinstance(monitor_every, bool) or not isinstance(monitor_every, int) or monitor_every < 0:
            raise ValueError(
                f"halo: monitor_every must be an integer >= 0 (0: no error measured), got {monitor_every!r}"
            )
        self.monitor_every = monitor_every
        # (direction/key) -> [sum of relative errors (device), measurements, calls]: see errors()
        self._errors: dict[str, list[Any]] = {}
        self.device = torch.device("cpu") if device is None else as_device(device)
        check_partitions(part, transport)
        self.part = part
        self.transport = transport
        self.forward_precision = parse_precision(forward)
        self.backward_precision = parse_precision(backward)
        if meta_dtype not in ("fp32", "bf16"):
            raise ValueError(f"halo: meta_dtype must be 'fp32' or 'bf16', got {meta_dtype!r}")
        self.meta_dtype = meta_dtype
        self.error_feedback = error_feedback
        self.seed = seed
        self.feedback = ErrorFeedback()
        self._formats: dict[tuple[str, int, str], RowFormat] = {}
        self._plans: dict[tuple[str, str, int], HaloPlan] = {}
        # Each boundary row is encoded once; every peer's rows are picked from that encoding. Computed on the
        # host from the partition (set-up), then placed on the features' device once.
        sends = [s.to("cpu") for s in part.send_idx]  # one (possibly empty) list per rank
        scatter_idx = torch.cat(sends)
        boundary = torch.unique(scatter_idx)
        pick = torch.cat([torch.searchsorted(boundary, s) for s in sends])
        self.scatter_idx = scatter_idx.to(self.device)  # where returned gradient rows land among the inner rows
        self.boundary = boundary.to(self.device)
        self.pick = pick.to(self.device)
        self.send_counts = part.send_counts
        self.halo_counts = list(part.halo_counts)
        # Each peer's part of ``pick``: views made once, the blocks of the forward all-to-all.
        starts = [sum(self.send_counts[:p]) for p in range(len(self.send_counts))]
        self.picks = [self.pick[s : s + k] for s, k in zip(starts, self.send_counts, strict=True)]
        # The bytes sent, per direction, in the shared accounting (steps: the pipeline's epochs, see ``step``).
        self.accounting = {"forward": Stats(), "backward": Stats()}
        self.step = 0

    def _format(self, direction: str, features: int, key: str) -> RowFormat:
        fkey = (direction, features, key)
        fmt = self._formats.get(fkey)
        if fmt is None:
            fmt = self._formats[fkey] = self._new_format(direction, features, key)
        return fmt

    def plan(self, direction: str, key: str, features: int) -> HaloPlan:
        """The :class:`HaloPlan` of ``key``'s exchanges in ``direction`` at width ``features`` (made once)."""
        pkey = (direction, key, features)
        plan = self._plans.get(pkey)
        if plan is None:
            rows = self.part.n_halo if direction == "forward" else sum(self.send_counts)
            plan = self._plans[pkey] = HaloPlan(direction, key, self._format(direction, features, key), rows,
                                                self.device)  # fmt: skip
        return plan

    def _count(self, direction: str, rows: int, fmt: RowFormat) -> None:
        """Count ``rows`` rows sent to other ranks in ``direction``: their bytes, and the fp32 rows' bytes."""
        self.accounting[direction].add(self.step, bytes_sent=rows * fmt.row_bytes,
                                       bytes_uncompressed=rows * fmt.features * 4, collectives=1)  # fmt: skip

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank sent to the others, by direction (``forward``, ``backward``), from the accounting."""
        return {d: int(s.summary(self.step + 1)["bytes_sent"]) for d, s in self.accounting.items()}

    def _new_format(self, direction: str, features: int, key: str) -> RowFormat:
        precision = self.forward_precision if direction == "forward" else self.backward_precision
        # Distinct noise streams per rank, direction and layer.
        seed = zlib.crc32(f"{self.seed}/{self.part.rank}/{direction}/{key}".encode())
        return RowFormat(precision, features, self.meta_dtype, seed)

    def _encode(self, fmt: RowFormat, rows: torch.Tensor, ef_key: str) -> Encoded:
        return fmt.encode_payload(rows, self.feedback if self.error_feedback else None, ef_key)

    def _measure(self, where: str, fmt: RowFormat, rows: torch.Tensor, encoded: Encoded) -> None:
        """Every ``monitor_every``-th call for ``where``: add ``||decode(encoded) - rows|| / ||rows||`` (on the
        device): what every receiver decodes, for the same bits."""
        if not self.monitor_every or not rows.numel():
            return
        entry = self._errors.setdefault(where, [None, 0, 0])
        entry[2] += 1
        if (entry[2] - 1) % self.monitor_every:
            return
        rel = (fmt.codec.decode(encoded) - rows).norm() / rows.norm()
        rel = torch.nan_to_num(rel, nan=0.0, posinf=0.0)
        entry[0] = rel if entry[0] is None else entry[0] + rel
        entry[1] += 1

    def errors(self) -> dict[str, float]:
        """The mean relative error of the rows sent (what every receiver decodes against what was encoded), by
        ``forward/<layer>`` and ``backward/<layer>``, over the measured exchanges (read on the host)."""
        return {k: float(v[0]) / v[1] for k, v in sorted(self._errors.items()) if v[1] and v[0].device.type != "meta"}

    def check_features(self, inner: torch.Tensor) -> None:
        """ValueError unless ``inner`` is ``(n_inner, F)`` rows on this exchanger's device."""
        if inner.dim() != 2 or inner.shape[0] != self.part.n_inner:
            raise ValueError(
                f"halo: expected features of shape ({self.part.n_inner}, F) for this partition's inner nodes, "
                f"got {tuple(inner.shape)}"
            )
        self._check_device("features", inner)

    def _check_device(self, what: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(
                f"halo: {what} are on {t.device} but this exchanger's index tensors are on {self.device}; "
                f"build the HaloExchanger with device={str(t.device)!r}"
            )

    @staticmethod
    def _keep_send(send: torch.Tensor) -> None:
        """CUDA-only: the job's stream reads ``send``, which the training stream allocated; without this the
        caching allocator could hand its memory out again while the collective still reads it."""
        if send.is_cuda:
            send.record_stream(torch.cuda.current_stream(send.device))

    def _receive_and_decode(
        self, plan: HaloPlan, send: torch.Tensor, out_counts: list[int], in_counts: list[int],
        out: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """Run one all-to-all of ``send`` and decode what arrives: into ``out`` when given (fp32 and contiguous:
        straight there; else through fp32 rows, cast on the copy), else into new fp32 rows."""
        self._keep_send(send)
        fmt = plan.fmt
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
        target = out if direct and out is not None else torch.empty(plan.rows, fmt.features, device=self.device)
        if fmt.in_place:
            # fp32 rows: received where they are read, nothing decoded.
            self.transport.all_to_all_v(target.view(torch.uint8), send, out_counts, in_counts).wait()
        else:
            recv = plan.receive_buffer()
            self.transport.all_to_all_v(recv, send, out_counts, in_counts).wait()
            fmt.decode_blocks(recv, out_counts, target)
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def features_job(
        self,
        inner: torch.Tensor,
        key: str,
        feedback: bool = True,
        precision: str | None = None,
        out: torch.Tensor | None = None,
    ) -> Callable[[], torch.Tensor]:
        """Encode boundary rows now; the returned job sends them and returns the decoded halo rows.

        ``feedback=False`` leaves the error-feedback residuals alone (evaluation
        passes); ``precision`` overrides the forward precision (one-off exchanges);
        ``out`` (``(n_halo, F)``) is where the job decodes the halo rows and what it returns, for a caller that
        waits for the job before it reads ``out`` (the halo rows of a layer's ``[inner; halo]`` buffer).
        """
        self.check_features(inner)
        if out is not None and tuple(out.shape) != (self.part.n_halo, inner.shape[1]):
            raise ValueError(f"halo: out must have shape ({self.part.n_halo}, {inner.shape[1]}) (the halo rows), "
                             f"got {tuple(out.shape)}")  # fmt: skip
        if precision is None:
            plan = self.plan("forward", key, inner.shape[1])
        else:  # a one-off exchange: its own format (and noise) each time, as it has always had
            fmt = RowFormat(parse_precision(precision), inner.shape[1], self.meta_dtype, self.seed)
            plan = HaloPlan("forward", key, fmt, self.part.n_halo, self.device)
        fmt = plan.fmt
        rows = inner[self.boundary].float()
        encoded = self._encode(fmt, rows, f"forward/{key}") if feedback else fmt.encode_payload(rows)
        if feedback:  # training passes only
            self._measure(f"forward/{key}", fmt, rows, encoded)
        send = fmt.pack(encoded, self.send_counts, self.pick, self.picks)
        self._count("forward", send.shape[0] - self.send_counts[self.part.rank], fmt)

        smooth = feedback and precision is None and self.smoothing > 0.0

        def job() -> torch.Tensor:
            if not smooth:
                return self._receive_and_decode(plan, send, self.halo_counts, self.send_counts, out)
            return self._smooth(key, self._receive_and_decode(plan, send, self.halo_counts, self.send_counts, out))

        return job

    def _smooth(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Fold ``rows`` (decoded, fp32) into ``key``'s running average and write the average into ``rows``.

        Runs inside the job, so the exchanges of one layer update the average in the order they were made (the
        pipeline runs them in submission order); ``rows`` is this exchange's own tensor, the average is kept
        apart, so an older exchange still queued keeps its rows."""
        avg = self._smoothed.get(key)
        if avg is None or avg.shape != rows.shape:
            avg = self._smoothed[key] = rows.detach().clone()
        else:
            avg.mul_(self.smoothing).add_(rows, alpha=1.0 - self.smoothing)
        return rows.copy_(avg)

    def gradients_job(self, grad_halo: torch.Tensor, key: str) -> Callable[[], torch.Tensor]:
        """Encode halo-row gradients now; the job returns the rows peers sent back for our boundary rows
        (``len(scatter_idx)`` rows, to be added at ``scatter_idx``)."""
        self._check_device("gradients", grad_halo)
        plan = self.plan("backward", key, grad_halo.shape[1])
        fmt = plan.fmt
        rows = grad_halo.float()
        encoded = self._encode(fmt, rows, f"backward/{key}")
        self._measure(f"backward/{key}", fmt, rows, encoded)
        send = fmt.pack(encoded, self.halo_counts)
        self._count("backward", send.shape[0], fmt)

        def job() -> torch.Tensor:
            return self._receive_and_decode(plan, send, self.send_counts, self.halo_counts, None)

        return job

    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this exchanger is only valid for."""
        return {"world_size": self.transport.world_size, "forward": self.forward_precision,
                "backward": self.backward_precision, "meta_dtype": self.meta_dtype,
                "error_feedback": self.error_feedback, "seed": self.seed,
                "partition": partition_signature(self.part),
                **({"smoothing": self.smoothing} if self.smoothing else {})}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals, the noise offset of every q-bit codec (by direction, layer key and
        width) and the byte counters. Local: no collectives."""
        codecs = [{"direction": d, "key": k, "features": f, "codec": fmt.codec.state_dict()}
                  for (d, f, k), fmt in self._formats.items() if fmt.stateful]  # fmt: skip
        errors = {k: [0.0 if v[0] is None or v[0].device.type == "meta" else float(v[0]), v[1], v[2]]
                  for k, v in self._errors.items()}  # fmt: skip
        smoothed = {k: v.detach().clone() for k, v in self._smoothed.items()}
        return {"settings": self.settings(), "feedback": self.feedback.state_dict(), "codecs": codecs,
                "bytes_sent": dict(self.bytes_sent), "errors": errors,
                **({"smoothed": smoothed} if self.smoothing else {})}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a checkpoint of other settings or another partition raises
        ValueError naming the field, and nothing is changed then."""
        what = "halo: HaloExchanger.load_state_dict"
        keys = {"settings", "feedback", "codecs", "bytes_sent"}
        # 'errors' (the measured error's sums and counts): absent from checkpoints written before it was kept.
        # 'smoothed' (the running averages): only in checkpoints of an exchanger that smooths.
        optional = {"errors"} | ({"smoothed"} if self.smoothing else set())
        state = check_state(what, state, keys | (optional & set(state) if isinstance(state, Mapping) else set()))
        smoothed = state.get("smoothed", {})
        rows = self.part.n_halo
        if not isinstance(smoothed, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.dim() == 2
            and v.shape[0] == rows for k, v in smoothed.items()
        ):  # fmt: skip
            raise ValueError(f"{what}: 'smoothed' must map layer keys to ({rows}, F) float32 tensors (this "
                             "partition's halo rows)")  # fmt: skip
        errors = state.get("errors", {})
        ok = isinstance(errors, Mapping) and all(
            isinstance(v, (list, tuple)) and len(v) == 3 and isinstance(v[0], float) and math.isfinite(v[0])
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v[1:])
            for v in errors.values()
        )  # fmt: skip
        if not ok:
            raise ValueError(f"{what}: 'errors' must map 'direction/layer' to [sum, measured, calls]")
        check_settings(what, self.settings(), state["settings"])
        if not isinstance(state["codecs"], list):
            raise ValueError(f"{what}: 'codecs' must be a list, got {type(state['codecs']).__name__}")
        # Codecs are built aside and replace the live ones only once everything has loaded.
        formats: dict[tuple[str, int, str], RowFormat] = {}
        for i, rec in enumerate(state["codecs"]):
            rec = check_state(f"{what}: codecs[{i}]", rec, {"direction", "key", "features", "codec"})
            direction, key, features = rec["direction"], rec["key"], rec["features"]
            if direction not in ("forward", "backward") or not isinstance(key, str):
                raise ValueError(f"{what}: codecs[{i}] has direction {direction!r} and key {key!r}; expected "
                                 "'forward' or 'backward' and a string")  # fmt: skip
            if isinstance(features, bool) or not isinstance(features, int) or features < 0:
                raise ValueError(f"{what}: codecs[{i}] has features {features!r}; expected an integer >= 0")
            fmt = formats[(direction, features, key)] = self._new_format(direction, features, key)
            if not fmt.stateful:
                raise ValueError(f"{what}: codecs[{i}] holds q-bit state for {direction} halos, which this "
                                 f"exchanger sends as {fmt.precision}")  # fmt: skip
            fmt.codec.load_state_dict(rec["codec"])
        bytes_sent = state["bytes_sent"]
        if not isinstance(bytes_sent, Mapping) or set(bytes_sent) != {"forward", "backward"}:
            raise ValueError(f"{what}: 'bytes_sent' must map 'forward' and 'backward' to byte counts")
        self.feedback.load_state_dict(state["feedback"])  # validates before it replaces anything
        self._formats = formats
        self._plans = {}
        self.accounting = {"forward": Stats(), "backward": Stats()}
        for direction, sent in bytes_sent.items():  # the totals so far, counted before any step of this run
            self.accounting[direction].add(-1, bytes_sent=int(sent))
        self._errors = {str(k): [torch.tensor(v[0], device=self.device) if v[1] else None, v[1], v[2]]
                        for k, v in errors.items()}  # fmt: skip
        self._smoothed = {k: v.detach().to(self.device, copy=True) for k, v in smoothed.items()}
