"""Low-communication training: DiLoCo and Streaming DiLoCo, the outer step averaged by any of the project's algorithms.

Each replica takes ``sync_every`` inner optimizer steps alone; then the replicas average the pseudo-gradient (the
parameters' change since the last global point, ``outer - current``) and an outer optimizer (Nesterov SGD, lr 0.7,
momentum 0.9 unless given) applies it to the global parameters, which every replica then continues from. The
average goes through a :class:`~sylvie_comm.algorithms.session.Session`, so any of the project's algorithms can
carry it (``codec="qsgd", bits=2``; ``"topk"``; ``"acpsgd"``), with its error feedback carried from one outer step
to the next (per parameter name), the configuration agreed across ranks, the bytes counted, exact resume.

**Streaming** (``fragments=F``): the parameters are cut into ``F`` fragments (in order, about equal in size), synced
in turn, one every ``sync_every // F`` inner steps, so each is synced every ``sync_every`` steps and the wire
carries a fragment at a time. With ``delay=tau`` a fragment's pseudo-gradient is taken and its average started
``tau`` inner steps before it is applied, the inner steps running while it travels; ``alpha`` mixes the replica's
own parameters back in when it is applied: ``(1 - alpha) * global + alpha * local`` (Streaming DiLoCo's
definitions, torchft's ``fragment_sync_delay`` and ``fragment_update_alpha``).

**Memory**: the global parameters (``outer``: one copy of the trainable parameters, of this rank's shard under
FSDP2, in their dtype, on their device) and the outer optimizer's state (one more copy for SGD with momentum);
the pseudo-gradient buffers (fp32, a model's worth over the fragments); the algorithm's state (error feedback:
one fp32 residual per compressed parameter).

**Non-finite**: a fragment whose averaged pseudo-gradient holds a NaN or an Inf (some replica diverged) is not
applied on any rank: every replica goes back to the global parameters of every fragment (a NaN left in one
fragment would reach the others through the next backward pass), a replica whose inner optimizer state holds a
NaN or an Inf clears that state (AdamW's moments, SGD's momentum: kept, they would poison every later step), the
outer optimizer's state and the algorithm's residuals stay as they were, ``stats()["skipped_nonfinite"]`` counts
it and each rank logs one warning. That decision is one host read per outer step (every ``sync_every // F`` inner
steps); a skip reads the replica's parameters and inner state once more. ``SKIPPED_CYCLES`` cycles of skipped outer
steps in a row (every fragment skipped that many times running, despite the resets) fail the run on every rank.

**GradScaler**: ``torch.amp.GradScaler`` steps an optimizer only where the gradients are finite, so a step it
skipped on one replica would not be counted there and that replica would sync one inner step after the others for
the rest of the run. DiLoCo marks the inner optimizer as one that handles the scaling itself
(``_step_supports_amp_scaling``, as torch's fused optimizers are): the scaler calls its ``step()`` every time, and
DiLoCo unscales the gradients (as ``unscale_`` does) and steps, or skips the update where the scaler found an Inf,
counting the inner step either way.

**Failures**: a collective that fails (a peer died or did not answer within the timeout) raises the transport's
:class:`~sylvie_comm.collectives.CollectiveError` from ``opt.step()``.
"""

from __future__ import annotations

import logging
import math
import weakref
import zlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from sylvie_comm.algorithms.guard import nonfinite
from sylvie_comm.algorithms.session import Session
from sylvie_comm.collectives import ProcessGroupTransport, Transport, agree, wait, wire_bytes
from sylvie_comm.config import Config
from sylvie_comm.optim.diloco_amp import hook_amp, unhook_amp
from sylvie_comm.optim.diloco_checks import OUTER_DEFAULTS, check_groups, check_replica, check_state, diloco_config
from sylvie_comm.optim.fragments import Fragment, as_grad, check_schedule, due, local_part, split

Future = torch.futures.Future

LOG = logging.getLogger("sylvie_comm")

