"""Shared-prefix rows through the compiled decoder (``kv.compiled_decoder``):
the same logits and greedy tokens as the eager bridge on the same shared rows
and as the compiled decoder on the same rows stored unshared (float32, CPU);
one trace per capacity bucket, none per token, none when rows join and leave
reading the same prefix records."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from tiny_models import VOCAB, greedy, llama_model, qwen3_model

import kvstate as kv
from kvstate import mlx_lm as bridge
from kvstate.bridge import decoder as _decoder
from kvstate.bridge import routing
from kvstate.kinds import shared

ATOL = 5e-5


def prompts_and_rows(model, rng, step=64):
    """Six shared rows over two prefix records: three forks of a one-row prompt
    (one trimmed into its prefix view) and a 2-row batch with one fork."""
    p1 = rng.integers(0, VOCAB, 11).tolist()
    p2 = rng.integers(0, VOCAB, 7).tolist()
    _, one = bridge.forward(model, mx.array([p1]), bridge.make_states(model, 1))
    _, two = bridge.forward(model, mx.array([p2, p2[::-1]]), bridge.make_states(model, 2))
    a = [kv.trim(s, [0, 0, 4]) for s in kv.fork(one, 0, 2, step=step)]
    b = kv.fork(two, 1, 1, step=step)
    return one, [kv.merge_rows([x, y]) for x, y in zip(a, b)]


@pytest.mark.parametrize("make_model", [llama_model, qwen3_model])
def test_compiled_shared_decode_equals_eager_and_dense(make_model):
    model = make_model()
    rng = np.random.default_rng(1)
    _, rows = prompts_and_rows(model, rng)
    dense = [kv.materialize(s) for s in rows]
    first = [5, 17, 17, 90, 3, 4]  # B = 6: padded to the bucket of 8 (blank shared rows)
    dec_shared = _decoder.make_step(model)
    dec_dense = _decoder.make_step(model)
    got, got_toks, out = greedy(dec_shared, model, first, rows, 5)
    eager, eager_toks, eager_out = greedy(bridge.step, model, first, rows, 5)
    unshared, unshared_toks, _ = greedy(dec_dense, model, first, dense, 5)
    for g, e, u in zip(got, eager, unshared):
        np.testing.assert_allclose(np.array(g), np.array(e), atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.array(g), np.array(u), atol=ATOL, rtol=1e-5)
    assert got_toks == eager_toks == unshared_toks
    # The rows stay shared, rebuilt around the very same prefix records.
    assert all(isinstance(s, kv.SharedState) for s in out)
    assert all(a is b for s, r in zip(out, rows) for a, b in zip(s.prefixes, r.prefixes))
    assert [s.lengths for s in out] == [s.lengths for s in eager_out]
    assert dec_shared.decoder.traces == 1


def test_no_retrace_per_token_and_none_when_rows_join_and_leave():
    """Across suffix buckets: one trace per bucket. Rows leaving and fresh forks
    of the same prompt joining (the batch within its bucket, the suffix within
    its capacity): no trace, in the compiled decoder or the eager read."""
    model = llama_model(layers=2)
    rng = np.random.default_rng(2)
    one, rows = prompts_and_rows(model, rng, step=4)
    decoder = kv.compiled_decoder(model, batch_buckets=(8,))
    tok = mx.array([1, 2, 3, 4, 5, 6])
    for _ in range(9):  # suffix rows of 1..9 tokens: capacity buckets 4, 8, 12
        logits, rows = decoder(tok, rows)
        tok = mx.argmax(logits, axis=-1)
    assert decoder.traces == 3
    assert all("new capacity bucket" in r for r in decoder.trace_reasons[1:])
    bridge.step(model, tok, rows)  # (the eager read's trace for this shape)
    eager_traces = shared.traces()
    for joined in range(3):  # a row leaves, a new fork of the prompt joins
        rows = [kv.filter_rows(s, [0, 2, 3, 4, 5]) for s in rows]
        rows = [kv.merge_rows([s, f]) for s, f in zip(rows, kv.fork(one, 0, 0, step=4))]
        assert rows[0].shared[-1] == 11 and rows[0].suffix.lengths[-1] == 0
        tok = mx.concatenate([tok[:1], tok[2:], mx.array([7 + joined])])
        logits, new = decoder(tok, rows)
        want, _ = bridge.step(model, tok, rows)
        np.testing.assert_allclose(np.array(logits), np.array(want), atol=ATOL, rtol=1e-5)
        rows, tok = new, mx.argmax(logits, axis=-1)
    assert decoder.traces == 3
    assert shared.traces() == eager_traces
    # A row of a new prompt (a new prefix record) joins: one trace for the new set
    # of record shapes; it leaves and a row of another prompt of the same shape
    # joins: the set seen before, its trace reused.
    counts = []
    for joined in range(3):
        p = rng.integers(0, VOCAB, 5 + joined).tolist()
        _, new_prompt = bridge.forward(model, mx.array([p]), bridge.make_states(model, 1))
        src = rows[0].source
        drop = 5 if joined else next(b for b in range(6) if src.count(src[b]) > 1)
        keep = [b for b in range(6) if b != drop]
        rows = [kv.filter_rows(s, keep) for s in rows]
        rows = [kv.merge_rows([s, f]) for s, f in zip(rows, kv.fork(new_prompt, 0, 0, step=4))]
        tok = mx.concatenate([tok[mx.array(keep)], mx.array([9])])
        logits, new = decoder(tok, rows)
        want, _ = bridge.step(model, tok, rows)
        np.testing.assert_allclose(np.array(logits), np.array(want), atol=ATOL, rtol=1e-5)
        counts.append((len(rows[0].prefixes), decoder.traces))
        rows, tok = new, mx.argmax(logits, axis=-1)
    assert counts == [(3, 4), (3, 4), (3, 4)]


def test_a_traced_read_that_bypasses_the_cascade_is_refused(monkeypatch):
    model = llama_model(layers=2)
    _, states = bridge.forward(model, mx.array([[1, 2, 3]]), bridge.make_states(model, 1))
    monkeypatch.setattr(routing, "_attention_modules", lambda model: set())
    with pytest.raises(kv.KVStateError, match="bypassed"):
        kv.compiled_decoder(model)(mx.array([4, 5]), kv.fork(states, 0, 1))


@pytest.mark.slow
def test_real_model_compiled_shared_decode_equals_eager_and_dense(smollm):
    """SmolLM2-135M (float32, 30 layers): 4 forks of one prompt, 3 greedy steps (~15 s)."""
    model = smollm.model
    prompt = smollm.tokenizer.encode("The capital of France is")
    _, states = bridge.forward(model, mx.array([prompt]), bridge.make_states(model, 1))
    rows = kv.fork(states, 0, 3)
    first = [1, 2, 3, 4]
    got, got_toks, _ = greedy(_decoder.make_step(model), model, first, rows, 3)
    eager, eager_toks, _ = greedy(bridge.step, model, first, rows, 3)
    dense = [kv.materialize(s) for s in rows]
    unshared, unshared_toks, _ = greedy(_decoder.make_step(model), model, first, dense, 3)
    for g, e, u in zip(got, eager, unshared):
        np.testing.assert_allclose(np.array(g), np.array(e), atol=2e-3, rtol=1e-4)
        np.testing.assert_allclose(np.array(g), np.array(u), atol=2e-3, rtol=1e-4)
    assert got_toks == eager_toks == unshared_toks


def test_rows_reading_an_empty_prefix_record_decode_as_unshared():
    """A row forked from an empty record (no tokens yet) beside rows reading a
    prompt: it reads only its suffix, in both reads."""
    model = llama_model(layers=2)
    rng = np.random.default_rng(4)
    one, rows = prompts_and_rows(model, rng)
    empty = kv.fork(bridge.make_states(model, 1), 0, 0)
    rows = [kv.merge_rows([s, e]) for s, e in zip(rows, empty)]
    assert len(rows[0].prefixes) == 3 and rows[0].shared[-1] == 0
    first = [5, 17, 17, 90, 3, 4, 8]
    got, got_toks, _ = greedy(_decoder.make_step(model), model, first, rows, 3)
    eager, eager_toks, _ = greedy(bridge.step, model, first, rows, 3)
    for g, e in zip(got, eager):
        np.testing.assert_allclose(np.array(g), np.array(e), atol=ATOL, rtol=1e-5)
    assert got_toks == eager_toks
    # the row alone, through mlx-lm's own cache: the same logits
    cache = bridge.make_states(model, 1)
    alone, _ = bridge.step(model, mx.array([8]), cache)
    np.testing.assert_allclose(np.array(got[0][-1]), np.array(alone[0]), atol=ATOL, rtol=1e-5)


def _force_route(monkeypatch, fused: bool):
    """Off CUDA, ``kernels.decode_read`` made to answer ``"kernel"`` for decode
    widths (``"fused"`` for a read with a write at hand, with ``fused``) while the
    kernels' own launch gate stays shut (``kernels._kernel_reads``): they answer by
    their stock paths, so the wiring runs everywhere. On CUDA, the real route."""
    from kvstate.kernels import cuda as kernels

    if kernels.kernel_available():
        return

    def route(N, q=None, k=None, **kw):
        if N > kernels.MAX_QUERIES:
            return "masked"
        return "fused" if fused and kw.get("written") else "kernel"

    monkeypatch.setattr(kernels, "decode_read", route)
    monkeypatch.setattr(kernels, "_kernel_reads", lambda *a: False)


def test_the_kernel_wiring_reads_the_same(monkeypatch):
    """With the prefix-source read forced (``kernels.decode_read``; off CUDA
    ``ragged_attention`` answers by its stock path), eager and compiled shared
    decode give the cascade's logits: the arrays handed to the kernel (the
    suffix's ``left_pad``/``ends``, the row map) are the right ones."""
    from kvstate.kernels import cuda as kernels

    model = llama_model(layers=2)
    rng = np.random.default_rng(6)
    p = rng.integers(0, VOCAB, 9).tolist()
    _, one = bridge.forward(model, mx.array([p]), bridge.make_states(model, 1))
    rows = [kv.trim(s, [0, 0, 3]) for s in kv.fork(one, 0, 2)]  # one record: the kernel's case
    first = [3, 5, 7]
    want, want_toks, _ = greedy(bridge.step, model, first, rows, 3)
    calls = []
    real = kernels.ragged_attention

    def counted(*a, **k):
        calls.append(k.get("prefix") is not None)
        return real(*a, **k)

    _force_route(monkeypatch, fused=False)
    monkeypatch.setattr(kernels, "ragged_attention", counted)
    shared._compiled_read.cache_clear()  # (decided while tracing)
    eager, eager_toks, _ = greedy(bridge.step, model, first, rows, 3)
    got, got_toks, _ = greedy(_decoder.make_step(model, attention="mask"), model, first, rows, 3)
    shared._compiled_read.cache_clear()
    assert calls and all(calls)
    for w, e, g in zip(want, eager, got):
        np.testing.assert_allclose(np.array(e), np.array(w), atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.array(g), np.array(w), atol=ATOL, rtol=1e-5)
    assert want_toks == eager_toks == got_toks


