"""Differential: RotatingState against mlx-lm's RotatingKVCache, same process,
same inputs.

What a model sees must match after every append of 1 or more tokens: the
entries a row holds (``kv.fetch``, temporal order, against the cache's
buffer put in temporal order) bit for bit, and the attention output of
``kv.attend`` against mlx-lm's ``make_mask`` (called before
``update_and_fetch``, as a model does) + fused SDPA, float32.

One exception, measured: mlx-lm's single-token mask for a window smaller
than the ring rolls a ring that ignores ``keep`` (with ``keep > 0`` a query
can miss itself, see ``test_mlx_lm_window_mask_ignores_keep``). There,
kvstate is compared against the numpy reference of the semantics mlx-lm's
block mask uses (``RefRing``); everywhere else against both.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from _ring import RefRing, rand, rows_of
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import RotatingKVCache

import kvstate as kv
from kvstate.kinds.rotating import from_temporal, read_width, ring_mask, update_and_read

H, HQ, D = 2, 4, 8
SCALE = D**-0.5


def own(x):
    """A private copy for mlx-lm: its ring keeps the array a block append passes it and
    later writes into it in place (measured: ``test_mlx_lm_writes_into_the_callers_array``),
    which would reach any lazy kvstate graph still reading that array."""
    return mx.array(np.array(x))


def mlx_temporal(cache):
    """The entries an mlx-lm ring holds, in temporal order (its own reordering)."""
    k = cache._temporal_order(cache.keys)
    v = cache._temporal_order(cache.values)
    n = min(cache.offset, k.shape[2])
    return np.array(k[0, :, :n]), np.array(v[0, :, :n])


def mlx_buggy(n, keep, window, max_size):
    return n == 1 and keep > 0 and window is not None and window < max_size


rings = st.sampled_from([(1, 0), (2, 0), (2, 1), (4, 0), (4, 2), (5, 1), (7, 3), (8, 0), (8, 4)])
appends = st.lists(st.sampled_from([1, 1, 1, 1, 2, 3, 5, 9]), min_size=1, max_size=14)


@given(
    ring=rings,
    sizes=appends,
    window=st.sampled_from([None, None, 1, 2, 3, 6, 20]),
    step=st.sampled_from([3, 256]),
    seed=st.integers(0, 2**16),
)
def test_one_row_equals_rotating_kv_cache(ring, sizes, window, step, seed):
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    cache = RotatingKVCache(max_size, keep)
    ref = RefRing(max_size, keep)
    s = kv.rotating(1, max_size=max_size, keep=keep, step=step)
    for n in sizes:
        k, v, q = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D), rand(rng, 1, HQ, n, D)
        mask = cache.make_mask(n, window_size=window)
        ck, cv = cache.update_and_fetch(own(k), own(v))
        want = mx.fast.scaled_dot_product_attention(mx.array(q), ck, cv, scale=SCALE, mask=mask)
        ref.append(k[0], v[0])
        s = kv.append(s, mx.array(k), mx.array(v))
        got = kv.attend(s, mx.array(q), scale=SCALE, window=window)

        # What the row holds: same entries, same order, same bits.
        ((gk, gv),) = rows_of(s)
        mk, mv = mlx_temporal(cache)
        np.testing.assert_array_equal(gk, mk)
        np.testing.assert_array_equal(gv, mv)
        assert s.lengths == (cache.offset,)
        assert read_width(s) <= max(max_size, s.held[0])

        np.testing.assert_allclose(np.array(got)[0], ref.attend(q[0], SCALE, window), atol=2e-5)
        if not mlx_buggy(n, keep, window, max_size):
            np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)


@given(ring=rings, sizes=appends, cut=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_trim_equals_rotating_kv_cache_where_mlx_lm_can_trim(ring, sizes, cut, seed):
    """mlx-lm trims only before anything is evicted (``is_trimmable``); there both agree,
    and appends after the trim agree too."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    cache = RotatingKVCache(max_size, keep)
    s = kv.rotating(1, max_size=max_size, keep=keep)
    for n in sizes:
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        cache.update_and_fetch(own(k), own(v))
        s = kv.append(s, mx.array(k), mx.array(v))
        if cache.is_trimmable() and cut:
            m = min(cut, cache.offset)
            assert cache.trim(m) == m
            s = kv.trim(s, m)
        ((gk, _),) = rows_of(s) if s.held[0] else [(np.zeros((H, 0, D), np.float32), None)]
        mk, _ = mlx_temporal(cache) if cache.offset else (np.zeros((H, 0, D), np.float32), None)
        np.testing.assert_array_equal(gk, mk)