# Cycles of skipped outer steps in a row (each fragment skipped this many times running, the replicas reset to the
# global parameters after each) after which the run fails instead of training on with nothing applied.
SKIPPED_CYCLES = 3

# The open DiLoCo of each model and inner optimizer (weakly: a DiLoCo dropped unclosed lives as long as the hook it
# left on its optimizer): a second one would hook the same step() and take a second outer step every period.
_OPEN: weakref.WeakKeyDictionary[Any, weakref.ref[DiLoCo]] = weakref.WeakKeyDictionary()


class DiLoCo:
    """DiLoCo around a replica's training loop: the inner optimizer's ``step()`` does the rest.

    ::

        with DiLoCo(model, opt, sync_every=16, codec="qsgd", bits=2) as diloco:
            for x, y in data:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()  # every 16th step: the outer step, the pseudo-gradient averaged 2-bit
        print(diloco.stats())

    Building one is a collective call (the ranks agree on the configuration and start from rank 0's
    parameters); so is every inner step that syncs a fragment.

    Args:
        model: the replica (plain, no DDP inside: the replicas train apart between outer steps).
        inner_optimizer: the optimizer stepping ``model``'s parameters (its ``step()`` is hooked).
        sync_every: inner steps between two outer steps of a fragment (``H``).
        outer_optimizer: an optimizer over ``model``'s trainable parameters (default Nesterov SGD, lr 0.7,
            momentum 0.9): its ``step()`` runs on the global parameters with the averaged pseudo-gradient as
            their ``.grad``.
        codec: the algorithm that averages the pseudo-gradient (default ``none``: fp32, DiLoCo as published).
        fragments: Streaming DiLoCo's fragments (``sync_every`` must be a multiple of it).
        delay: inner steps between taking a fragment's pseudo-gradient and applying its average (``0 <= delay <
            sync_every // fragments``).
        alpha: the share of the replica's own parameters kept when a fragment's update is applied (0: none).
        transport: the ranks (a :class:`~sylvie_comm.collectives.Transport`; the in-process one in tests).
        process_group: without ``transport``, the ranks across replica groups (default: the default group, on a
            dedicated group of its ranks with ``timeout``, seconds, default 600 s); a group given is used as it is,
            with its own timeout: create it for DiLoCo (``dist.new_group(ranks, timeout=...)``).
        config: a :class:`~sylvie_comm.config.Config` instead of ``codec`` and keywords (``warmup_steps``
            counts outer steps averaged in fp32 first; default 0).
        **options: the codec's options (``bits``, ``ratio``, ``rank``, ...) and Config fields (``seed``).
    """

    what = "DiLoCo"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_optimizer: torch.optim.Optimizer | None = None,
        codec: str | None = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        transport: Transport | None = None,
        process_group: Any = None,
        timeout: float | timedelta | None = None,
        config: Config | None = None,
        **options: Any,
    ) -> None:
        what = self.what
        model, inner_group, named, outer_optimizer, self.period = check_replica(
            what, model, inner_optimizer, outer_optimizer, sync_every, fragments, delay, alpha
        )
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.sync_every = sync_every
        self.fragments_count = fragments
        self.delay = delay
        self.alpha = float(alpha)
        self._owns_transport = transport is None
        if transport is None:
            # The default group: a dedicated group of its ranks. A group given (the ranks across replica groups, which
            # differ from rank to rank and so cannot be created here by every rank alike) is used as it is.
            transport = ProcessGroupTransport(process_group, dedicated=process_group is None, timeout=timeout)
        self.transport = transport
        try:
            check_groups(what, transport, inner_group, [p for _, p in named])
        except BaseException:
            if self._owns_transport:
                transport.close()  # type: ignore[attr-defined]
            raise
        self.world_size = transport.world_size
        self.rank = transport.rank
        self._named = named
        self.inner_step = 0  # inner steps taken (the outer steps' clock), GradScaler's skipped ones included
        self._skipped = 0
        self._skipped_in_a_row = 0  # outer steps skipped since the last one applied
        self._amp_step: Any = None  # the step() wrapper GradScaler calls (see hook_amp)
        self._carried: dict[str, float] = {}  # the counters of the run a checkpoint was written in
        self._handle: Any = None
        self._closed = False
        cfg = diloco_config(what, codec, config, options)
        self.fragments = [Fragment(i, part) for i, part in enumerate(split(named, fragments))]
        try:
            for frag in self.fragments:
                frag.attach(self._session(frag, cfg))
            self._start_from_rank0()
        except BaseException:
            self._close_sessions()
            raise
        self._handle = inner_optimizer.register_step_post_hook(lambda *_: self._after_inner_step())
        # GradScaler steps the inner optimizer every time, a skipped step too: every replica counts it.
        self._amp_step = hook_amp(inner_optimizer, self._after_inner_step)
        _OPEN[model] = _OPEN[inner_optimizer] = weakref.ref(self)

    def _check_unclaimed(self) -> None:
        """Refuse a model or inner optimizer that an open DiLoCo trains already (a ValueError naming it)."""
        for key, role in ((self.model, "model"), (self.inner_optimizer, "inner optimizer")):
            ref = _OPEN.get(key)
            other = ref() if ref is not None else None
            if other is not None and not other._closed:
                raise ValueError(
                    f"{self.what}: this {type(key).__name__} ({role}) belongs to an open DiLoCo already "
                    f"(sync_every={other.sync_every}, fragments={other.fragments_count}), which hooks the inner "
                    "optimizer's step(): a second DiLoCo would take a second outer step every period (two outer "
                    "momentum updates, twice the bytes); close() that one first, or keep using it"
                )

    def _release(self) -> None:
        """Unhook the inner optimizer and free the model for another DiLoCo (idempotent)."""
        self._closed = True
        if self._handle is not None:
            self._handle.remove()
        unhook_amp(self.inner_optimizer, self._amp_step)
        for key in (self.model, self.inner_optimizer):
            ref = _OPEN.get(key)
            if ref is not None and ref() is self:
                del _OPEN[key]

    # ------------------------------------------------------------------ set-up

    def _describe(self, frag: Fragment) -> dict[str, Any]:
        shapes = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in self._named)
        outer = type(self.outer_optimizer)
        hyper = {k: v for k, v in self.outer_optimizer.defaults.items() if isinstance(v, (int, float, bool, str))}
        return {
            "diloco": {
                "sync_every": self.sync_every, "fragments": self.fragments_count, "delay": self.delay,
                "alpha": self.alpha, "fragment": frag.index, "fragment_numel": frag.numel,
                "parameters": len(self._named), "parameter_digest": f"{zlib.crc32(shapes.encode()):08x}",
                "outer_optimizer": f"{outer.__module__}.{outer.__qualname__}", "outer_defaults": hyper,
            }
        }  # fmt: skip

    def _session(self, frag: Fragment, cfg: Config) -> Session:
        what = f"{self.what}[{cfg.codec}]" + (f" fragment {frag.index}" if self.fragments_count > 1 else "")

        def prepare(s: Session) -> None:
            if frag.index == 0:  # inside the agreement: a rank that refuses fails every rank
                self._check_unclaimed()
            s.policy.check_parameters(frag.named, what)

        return Session.agreed(
            what, self.transport, lambda: cfg, describe=lambda _: self._describe(frag), close_transport=False,
            prepare=prepare,
        )  # fmt: skip

    def _start_from_rank0(self) -> None:
        """Every replica starts from rank 0's parameters (an all-reduce of rank 0's values and zeros elsewhere)."""
        for frag in self.fragments:
            with torch.no_grad():
                local = frag.local()
                if self.rank == 0:
                    torch._foreach_copy_(frag.views, [t.float() for t in local])
                else:
                    frag.flat.zero_()
                wait(self.transport.all_reduce(frag.flat))
                for t, o, v in zip(local, frag.outer, frag.views, strict=True):
                    t.copy_(v)
                    o.copy_(t)

    # ------------------------------------------------------------------ the clock

    def _after_inner_step(self) -> None:
        if self._closed:
            return
        self.inner_step += 1
        k, start, apply = due(self.inner_step, self.period, self.delay, self.fragments_count)
        frag = self.fragments[k]
        if start:
            self._start(frag)
        if apply:
            self._apply(frag)

    def _start(self, frag: Fragment) -> None:
        """Take ``frag``'s pseudo-gradient (global - current) and start its average."""
        assert frag.session is not None and frag.group is not None and frag.pending is None
        with torch.no_grad():
            torch._foreach_copy_(frag.views, [o.float() for o in frag.outer])
            torch._foreach_sub_(frag.views, [t.float() for t in frag.local()])
        frag.pending = frag.session.run(frag.group)

    def _apply(self, frag: Fragment) -> None:
        """Wait for ``frag``'s average and take the outer step on it (or skip it where it is not finite); nothing
        where :meth:`sync` applied it already."""
        assert frag.session is not None
        if frag.pending is None:
            return
        fut, frag.pending = frag.pending, None
        wait(fut)
        session = frag.session
        session.advance()
        bad = nonfinite(frag.flat)
        session.algorithm.guard.settle()  # the algorithm's state goes back where its flag is set
        if bad is not None and bool(bad):
            self._skip(frag)
            return
        self._skipped_in_a_row = 0
        with torch.no_grad():
            now = frag.local()
            local = [t.clone() for t in now] if self.alpha > 0 else None
            torch._foreach_copy_(now, frag.outer)
            grads = {id(p): p.grad for _, p in self._named}
            for _, p in self._named:
                p.grad = None
            for q, v in zip(frag.params, frag.views, strict=True):
                q.grad = as_grad(q, v)
        try:
            self.outer_optimizer.step()
        finally:
            with torch.no_grad():
                for _, p in self._named:
                    p.grad = grads[id(p)]
        with torch.no_grad():
            now = frag.local()
            torch._foreach_copy_(frag.outer, now)
            if local is not None:
                torch._foreach_lerp_(now, local, self.alpha)

    def _skip(self, frag: Fragment) -> None:
        """The outer step of ``frag`` is not applied (its average is not finite; every rank decides alike): every
        replica goes back to the global parameters of every fragment, and a replica whose inner optimizer state is
        not finite clears it; one warning; the run fails after ``SKIPPED_CYCLES`` cycles of skips in a row."""
        self._skipped += 1
        self._skipped_in_a_row += 1
        with torch.no_grad():
            mine = nonfinite(*[t for f in self.fragments for t in f.local()])
            diverged = mine is not None and bool(mine)  # for the message only: one more read, on a skip only
            for f in self.fragments:
                torch._foreach_copy_(f.local(), f.outer)
        cleared = self._clear_nonfinite_inner_state()
        LOG.warning(
            "sylvie_comm %s rank %d: outer step of fragment %d of %d skipped at inner step %d: the averaged "
            "pseudo-gradient holds a NaN or an Inf (this replica's parameters are %s); every replica goes back to the "
            "global parameters%s; %d skipped in all, %d in a row",
            self.what, self.rank, frag.index, self.fragments_count, self.inner_step,
            "not finite" if diverged else "finite",
            f", and this replica's inner optimizer state of {cleared} parameter(s), not finite, is cleared"
            if cleared else "", self._skipped, self._skipped_in_a_row,
        )  # fmt: skip
        limit = SKIPPED_CYCLES * self.fragments_count
        if self._skipped_in_a_row >= limit:
            raise RuntimeError(
                f"{self.what}: {self._skipped_in_a_row} outer steps in a row skipped ({SKIPPED_CYCLES} cycles of "
                f"{self.fragments_count} fragment(s), at most {limit - 1} allowed), at inner step {self.inner_step}: "
                f"each averaged pseudo-gradient held a NaN or an Inf although every replica went back to the global "
                f"parameters after each; some replica diverges within sync_every={self.sync_every} inner steps, or "
                f"its data is not finite (this rank's parameters were {'not ' if diverged else ''}finite): lower the "
                "inner learning rate or check the data"
            )

    def _clear_nonfinite_inner_state(self) -> int:
        """Drop the inner optimizer's state of each parameter where it holds a NaN or an Inf (the optimizer makes it
        afresh at its next step); returns how many. One host read for all of them."""
        state = self.inner_optimizer.state
        device = self._named[0][1].device
        keys, flags = [], []
        for p, entry in state.items():
            values = entry.values() if isinstance(entry, Mapping) else ()
            # this rank's part (FSDP2's shard), on the parameters' device (not Adam's step counter on the CPU)
            tensors = [local_part(v) for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
            flag = nonfinite(*[t for t in tensors if t.device == device])
            if flag is not None:
                keys.append(p)
                flags.append(flag.to(device))
        if not flags:
            return 0
        bad = [p for p, b in zip(keys, torch.stack(flags).tolist(), strict=True) if b]
        for p in bad:
            del state[p]
        return len(bad)

    # ------------------------------------------------------------------ public

    def sync(self) -> None:
        """Apply every fragment's average still in flight (``delay``) now; a collective. :meth:`close` does it. The
        schedule goes on: a fragment applied here is not applied again at its scheduled inner step."""
        for frag in self.fragments:
            if frag.pending is not None:
                self._apply(frag)

    def stats(self) -> dict[str, Any]:
        """Bytes each rank sent for the outer steps, summed over the fragments, next to what plain data-parallel
        training would have sent for the same inner steps (an fp32 all-reduce of the gradients every step):
        ``bytes_sent``, ``bytes_uncompressed`` (the pseudo-gradients' fp32 all-reduces), ``compression_ratio``
        (the codec's own), ``ddp_bytes``, ``reduction_vs_ddp``, ``inner_steps``, ``outer_steps``,
        ``skipped_nonfinite``, ``encode_seconds``, ``decode_seconds``, ``collectives``."""
        keys = ("bytes_sent", "bytes_uncompressed", "collectives", "encode_seconds", "decode_seconds")
        out: dict[str, Any] = dict.fromkeys(keys, 0)
        for frag in self.fragments:
            assert frag.session is not None
            s = frag.session.stats()
            for k in keys:
                out[k] += s[k]
        for k in keys:
            out[k] += self._carried.get(k, 0)
        sent = out["bytes_sent"]
        out["compression_ratio"] = out["bytes_uncompressed"] / sent if sent else math.nan
        numel = sum(f.numel for f in self.fragments)
        out["ddp_bytes"] = self.inner_step * wire_bytes("all_reduce", 4 * numel, self.world_size)
        out["reduction_vs_ddp"] = out["ddp_bytes"] / sent if sent else math.nan
        out["inner_steps"] = self.inner_step
        out["outer_steps"] = sum(f.session.step for f in self.fragments if f.session is not None)  # taken or skipped
        out["skipped_nonfinite"] = self._skipped
        return out

    def memory_bytes(self) -> int:
        """Bytes DiLoCo keeps beside the model: the global copy, the pseudo-gradient buffers, the algorithms'
        state (the outer optimizer's own state is the optimizer's)."""
        total = 0
        for frag in self.fragments:
            assert frag.session is not None
            total += sum(o.numel() * o.element_size() for o in frag.outer) + frag.flat.numel() * 4
            total += frag.session.memory_bytes()
        return total

    def state_dict(self) -> dict[str, Any]:
        """This rank's DiLoCo state: the inner step, the global parameters, the outer optimizer's state, each
        fragment's session (residuals, per name), and each average in flight (waited for, saved as received).
        With the model's and the inner optimizer's own state dicts it resumes the run bit for bit."""
        frags = []
        for frag in self.fragments:
            assert frag.session is not None
            pending = None
            if frag.pending is not None:
                wait(frag.pending)
                pending = frag.flat.detach().clone()
            frags.append({
                "outer": {n: o.detach().clone() for (n, _), o in zip(frag.named, frag.outer, strict=True)},
                "session": frag.session.state_dict(), "pending": pending,
            })  # fmt: skip
        stats = self.stats()
        return {
            "inner_step": self.inner_step, "skipped": self._skipped, "skipped_in_a_row": self._skipped_in_a_row,
            "fragments": frags,
            "counters": {k: stats[k] for k in ("bytes_sent", "bytes_uncompressed", "collectives", "encode_seconds",
                                               "decode_seconds")},
            "outer_optimizer": self.outer_optimizer.state_dict(), "config": self._describe(self.fragments[0]),
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (a collective: every rank loads its own).

        Every rank checks its checkpoint, then the ranks agree: all load, or every rank raises (a ValueError naming
        the field that does not fit, or the rank that refused). Checkpoints of different inner steps are refused:
        the ranks would sync out of phase from then on."""
        what = self.what
        agree(self.transport, lambda: check_state(what, state, self.fragments, self._describe),
              lambda step: {"inner_step": step}, f"{what} load_state_dict", "checkpoint")  # fmt: skip
        frags = state["fragments"]
        for frag, saved in zip(self.fragments, frags, strict=True):
            assert frag.session is not None
            frag.session.load_state_dict(
                saved["session"], [(n, shape) for (n, _), shape in zip(frag.named, frag.shapes, strict=True)]
            )
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        with torch.no_grad():
            for frag, saved in zip(self.fragments, frags, strict=True):
                for (n, _), o in zip(frag.named, frag.outer, strict=True):
                    o.copy_(saved["outer"][n])
                frag.pending = None
                if saved["pending"] is not None:
                    frag.flat.copy_(saved["pending"])
                    done: Future[Any] = torch.futures.Future()
                    done.set_result(None)
                    frag.pending = done
        self.inner_step = int(state["inner_step"])
        self._skipped = int(state.get("skipped", 0))
        self._skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self._carried = dict(state.get("counters", {}))

    def close(self) -> None:
        """Apply what is in flight, unhook the inner optimizer, stop the algorithms' threads; idempotent."""
        if self._closed:
            return
        try:
            self.sync()
        finally:
            self._release()
            self._close_sessions()

    def _close_sessions(self) -> None:
        for frag in self.fragments if hasattr(self, "fragments") else ():
            if frag.session is not None:
                frag.session.close(transport=False)
        close = getattr(self.transport, "close", None) if hasattr(self, "transport") else None
        if self._owns_transport and close is not None:
            close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # an error mid-loop: unhook without another collective
            self._release()
            self._close_sessions()
            return
        self.close()


class ReplicaState:
    """A replica's whole state for a checkpointer that writes one process's model and optimizer only (Lightning,
    Accelerate): DiLoCo's :meth:`~DiLoCo.state_dict` with this replica's model and inner optimizer state, whose
    values differ from replica to replica. ``stats()`` and ``close()`` are DiLoCo's."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco
        self.optimizer_state: Any = None  # the last loaded inner optimizer state (to load again after a checkpointer's)

    def stats(self) -> dict[str, Any]:
        return self.diloco.stats()

    def state_dict(self) -> dict[str, Any]:
        return {
            "diloco": self.diloco.state_dict(),
            "model": {k: v.detach().clone() for k, v in self.diloco.model.state_dict().items()},
            "optimizer": self.diloco.inner_optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or not {"diloco", "model", "optimizer"} <= set(state):
            raise ValueError("DiLoCo: not a replica state (expected diloco, model, optimizer)")
        self.diloco.model.load_state_dict(state["model"])
        self.diloco.inner_optimizer.load_state_dict(state["optimizer"])
        self.optimizer_state = state["optimizer"]
        self.diloco.load_state_dict(state["diloco"])

    def close(self) -> None:
        self.diloco.close()


__all__ = ["OUTER_DEFAULTS", "DiLoCo", "ReplicaState", "check_schedule", "diloco_config"]
