"""``kvstate.mlx_lm``: states per layer, the cache shells, masks through the
memo, and conversion to and from mlx-lm cache objects (same process)."""

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm
from _quant import needs_stock_quantized_read
from _rows import peak_growth, same_buffer
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    trim_prompt_cache,
)

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.bridge import routing
from kvstate.bridge import shells as _shells

ATOL = 1e-4


def ragged(model, lengths=(5, 9, 2), **make):
    prompts = [tm.prompt(20 + i, n) for i, n in enumerate(lengths)]
    logits, states = br.prefill(model, prompts, **make)
    return prompts, logits, states


def snapshot(states):
    out = []
    for s in states:
        fields = (type(s), s.lengths, s.left_pad, s.capacity)
        out.append((fields, [np.array(p) for p in s.planes]))
    return out


def assert_same(states, snap):
    assert len(states) == len(snap)
    for s, (fields, planes) in zip(states, snap):
        assert (type(s), s.lengths, s.left_pad, s.capacity) == fields
        for p, q in zip(s.planes, planes):
            np.testing.assert_array_equal(np.array(p), q)


def close(a, b):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=ATOL, rtol=0)


# --- make_states ------------------------------------------------------------------


def test_make_states_mirrors_make_cache(llama):
    states = br.make_states(llama, 3)
    assert len(states) == len(llama.layers)
    assert all(type(s) is kv.CacheState and s.batch_size == 3 for s in states)
    q = br.make_states(llama, 2, kv_bits=4, kv_group_size=32)
    assert all(type(s) is kv.QuantizedState for s in q)
    assert {(s.bits, s.group_size, s.batch_size) for s in q} == {(4, 32, 2)}


def test_make_states_without_make_cache_and_max_kv_size():
    model = tm.qwen3_model()
    assert not hasattr(model, "make_cache")
    assert all(type(s) is kv.CacheState for s in br.make_states(model))
    rings = br.make_states(model, max_kv_size=16)
    assert all(type(s) is kv.RotatingState for s in rings)
    assert {(s.max_size, s.keep) for s in rings} == {(16, 4)}


def test_make_states_sliding_layers_get_rings():
    model = tm.gemma3_model(sliding_window=8)
    states = br.make_states(model, 2)
    want = [type(c).__name__ for c in model.make_cache()]
    got = ["RotatingKVCache" if type(s) is kv.RotatingState else "KVCache" for s in states]
    assert got == want
    assert {s.max_size for s in states if type(s) is kv.RotatingState} == {8}


def test_make_states_bad_input(llama):
    with pytest.raises(kv.KVStateError, match="batch_size"):
        br.make_states(llama, -1)  # 0 rows is legal (an empty batch)


# --- forward ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "quantized", "rings"])
def test_forward_leaves_input_states_unchanged(llama, kind):
    model, make = llama, {}
    if kind == "quantized":
        make = {"kv_bits": 8, "kv_group_size": 32}
    elif kind == "rings":
        model = tm.gemma3_model(sliding_window=8)
    _, logits, states = ragged(model, lengths=(5, 11, 2), **make)
    mx.eval([s.planes for s in states])
    snap = snapshot(states)
    tok = mx.argmax(logits, axis=-1)
    out1, new1 = br.forward(model, tok[:, None], states)
    out3, new3 = br.forward(model, mx.stack([tok, tok, tok], axis=1), states)
    mx.eval(out1, out3, [s.planes for s in new1 + new3])
    assert_same(states, snap)
    assert [s.lengths for s in new3] == [tuple(n + 3 for n in s.lengths) for s in states]


def test_forward_bad_input(llama):
    _, _, states = ragged(llama)
    snap = snapshot(states)
    with pytest.raises(kv.KVStateError, match="batch size"):
        br.forward(llama, mx.zeros((2, 1), mx.int32), states)
    with pytest.raises(kv.KVStateError, match="tokens rank"):
        br.forward(llama, mx.zeros((3,), mx.int32), states)
    with pytest.raises(kv.KVStateError, match="states"):
        br.forward(llama, mx.zeros((3, 1), mx.int32), [])
    assert_same(states, snap)


