"""Shared rows through the mlx-lm bridge: the same logits and greedy tokens as
each row run alone through mlx-lm (float32, CPU, same process)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _quant import needs_stock_quantized_read
from _threads import in_another_thread
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from tiny_models import VOCAB, llama_model, qwen3_model

import kvstate as kv
from kvstate import mlx_lm as bridge
from kvstate.bridge import forward as bridge_forward
from kvstate.bridge import routing
from kvstate.serving.prefix_cache import PrefixCache, prefill


def mlx_lm_run(model, prompt, forced, steps, kv_bits=None):
    """mlx-lm alone: ``prompt``, then the ``forced`` tokens, then ``steps`` greedy
    tokens; returns every logits row after the prompt and the greedy tokens."""
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [QuantizedKVCache(group_size=32, bits=kv_bits) for _ in cache]
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    seen = [logits]
    toks = []
    for t in range(len(forced) + steps):
        tok = forced[t] if t < len(forced) else int(mx.argmax(seen[-1], axis=-1).item())
        toks.append(tok)
        seen.append(model(mx.array([[tok]]), cache=cache)[:, -1, :])
    return seen, toks


def kv_run(model, states, first, steps):
    """The bridge on ``states``: one forced token per row, then greedy steps."""
    seen, toks = [], [list(first)]
    logits, states = bridge.step(model, mx.array(first), states)
    seen.append(logits)
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)
        toks.append(tok.tolist())
        logits, states = bridge.step(model, tok, states)
        seen.append(logits)
    return seen, toks, states


@pytest.mark.parametrize("make_model", [llama_model, qwen3_model])
@pytest.mark.parametrize("kv_bits", [None, pytest.param(8, marks=needs_stock_quantized_read)])
def test_forked_rows_decode_as_mlx_lm_alone(make_model, kv_bits):
    model = make_model()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 11).tolist()
    _, states = bridge.forward(
        model, mx.array([prompt]), bridge.make_states(model, 1, kv_bits=kv_bits, kv_group_size=32)
    )
    forked = kv.fork(states, 0, 3)
    assert all(isinstance(s, kv.SharedState) for s in forked)
    assert sum(s.nbytes for s in forked) == sum(s.nbytes for s in states)
    first = [5, 17, 17, 90]
    steps = 4
    seen, toks, after = kv_run(model, forked, first, steps)
    for b, f in enumerate(first):
        want, want_toks = mlx_lm_run(model, prompt, [f], steps, kv_bits)
        assert [t[b] for t in toks] == want_toks[: steps + 1]
        for got, w in zip(seen, want[1:]):
            np.testing.assert_allclose(np.array(got[b]), np.array(w[0]), atol=2e-4, rtol=1e-4)
    # Rows 1 and 2 were given the same token: they still share the prefix record.
    assert all(s.prefixes[0] is p for s, p in zip(after, states))


def test_trimmed_into_the_prefix_and_merged_rows():
    """Rows trimmed into their shared prefix, and rows of two different prompts
    merged into one batch, decode as mlx-lm runs each alone."""
    model = llama_model()
    rng = np.random.default_rng(1)
    p1, p2 = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 6).tolist()
    _, s1 = bridge.forward(model, mx.array([p1]), bridge.make_states(model, 1))
    _, s2 = bridge.forward(model, mx.array([p2]), bridge.make_states(model, 1))
    a = [kv.trim(s, [0, 4]) for s in kv.fork(s1, 0, 1)]  # row 1 reads 5 of p1's tokens
    b = kv.fork(s2, 0, 0)
    batch = bridge.merge_rows([a, b])
    rows = [p1, p1[:5], p2]
    first = [3, 7, 11]
    seen, toks, _ = kv_run(model, batch, first, 3)
    for r, (prompt, f) in enumerate(zip(rows, first)):
        want, want_toks = mlx_lm_run(model, prompt, [f], 3)
        assert [t[r] for t in toks] == want_toks[:4]
        for got, w in zip(seen, want[1:]):
            np.testing.assert_allclose(np.array(got[r]), np.array(w[0]), atol=2e-4, rtol=1e-4)


def test_cached_prefix_prefills_only_the_rest():
    model = llama_model()
    rng = np.random.default_rng(2)
    system = rng.integers(0, VOCAB, 12).tolist()
    users = [rng.integers(0, VOCAB, n).tolist() for n in (3, 5, 4)]
    prompts = [system + u for u in users]
    cache = PrefixCache(1 << 24)
    logits, states, leases, prefilled = prefill(model, prompts, cache)
    # The first request runs everything; the others only what follows the system prompt.
    assert prefilled == [15, 5, 4]
    assert cache.pinned == 3
    # A repeated prompt runs one token (the last, for its logits).
    _, _, more, again = prefill(model, [prompts[1]], cache)
    assert again == [1]
    assert all(lease is not None for lease in leases + more)
    for lease in leases + more:
        lease.release()
    assert cache.pinned == 0
    # Same logits and greedy tokens as mlx-lm alone.
    _, toks, _ = kv_run(model, states, mx.argmax(logits, axis=-1).tolist(), 3)
    for r, p in enumerate(prompts):
        want = model(mx.array([p]), cache=make_prompt_cache(model))[:, -1, :]
        np.testing.assert_allclose(np.array(logits[r]), np.array(want[0]), atol=2e-4, rtol=1e-4)
        _, want_toks = mlx_lm_run(model, p, [], 4)
        assert [t[r] for t in toks] == want_toks
    # Nothing is reused without a cache; chunked prefill gives the same logits.
    chunked, _, _, ran = prefill(model, prompts, None, prefill_step_size=4)
    assert ran == [15, 17, 16]
    np.testing.assert_allclose(np.array(chunked), np.array(logits), atol=2e-4, rtol=1e-4)


def test_bridge_reads_shared_rows_by_cascade(monkeypatch):
    """The model's attention over shared dense rows goes to the cascade (one call
    per layer per forward), not to the materialized columns."""
    from kvstate.kinds import shared

    calls = []
    real = shared.read

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bridge_forward, "shared_read", counted)
    model = llama_model(layers=3)
    _, states = bridge.forward(model, mx.array([[1, 2, 3, 4]]), bridge.make_states(model, 1))
    forked = kv.fork(states, 0, 2)
    logits, _ = bridge.step(model, mx.array([5, 6, 7]), forked)
    mx.eval(logits)
    assert len(calls) == 3

    # The materialized read gives the same logits.
    monkeypatch.setattr(bridge_forward, "_cascade", _NoRoute)
    again, _ = bridge.step(model, mx.array([5, 6, 7]), forked)
    assert len(calls) == 3
    np.testing.assert_allclose(np.array(logits), np.array(again), atol=2e-5, rtol=1e-5)


class _NoRoute:
    def __init__(self, model, fwd):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bridge_builds_the_row_map_once_per_map_not_per_step(monkeypatch):
    """Host work that does not change between layers or decode steps is done
    once: the row map's arrays (decoding never changes the map: every layer
    of every step reads the very same four arrays, not ones built once
    per forward) and the walk for the model's attention modules (once per
    model)."""
    from kvstate.kinds import shared

    maps, walks = [], []
    real_read, real_walk = shared._compiled_read, routing._find_attention_modules

    def spy(scale):
        fn = real_read(scale)

        def call(*args):
            maps.append(args[5:9])  # (q, suffix k, v, left_pad, ends, then the row map)
            return fn(*args)

        return call

    monkeypatch.setattr(shared, "_compiled_read", spy)
    monkeypatch.setattr(
        routing, "_find_attention_modules", lambda m: walks.append(1) or real_walk(m)
    )
    model = llama_model(layers=3)
    _, states = bridge.forward(model, mx.array([[1, 2, 3, 4]]), bridge.make_states(model, 1))
    rows = kv.fork(states, 0, 2)
    tok = mx.array([5, 6, 7])
    for _ in range(3):
        logits, rows = bridge.step(model, tok, rows)
        tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    assert len(maps) == 9  # 3 layers x 3 steps, each read with the row map
    assert all(a is b for m in maps for a, b in zip(m, maps[0]))  # one set of arrays
    np.testing.assert_array_equal(np.array(maps[0][3]), [4, 4, 4])  # (shared: 4 tokens each)
    assert len(walks) == 1


def test_a_read_that_bypasses_the_cascade_is_refused(monkeypatch):
    """A model whose attention does not read through mlx-lm's global (simulated:
    no module found to route) would see only suffix columns: refused, not wrong."""

    model = llama_model(layers=2)
    _, states = bridge.forward(model, mx.array([[1, 2, 3]]), bridge.make_states(model, 1))
    forked = kv.fork(states, 0, 1)
    monkeypatch.setattr(routing, "_attention_modules", lambda model: set())
    with pytest.raises(kv.KVStateError, match="bypassed"):
        bridge.step(model, mx.array([4, 5]), forked)


def test_bridge_shared_read_traces_once_per_bucket_not_per_token():
    """Every layer and every decode step of one suffix bucket reuse one trace of
    the compiled shared read (``shared.traces``: the cascade off CUDA, the kernel
    with its prefix source on CUDA, where the cascade is never called)."""
    from kvstate.kinds import shared

    shared._compiled_read.cache_clear()
    before = shared.traces()
    model = llama_model(layers=3)
    _, states = bridge.forward(model, mx.array([[1, 2, 3, 4, 5]]), bridge.make_states(model, 1))
    states = kv.fork(states, 0, 3)
    tok = mx.array([5, 6, 7, 8])
    for _ in range(6):  # 6 steps x 3 layers = 18 reads, all in the first 64-column bucket
        logits, states = bridge.step(model, tok, states)
        tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    assert shared.traces() - before == 1


def test_the_compiled_decoder_refuses_quantized_shared_rows_by_name():
    model = llama_model(layers=2)
    states = bridge.make_states(model, 1, kv_bits=8, kv_group_size=32)
    _, states = bridge.forward(model, mx.array([[1, 2, 3]]), states)
    with pytest.raises(kv.KVStateError, match="QuantizedState rows"):
        kv.compiled_decoder(model)(mx.array([1, 2]), kv.fork(states, 0, 1))


def test_prefill_over_a_cached_prefix_traces_nothing_per_prompt_length():
    """Requests whose prompts share a cached system prompt and differ in length
    prefill their rest through the shared read uncompiled (its width is the
    request's): no trace per prompt length (before: one per length). Only the
    first-token step (one query per row) is compiled, once for its shapes; the
    logits equal the request run alone from an empty cache."""
    from kvstate.kinds import shared

    model = llama_model(layers=2)
    rng = np.random.default_rng(3)
    system = rng.integers(1, VOCAB, 40).tolist()
    cache = PrefixCache(1 << 30)
    prefill(model, [system + [7, 8]], cache)  # the system prompt is cached from here
    before = shared.traces()
    for width in (12, 17, 23, 30, 41):  # (rests of more than kernels.MAX_QUERIES tokens)
        prompt = system + rng.integers(1, VOCAB, width).tolist()
        logits, _, leases, ran = prefill(model, [prompt], cache)
        assert ran == [width]  # the system prompt came from the cache
        alone, _, _, _ = prefill(model, [prompt], None)
        np.testing.assert_allclose(np.array(logits), np.array(alone), atol=2e-5, rtol=1e-5)
        for lease in leases:
            lease.release()
    assert shared.traces() - before <= 1


@pytest.mark.parametrize("make_model", [llama_model, qwen3_model])
def test_forward_last_gives_the_last_positions_logits(make_model):
    """``forward(..., last=True)``: ``[B, 1, V]``, the full forward's last position
    (for these models the output layer runs on that position alone), and the
    same records."""
    model = make_model()
    assert type(model).__module__ in bridge.PLAIN_HEADS
    tokens = mx.array([[3, 9, 4, 1, 7], [2, 2, 8, 5, 6]])
    full, want = bridge.forward(model, tokens, bridge.make_states(model, 2))
    got, states = bridge.forward(model, tokens, bridge.make_states(model, 2), last=True)
    assert got.shape == (2, 1, full.shape[-1])
    np.testing.assert_allclose(np.array(got), np.array(full[:, -1:]), atol=1e-5, rtol=1e-5)
    for s, w in zip(states, want):
        np.testing.assert_array_equal(np.array(s.keys), np.array(w.keys))


@pytest.mark.parametrize("make_model", [llama_model, qwen3_model])
def test_a_cached_request_is_one_forward_and_equals_the_request_alone(make_model, monkeypatch):
    """A request over a cached system prompt runs its rest and its last token in
    one forward (was two: the rest, then the last token's step); its logits and
    greedy tokens (and their logits) equal mlx-lm's on the request alone."""
    model = make_model()
    rng = np.random.default_rng(8)
    system = rng.integers(1, VOCAB, 20).tolist()
    cache = PrefixCache(1 << 30)
    prefill(model, [system + [5, 6]], cache)  # the system prompt is cached from here
    prompt = system + rng.integers(1, VOCAB, 7).tolist()
    calls = []
    real = bridge.forward

    def spy(model, tokens, states, **kw):
        calls.append((tuple(tokens.shape), kw.get("last", False)))
        return real(model, tokens, states, **kw)

    monkeypatch.setattr(bridge, "forward", spy)
    logits, states, leases, ran = prefill(model, [prompt], cache)
    assert ran == [7] and calls == [((1, 7), True)]
    monkeypatch.undo()
    want, want_toks = mlx_lm_run(model, prompt, [], 3)
    np.testing.assert_allclose(np.array(logits[0]), np.array(want[0][0]), atol=2e-5, rtol=1e-5)
    seen, toks, _ = kv_run(model, states, [want_toks[0]], 2)
    assert [t[0] for t in toks] == want_toks
    for g, w in zip(seen, want[1:]):
        np.testing.assert_allclose(np.array(g[0]), np.array(w[0]), atol=2e-5, rtol=1e-5)
    for lease in leases:
        lease.release()


def test_prefill_runs_cached_heads_together_and_keeps_the_prompt_order(monkeypatch):
    """One call with prompts whose rest must run (one forward each) and prompts
    cached up to their last token (one batched step for all of them): three
    forwards for five prompts, the rows and logits in prompt order, each equal
    to the prompt run alone."""
    model = llama_model()
    rng = np.random.default_rng(9)
    a = rng.integers(1, VOCAB, 9).tolist()
    b = a[:5] + rng.integers(1, VOCAB, 6).tolist()
    cache = PrefixCache(1 << 30)
    _, _, (first,), _ = prefill(model, [a], cache)
    first.release()
    prompts = [a, b, a, a[:4] + [3, 3], a]  # cached, rest, cached, rest, cached
    calls = []
    real = bridge.forward

    def spy(model, tokens, states, **kw):
        calls.append(tuple(tokens.shape))
        return real(model, tokens, states, **kw)

    monkeypatch.setattr(bridge, "forward", spy)
    logits, states, leases, ran = prefill(model, prompts, cache)
    monkeypatch.undo()
    assert ran == [1, 6, 1, 2, 1]
    assert calls == [(1, 6), (1, 2), (3, 1)]
    seen, toks, _ = kv_run(model, states, [1, 2, 3, 4, 5], 2)
    for r, p in enumerate(prompts):
        want, want_toks = mlx_lm_run(model, p, [r + 1], 2)
        np.testing.assert_allclose(np.array(logits[r]), np.array(want[0][0]), atol=2e-5, rtol=1e-5)
        assert [t[r] for t in toks] == want_toks
        for g, w in zip(seen, want[1:]):
            np.testing.assert_allclose(np.array(g[r]), np.array(w[0]), atol=2e-5, rtol=1e-5)
    for lease in leases:
        lease.release()
    assert cache.pinned == 0


def test_a_cached_rest_is_read_over_its_prefix_in_one_kernel_call(monkeypatch):
    """A cached request's rest (more than ``kernels.MAX_QUERIES`` tokens, at most
    ``PREFIX_QUERIES``) takes the kernel route with its prefix source, one call per
    layer (off CUDA the route is forced and the call answers by its stock path),
    and gives the logits of the request run alone."""
    from kvstate.kernels import cuda as kernels

    model = llama_model(layers=2)
    rng = np.random.default_rng(10)
    system = rng.integers(1, VOCAB, 30).tolist()
    cache = PrefixCache(1 << 30)
    _, _, (first,), _ = prefill(model, [system + [5, 6]], cache)
    first.release()
    prompt = system + rng.integers(1, VOCAB, 19).tolist()
    if not kernels.kernel_available():
        real_route = kernels.decode_read

        def route(N, q=None, k=None, *, prefix=False, **kw):
            if prefix and N <= kernels.PREFIX_QUERIES:
                return "kernel"
            return real_route(N, q, k, prefix=prefix, **kw)

        monkeypatch.setattr(kernels, "decode_read", route)
        monkeypatch.setattr(kernels, "_kernel_reads", lambda *a: False)
    calls = []
    real = kernels.ragged_attention

    def spy(q, *a, **kw):
        calls.append((q.shape[2], kw.get("prefix") is not None))
        return real(q, *a, **kw)

    monkeypatch.setattr(kernels, "ragged_attention", spy)
    logits, _, leases, ran = prefill(model, [prompt], cache)
    monkeypatch.undo()
    assert ran == [19] and calls == [(19, True)] * 2  # one read per layer
    alone, _, _, _ = prefill(model, [prompt], None)
    np.testing.assert_allclose(np.array(logits), np.array(alone), atol=2e-5, rtol=1e-5)
    for lease in leases:
        lease.release()


def test_row_map_arrays_kept_by_one_thread_serve_another():
    """The kept row-map arrays (``shared.view_arrays``) hold their data: a map built
    by a step in one thread (not evaluated there) is read by a step in another
    (a kept lazy array would be bound to the first thread's stream: d7c42ec)."""
    from kvstate.kinds import shared

    model = llama_model(layers=2)
    _, states = bridge.forward(model, mx.array([[3, 1, 4, 1, 5]]), bridge.make_states(model, 1))
    rows = kv.fork(states, 0, 2, step=8)  # (a step this test alone uses: a map of its own)
    mx.eval(model.parameters(), [s.planes for s in states])  # (only the map is left lazy)
    shared._view_arrays.cache_clear()
    tok = mx.array([9, 2, 6])
    first, _ = bridge.step(model, tok, rows)  # builds the map here, evaluates nothing
    logits = in_another_thread(lambda: np.array(bridge.step(model, tok, rows)[0]))
    np.testing.assert_allclose(logits, np.array(first), atol=1e-5, rtol=1e-5)