def test_the_fused_write_wiring_reads_and_writes_the_same(monkeypatch):
    """The compiled shared step with its suffix write fused into the read
    (``kernels.write_and_read(..., prefix=...)``, the route ``"fused"``) gives the
    logits and the suffix planes of the same step writing by scatter, and the eager
    bridge's logits. Off CUDA the route is forced (``_force_route``) and the fused
    call is its stock path; on CUDA it is the kernel."""
    from kvstate.kernels import cuda as kernels

    model = llama_model(layers=2)
    rng = np.random.default_rng(7)
    p = rng.integers(0, VOCAB, 9).tolist()
    _, one = bridge.forward(model, mx.array([p]), bridge.make_states(model, 1))
    rows = [kv.trim(s, [0, 0, 3]) for s in kv.fork(one, 0, 2, step=4)]
    first = [3, 5, 7]
    want, want_toks, _ = greedy(bridge.step, model, first, rows, 5)  # (crosses a suffix bucket)
    _force_route(monkeypatch, fused=True)
    calls = []
    real = kernels.write_and_read

    def spy(*a, **k):
        calls.append(k.get("prefix") is not None)
        return real(*a, **k)

    monkeypatch.setattr(kernels, "write_and_read", spy)
    fused, fused_toks, fused_out = greedy(_decoder.make_step(model), model, first, rows, 5)
    assert calls and all(calls)
    calls.clear()
    monkeypatch.setattr(kernels, "FUSED_BYTES", 0)  # (on CUDA: the scatter write)
    if not kernels.kernel_available():
        _force_route(monkeypatch, fused=False)
    plain, plain_toks, plain_out = greedy(_decoder.make_step(model), model, first, rows, 5)
    assert not calls
    assert fused_toks == plain_toks == want_toks
    # CUDA: the fused launch sums the new columns last (float rounding, ROUNDING of
    # test_fused_write); off CUDA the same operations
    tol = 2e-3 if kernels.kernel_available() else ATOL
    for f, g, w in zip(fused, plain, want):
        np.testing.assert_allclose(np.array(f), np.array(g), atol=tol, rtol=1e-5)
        np.testing.assert_allclose(np.array(f), np.array(w), atol=tol, rtol=1e-5)
    for i, (a, b) in enumerate(zip(fused_out, plain_out)):
        assert a.lengths == b.lengths and a.shared == b.shared
        assert all(x is y for x, y in zip(a.prefixes, b.prefixes))
        for pa, pb in zip(a.suffix.planes, b.suffix.planes):
            assert pa.shape == pb.shape
            if i == 0 or not kernels.kernel_available():  # (layer 0: the tokens alone)
                assert np.array_equal(np.array(pa), np.array(pb))
            else:
                assert mx.abs(pa - pb).max().item() < tol