def test_one_mask_build_per_forward(llama):
    _, logits, states = ragged(llama)
    tok = mx.argmax(logits, axis=-1)
    memo = kv.MaskMemo()
    for i in range(3):  # ragged rows: one array per forward, shared by every layer
        logits, states = br.step(llama, tok, states, memo=memo)
        assert memo.builds == i + 1 and memo.live == 0
    # Aligned rows: decode needs no mask, a block uses the fused "causal" mode.
    memo = kv.MaskMemo()
    _, aligned = br.forward(llama, mx.ones((2, 4), mx.int32), br.make_states(llama, 2), memo=memo)
    br.forward(llama, mx.ones((2, 1), mx.int32), aligned, memo=memo)
    assert memo.builds == 0 and memo.live == 0


def test_layers_of_one_layout_share_one_append_plan(llama, monkeypatch):
    from kvstate.kinds import rows as _rows

    made = []
    init = _rows.AppendPlan.__init__
    monkeypatch.setattr(
        _rows.AppendPlan, "__init__", lambda self, *a: (made.append(a), init(self, *a))[1]
    )
    _, logits, states = ragged(llama)
    tok = mx.argmax(logits, axis=-1)
    for _ in range(3):  # merged rows hold equal (not identical) tuples at first
        made.clear()
        logits, states = br.step(llama, tok, states)
        assert len(made) == 1
    assert all(s.lengths is states[0].lengths for s in states)  # then one object
    # A layer of another capacity gets its own plan; the step is unchanged.
    s1 = states[1]
    pad = mx.zeros((s1.batch_size, s1.keys.shape[1], 256, s1.keys.shape[3]))
    wider = list(states)
    wider[1] = kv.CacheState(
        s1.lengths,
        s1.left_pad,
        s1.step,
        keys=mx.concatenate([s1.keys, pad], axis=2),
        values=mx.concatenate([s1.values, pad], axis=2),
    )
    made.clear()
    got, got_states = br.step(llama, tok, wider)
    assert len(made) == 2
    want, want_states = br.step(llama, tok, states)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    for a, b in zip(got_states, want_states):
        np.testing.assert_array_equal(np.array(kv.fetch(a)[0]), np.array(kv.fetch(b)[0]))


def test_forward_starts_the_first_layer_early_and_only_it(llama, monkeypatch):
    started = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (started.append(a), real(*a))[1])
    _, logits, states = ragged(llama)
    started.clear()
    logits, states = br.step(llama, mx.argmax(logits, axis=-1), states, start_early=True)
    assert len(started) == 1  # one forward, one early start
    k, v = started[0]
    assert k.shape == v.shape == (3, 2, 1, 32)  # the first layer's new keys and values
    tok = mx.argmax(logits, axis=-1)
    late, late_states = br.step(llama, tok, states, start_early=False)
    assert len(started) == 1  # switched off: nothing started
    early, early_states = br.step(llama, tok, states, start_early=True)
    assert len(started) == 2
    np.testing.assert_array_equal(np.array(late), np.array(early))
    # The default starts early only on the CPU (it measured slower on the H200),
    # whichever backend runs this test.
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    br.step(llama, tok, states)
    assert len(started) == 3
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    br.step(llama, tok, states)
    assert len(started) == 3


def test_steps_write_in_place_when_the_caller_drops_the_old_states(llama):
    # The early start must not evaluate any write while the caller still
    # holds the old records (that would copy every plane).
    _, logits, states = ragged(llama, lengths=(900, 700, 1000))
    tok = mx.argmax(logits, axis=-1)
    logits, states = br.step(llama, tok, states)
    mx.eval(logits, [s.planes for s in states])
    plane_bytes = sum(s.nbytes for s in states)

    def peak(steps, keep_old):
        kept = []

        def run():
            nonlocal states, logits
            for _ in range(steps):
                if keep_old:
                    kept.append(states)
                logits, states = br.step(llama, tok, states)
                mx.eval(logits, [s.planes for s in states])

        return peak_growth(run)

    assert peak(4, keep_old=False) < plane_bytes / 4
    assert peak(2, keep_old=True) > plane_bytes  # the control: held records force copies


