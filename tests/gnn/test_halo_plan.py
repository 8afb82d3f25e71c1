"""The halo layer's plan: the same bits as the reference path, rows written once, exchanges inline at staleness 0.

The reference is the exchange as it is defined: the codec's row layout (``RowFormat.encode`` of the boundary
rows, each peer's rows picked from it, ``RowFormat.decode`` of what arrives), every exchange on the pipeline's
communication thread, and an autograd op that concatenates ``[inner; halo]`` and hands back a copy of the inner
rows' gradient with the returned halo gradients added; the ReLU between layers a separate op. The plan's path
(blocks, decoding into the layer's buffer, the ReLU written there, inline exchanges) must give the same bits,
forward rows and gradients, at every precision, with and without error feedback and staleness.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sylvie_comm.collectives import Stats
from sylvie_comm.collectives.local import run_local
from sylvie_comm.gnn.halo import HaloExchanger, HaloPipeline, RowFormat, halo_exchange, parse_precision
from sylvie_comm.gnn.models import FullGraphGNN, LocalGraph
from sylvie_comm.gnn.partition import partition
from tests.gnn import workloads as gw

FORMS = ["fp32", "bf16", "fp16", "q1", "q2", "q4", "q8"]


class ReferenceExchanger(HaloExchanger):
    """The exchange in the codec's row layout, decoded into new rows (``out`` is not used)."""

    def features_job(self, inner: torch.Tensor, key: str, feedback: bool = True, precision: str | None = None,
                     out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:  # fmt: skip
        if precision is None:
            fmt = self._format("forward", inner.shape[1], key)
        else:
            fmt = RowFormat(parse_precision(precision), inner.shape[1], self.meta_dtype, self.seed)
        rows = inner[self.boundary].float()
        ef = self.feedback if self.error_feedback and feedback else None
        send = fmt.encode(rows, ef, f"forward/{key}")[self.pick]

        def job() -> torch.Tensor:
            recv = torch.empty(self.part.n_halo, fmt.row_bytes, dtype=torch.uint8)
            self.transport.all_to_all_v(recv, send, self.halo_counts, self.send_counts).wait()
            return fmt.decode(recv)

        return job

    def gradients_job(self, grad_halo: torch.Tensor, key: str) -> Callable[[], torch.Tensor]:
        fmt = self._format("backward", grad_halo.shape[1], key)
        send = fmt.encode(grad_halo.float(), self.feedback if self.error_feedback else None, f"backward/{key}")

        def job() -> torch.Tensor:
            recv = torch.empty(sum(self.send_counts), fmt.row_bytes, dtype=torch.uint8)
            self.transport.all_to_all_v(recv, send, self.send_counts, self.halo_counts).wait()
            return fmt.decode(recv)

        return job


class ReferencePipeline(HaloPipeline):
    """Every exchange on the communication thread and queued, staleness 0 included (the path before the inline one)."""

    def features(self, layer: int, inner: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._evaluating:
            job = self.exchanger.features_job(inner.detach(), str(layer), feedback=False)
            fresh: torch.Tensor = self._wait(self._submit(job))
            return fresh
        return self._queued_features(layer, inner)

    def gradients(self, layer: int, grad_halo: torch.Tensor) -> torch.Tensor | None:
        return self._queued_gradients(layer, grad_halo)


class _ReferenceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inner: torch.Tensor, pipeline: HaloPipeline, layer: int) -> torch.Tensor:
        halo = pipeline.features(layer, inner)
        ctx.pipeline, ctx.layer, ctx.n_inner = pipeline, layer, inner.shape[0]
        return torch.cat([inner, halo.to(inner.dtype)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        n = ctx.n_inner
        grad_inner = grad[:n].clone()
        returned = ctx.pipeline.gradients(ctx.layer, grad[n:])
        if returned is not None and returned.numel():
            grad_inner.index_add_(0, ctx.pipeline.exchanger.scatter_idx, returned.to(grad_inner.dtype))
        return grad_inner, None, None


def reference_exchange(inner: torch.Tensor, pipeline: HaloPipeline, layer: int, relu: bool = False) -> torch.Tensor:
    return _ReferenceFn.apply(inner if not relu else F.relu(inner), pipeline, layer)  # type: ignore[no-any-return]


def parts_for(world: int) -> list[Any]:
    g = gw.small_graph()
    return partition((g.src, g.dst), world, "random", num_nodes=g.num_nodes, ndata=g.ndata, seed=1)


def pipelines(tr: Any, part: Any, precision: str, staleness: int, feedback: bool,
              meta: str = "fp32") -> tuple[HaloPipeline, HaloPipeline]:  # fmt: skip
    """The plan's pipeline and the reference's, each on a transport of its own, with the same seeds."""
    options = {"error_feedback": feedback, "seed": 5, "meta_dtype": meta}
    ours = HaloPipeline(HaloExchanger(part, tr.fork(), precision, precision, **options), staleness, sync_every=3)
    ref = ReferencePipeline(ReferenceExchanger(part, tr.fork(), precision, precision, **options), staleness,
                            sync_every=3)  # fmt: skip
    return ours, ref


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("staleness", [0, 2])
@pytest.mark.parametrize("precision", FORMS)
@pytest.mark.parametrize("world,width", [(2, 16), (3, 13)])
def test_rows_and_gradients_are_the_reference_bits(world: int, width: int, precision: str, staleness: int) -> None:
    """Layer 1 (the ReLU written into the buffer) and layer 2 (a fixed leaf, written once): every epoch's
    ``[inner; halo]`` rows and both inputs' gradients equal the reference's bit for bit, and so do the rows
    of an evaluation pass. Width 13 at three ranks: q-bit blocks that start off a 4-byte boundary."""
    parts = parts_for(world)
    feedback = precision.startswith("q")

    def body(tr: Any) -> list[str]:
        part = parts[tr.rank]
        ours, ref = pipelines(tr, part, precision, staleness, feedback)
        gen = torch.Generator().manual_seed(10 + tr.rank)
        fixed = torch.randn(part.n_inner, width, generator=gen)
        x_ours, x_ref = fixed.clone().requires_grad_(), fixed.clone().requires_grad_()
        wrong = []
        try:
            for epoch in range(7):
                ours.begin_epoch(epoch)
                ref.begin_epoch(epoch)
                h = torch.randn(part.n_inner, width, generator=gen)
                h[::3] *= -1  # rows on both sides of the ReLU
                w1 = torch.randn(part.n_inner + part.n_halo, width, generator=gen)
                w2 = torch.randn(part.n_inner + part.n_halo, width, generator=gen)
                h_ours, h_ref = h.clone().requires_grad_(), h.clone().requires_grad_()
                x_ours.grad = x_ref.grad = None
                a1, b1 = halo_exchange(h_ours, ours, 1, relu=True), reference_exchange(h_ref, ref, 1, relu=True)
                a2, b2 = halo_exchange(x_ours, ours, 2), reference_exchange(x_ref, ref, 2)
                for what, a, b in (("rows 1", a1, b1), ("rows 2", a2, b2)):
                    if not same(a, b):
                        wrong.append(f"epoch {epoch}: {what}")
                ((a1 * w1).sum() + (a2 * w2).sum()).backward()
                ((b1 * w1).sum() + (b2 * w2).sum()).backward()
                assert h_ours.grad is not None and h_ref.grad is not None
                assert x_ours.grad is not None and x_ref.grad is not None
                if not same(h_ours.grad, h_ref.grad):
                    wrong.append(f"epoch {epoch}: gradient 1")
                if not same(x_ours.grad, x_ref.grad):
                    wrong.append(f"epoch {epoch}: gradient 2")
                with ours.evaluating(), ref.evaluating(), torch.no_grad():
                    if not same(halo_exchange(h, ours, 1, relu=True), reference_exchange(h, ref, 1, relu=True)):
                        wrong.append(f"epoch {epoch}: evaluation rows")
            if ours.stats()["observed_staleness"] != ref.stats()["observed_staleness"]:
                wrong.append("observed staleness")
        finally:
            ours.close()
            ref.close()
        return wrong

    for rank, wrong in enumerate(run_local(world, body, timeout=120)):
        assert not wrong, (rank, wrong)


@pytest.mark.parametrize("precision", ["q2", "fp32"])
def test_a_model_trains_to_the_reference_bits(precision: str) -> None:
    """A 3-layer GraphSAGE (no precompute: every layer exchanges), forward and backward over three epochs:
    logits and every weight gradient equal those of the same weights through the reference path."""
    parts = parts_for(2)

    def body(tr: Any) -> bool:
        part = parts[tr.rank]
        ours, ref = pipelines(tr, part, precision, 0, True)
        g_ours, g_ref = LocalGraph(part, ours), LocalGraph(part, ref)
        torch.manual_seed(0)
        model = FullGraphGNN("sage", 16, 8, 4, num_layers=3, backend="torch")
        x = part.ndata["feat"].float()
        ok = True
        try:
            for epoch in range(3):
                ours.begin_epoch(epoch)
                ref.begin_epoch(epoch)
                model.zero_grad()
                logits = model(g_ours, x)
                logits.square().sum().backward()
                grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                model.zero_grad()
                h = x
                for i, layer in enumerate(model.layers):  # the same layers, the ReLU a separate op
                    h = layer(g_ref, reference_exchange(h, ref, i, relu=i > 0))
                h.square().sum().backward()
                ok = ok and same(logits, h)
                ok = ok and all(same(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
        finally:
            ours.close()
            ref.close()
        return ok

    assert run_local(2, body, timeout=120) == [True, True]


def test_two_forwards_before_a_backward_get_buffers_of_their_own() -> None:
    """A buffer autograd may still read is never written again: a second forward of the layer while the first
    one's graph is alive gets another buffer, and both backward passes give the reference gradients."""
    parts = parts_for(2)

    def body(tr: Any) -> bool:
        part = parts[tr.rank]
        ours, ref = pipelines(tr, part, "q4", 0, False)
        try:
            ours.begin_epoch(0)
            ref.begin_epoch(0)
            gen = torch.Generator().manual_seed(tr.rank)
            h1, h2 = torch.randn(part.n_inner, 8, generator=gen), torch.randn(part.n_inner, 8, generator=gen)
            ins = [t.clone().requires_grad_() for t in (h1, h2, h1, h2)]
            a1 = halo_exchange(ins[0], ours, 1, relu=True)
            a1_rows = a1.detach().clone()
            a2 = halo_exchange(ins[1], ours, 1, relu=True)
            b1, b2 = reference_exchange(ins[2], ref, 1, relu=True), reference_exchange(ins[3], ref, 1, relu=True)
            distinct = a1.data_ptr() != a2.data_ptr() and same(a1, a1_rows)
            (a1.square().sum() + 3 * a2.sum()).backward()
            (b1.square().sum() + 3 * b2.sum()).backward()
            grads = all(same(ins[i].grad, ins[i + 2].grad) for i in (0, 1))  # type: ignore[arg-type]
            del a1, a2, b1, b2
            # Nothing holds the buffers now: the next call reuses the last one made.
            ours.begin_epoch(1)
            ref.begin_epoch(1)
            again = halo_exchange(h1, ours, 1, relu=True)
            reused = again.data_ptr() == ours.exchanger.plan("forward", "1", 8)._buffer.data_ptr()  # type: ignore[union-attr]
            reference_exchange(h1, ref, 1, relu=True)
        finally:
            ours.close()
            ref.close()
        return distinct and grads and reused

    assert run_local(2, body, timeout=60) == [True, True]


class Ops(TorchDispatchMode):
    """Records every op with its tensors' data pointers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int], list[int]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
        outs = [t.data_ptr() for t in ([out] if isinstance(out, torch.Tensor) else [])]
        outs += [v.data_ptr() for v in kwargs.values() if isinstance(v, torch.Tensor)]
        self.calls.append((str(func), ins, outs))
        return out


def test_inner_rows_are_written_once_and_halo_rows_decoded_into_the_buffer() -> None:
    """Forward at staleness 0: the ReLU writes its output into the buffer's first rows (no concatenation, no
    copy of the inner rows), the q-bit decoding writes into its halo rows, and an unchanged leaf handed in
    again (the model's input) is not written again: the same buffer, no copy."""
    parts = parts_for(2)

    def body(tr: Any) -> dict[str, Any]:
        part = parts[tr.rank]
        pipeline = HaloPipeline(HaloExchanger(part, tr, "q2", "q2"), 0)
        n = part.n_inner
        h = torch.randn(n, 16, requires_grad=True)
        x = torch.randn(n, 16)
        try:
            pipeline.begin_epoch(0)
            with Ops() as ops:
                full = halo_exchange(h, pipeline, 1, relu=True)
            buf = full.data_ptr()
            halo_at = full[n:].data_ptr()
            relu_into = [c for c in ops.calls if c[0].startswith("aten.clamp_min") and buf in c[2]]
            copies = [c for c in ops.calls if c[0] in ("aten.cat.default", "aten.copy_.default") and buf in c[2]]
            decoded_into = [c for c in ops.calls if "qbit_decode_into" in c[0] and halo_at in c[1]]
            full.sum().backward()
            del full
            first = halo_exchange(x, pipeline, 2)
            first_ptr = first.data_ptr()
            del first
            pipeline.begin_epoch(1)
            with Ops() as ops2:
                second = halo_exchange(x, pipeline, 2)
            inner_copies = [c for c in ops2.calls if c[0] == "aten.copy_.default" and second.data_ptr() in c[2]]
            return {"relu_into": len(relu_into), "copies": len(copies), "decoded_into": len(decoded_into),
                    "same_buffer": second.data_ptr() == first_ptr, "inner_copies": len(inner_copies),
                    "rows_right": torch.equal(second[:n], x)}  # fmt: skip
        finally:
            pipeline.close()

    for r in run_local(2, body, timeout=60):
        assert r == {"relu_into": 1, "copies": 0, "decoded_into": 1, "same_buffer": True, "inner_copies": 0,
                     "rows_right": True}, r  # fmt: skip


@pytest.mark.parametrize("staleness", [0, 1])
def test_staleness_zero_exchanges_on_the_calling_thread(staleness: int) -> None:
    """Staleness 0: every exchange (features, gradients, evaluation, the one-off) runs on the caller's thread
    and nothing is queued; staleness 1: all of them on the communication thread."""
    parts = parts_for(2)

    class Where(HaloExchanger):
        threads: list[threading.Thread]

        def _record(self, job: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                self.threads.append(threading.current_thread())
                return job()

            return run

        def features_job(self, *args: Any, **kwargs: Any) -> Callable[[], torch.Tensor]:
            return self._record(super().features_job(*args, **kwargs))

        def gradients_job(self, *args: Any, **kwargs: Any) -> Callable[[], torch.Tensor]:
            return self._record(super().gradients_job(*args, **kwargs))

    def body(tr: Any) -> dict[str, Any]:
        part = parts[tr.rank]
        ex = Where(part, tr, "q1", "q1")
        ex.threads = []
        pipeline = HaloPipeline(ex, staleness)
        try:
            pipeline.exchange_once(torch.randn(part.n_inner, 4))
            for epoch in range(3):
                pipeline.begin_epoch(epoch)
                halo_exchange(torch.randn(part.n_inner, 4, requires_grad=True), pipeline, 1).sum().backward()
            with pipeline.evaluating():
                pipeline.features(1, torch.randn(part.n_inner, 4))
            pending = pipeline.pending()
            timings = pipeline.timings()
        finally:
            pipeline.close()
        return {"here": all(t is threading.current_thread() for t in ex.threads), "calls": len(ex.threads),
                "there": all(t is pipeline.executor._thread for t in ex.threads), "pending": pending,
                "timed": timings["wait_s"] > 0 and timings["exchange_s"] > 0}  # fmt: skip

    for r in run_local(2, body, timeout=60):
        assert r["calls"] == 1 + 3 * 2 + 1 and r["timed"], r
        if staleness == 0:
            assert r["here"] and r["pending"] == 0, r
        else:
            assert r["there"] and r["pending"] > 0, r


def test_the_bytes_are_in_the_shared_accounting() -> None:
    """Each direction's bytes, fp32 equivalent and collectives are counted per epoch in a
    :class:`~sylvie_comm.collectives.Stats` table; ``bytes_sent`` and ``stats()`` read their totals, which a
    checkpoint carries into a fresh exchanger."""
    parts = parts_for(2)

    def body(tr: Any) -> dict[str, Any]:
        part = parts[tr.rank]
        ex = HaloExchanger(part, tr, "q1", "bf16")
        pipeline = HaloPipeline(ex, 0)
        fwd, back = RowFormat("q1", 16), RowFormat("bf16", 16)
        sent_rows = sum(part.send_counts) - part.send_counts[part.rank]
        try:
            for epoch in range(2):
                pipeline.begin_epoch(epoch)
                halo_exchange(torch.randn(part.n_inner, 16, requires_grad=True), pipeline, 1).sum().backward()
            state = ex.state_dict()
            fresh = HaloExchanger(part, tr, "q1", "bf16")
            fresh.load_state_dict(state)
            stats = pipeline.stats()["bytes_sent"]
        finally:
            pipeline.close()
        return {
            "tables": all(isinstance(s, Stats) for s in ex.accounting.values()),
            "forward_epoch": ex.accounting["forward"].step(1).as_dict(),
            "backward_epoch": ex.accounting["backward"].step(1).as_dict(),
            "want_forward": {"bytes_sent": sent_rows * fwd.row_bytes, "bytes_uncompressed": sent_rows * 16 * 4},
            "want_backward": {"bytes_sent": part.n_halo * back.row_bytes, "bytes_uncompressed": part.n_halo * 64},
            "totals": ex.bytes_sent,
            "stats": stats,
            "restored": fresh.bytes_sent,
        }

    for r in run_local(2, body, timeout=60):
        assert r["tables"]
        for direction in ("forward", "backward"):
            got, want = r[f"{direction}_epoch"], r[f"want_{direction}"]
            assert got["collectives"] == 1 and got["bytes_sent"] == want["bytes_sent"] > 0, (direction, got)
            assert got["bytes_uncompressed"] == want["bytes_uncompressed"], (direction, got)
            assert r["totals"][direction] == 2 * want["bytes_sent"]
        assert r["stats"] == r["totals"] == r["restored"]


@pytest.mark.parametrize("precision", FORMS)
@pytest.mark.parametrize("meta", ["fp32", "bf16"])
@pytest.mark.parametrize("width", [13, 16, 33])
def test_blocks_decode_as_the_row_layout(precision: str, meta: str, width: int) -> None:
    """Blocks of picked rows (peers of 4, 0 and 7 rows) decode to the rows the row layout decodes, the
    unpicked form too; the q-bit parts reach the decoding kernel as views of the received bytes."""
    x = torch.randn(20, width)
    ours, ref = RowFormat(precision, width, meta, seed=5), RowFormat(precision, width, meta, seed=5)
    pick = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 19, 0, 7])
    counts = [4, 0, 7]
    picks = [pick[:4], pick[4:4], pick[4:]]
    send = ours.pack(ours.encode_payload(x), counts, pick, picks)
    assert send.dtype == torch.uint8 and send.shape == (11, ours.row_bytes)
    out = torch.full((11, width), float("nan"))
    with Ops() as ops:
        assert ours.decode_blocks(send, counts, out) is out
    assert same(out, ref.decode(ref.encode(x)[pick]))
    if precision.startswith("q"):
        lo, hi = send.data_ptr(), send.data_ptr() + send.numel()
        kernels = [c for c in ops.calls if "qbit_decode" in c[0]]
        assert len(kernels) == 2  # one per block that has rows
        aligned = ours.row_bytes % (4 if meta == "fp32" else 2) == 0
        for _, ins, _ in kernels[:1] if not aligned else kernels:
            assert all(lo <= p < hi for p in ins[:3]), "a part was copied before decoding"
    whole = ours.pack(ours.encode_payload(x), [5, 15])
    out = torch.empty(20, width)
    ours.decode_blocks(whole, [5, 15], out)
    assert same(out, ref.decode(ref.encode(x)))


def test_pack_refuses_a_pick_without_its_blocks() -> None:
    fmt = RowFormat("q1", 8)
    with pytest.raises(ValueError, match=r"pack\(\) with pick needs picks, one index tensor per peer \(2\), got None"):
        fmt.pack(fmt.encode_payload(torch.randn(3, 8)), [1, 2], torch.tensor([0, 1, 2]))


def test_features_job_refuses_an_out_of_the_wrong_shape() -> None:
    (part,) = parts_for(1)

    def body(tr: Any) -> str:
        ex = HaloExchanger(part, tr)
        with pytest.raises(ValueError, match=r"out must have shape \(0, 3\) \(the halo rows\), got \(2, 3\)"):
            ex.features_job(torch.zeros(part.n_inner, 3), "1", out=torch.zeros(2, 3))
        return "ok"

    assert run_local(1, body) == ["ok"]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # PyG's import
def test_the_benchmark_rows_hold_their_medians_and_ratios() -> None:
    """``sylvie_comm.bench.hooks_halo``: a halo row per precision and an epoch row per model and
    implementation, each with its baseline from the same run and the ratio to it."""
    from sylvie_comm.bench import hooks_halo

    halo = hooks_halo.halo_layer_rows(1, 200, 16)
    assert [r["precision"] for r in halo] == list(hooks_halo.PRECISIONS)
    for r in halo:
        assert r["us"] > 0 and r["baseline_us"] > 0 and r["host_us"] <= r["us"]
        assert r["x_baseline"] == pytest.approx(r["us"] / r["baseline_us"])
        assert r["exchange_us"] == pytest.approx(r["us"] - r["baseline_us"])
        assert r["halo_bytes_per_rank_step"] > 0 and sum(r["halo_rows"]) > 0
    epochs = hooks_halo.epoch_rows(1, nodes=300, features=8, hidden=8, layers=2)
    assert [r["name"] for r in epochs] == [f"{m} {i}" for m in ("sage", "gcn")
                                           for i in ("pyg", "ours", "ours, first precomputed")]  # fmt: skip
    for r in epochs:
        assert r["x_baseline"] == pytest.approx(r["us"] / r["baseline_us"])
    assert "x baseline" in hooks_halo.table(halo + epochs)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        hooks_halo.halo_rows(0)
