"""The eager bridge's routed attention reads (``routing.routed_read``), run on
the CPU by forcing the route (``routing.routes_reads``: on by itself only on
MLX's CUDA backend). Off CUDA the kernels answer by their stock paths, so a
forced run must give the plain run's logits and greedy tokens: what this
checks is the wiring (which rows are routed, with which ``left_pad``/``ends``
arrays, and the quantized read's three routes). float32; the CUDA side of the
same reads is ``tests/bridge/test_bridge_cuda.py``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from _quant import needs_stock_quantized_read
from _tol import atol

import kvstate as kv
from kvstate import mlx_lm as bridge
from kvstate.bridge import routing
from kvstate.kernels import cuda as kernels
from kvstate.kinds import quantized as _quantized

ATOL = atol(mx.float32)
CUDA = kernels.kernel_available()
PROMPTS = [5, 11, 3]  # ragged rows


def prompts(lengths=PROMPTS):
    return [tm.prompt(70 + i, n) for i, n in enumerate(lengths)]


def decode(model, logits, states, steps=3):
    """Greedy steps after ``logits``: (logits of every step, tokens, states)."""
    seen, toks, states = tm.greedy(
        bridge.step, model, mx.argmax(logits, -1).tolist(), states, steps
    )
    return [logits, *seen], toks, states


def close(got, want, atol=ATOL):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), atol=atol, rtol=1e-5)


def unrouted(monkeypatch, run):
    """``run()`` with the eager reads not routed (the model's own reads)."""
    with monkeypatch.context() as m:
        m.setattr(routing, "routes_reads", lambda: False)
        return run()


class Calls(list):
    def __init__(self):
        super().__init__()
        self.widths: list = []


@pytest.fixture
def forced(monkeypatch):
    """Route the eager reads; record each ``ragged_attention`` call's rows (and,
    in ``calls.widths``, the columns of the planes it was given)."""
    calls = Calls()
    real = kernels.ragged_attention

    def counted(q, k, v, left_pad, ends, **kw):
        calls.append((q.shape[2], left_pad.tolist(), ends.tolist()))
        calls.widths.append(k.shape[2])
        return real(q, k, v, left_pad, ends, **kw)

    monkeypatch.setattr(routing, "routes_reads", lambda: True)
    monkeypatch.setattr(kernels, "ragged_attention", counted)
    return calls


def test_ragged_dense_rows_read_through_the_kernel_call(monkeypatch, forced):
    model = tm.llama_model(layers=2)
    want = unrouted(monkeypatch, lambda: decode(model, *bridge.prefill(model, prompts())))
    assert forced == []
    # (routed: prefill's chunks are aligned (causal, not routed), its last
    # step and every decode step ragged: routed)
    got = decode(model, *bridge.prefill(model, prompts()))
    close(got[0], want[0])
    assert got[1] == want[1]
    # One call per layer per ragged step (the prefill's last step, 3 decode
    # steps), each with the rows' own columns after the write.
    assert len(forced) == 2 * 4
    ends = [4, 10, 2]  # the prompts' heads, right-padded to 10 and trimmed
    for step in range(4):
        for layer in range(2):
            n, lp, en = forced[2 * step + layer]
            assert n == 1 and lp == [0, 0, 0] and en == [e + 1 + step for e in ends]
    # ... over the records' whole planes, not cut to each step's width: the
    # kernel compiles once per capacity (CUDA), not once per width
    widths = list(forced.widths)
    capacity = unrouted(monkeypatch, lambda: bridge.prefill(model, prompts()))[1][0].capacity
    assert widths == [capacity] * 8 and capacity > 14


def test_aligned_rows_keep_the_stock_unmasked_read(monkeypatch, forced):
    model = tm.llama_model(layers=2)
    want = unrouted(monkeypatch, lambda: decode(model, *bridge.prefill(model, prompts([6, 6]))))
    got = decode(model, *bridge.prefill(model, prompts([6, 6])))
    close(got[0], want[0])
    assert got[1] == want[1] and forced == []


def test_a_windowed_mask_is_never_routed(monkeypatch, forced):
    """Dense records under a sliding-window layer: the window is only in the
    mask, so the routed read (which reads every column) must not take them.
    The ring layer of the same model is routed (it holds its window)."""
    model = tm.llama_model(layers=2, sliding_window=4)
    ps = prompts([9, 6])

    def run():
        heads = [p[:-1] for p in ps]
        W = max(len(h) for h in heads)
        states = [kv.empty(2), kv.empty(2)]  # dense, the sliding layer's too
        _, states = bridge.forward(model, mx.array([h + [0] * (W - len(h)) for h in heads]), states)
        states = [bridge.unpad(s, tuple(W - len(h) for h in heads)) for s in states]
        logits, states = bridge.step(model, mx.array([p[-1] for p in ps]), states)
        return decode(model, logits, states, 2)

    monkeypatch.setattr(routing, "routes_reads", lambda: False)
    want = run()
    monkeypatch.setattr(routing, "routes_reads", lambda: True)
    got = run()
    close(got[0], want[0])
    assert got[1] == want[1] and forced == []
    ps = prompts([9, 1])  # a ring row holding fewer than max_size: a ragged ring read
    rings = decode(model, *bridge.prefill(model, ps))  # (a ring for the sliding layer)
    assert forced and all(lp == [0, 0] for _, lp, _ in forced)  # the ring's reads only
    monkeypatch.setattr(routing, "routes_reads", lambda: False)
    plain = decode(model, *bridge.prefill(model, ps))
    close(rings[0], plain[0])
    assert rings[1] == plain[1]


def record_routes(monkeypatch) -> list:
    """Each quantized read's ``(route, queries)``, in order (``_quantized.reader``
    wrapped)."""
    seen = []
    real = _quantized.reader

    def recorded(record, q, *a, **kw):
        route, read = real(record, q, *a, **kw)

        def read_recorded(mask):
            seen.append((route, q.shape[2]))
            return read(mask)

        return route, read_recorded

    monkeypatch.setattr(_quantized, "reader", recorded)
    return seen


@pytest.fixture
def quantized_routes(monkeypatch):
    """The quantized read's routes as on CUDA (forced): the kernel for decode
    and verify widths, the dequantized columns for wider reads; records each
    read's route and query count."""

    def route(q, keys, gs, bits):
        return "kernel" if q.shape[2] <= kernels.MAX_QUERIES else "dequantized"

    monkeypatch.setattr(routing, "routes_reads", lambda: True)
    monkeypatch.setattr(_quantized, "read_route", route)
    return record_routes(monkeypatch)


@needs_stock_quantized_read  # (the unrouted reference; on CUDA: tests/bridge/test_bridge_cuda.py)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_rows_take_the_one_quantized_read(monkeypatch, quantized_routes, bits):
    model = tm.llama_model(layers=2)
    ps = prompts([5, 14, 3])
    want = unrouted(
        monkeypatch,
        lambda: decode(model, *bridge.prefill(model, ps, kv_bits=bits, kv_group_size=32)),
    )
    del quantized_routes[:]  # (the unrouted run's stock reads)
    widths, real = [], kernels.quantized_attention

    def spy(q, k, *a, **kw):
        widths.append(k[0].shape[2])
        return real(q, k, *a, **kw)

    monkeypatch.setattr(kernels, "quantized_attention", spy)
    got = decode(model, *bridge.prefill(model, ps, kv_bits=bits, kv_group_size=32))
    close(got[0], want[0], atol=1e-4)  # (dequantize + SDPA: another order of sums)
    assert got[1] == want[1]
    # prefill: one 13-column chunk (dequantized), then 4 single-token steps (kernel)
    assert quantized_routes == [("dequantized", 13)] * 2 + [("kernel", 1)] * 8
    assert widths == [got[2][0].capacity] * 8  # whole planes: one compile per capacity


@needs_stock_quantized_read  # (forced stock paths; on CUDA: tests/bridge/test_bridge_cuda.py)
@pytest.mark.parametrize("n", [1, 12])
def test_kv_attend_quantized_routes_give_the_stock_read(monkeypatch, n):
    rng = np.random.default_rng(3)
    rows = []
    for m in (9, 4):
        k, v = (mx.array(rng.standard_normal((1, 2, m, 32)).astype(np.float32)) for _ in "kv")
        rows.append(kv.append(kv.quantized(1, group_size=32, bits=4), k, v))
    s = kv.merge_rows(rows)
    s = kv.append(s, *(mx.array(rng.standard_normal((2, 2, n, 32)).astype(np.float32)),) * 2)
    q = mx.array(rng.standard_normal((2, 4, n, 32)).astype(np.float32))
    want = kv.attend(s, q, scale=0.2)
    for route in ("kernel", "dequantized"):
        monkeypatch.setattr(_quantized, "read_route", lambda *a, route=route: route)
        got = kv.attend(s, q, scale=0.2)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=ATOL, rtol=1e-5)