def test_forward_traced_by_mx_compile_equals_eager(llama):
    _, logits, states = ragged(llama)
    tok = mx.argmax(logits, axis=-1)[:, None]
    eager, _ = br.forward(llama, tok, states)
    traced = mx.compile(lambda t: br.forward(llama, t, states)[0])(tok)
    np.testing.assert_array_equal(np.array(traced), np.array(eager))


@pytest.mark.parametrize("routed", [False, True])
def test_a_failing_model_releases_its_leases(llama, monkeypatch, routed):
    # routed: the reads go through the router, as on CUDA (a duck-typed model
    # without named_modules routes nothing and fails with its own error)
    monkeypatch.setattr(routing, "routes_reads", lambda: routed)
    _, _, states = ragged(llama)

    class Boom:
        layers = llama.layers

        def __call__(self, tokens, cache):
            cache[0].make_mask(tokens.shape[1])
            raise RuntimeError("model failed")

    memo = kv.MaskMemo()
    with pytest.raises(RuntimeError, match="model failed"):
        br.forward(Boom(), mx.zeros((3, 1), mx.int32), states, memo=memo)
    assert memo.builds == 1 and memo.live == 0


def test_model_sees_the_same_mask_object_for_every_layer(llama):
    # The model asks one layer for the mask; with return_array every call leases
    # one memoized array.
    _, _, states = ragged(llama)
    memo = kv.MaskMemo()
    fwd = _shells.Eager(memo)
    shells = [_shells.shell(s, fwd) for s in states]
    masks = [sh.make_mask(1) for sh in shells]
    assert memo.builds == 1 and all(same_buffer(m, masks[0]) for m in masks)
    arr = shells[0].make_mask(2, return_array=True)
    assert arr.shape == (3, 1, 2, states[0].width + 2)
    fwd.release()
    assert memo.live == 0


class Probe:
    """A stand-in model that records what the shells answer, then appends."""

    def __init__(self, n_layers, heads=2, dim=32):
        self.layers = [None] * n_layers
        self.heads, self.dim, self.seen = heads, dim, []

    def __call__(self, tokens, cache):
        B, N = tokens.shape
        for c in cache:
            self.seen.append(
                dict(
                    offset=c.offset,
                    quantized=hasattr(c, "bits"),
                    trimmable=c.is_trimmable(),
                    empty=c.empty(),
                    size=c.size(),
                    nbytes=c.nbytes,
                )
            )
            k = mx.random.normal((B, self.heads, N, self.dim))
            c.update_and_fetch(k, k)
        return mx.zeros((B, N, 4))


def test_shells_answer_the_cache_protocol():
    probe = Probe(2)
    states = br.make_states(probe, 2)
    _, states = br.forward(probe, mx.zeros((2, 3), mx.int32), states)
    first = probe.seen[0]
    assert first["offset"] == 0 and first["empty"] and not first["quantized"]
    assert first["trimmable"] and first["size"] == 0 and first["nbytes"] == 0
    probe.seen.clear()
    rows = [kv.trim(s, [1, 0]) for s in states]  # ends differ: per-row RoPE offsets
    _, after = br.forward(probe, mx.zeros((2, 1), mx.int32), rows)
    off = probe.seen[0]["offset"]
    assert isinstance(off, mx.array) and off.tolist() == [2, 3]
    assert probe.seen[0]["size"] == 3 and probe.seen[0]["nbytes"] == rows[0].nbytes
    assert [s.lengths for s in after] == [(3, 4)] * 2
    q = br.make_states(probe, 1, kv_bits=8, kv_group_size=32)
    _, q = br.forward(probe, mx.zeros((1, 2), mx.int32), q)
    assert probe.seen[-1]["quantized"] and probe.seen[-1]["empty"]  # seen before its write
    assert type(q[0]) is kv.QuantizedState and q[0].lengths == (2,)