def test_returned_shared_rows_are_not_flattened_again(monkeypatch):
    """Shared rows the decoder returned and gets back unchanged take its remembered
    Spec (``prepare`` hands back the record itself when its suffix has room), as
    dense rows do: no ``compiled.flatten`` per layer per step."""
    from kvstate.compiled import boundary as compiled

    model = llama_model(layers=2)
    rng = np.random.default_rng(11)
    _, rows = prompts_and_rows(model, rng)
    decoder = kv.compiled_decoder(model, batch_buckets=None)
    tok = mx.array([1, 2, 3, 4, 5, 6])
    logits, rows = decoder(tok, rows)
    calls = []
    real = compiled.flatten

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(compiled, "flatten", spy)
    for _ in range(3):
        logits, rows = decoder(mx.argmax(logits, axis=-1), rows)
    assert not calls
    assert all(isinstance(s, kv.SharedState) for s in rows)


def test_layers_of_served_shared_rows_share_one_spec_and_read_the_same(monkeypatch):
    """Rows as a server makes them (``prefix_cache.prefill`` of prompts sharing a
    system prompt, then forks of one of them: one model's layers hold one set of
    row ids) share one ``SharedSpec`` across layers in the compiled decoder, as
    unshared layers share one ``Spec``: per step the Spec is advanced once and
    its position arrays looked up once (not once per layer); each layer's rows
    still read its own prefix records, and the logits equal the eager bridge's
    and the same rows stored unshared (``materialize``), compiled."""
    from kvstate.compiled import boundary as compiled
    from kvstate.serving.prefix_cache import PrefixCache, prefill

    model = llama_model(layers=4)
    rng = np.random.default_rng(7)
    system = rng.integers(0, VOCAB, 13).tolist()
    prompts = [system + rng.integers(0, VOCAB, n).tolist() for n in (3, 5, 2)]
    cache = PrefixCache(1 << 30)
    logits, rows, leases, _ = prefill(model, prompts, cache)
    rows = kv.merge_rows([rows, kv.fork(kv.filter_rows(rows, [1]), 0, 4)])  # B = 8
    assert len({s.row_ids for s in rows}) == 1  # (layer-list merges and forks: one set)
    first = mx.argmax(mx.concatenate([logits, mx.repeat(logits[1:2], 5, axis=0)]), axis=-1)
    dense = [kv.materialize(s) for s in rows]
    dec_shared = _decoder.make_step(model)
    dec_dense = _decoder.make_step(model)
    got, got_toks, out = greedy(dec_shared, model, first.tolist(), rows, 2)
    advanced, positions = [], []
    real_advanced, real_host = compiled.advanced, compiled.host_positions

    def count_advanced(*a, **k):
        advanced.append(1)
        return real_advanced(*a, **k)

    def count_positions(state):
        positions.append(type(state))
        return real_host(state)

    monkeypatch.setattr(compiled, "advanced", count_advanced)
    monkeypatch.setattr(compiled, "host_positions", count_positions)
    more, more_toks, out = greedy(dec_shared, model, got_toks[-1], out, 3)
    monkeypatch.undo()
    # one Spec for the 4 layers; advanced once a step (the suffix's, inside the shared
    # record's: 2 calls), its positions derived once a step (suffix's + the row map: 2)
    d = dec_shared.decoder
    assert len({id(d._returned[id(s)][1]) for s in out}) == 1
    assert len(advanced) == 3 * 2, advanced
    assert len(positions) == 3 * 2, positions
    eager, eager_toks, _ = greedy(bridge.step, model, first.tolist(), rows, 5)
    unshared, unshared_toks, _ = greedy(dec_dense, model, first.tolist(), dense, 5)
    for g, e, u in zip(got + more, eager, unshared):
        np.testing.assert_allclose(np.array(g), np.array(e), atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.array(g), np.array(u), atol=ATOL, rtol=1e-5)
    assert got_toks + more_toks == eager_toks == unshared_toks
    # each layer's rows read that layer's own prefix records, the very same objects
    for s, r in zip(out, rows):
        assert len(s.prefixes) == len(r.prefixes)
        assert all(a is b for a, b in zip(s.prefixes, r.prefixes))
    assert len({id(s.prefixes[0]) for s in out}) == len(out)
    assert d.traces == 1
    for lease in leases:
        lease.release()