def test_the_routes_follow_the_backend():
    """Eager forwards are routed on CUDA only; there the quantized read is the
    kernel at decode widths and the dequantized columns past them; elsewhere
    always the stock read."""
    q = mx.zeros((1, 4, 1, 32))
    wide = mx.zeros((1, 4, kernels.MAX_QUERIES + 1, 32))
    keys = tuple(mx.quantize(mx.zeros((1, 2, 16, 32)), group_size=32, bits=4))
    assert routing.routes_reads() == CUDA
    assert _quantized.read_route(q, keys, 32, 4) == ("kernel" if CUDA else "stock")
    assert _quantized.read_route(wide, keys, 32, 4) == ("dequantized" if CUDA else "stock")


def test_quantized_shared_rows_read_dequantized_where_the_stock_read_cannot_run(monkeypatch):
    """Quantized shared rows are read materialized, under the model's mask: where
    the stock quantized read cannot run (MLX's CUDA backend; forced here, with
    ``mx.quantized_matmul`` failing as there), the routed read dequantizes the
    columns; the rows decode as the same rows unshared."""
    model = tm.llama_model(layers=2)
    make = bridge.make_states(model, 1, kv_bits=8, kv_group_size=32)
    _, states = bridge.forward(model, mx.array(prompts([11])), make)
    rows = kv.fork(states, 0, 2)
    assert all(isinstance(s, kv.SharedState) for s in rows)
    unshared = [kv.materialize(s) for s in rows]
    monkeypatch.setattr(routing, "routes_reads", lambda: True)
    monkeypatch.setattr(_quantized, "stock_read_runs", lambda: False)

    def missing(*a, **kw):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape")

    monkeypatch.setattr(mx, "quantized_matmul", missing)
    first = [5, 17, 90]
    got, got_toks, _ = tm.greedy(bridge.step, model, first, rows, 4)
    want, want_toks, _ = tm.greedy(bridge.step, model, first, unshared, 4)
    close(got, want, atol=1e-4)  # (the unshared rows: the kernel on CUDA, another order of sums)
    assert got_toks == want_toks