def test_shell_trim_through_mlx_lm_helper():
    class Trimmer(Probe):
        def __call__(self, tokens, cache):
            out = super().__call__(tokens, cache)
            self.trimmed = trim_prompt_cache(cache, 2)  # mlx-lm's own helper
            return out

    probe = Trimmer(2)
    _, states = br.forward(probe, mx.zeros((2, 3), mx.int32), br.make_states(probe, 2))
    assert probe.trimmed == 2 and [s.lengths for s in states] == [(1, 1)] * 2


# --- conversion ------------------------------------------------------------------------


def solo_cache(model, prompt):
    c = [KVCache() for _ in model.layers]
    logits = model(mx.array([prompt]), cache=c)[:, -1]
    return logits, c


def test_kvcache_round_trip_continues_identically(llama):
    p = tm.prompt(3, 7)
    logits, c = solo_cache(llama, p)
    states = br.from_prompt_cache(c)
    for s, x in zip(states, c):
        np.testing.assert_array_equal(np.array(kv.fetch(s)[0]), np.array(x.keys[..., :7, :]))
    tok = mx.argmax(logits, axis=-1)
    ours, states = br.step(llama, tok, states)
    theirs = llama(tok[:, None], cache=c)[:, -1]  # mlx-lm writes in place ...
    close(ours, theirs)
    back = br.to_prompt_cache(states)
    assert all(type(x) is KVCache and x.offset == 8 for x in back)
    close(llama(tok[:, None], cache=back)[:, -1], llama(tok[:, None], cache=c)[:, -1])


def test_batch_kvcache_round_trip(llama):
    prompts = [tm.prompt(40 + i, n) for i, n in enumerate((6, 3, 9))]
    solos = [solo_cache(llama, p) for p in prompts]
    batch = [BatchKVCache.merge([s[1][i] for s in solos]) for i in range(len(llama.layers))]
    states = br.from_prompt_cache(batch)
    assert states[0].left_pad == (3, 6, 0) and states[0].lengths == (6, 3, 9)
    tok = mx.argmax(mx.concatenate([s[0] for s in solos]), axis=-1)
    ours, states = br.step(llama, tok, states)
    close(ours, llama(tok[:, None], cache=batch)[:, -1])  # mlx-lm's batch cache, same step
    back = br.to_prompt_cache(states)
    assert all(type(x) is BatchKVCache for x in back)
    assert back[0].left_padding.tolist() == [3, 6, 0] and back[0].offset.tolist() == [7, 4, 10]
    close(llama(tok[:, None], cache=back)[:, -1], llama(tok[:, None], cache=batch)[:, -1])


def test_to_prompt_cache_right_aligns_rows_with_different_ends(llama):
    _, logits, states = ragged(llama)
    states = [kv.trim(s, [2, 0, 1]) for s in states]  # rows end at different columns
    back = br.to_prompt_cache(states)
    assert back[0].offset.tolist() == list(states[0].lengths)
    tok = mx.argmax(logits, axis=-1)
    ours, _ = br.step(llama, tok, states)
    close(ours, llama(tok[:, None], cache=back)[:, -1])


def test_conversion_never_aliases(llama):
    _, _, states = ragged(llama, lengths=(4,))
    mx.eval([s.planes for s in states])
    snap = snapshot(states)
    back = br.to_prompt_cache(states)
    for _ in range(3):  # mlx-lm writes into its buffers in place
        llama(mx.ones((1, 1), mx.int32), cache=back)
    mx.eval([c.state for c in back])
    assert_same(states, snap)
    _, c = solo_cache(llama, tm.prompt(5, 6))
    recs = br.from_prompt_cache(c)
    snap = snapshot(recs)
    llama(mx.ones((1, 1), mx.int32), cache=c)  # capacity 256 > 6: writes in place
    mx.eval([x.state for x in c])
    assert_same(recs, snap)


