"""The halo exchanger: boundary rows to the peers that need them, gradients back to their owners.

Per layer, forward: gather this rank's boundary rows (the union of what any
peer needs) once, encode them once (Sylvie's low-bit module: per-row min/max
stochastic quantization, or fp32/bf16/fp16), send each peer its rows in one
all-to-all with per-peer splits, decode into the halo buffer. Backward mirrors
it: halo-row gradients go back to their owners, who add them into their inner
rows. Each transfer is a job that :class:`~sylvie_comm.gnn.halo_pipeline.HaloPipeline`
runs on its communication thread.

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
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from sylvie_comm.codecs import ErrorFeedback
from sylvie_comm.collectives import Transport
from sylvie_comm.gnn.halo_checks import as_device, check_partitions, check_settings, check_state, partition_signature
from sylvie_comm.gnn.halo_rows import RowFormat, parse_precision
from sylvie_comm.gnn.partition import Partition


class HaloExchanger:
    """The two halo transfers of one partition, with per-direction precision and optional error feedback.

    Args:
        part: this rank's partition.
        transport: the ranks (a :class:`~sylvie_comm.collectives.Transport`: process group, Horovod or in-process).
        forward, backward: precision of features and of gradients (see :func:`parse_precision`).
        meta_dtype: ``fp32`` or ``bf16`` for the per-row scale and minimum of q-bit rows.
        error_feedback: keep the quantization error of each sent row and add it next time.
        seed: noise seed of the stochastic rounding (offset by rank, layer and direction).
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
    ) -> None:
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
        self.bytes_sent = {"forward": 0, "backward": 0}

    def _format(self, direction: str, features: int, key: str) -> RowFormat:
        fkey = (direction, features, key)
        fmt = self._formats.get(fkey)
        if fmt is None:
            fmt = self._formats[fkey] = self._new_format(direction, features, key)
        return fmt

    def _new_format(self, direction: str, features: int, key: str) -> RowFormat:
        precision = self.forward_precision if direction == "forward" else self.backward_precision
        # Distinct noise streams per rank, direction and layer.
        seed = zlib.crc32(f"{self.seed}/{self.part.rank}/{direction}/{key}".encode())
        return RowFormat(precision, features, self.meta_dtype, seed)

    def _encode(self, fmt: RowFormat, rows: torch.Tensor, ef_key: str) -> torch.Tensor:
        return fmt.encode(rows, self.feedback if self.error_feedback else None, ef_key)

    def _measure(self, where: str, fmt: RowFormat, rows: torch.Tensor, wire: torch.Tensor) -> None:
        """Every ``monitor_every``-th call for ``where``: add ``||decode(wire) - rows|| / ||rows||`` (on the device)."""
        if not self.monitor_every or not rows.numel():
            return
        entry = self._errors.setdefault(where, [None, 0, 0])
        entry[2] += 1
        if (entry[2] - 1) % self.monitor_every:
            return
        rel = (fmt.decode(wire) - rows).norm() / rows.norm()
        rel = torch.nan_to_num(rel, nan=0.0, posinf=0.0)
        entry[0] = rel if entry[0] is None else entry[0] + rel
        entry[1] += 1

    def errors(self) -> dict[str, float]:
        """The mean relative error of the rows sent (what every receiver decodes against what was encoded), by
        ``forward/<layer>`` and ``backward/<layer>``, over the measured exchanges (read on the host)."""
        return {k: float(v[0]) / v[1] for k, v in sorted(self._errors.items()) if v[1] and v[0].device.type != "meta"}

    def _check_device(self, what: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(
                f"halo: {what} are on {t.device} but this exchanger's index tensors are on {self.device}; "
                f"build the HaloExchanger with device={str(t.device)!r}"
            )

    def _receive(self, send: torch.Tensor, rows: int, row_bytes: int) -> torch.Tensor:
        """A receive buffer on the exchanger's device, made on the stream the job runs on."""
        if send.is_cuda:
            # CUDA-only: the job's stream reads ``send``, which the training stream allocated; without this the
            # caching allocator could hand its memory out again while the collective still reads it.
            send.record_stream(torch.cuda.current_stream(send.device))
        return torch.empty(rows, row_bytes, dtype=torch.uint8, device=self.device)

    def features_job(
        self, inner: torch.Tensor, key: str, feedback: bool = True, precision: str | None = None
    ) -> Callable[[], torch.Tensor]:
        """Encode boundary rows now; the returned job sends them and returns the decoded halo rows.

        ``feedback=False`` leaves the error-feedback residuals alone (evaluation
        passes); ``precision`` overrides the forward precision (one-off exchanges).
        """
        if inner.dim() != 2 or inner.shape[0] != self.part.n_inner:
            raise ValueError(
                f"halo: expected features of shape ({self.part.n_inner}, F) for this partition's inner nodes, "
                f"got {tuple(inner.shape)}"
            )
        self._check_device("features", inner)
        fmt = (
            self._format("forward", inner.shape[1], key)
            if precision is None
            else RowFormat(parse_precision(precision), inner.shape[1], self.meta_dtype, self.seed)
        )
        rows = inner[self.boundary].float()
        wire = self._encode(fmt, rows, f"forward/{key}") if feedback else fmt.encode(rows)
        if feedback:  # training passes only
            self._measure(f"forward/{key}", fmt, rows, wire)
        send = wire[self.pick]
        self.bytes_sent["forward"] += (send.shape[0] - self.send_counts[self.part.rank]) * fmt.row_bytes

        def job() -> torch.Tensor:
            recv = self._receive(send, self.part.n_halo, fmt.row_bytes)
            self.transport.all_to_all_v(recv, send, self.halo_counts, self.send_counts).wait()
            return fmt.decode(recv)

        return job

    def gradients_job(self, grad_halo: torch.Tensor, key: str) -> Callable[[], torch.Tensor]:
        """Encode halo-row gradients now; the job returns the rows peers sent back for our boundary rows
        (``len(scatter_idx)`` rows, to be added at ``scatter_idx``)."""
        self._check_device("gradients", grad_halo)
        fmt = self._format("backward", grad_halo.shape[1], key)
        send = self._encode(fmt, grad_halo.float(), f"backward/{key}")
        self._measure(f"backward/{key}", fmt, grad_halo.float(), send)
        self.bytes_sent["backward"] += send.shape[0] * fmt.row_bytes

        def job() -> torch.Tensor:
            recv = self._receive(send, sum(self.send_counts), fmt.row_bytes)
            self.transport.all_to_all_v(recv, send, self.send_counts, self.halo_counts).wait()
            return fmt.decode(recv)

        return job

    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this exchanger is only valid for."""
        return {"world_size": self.transport.world_size, "forward": self.forward_precision,
                "backward": self.backward_precision, "meta_dtype": self.meta_dtype,
                "error_feedback": self.error_feedback, "seed": self.seed,
                "partition": partition_signature(self.part)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals, the noise offset of every q-bit codec (by direction, layer key and
        width) and the byte counters. Local: no collectives."""
        codecs = [{"direction": d, "key": k, "features": f, "codec": fmt.codec.state_dict()}
                  for (d, f, k), fmt in self._formats.items() if fmt.stateful]  # fmt: skip
        errors = {k: [0.0 if v[0] is None or v[0].device.type == "meta" else float(v[0]), v[1], v[2]]
                  for k, v in self._errors.items()}  # fmt: skip
        return {"settings": self.settings(), "feedback": self.feedback.state_dict(), "codecs": codecs,
                "bytes_sent": dict(self.bytes_sent), "errors": errors}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a checkpoint of other settings or another partition raises
        ValueError naming the field, and nothing is changed then."""
        what = "halo: HaloExchanger.load_state_dict"
        keys = {"settings", "feedback", "codecs", "bytes_sent"}
        # 'errors' (the measured error's sums and counts): absent from checkpoints written before it was kept.
        state = check_state(what, state, keys | ({"errors"} & set(state) if isinstance(state, Mapping) else set()))
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
        self.bytes_sent = {k: int(v) for k, v in bytes_sent.items()}
        self._errors = {str(k): [torch.tensor(v[0], device=self.device) if v[1] else None, v[1], v[2]]
                        for k, v in errors.items()}  # fmt: skip
