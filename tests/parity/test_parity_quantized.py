"""Differential: QuantizedState against mlx-lm's QuantizedKVCache, same
process, same inputs.

What a model sees must match: ``kv.fetch`` returns the exact triples
``QuantizedKVCache.update_and_fetch`` returns (over the stored columns), and
``kv.attend`` equals mlx-lm's ``quantized_scaled_dot_product_attention``
under the cache's own ``make_mask``. mlx-lm cannot batch quantized rows of
different lengths (mlx-lm #1583); here each row of such a batch must equal
that row alone in its own QuantizedKVCache.
"""

from __future__ import annotations

import numpy as np
from _quant import (
    GEOMETRIES,
    assert_same_bytes,
    mlx_qsdpa,
    needs_stock_quantized_read,
    np_of,
    rand,
    row_planes,
)
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import kvstate as kv
from kvstate import to_quantized

H = 2
SCALE = 0.17


def mlx_mask(cache, n, window=None):
    """What a model gets from ``create_attention_mask(h, cache)`` (``window_size`` as gemma)."""
    return cache.make_mask(n, return_array=False, window_size=window)


# Each op: ("append", n) or ("trim", m); windows are drawn per attention read.
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.sampled_from([1, 1, 1, 2, 3, 7])),
        st.tuples(st.just("trim"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=8,
)


@needs_stock_quantized_read
@given(
    geometry=st.sampled_from(GEOMETRIES),
    B=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2]),
    step=st.sampled_from([4, 256]),
    ops=ops_strategy,
    window=st.sampled_from([None, None, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_fetch_and_attend_equal_quantized_kv_cache(geometry, B, rep, step, ops, window, seed):
    bits, gs, D = geometry
    rng = np.random.default_rng(seed)
    cache = QuantizedKVCache(group_size=gs, bits=bits)
    s = kv.quantized(B, group_size=gs, bits=bits, step=step)
    for op, n in [("append", 2)] + ops:
        if op == "trim":
            m = min(n, s.lengths[0] - 1)
            assert cache.trim(m) == m
            s = kv.trim(s, m)
            continue
        k, v, q = rand(rng, B, H, n, D), rand(rng, B, H, n, D), rand(rng, B, H * rep, n, D)
        mask = mlx_mask(cache, n, window)
        want_k, want_v = cache.update_and_fetch(k, v)
        s = kv.append(s, k, v)
        got_k, got_v = kv.fetch(s)
        assert s.lengths == (cache.offset,) * B
        assert_same_bytes(
            [np_of(x) for x in (*got_k, *got_v)],
            [np_of(x) for x in (*want_k, *want_v)],
            f"fetch after {op} {n}",
        )
        want = mlx_qsdpa(q, want_k, want_v, scale=SCALE, mask=mask, group_size=gs, bits=bits)
        got = kv.attend(s, q, scale=SCALE, window=window)
        np.testing.assert_array_equal(np_of(got), np_of(want), err_msg=f"attend, window={window}")


@needs_stock_quantized_read
def test_to_quantized_equals_kv_cache_to_quantized():
    """kvstate's ``to_quantized`` of a float record fetches the same bytes as
    mlx-lm's ``KVCache.to_quantized`` of the same tokens, and both continue
    the same way."""
    rng = np.random.default_rng(1)
    for bits, gs in [(4, 64), (8, 32), (3, 32)]:
        cache, s = KVCache(), kv.empty(2)
        for n in (5, 1, 3):
            k, v = rand(rng, 2, H, n, 64), rand(rng, 2, H, n, 64)
            cache.update_and_fetch(k, v)
            s = kv.append(s, k, v)
        qc = cache.to_quantized(group_size=gs, bits=bits)
        qs = to_quantized(s, group_size=gs, bits=bits)
        for step in range(3):
            want_k, want_v = qc.keys_and_values() if step == 0 else qc.update_and_fetch(k, v)
            got_k, got_v = kv.fetch(qs)
            assert_same_bytes(
                [np_of(x) for x in (*got_k, *got_v)],
                [np_of(x) for x in (*want_k, *want_v)],
                f"bits={bits} step {step}",
            )
            q = rand(rng, 2, 2 * H, 1, 64)
            np.testing.assert_array_equal(
                np_of(kv.attend(qs, q, scale=SCALE)),
                np_of(
                    mlx_qsdpa(q, want_k, want_v, scale=SCALE, mask=None, group_size=gs, bits=bits)
                ),
            )
            k, v = rand(rng, 2, H, 1, 64), rand(rng, 2, H, 1, 64)
            qs = kv.append(qs, k, v)


def test_nbytes_match_at_equal_capacity():
    rng = np.random.default_rng(0)
    for bits, gs in [(4, 64), (8, 64), (8, 32)]:
        cache = QuantizedKVCache(group_size=gs, bits=bits)
        s = kv.quantized(2, group_size=gs, bits=bits)  # step 256, as mlx-lm
        for n in (100, 156, 3):
            k, v = rand(rng, 2, H, n, 64), rand(rng, 2, H, n, 64)
            cache.update_and_fetch(k, v)
            s = kv.append(s, k, v)
        assert s.capacity == cache.keys[0].shape[2] == 512
        assert s.nbytes == cache.nbytes


@needs_stock_quantized_read
@given(
    geometry=st.sampled_from([g for g in GEOMETRIES if g[2] == 64 and g[0] in (3, 4, 8)]),
    lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    steps=st.lists(st.sampled_from([1, 1, 2]), min_size=1, max_size=4),
    rep=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_ragged_batch_rows_equal_each_row_alone(geometry, lengths, steps, rep, seed):
    """Rows prefilled alone and merged, then appended and read as one batch
    (every row at its own end): each row equals its own QuantizedKVCache."""
    bits, gs, D = geometry
    rng = np.random.default_rng(seed)
    caches = [QuantizedKVCache(group_size=gs, bits=bits) for _ in lengths]
    rows = []
    for c, n in zip(caches, lengths):
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        c.update_and_fetch(k, v)
        rows.append(kv.append(kv.quantized(1, group_size=gs, bits=bits), k, v))
    s = kv.merge_rows(rows)
    assert s.left_pad == tuple(max(lengths) - n for n in lengths)
    B = len(lengths)
    for n in steps:
        if n > min(s.lengths):
            continue
        k, v, q = rand(rng, B, H, n, D), rand(rng, B, H, n, D), rand(rng, B, H * rep, n, D)
        s = kv.append(s, k, v)
        got = np_of(kv.attend(s, q, scale=SCALE))
        for b, c in enumerate(caches):
            mask = mlx_mask(c, n)
            want_k, want_v = c.update_and_fetch(k[b : b + 1], v[b : b + 1])
            assert_same_bytes(
                row_planes(s, b), [np_of(x[0]) for x in (*want_k, *want_v)], f"row {b} columns"
            )
            want = mlx_qsdpa(
                q[b : b + 1], want_k, want_v, scale=SCALE, mask=mask, group_size=gs, bits=bits
            )
            # The batch reads padding columns the solo row lacks: their weight
            # is exactly 0, but the longer reductions may round differently.
            np.testing.assert_allclose(
                got[b : b + 1], np_of(want), atol=1e-5, rtol=1e-5, err_msg=f"row {b}"
            )