def test_a_shared_spec_holds_no_record_and_rebuilds_around_like():
    """``compiled.unflatten`` of a ``SharedState``: its ``SharedSpec`` holds the row
    map and the prefix records' shapes, not the records, so the rows are rebuilt
    around ``like``'s prefix records (the very same objects); without ``like``
    it is refused by name. Specs of equal layouts over other records are equal."""
    from kvstate.compiled import boundary as compiled
    from kvstate.core.records import share_row_ids

    model = llama_model(layers=2)
    rng = np.random.default_rng(3)
    _, rows = prompts_and_rows(model, rng)
    _, rows = bridge.step(model, mx.array([1, 2, 3, 4, 5, 6]), share_row_ids(rows))
    s = rows[0]
    flat, spec = compiled.flatten(s)
    assert not any(isinstance(v, kv.CacheState) for v in attrs.astuple(spec, recurse=False))
    back = compiled.unflatten(spec, flat, like=s)
    assert isinstance(back, kv.SharedState)
    assert all(a is b for a, b in zip(back.prefixes, s.prefixes))
    assert (back.source, back.prefix_row, back.shared) == (s.source, s.prefix_row, s.shared)
    assert back.lengths == s.lengths
    for a, b in zip(back.suffix.planes, compiled.prepare(s).suffix.planes):
        assert mx.array_equal(a, b)
    with pytest.raises(kv.KVStateError, match="like"):
        compiled.unflatten(spec, flat)
    # the other layer reads other records in the same layout: an equal Spec
    assert rows[1].prefixes[0] is not s.prefixes[0]
    assert compiled.flatten(rows[1])[1] == spec


