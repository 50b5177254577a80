"""Algebraic laws of the dense pure functions (hypothesis).

Rows are drawn with every layout feature the contract allows: left padding
(from merging rows of different widths), stale columns past a row's end
(trimmed tokens), rows with no tokens, per-row ends, several step sizes.
"Equal" for rows means byte-exact mask-visible columns, ``[left_pad[b],
ends[b])``; what lies outside them is never read and may differ.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from _rows import assert_rows_equal, np_of, rand, ref_attend, visible
from hypothesis import given, note
from hypothesis import strategies as st

import kvstate as kv

dims = st.tuples(st.sampled_from([1, 2]), st.sampled_from([4, 8]), st.sampled_from([4, 8]))


@st.composite
def batches(draw, geo, max_rows=3, min_len=0):
    """``(state, rows)``: a merged batch with stale tails and per-row ends, and its numpy rows."""
    H, D, DV = geo
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    step = draw(st.sampled_from([1, 4, 256]))
    singles, rows = [], []
    for _ in range(draw(st.integers(1, max_rows))):
        n, stale = draw(st.integers(min_len, 6)), draw(st.integers(0, 3))
        k, v = rand(rng, 1, H, n + stale, D), rand(rng, 1, H, n + stale, DV)
        s = kv.empty(1, step=step)
        if n + stale:
            s = kv.trim(kv.append(s, mx.array(k), mx.array(v)), stale)
        singles.append(s)
        rows.append((k[0, :, :n], v[0, :, :n]))
    s = kv.merge_rows(singles)
    cut = [draw(st.integers(0, min(2, len(k[0]) - min_len))) for k, _ in rows]
    s = kv.trim(s, cut)
    rows = [(k[:, : k.shape[1] - c], v[:, : v.shape[1] - c]) for (k, v), c in zip(rows, cut)]
    note(f"batch lengths={s.lengths} left_pad={s.left_pad} step={step}")
    return s, rows


def attend_both(state, rows, rng, n, window=None, memo=None):
    """kvstate's attention and the numpy reference for ``n`` random queries."""
    H, D = state.keys.shape[1], state.keys.shape[3]
    q = rand(rng, state.batch_size, 2 * H, n, D)
    got = kv.attend(state, mx.array(q), scale=0.5, memo=memo, window=window)
    return np_of(got), ref_attend(rows, q, 0.5, window)


@given(dims.flatmap(lambda g: st.lists(batches(g), min_size=1, max_size=3)))
def test_extract_of_merge_is_the_row(inputs):
    merged = kv.merge_rows([s for s, _ in inputs])
    pairs = [(s, i, row) for s, rows in inputs for i, row in enumerate(rows)]
    assert merged.batch_size == len(pairs)
    assert merged.width == max(s.width for s, _ in inputs)
    for g, (s, i, row) in enumerate(pairs):
        got = kv.extract_row(merged, g)
        assert got.lengths == (row[0].shape[1],) and got.left_pad == (0,)
        assert_rows_equal(visible(got), [row])
        assert_rows_equal(visible(got), visible(kv.extract_row(s, i)))


@given(dims.flatmap(batches), st.data())
def test_filter_keeps_surviving_rows(sr, data):
    s, rows = sr
    keep = data.draw(
        st.lists(st.integers(0, s.batch_size - 1), min_size=1, max_size=s.batch_size + 1),
        label="keep",
    )
    f = kv.filter_rows(s, keep)
    assert f.lengths == tuple(s.lengths[r] for r in keep)
    assert_rows_equal(visible(f), [rows[r] for r in keep])
    # the padding every survivor shared is gone; relative layout is kept
    shared = min(s.left_pad[r] for r in keep)
    assert min(f.left_pad) == 0
    assert f.left_pad == tuple(s.left_pad[r] - shared for r in keep)
    assert f.width == max(s.ends[r] for r in keep) - shared