@needs_stock_quantized_read
def test_quantized_round_trip(llama):
    c = [QuantizedKVCache(group_size=32, bits=8) for _ in llama.layers]
    logits = llama(mx.array([tm.prompt(6, 5)]), cache=c)[:, -1]
    states = br.from_prompt_cache(c)
    assert all(type(s) is kv.QuantizedState and s.bits == 8 and s.group_size == 32 for s in states)
    tok = mx.argmax(logits, axis=-1)
    ours, states = br.step(llama, tok, states)
    close(ours, llama(tok[:, None], cache=c)[:, -1])
    back = br.to_prompt_cache(states)
    assert all(type(x) is QuantizedKVCache and x.offset == 6 for x in back)
    for s, x in zip(states, back):
        for a, b in zip(kv.fetch(s)[0], x.keys):
            np.testing.assert_array_equal(np.array(a), np.array(b))


def test_conversion_bad_input(llama):
    with pytest.raises(kv.KVStateError, match=r"caches\[0\]"):
        br.from_prompt_cache([ConcatenateKVCache()])  # (a cache kvstate has no record for)
    q = br.make_states(llama, 2, kv_bits=8, kv_group_size=32)
    with pytest.raises(kv.KVStateError, match="batch size"):
        br.to_prompt_cache(q)


# --- rings: sliding layers of gemma3 ---------------------------------------------------


def test_ring_and_full_layers_one_build_per_family(gemma):
    _, logits, states = ragged(gemma, lengths=(3, 6, 5))  # rings not full yet: ragged
    tok = mx.argmax(logits, axis=-1)
    memo = kv.MaskMemo()
    _, states = br.step(gemma, tok, states, memo=memo)
    assert memo.builds == 2 and memo.live == 0  # one "rows", one "ring"


def test_rotating_kvcache_round_trip(gemma):
    p = tm.prompt(8, 13)  # longer than the window: the ring has rotated
    c = gemma.make_cache()
    logits = gemma(mx.array([p]), cache=c)[:, -1]
    for _ in range(3):
        logits = gemma(mx.argmax(logits, axis=-1)[:, None], cache=c)[:, -1]
    states = br.from_prompt_cache(c)
    assert [type(s).__name__ for s in states] == ["RotatingState", "CacheState"] * 2
    tok = mx.argmax(logits, axis=-1)
    ours, states = br.step(gemma, tok, states)
    close(ours, gemma(tok[:, None], cache=c)[:, -1])
    back = br.to_prompt_cache(states)
    assert [type(x) for x in back] == [RotatingKVCache, KVCache] * 2
    tok = mx.argmax(ours, axis=-1)
    for _ in range(3):  # mlx-lm's single-token ring path on the converted cache
        a = gemma(tok[:, None], cache=back)[:, -1]
        b = gemma(tok[:, None], cache=c)[:, -1]
        close(a, b)
        tok = mx.argmax(a, axis=-1)


def test_batch_rotating_kvcache_round_trip(gemma):
    prompts = [tm.prompt(50 + i, n) for i, n in enumerate((12, 4, 9))]
    solos = []
    for p in prompts:
        c = gemma.make_cache()
        solos.append((gemma(mx.array([p]), cache=c)[:, -1], c))
    batch = [type(solos[0][1][i]).merge([s[1][i] for s in solos]) for i in range(len(gemma.layers))]
    assert type(batch[0]) is BatchRotatingKVCache
    states = br.from_prompt_cache(batch)
    assert states[0].lengths == (12, 4, 9) and states[0].held == (8, 4, 8)
    tok = mx.argmax(mx.concatenate([s[0] for s in solos]), axis=-1)
    ours, states = br.step(gemma, tok, states)
    close(ours, gemma(tok[:, None], cache=batch)[:, -1])
    back = br.to_prompt_cache(states)
    assert type(back[0]) is BatchRotatingKVCache and type(back[1]) is BatchKVCache
    tok = mx.argmax(ours, axis=-1)
    close(gemma(tok[:, None], cache=back)[:, -1], br.step(gemma, tok, states)[0])