def test_the_row_map_arrays_are_built_once_not_per_step():
    """Decoding never changes the row map (which prefix row each row reads, from
    which column, how many tokens): every step of the compiled decoder takes
    the very same four row-map arrays (not ones built again each step);
    only the suffix's positions are new. The logits equal the eager bridge's."""
    model = llama_model(layers=3)
    _, states = bridge.forward(model, mx.array([[1, 2, 3, 4, 5]]), bridge.make_states(model, 1))
    rows = kv.fork(states, 0, 2)
    decoder = _decoder.Decoder(model)
    tok = mx.array([6, 7, 8])
    logits, out = decoder(tok, rows)
    got = []
    for key, fn in list(decoder._fns.items()):

        def spy(tokens, flats, layouts, fn=fn):
            got.append(layouts)
            return fn(tokens, flats, layouts)

        decoder._fns[key] = spy
    eager_logits, eager_rows = bridge.step(model, tok, rows)
    np.testing.assert_allclose(np.array(logits), np.array(eager_logits), atol=ATOL, rtol=1e-5)
    for _ in range(3):
        tok = mx.argmax(logits, axis=-1)
        logits, out = decoder(tok, out)
        eager_logits, eager_rows = bridge.step(model, tok, eager_rows)
        np.testing.assert_allclose(np.array(logits), np.array(eager_logits), atol=ATOL, rtol=1e-5)
    assert len(got) == 3 and all(len(g) == 1 and len(g[0]) == 6 for g in got)  # one layout
    # (ends, left_pad) of the suffix: new each step; the row map: the same arrays
    assert not any(got[i][0][0] is got[0][0][0] for i in (1, 2))
    assert all(a is b for g in got for a, b in zip(g[0][2:], got[0][0][2:]))
    np.testing.assert_array_equal(np.array(got[0][0][5])[:3], [5, 5, 5])  # (+ batch padding)
    assert decoder.traces == 1