@given(ring=rings, sizes=appends, window=st.sampled_from([None, 2, 3]), seed=st.integers(0, 2**16))
def test_shell_protocol_next_mask_then_update_and_read(ring, sizes, window, seed):
    """The bridge's path: ``next_mask`` before the append, ``update_and_read`` after,
    fused SDPA over that read: equals mlx-lm's cache driven the same way."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    cache = RotatingKVCache(max_size, keep)
    s = kv.rotating(1, max_size=max_size, keep=keep)
    memo = kv.MaskMemo()
    for n in sizes:
        k, v, q = (mx.array(rand(rng, 1, h, n, D)) for h in (H, H, HQ))
        mask, held = kv.next_mask(s, n, memo=memo, window=window)
        s, keys, values = update_and_read(s, k, v)
        got = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask=mask)
        if held is not None:
            assert mask.shape[-1] == keys.shape[2]
            held.release()
        np.testing.assert_allclose(
            np.array(got), np.array(kv.attend(s, q, scale=SCALE, window=window)), atol=1e-6
        )
        mmask = cache.make_mask(n, window_size=window)
        ck, cv = cache.update_and_fetch(own(k), own(v))
        if not mlx_buggy(n, keep, window, max_size):
            want = mx.fast.scaled_dot_product_attention(q, ck, cv, scale=SCALE, mask=mmask)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)
    assert memo.live == 0


def test_mlx_lm_window_mask_ignores_keep():
    """The measured mlx-lm behaviour that the parity tests step around."""
    cache = RotatingKVCache(6, keep=2)
    s = kv.rotating(1, max_size=6, keep=2)
    for p in range(7):
        mask = cache.make_mask(1, window_size=3)
        x = mx.full((1, 1, 1, 1), float(p))
        k, _ = cache.update_and_fetch(own(x), own(x))
        s = kv.append(s, x, x)
    # The 7th token (position 6) went to column 2; mlx-lm's mask hides column 2.
    assert np.array(k).reshape(-1).tolist()[2] == 6.0
    assert not np.array(mask)[2]
    # kvstate: position 6 sees itself and the two entries before it (4, 5).
    cols = np.array(
        ring_mask(1, s.lengths, s.held, keep=2, capacity=s.capacity, width=read_width(s), window=3)
    ).reshape(-1)
    assert sorted(np.array(s.keys)[0, 0, cols, 0].tolist()) == [4.0, 5.0, 6.0]


def to_mlx(state):
    """A one-row record as an mlx-lm ring (the state its concatenating path leaves)."""
    c = RotatingKVCache(state.max_size, state.keep)
    k, v = kv.fetch(state)
    c.keys, c.values = mx.array(np.array(k)), mx.array(np.array(v))
    c.offset, c._idx = state.lengths[0], state.held[0]
    return c


def from_mlx(cache):
    """An mlx-lm ring as a record: its buffer in temporal order, its offset and keep."""
    k, v = mlx_temporal(cache)
    return from_temporal(
        mx.array(k)[None],
        mx.array(v)[None],
        lengths=cache.offset,
        max_size=cache.max_size,
        keep=cache.keep,
    )


@given(ring=rings, before=appends, after=appends, seed=st.integers(0, 2**16))
def test_conversion_both_ways_continues_identically(ring, before, after, seed):
    """``from_temporal`` of an mlx-lm ring, and an mlx-lm ring built from ``fetch``,
    both continue exactly as the original."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    cache = RotatingKVCache(max_size, keep)
    s = kv.rotating(1, max_size=max_size, keep=keep)
    for n in before:
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        cache.update_and_fetch(own(k), own(v))
        s = kv.append(s, mx.array(k), mx.array(v))
    pairs = [(cache, from_mlx(cache)), (to_mlx(s), s)]
    for n in after:
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        for i, (c, r) in enumerate(pairs):
            c.update_and_fetch(own(k), own(v))
            r = kv.append(r, mx.array(k), mx.array(v))
            pairs[i] = (c, r)
            ((gk, gv),) = rows_of(r)
            np.testing.assert_array_equal(gk, mlx_temporal(c)[0])
            np.testing.assert_array_equal(gv, mlx_temporal(c)[1])
            assert r.lengths == (c.offset,)