@given(dims.flatmap(lambda g: batches(g, min_len=1)), st.data())
def test_rollback_of_an_append_reads_like_the_original(sr, data):
    s, rows = sr
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    n = data.draw(st.integers(1, 4), label="draft")
    H, D, DV = s.keys.shape[1], s.keys.shape[3], s.values.shape[3]
    cp = kv.checkpoint(s)
    d = kv.append(
        s, mx.array(rand(rng, s.batch_size, H, n, D)), mx.array(rand(rng, s.batch_size, H, n, DV))
    )
    r = kv.rollback(d, cp, 0)
    assert (r.lengths, r.left_pad, r.width) == (s.lengths, s.left_pad, s.width)
    assert [x.shape for x in kv.fetch(r)] == [x.shape for x in kv.fetch(s)]
    assert_rows_equal(visible(r), visible(s))
    assert (kv.positions(r) is None) == (kv.positions(s) is None)
    m = data.draw(st.integers(1, min(s.lengths)), label="queries")
    window = data.draw(st.sampled_from([None, 2]), label="window")
    q = mx.array(rand(rng, s.batch_size, H, m, D))
    np.testing.assert_array_equal(
        np_of(kv.attend(r, q, scale=0.3, window=window)),
        np_of(kv.attend(s, q, scale=0.3, window=window)),
    )


@given(dims.flatmap(batches), st.data())
def test_per_row_rollback_equals_appending_only_accepted(sr, data):
    s, rows = sr
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    n = data.draw(st.integers(1, 4), label="draft")
    keep = data.draw(
        st.lists(st.integers(0, n), min_size=s.batch_size, max_size=s.batch_size), label="keep"
    )
    H, D, DV = rows[0][0].shape[0], rows[0][0].shape[2], rows[0][1].shape[2]
    dk, dv = rand(rng, s.batch_size, H, n, D), rand(rng, s.batch_size, H, n, DV)
    cp = kv.checkpoint(s)
    r = kv.rollback(kv.append(s, mx.array(dk), mx.array(dv)), cp, keep)
    want = [
        (np.concatenate([k, dk[b, :, : keep[b]]], 1), np.concatenate([v, dv[b, :, : keep[b]]], 1))
        for b, (k, v) in enumerate(rows)
    ]
    assert r.lengths == tuple(len_ + k for len_, k in zip(s.lengths, keep))
    assert_rows_equal(visible(r), want)
    # the next token lands right after the accepted ones on every row
    nk, nv = rand(rng, s.batch_size, H, 1, D), rand(rng, s.batch_size, H, 1, DV)
    r = kv.append(r, mx.array(nk), mx.array(nv))
    want = [
        (np.concatenate([k, nk[b]], 1), np.concatenate([v, nv[b]], 1))
        for b, (k, v) in enumerate(want)
    ]
    assert_rows_equal(visible(r), want)
    window = data.draw(st.sampled_from([None, 1, 3]), label="window")
    got, ref = attend_both(r, want, rng, 1, window)
    np.testing.assert_allclose(got, ref, atol=1e-5)


@given(dims.flatmap(lambda g: batches(g, min_len=2)), st.data())
def test_shared_memo_changes_nothing_and_builds_once_per_family(sr, data):
    s, _ = sr
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    H, D, DV = s.keys.shape[1], s.keys.shape[3], s.values.shape[3]
    n = data.draw(st.integers(1, min(s.lengths)), label="queries")
    window = data.draw(st.integers(1, 4), label="window")
    # several "layers": same row layout, different data
    layers = [
        kv.from_arrays(
            mx.array(rand(rng, s.batch_size, H, s.capacity, D)),
            mx.array(rand(rng, s.batch_size, H, s.capacity, DV)),
            lengths=s.lengths,
            left_pad=s.left_pad,
        )
        for _ in range(4)
    ]
    memo = kv.MaskMemo()
    for _forward in range(2):
        builds = memo.builds
        for layer in layers:
            q = mx.array(rand(rng, s.batch_size, 2 * H, n, D))
            for w in (None, window):  # a full layer and a sliding layer
                shared = kv.attend(layer, q, scale=0.7, memo=memo, window=w)
                alone = kv.attend(layer, q, scale=0.7, window=w)
                np.testing.assert_array_equal(np_of(shared), np_of(alone))
        # one build per family per forward: "rows" (unless aligned: no array) and "rows-window"
        assert memo.builds - builds == (0 if s.aligned else 1) + 1
        assert memo.live == 0
        # the next forward: one token later on every row (new keys, so new builds)
        k = mx.array(rand(rng, s.batch_size, H, 1, D))
        vv = mx.array(rand(rng, s.batch_size, H, 1, DV))
        layers = [kv.append(layer, k, vv) for layer in layers]