def test_batched_ring_with_keep_has_no_mlx_lm_form():
    s = kv.rotating(2, max_size=8, keep=4)
    with pytest.raises(kv.KVStateError, match="keep"):
        br.to_prompt_cache([s])


def test_ring_shells_answer_the_cache_protocol():
    """``offset``, ``size()``, ``is_trimmable()`` as mlx-lm's own ring answers them."""
    probe = Probe(1)
    states = br.make_states(probe, 2, max_kv_size=6)  # rings, keep=4 (make_prompt_cache's)
    assert (states[0].max_size, states[0].keep) == (6, 4)
    ref = RotatingKVCache(6, 4)
    for n in (3, 1, 5, 1, 1):
        _, states = br.forward(probe, mx.zeros((2, n), mx.int32), states)
        k = mx.zeros((1, 2, n, 32))
        ref.update_and_fetch(k, k)
        br.forward(probe, mx.zeros((2, 1), mx.int32), states)  # the probe looks, then appends
        seen = probe.seen[-1]
        assert (seen["offset"], seen["size"], seen["trimmable"]) == (
            ref.offset,
            ref.size(),
            ref.is_trimmable(),
        )
    fwd = _shells.Eager(kv.MaskMemo())  # a block that needs no array, asked for one
    mask = _shells.shell(kv.rotating(2, max_size=6), fwd).make_mask(2, return_array=True)
    assert mask.dtype == mx.bool_
    np.testing.assert_array_equal(np.array(mask)[:, 0], [[[True, False], [True, True]]] * 2)
    fwd.release()


# --- found by the contract review ---------------------------------------------------


def gemma2_model(seed=3):
    from mlx_lm.models import gemma2

    mx.random.seed(seed)
    model = gemma2.Model(
        gemma2.ModelArgs(
            model_type="gemma2",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            vocab_size=tm.VOCAB,
            num_key_value_heads=1,
            query_pre_attn_scalar=32,
        )
    )
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("max_kv_size", [None, 8])
def test_model_asking_return_array_runs_on_rings_and_rows(max_kv_size):
    # gemma2 asks make_mask(..., return_array=True) and reads mask.dtype, so
    # it needs an array (or None) from dense and ring layers alike; with
    # max_kv_size=8 the ring wraps during the decode.
    from mlx_lm.models.cache import make_prompt_cache

    model = gemma2_model()
    toks = tm.prompt(40, 6)
    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    states = br.make_states(model, 1, max_kv_size=max_kv_size)
    ref = model(mx.array([toks]), cache=caches)
    got, states = br.forward(model, mx.array([toks]), states)
    close(got, ref)
    tok = int(mx.argmax(ref[0, -1]).item())
    for _ in range(8):
        ref = model(mx.array([[tok]]), cache=caches)
        got, states = br.forward(model, mx.array([[tok]]), states)
        close(got, ref)
        tok = int(mx.argmax(ref[0, -1]).item())


def test_forward_refuses_a_state_list_of_the_wrong_length(llama):
    # mlx-lm models zip layers with caches: a short list would silently run
    # fewer layers, a long one ignore states.
    states = br.make_states(llama, 1)
    toks = mx.array([tm.prompt(41, 4)])
    for wrong in (states[:-1], states + [kv.empty(1)]):
        with pytest.raises(kv.KVStateError, match="states"):
            br.forward(llama, toks, wrong)
        with pytest.raises(kv.KVStateError, match="states"):
            kv.compiled_decoder(llama)(toks, wrong)