@given(
    ring=rings,
    prefixes=st.lists(appends, min_size=2, max_size=3),
    after=st.lists(st.sampled_from([1, 1, 1, 2, 4]), min_size=1, max_size=8),
    window=st.sampled_from([None, None, 2, 20]),
    seed=st.integers(0, 2**16),
)
def test_ragged_batch_equals_each_row_in_its_own_rotating_kv_cache(
    ring, prefixes, after, window, seed
):
    """Rows with different histories in one batch (``keep`` included, which mlx-lm's
    ``BatchRotatingKVCache`` drops): each row equals mlx-lm's ring run alone."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    caches = [RotatingKVCache(max_size, keep) for _ in prefixes]
    rows = []
    for c, sizes in zip(caches, prefixes):
        r = kv.rotating(1, max_size=max_size, keep=keep)
        for n in sizes:
            k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
            c.update_and_fetch(own(k), own(v))
            r = kv.append(r, mx.array(k), mx.array(v))
        rows.append(r)
    s = kv.merge_rows(rows)
    B = len(caches)
    for n in after:
        k, v, q = (rand(rng, B, h, n, D) for h in (H, H, HQ))
        s = kv.append(s, mx.array(k), mx.array(v))
        got = np.array(kv.attend(s, mx.array(q), scale=SCALE, window=window))
        held = rows_of(s)
        for b, c in enumerate(caches):
            mask = c.make_mask(n, window_size=window)
            ck, cv = c.update_and_fetch(own(k[b : b + 1]), own(v[b : b + 1]))
            np.testing.assert_array_equal(held[b][0], mlx_temporal(c)[0])
            np.testing.assert_array_equal(held[b][1], mlx_temporal(c)[1])
            if not mlx_buggy(n, keep, window, max_size):
                want = mx.fast.scaled_dot_product_attention(
                    mx.array(q[b : b + 1]), ck, cv, scale=SCALE, mask=mask
                )
                np.testing.assert_allclose(got[b], np.array(want)[0], atol=2e-5)


def test_mlx_lm_writes_into_the_callers_array():
    """Why the tests hand mlx-lm private copies (measured): after a block append its
    ring buffer *is* the caller's array, and the next single token is written into it."""
    k = mx.array(np.array([10.0, 11.0], np.float32).reshape(1, 1, 2, 1))
    cache = RotatingKVCache(2)
    cache.update_and_fetch(k, own(k))
    x = mx.full((1, 1, 1, 1), 12.0)
    cache.update_and_fetch(x, own(x))
    assert np.array(k).ravel().tolist() == [12.0, 11.0]
    # kvstate never writes into an array it was given.
    k = mx.array(np.array([10.0, 11.0], np.float32).reshape(1, 1, 2, 1))
    s = kv.append(kv.rotating(max_size=2), k, k)
    s = kv.append(s, x, x)
    mx.eval(s.keys)
    assert np.array(k).ravel().tolist() == [10.0, 11.0]
