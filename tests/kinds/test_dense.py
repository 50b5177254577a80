"""Unit tests of ``CacheState`` and its pure functions (kvstate.kinds.dense, kvstate.kinds.rows)."""

from __future__ import annotations

import collections
import gc
import io
import re

import attrs
import mlx.core as mx
import numpy as np
import pytest
from _rows import (
    append_peak,
    assert_rows_equal,
    assert_unchanged,
    np_of,
    rand,
    ref_attend,
    snapshot,
    visible,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstate as kv

H, D = 2, 8


def ragged(rng, lengths, *, step=256, dv=D):
    """A merged batch whose rows hold ``lengths`` tokens, and the numpy rows."""
    rows = [(rand(rng, H, n, D), rand(rng, H, n, dv)) for n in lengths]
    states = [
        kv.append(kv.empty(1, step=step), mx.array(k[None]), mx.array(v[None])) for k, v in rows
    ]
    return kv.merge_rows(states), rows


# --- empty / from_arrays -------------------------------------------------------


def test_empty():
    s = kv.empty(3, step=16)
    assert isinstance(s, kv.CacheState)
    assert s.keys is None and s.values is None
    assert s.lengths == (0, 0, 0) and s.left_pad == (0, 0, 0)
    assert s.step == 16 and s.batch_size == 3
    assert s.width == 0 and s.capacity == 0 and s.nbytes == 0
    assert s.aligned and s.ends == (0, 0, 0)
    assert kv.positions(s) is None
    assert kv.empty().batch_size == 1 and kv.empty().step == 256


def test_records_are_frozen():
    s = kv.empty(1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.lengths = (1,)


def test_from_arrays_defaults_and_layout(rng):
    k, v = rand(rng, 2, H, 6, D), rand(rng, 2, H, 6, 4)
    s = kv.from_arrays(mx.array(k), mx.array(v))
    assert s.lengths == (6, 6) and s.left_pad == (0, 0) and s.capacity == 6
    assert s.nbytes == k.nbytes + v.nbytes
    assert s.aligned and kv.positions(s) is None
    fk, fv = kv.fetch(s)
    np.testing.assert_array_equal(np_of(fk), k)
    np.testing.assert_array_equal(np_of(fv), v)

    s = kv.from_arrays(mx.array(k), mx.array(v), lengths=[3, 4], left_pad=[2, 0])
    assert s.ends == (5, 4) and s.width == 5 and not s.aligned
    rows = visible(s)
    np.testing.assert_array_equal(rows[0][0], k[0, :, 2:5])
    np.testing.assert_array_equal(rows[1][1], v[1, :, 0:4])
    assert kv.fetch(s)[0].shape == (2, H, 5, D)


# --- append ----------------------------------------------------------------


def test_append_grows_capacity_in_step_multiples(rng):
    s = kv.empty(1, step=4)
    chunks, caps = [], []
    for n in (3, 1, 2, 9, 1):
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        s = kv.append(s, mx.array(k), mx.array(v))
        chunks.append((k, v))
        caps.append(s.capacity)
        assert s.capacity % 4 == 0 and s.capacity >= s.width
    # need 3 -> 4; 4 -> 4; 6 -> 8; 15 -> 16; 16 -> 16
    assert caps == [4, 4, 8, 16, 16]
    assert s.lengths == (16,)
    want_k = np.concatenate([c[0] for c in chunks], axis=2)[0]
    want_v = np.concatenate([c[1] for c in chunks], axis=2)[0]
    assert_rows_equal(visible(s), [(want_k, want_v)])


def test_append_writes_each_row_at_its_own_end(rng):
    s, rows = ragged(rng, [5, 2, 4], step=8)
    assert s.left_pad == (0, 3, 1) and s.ends == (5, 5, 5)
    s = kv.trim(s, [0, 1, 3])  # ends 5, 4, 2: rows now advance independently
    rows = [(k[:, : k.shape[1] - t], v[:, : v.shape[1] - t]) for (k, v), t in zip(rows, [0, 1, 3])]
    assert s.ends == (5, 4, 2)
    for n in (2, 1, 3):
        k, v = rand(rng, 3, H, n, D), rand(rng, 3, H, n, D)
        s = kv.append(s, mx.array(k), mx.array(v))
        rows = [
            (np.concatenate([rk, k[b]], 1), np.concatenate([rv, v[b]], 1))
            for b, (rk, rv) in enumerate(rows)
        ]
    assert s.lengths == (11, 7, 7) and s.left_pad == (0, 3, 1)
    assert s.ends == (11, 10, 8) and s.width == 11
    assert s.capacity == 16
    assert_rows_equal(visible(s), rows)


def test_append_does_not_change_the_input(rng):
    s, rows = ragged(rng, [3, 1])
    s = kv.trim(s, [0, 1])  # differing ends: the scatter path
    for state in (s, kv.filter_rows(s, [0])):  # and the slice_update path
        before = snapshot(state)
        k = mx.array(rand(rng, state.batch_size, H, 2, D))
        new = kv.append(state, k, k)
        mx.eval(*new.planes)
        assert_unchanged(state, before)


def test_append_never_writes_into_the_callers_arrays(rng):
    # from_arrays wraps the caller's arrays; rows short of capacity get written
    # within it, which must copy while the caller still holds them
    k, v = rand(rng, 2, H, 6, D), rand(rng, 2, H, 6, D)
    keys, values = mx.array(k), mx.array(v)
    s = kv.from_arrays(keys, values, lengths=[2, 4])
    for _ in range(2):
        new = rand(rng, 2, H, 1, D)
        s = kv.append(s, mx.array(new), mx.array(new))
        mx.eval(*s.planes)
    np.testing.assert_array_equal(np_of(keys), k)
    np.testing.assert_array_equal(np_of(values), v)
    assert s.lengths == (4, 6)
    # one array as both keys and values
    shared = mx.array(k)
    s = kv.from_arrays(shared, shared, lengths=[3, 3])
    s = kv.append(s, mx.zeros((2, H, 1, D)), mx.ones((2, H, 1, D)))
    mx.eval(*s.planes)
    np.testing.assert_array_equal(np_of(shared), k)
    assert (np_of(s.keys)[:, :, 3] == 0).all() and (np_of(s.values)[:, :, 3] == 1).all()


# --- fetch / positions --------------------------------------------------------


def test_fetch_is_columns_zero_to_width(rng):
    s, rows = ragged(rng, [3, 6], step=16)
    assert s.capacity == 16
    k, v = kv.fetch(s)
    assert k.shape == (2, H, 6, D) and v.shape == (2, H, 6, D)
    # the padding columns of row 0 come first, then its tokens
    np.testing.assert_array_equal(np_of(k)[0, :, 3:], rows[0][0])
    s = kv.trim(s, [1, 1])
    assert kv.fetch(s)[0].shape == (2, H, 5, D)
    s = kv.trim(s, [2, 5])
    assert kv.fetch(s)[1].shape == (2, H, 3, D)  # width = max(3 + 0, 0 + 0)


def test_positions(rng):
    s, _ = ragged(rng, [4, 4])
    assert kv.positions(s) is None
    s = kv.trim(s, [1, 0])
    p = kv.positions(s)
    assert isinstance(p, mx.array) and p.dtype == mx.int32 and p.tolist() == [3, 4]
    s, _ = ragged(rng, [2, 5])  # ends equal but padded: not aligned
    assert not s.aligned
    assert kv.positions(s).tolist() == [2, 5]


# --- trim / checkpoint / rollback ------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    step=st.sampled_from([3, 4, 16]),
    data=st.data(),
)
def test_dropped_columns_are_cleared_with_one_scatter_per_plane(lengths, step, data):
    """``trim``/``rollback`` clear each row's dropped columns (numpy model: the
    planes with those columns zeroed, nothing else changed) with one scatter per
    plane: a row dropping nothing writes its zero into a hidden column of its own
    (past its end or in its padding), so no gather, select or fill runs unless such
    a row has no hidden column. On the old code every clear with a row dropping
    nothing gathered and selected."""
    rng = np.random.default_rng(sum(lengths) + 7 * step)
    s, _ = ragged(rng, lengths, step=step)
    mx.eval(s.keys, s.values)  # the graph below is the clear's alone
    n = [data.draw(st.integers(0, m)) for m in lengths]
    t = kv.trim(s, n)
    assert t.lengths == tuple(m - k for m, k in zip(lengths, n))
    out = io.StringIO()
    mx.export_to_dot(out, t.keys, t.values)
    ops = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue()))
    trapped = any(
        k == 0 and p + m == s.capacity and p == 0 for p, m, k in zip(s.left_pad, lengths, n)
    )
    if any(n):
        assert ops["ScatterAxis"] == 2
        assert trapped or not (ops["GatherAxis"] or ops["Select"] or ops["Full"])
    for old, new in ((s.keys, t.keys), (s.values, t.values)):
        want = np.array(old)
        for b, (p, m, k) in enumerate(zip(s.left_pad, lengths, n)):
            want[b][:, p + m - k : p + m] = 0
        np.testing.assert_array_equal(np.array(new), want)


def test_a_models_layers_checkpoint_and_roll_back_with_one_layout_worked_out(rng, monkeypatch):
    """A speculative round checkpoints and rolls back every layer of a model (the
    same rows in each): the checkpoint is one value shared by the layers, the
    rollback's checks and dropped columns are worked out once, not once per layer
    (host work per layer, every round), and each layer's result is what rolling it
    back alone gives. On the old code every layer built and checked its own."""
    from kvstate.kinds import rows as _rows

    layers = []
    for _ in range(6):
        s, _ = ragged(rng, [5, 3, 4])
        layers.append(kv.append(s, *(mx.array(rand(rng, 3, H, 2, D)) for _ in range(2))))
    rows = layers[0].row_ids
    layers = [attrs.evolve(s, row_ids=rows) for s in layers]  # one model's rows
    cp = kv.checkpoint([kv.trim(s, 2) for s in layers])
    assert all(c is cp.layers[0] for c in cp.layers)
    alone = [kv.rollback(s, c, [1, 0, 2]) for s, c in zip(layers, cp.layers)]
    calls = []
    real = _rows.checkpoint_target
    monkeypatch.setattr(_rows, "checkpoint_target", lambda *a: calls.append(1) or real(*a))
    back = kv.rollback(layers, cp, [2, 0, 1])
    assert len(calls) == 1
    back = kv.rollback(layers, cp, [1, 0, 2])
    assert len(calls) == 2
    for got, want in zip(back, alone):
        assert got.lengths == want.lengths == (6, 3, 6)
        np.testing.assert_array_equal(np.array(got.keys), np.array(want.keys))
        np.testing.assert_array_equal(np.array(got.values), np.array(want.values))
    with pytest.raises(kv.KVStateError, match="keep"):
        kv.rollback(layers, cp, [3, 0, 1])  # a keep the rows do not hold: still refused


def test_trim(rng):
    s, rows = ragged(rng, [5, 3])
    t = kv.trim(s, 2)
    assert t.lengths == (3, 1) and t.left_pad == s.left_pad
    # moves no data; the dropped columns are cleared (notes/core.md)
    for old, new in ((s.keys, t.keys), (s.values, t.values)):
        old, new = np.array(old), np.array(new)
        dropped = np.zeros(old.shape[2], bool)
        for b, (e, m) in enumerate(zip(s.ends, t.ends)):
            dropped[:] = False
            dropped[m:e] = True
            assert (new[b][:, dropped] == 0).all()
            np.testing.assert_array_equal(new[b][:, ~dropped], old[b][:, ~dropped])
    assert_rows_equal(visible(t), [(k[:, :-2], v[:, :-2]) for k, v in rows])
    t = kv.trim(s, [0, 3])
    assert t.lengths == (5, 0)
    assert visible(t)[1][0].shape == (H, 0, D)
    assert kv.trim(s, 0).lengths == s.lengths


def test_checkpoint_holds_no_arrays(rng):
    s, _ = ragged(rng, [3, 2])
    cp = kv.checkpoint(s)
    assert isinstance(cp, kv.Checkpoint)
    assert cp.lengths == (3, 2) and cp.left_pad == (0, 1)
    assert cp.row_ids == s.row_ids
    for f in attrs.fields(type(cp)):
        value = getattr(cp, f.name)
        assert isinstance(value, tuple) and all(type(x) is int for x in value)


def test_rollback(rng):
    s, rows = ragged(rng, [3, 2])
    cp = kv.checkpoint(s)
    draft = rand(rng, 2, H, 4, D)
    d = kv.append(s, mx.array(draft), mx.array(draft))
    r = kv.rollback(d, cp, 0)
    assert r.lengths == s.lengths and r.left_pad == s.left_pad
    assert_rows_equal(visible(r), visible(s))
    r = kv.rollback(d, cp, [4, 1])
    assert r.lengths == (7, 3)
    assert_rows_equal(
        visible(r),
        [
            (np.concatenate([rows[0][0], draft[0]], 1), np.concatenate([rows[0][1], draft[0]], 1)),
            (
                np.concatenate([rows[1][0], draft[1, :, :1]], 1),
                np.concatenate([rows[1][1], draft[1, :, :1]], 1),
            ),
        ],
    )
    # the next append overwrites the rejected columns at each row's own end
    nxt = rand(rng, 2, H, 1, D)
    r2 = kv.append(r, mx.array(nxt), mx.array(nxt))
    assert r2.ends == (8, 5)
    np.testing.assert_array_equal(visible(r2)[1][0][:, -1], nxt[1, :, 0])


# --- rows: merge / filter / extract / extend -----------------------------------------


def test_merge_rows_left_pads_to_common_width(rng):
    a, ra = ragged(rng, [4], step=8)
    b, rb = ragged(rng, [9, 2], step=8)
    e = kv.empty(1, step=8)
    m = kv.merge_rows([a, e, b])
    assert m.batch_size == 4
    assert m.lengths == (4, 0, 9, 2)
    assert m.left_pad == (5, 9, 0, 7)
    assert m.ends == (9, 9, 9, 9) and m.capacity == 16
    assert_rows_equal(visible(m), ra + [None, *rb] if False else visible(m))
    got = visible(m)
    assert_rows_equal([got[0], got[2], got[3]], ra + rb)
    assert got[1][0].shape == (H, 0, D)
    # padding columns are zeros
    np.testing.assert_array_equal(np_of(kv.fetch(m)[0])[0, :, :5], 0)
    assert kv.merge_rows([a]) is a


def test_filter_rows_removes_shared_padding(rng):
    s, rows = ragged(rng, [3, 7, 5])
    assert s.left_pad == (4, 0, 2)
    f = kv.filter_rows(s, [2, 0])
    assert f.lengths == (5, 3) and f.left_pad == (0, 2) and f.width == 5
    assert_rows_equal(visible(f), [rows[2], rows[0]])
    # mlx-lm filter semantics: order as given, repeats allowed, mx.array indices
    f = kv.filter_rows(s, mx.array([0, 0]))
    assert f.lengths == (3, 3) and f.left_pad == (0, 0) and f.width == 3
    assert_rows_equal(visible(f), [rows[0], rows[0]])
    f = kv.filter_rows(s, [0, 1, 2])
    assert f.left_pad == s.left_pad
    assert_rows_equal(visible(f), rows)


def test_filter_rows_shared_padding_with_trimmed_rows(rng):
    # after per-row trims the ends differ; the shared padding is min(left_pad)
    s, rows = ragged(rng, [2, 6, 4])
    s = kv.trim(s, [0, 3, 1])
    f = kv.filter_rows(s, [0, 2])
    assert f.left_pad == (2, 0) and f.lengths == (2, 3) and f.ends == (4, 3)
    assert_rows_equal(visible(f), [rows[0], (rows[2][0][:, :3], rows[2][1][:, :3])])


def test_extract_row_is_compact(rng):
    s, rows = ragged(rng, [3, 7, 5], step=8)
    for i in range(3):
        r = kv.extract_row(s, i)
        assert r.batch_size == 1 and r.left_pad == (0,) and r.lengths == (len(rows[i][0][0]),)
        assert r.capacity == r.lengths[0] and r.aligned
        assert_rows_equal(visible(r), [rows[i]])


@pytest.mark.parametrize("eval_first", [True, False], ids=["evaluated", "lazy"])
def test_extract_row_does_not_pin_the_batch_buffer(eval_first):
    B, Hh, C, Dd = 8, 4, 2048, 64
    mx.eval(mx.zeros(1))
    gc.collect()
    mx.synchronize()  # (a GPU backend frees a buffer once its last reader is seen done)
    base = mx.get_active_memory()
    k = mx.random.normal((B, Hh, C, Dd))
    s = kv.from_arrays(k, k * 2, lengths=[C - 7] * B)
    del k
    mx.eval(*s.planes)
    batch_bytes = s.nbytes
    # (small arrays freed by earlier tests may leave the baseline by a few bytes)
    assert mx.get_active_memory() - base >= batch_bytes - 4096
    r = kv.extract_row(s, 3)
    if eval_first:
        mx.eval(*r.planes)
    del s  # lazy: the batch is dropped before the row is computed
    gc.collect()
    mx.eval(*r.planes)
    mx.synchronize()
    held = mx.get_active_memory() - base
    # what is left is the row (1/8 of the batch), not the batch buffer
    assert held < batch_bytes // 4, (held, batch_bytes)
    assert held >= r.nbytes - 4096
    # and the row is a fresh, independent copy: equal data
    assert r.lengths == (C - 7,)


def test_extend_is_merge_of_two(rng):
    a, _ = ragged(rng, [3, 1])
    b, _ = ragged(rng, [6])
    e, m = kv.extend(a, b), kv.merge_rows([a, b])
    assert e.lengths == m.lengths and e.left_pad == m.left_pad
    assert_rows_equal(visible(e), visible(m))


# --- attend --------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths,n,hq,window",
    [
        ([6, 6], 1, H, None),
        ([6, 6], 3, H, None),
        ([6, 2, 4], 2, 2 * H, None),
        ([7, 3], 1, H, 2),
        ([7, 5], 3, H, 3),
    ],
)
def test_attend_matches_numpy(rng, lengths, n, hq, window):
    s, rows = ragged(rng, lengths)
    q = rand(rng, len(lengths), hq, n, D)
    out = kv.attend(s, mx.array(q), scale=D**-0.5, window=window)
    want = ref_attend(rows, q, D**-0.5, window)
    assert out.shape == (len(lengths), hq, n, D)
    np.testing.assert_allclose(np_of(out), want, atol=1e-5)


# --- O(new tokens) appends -------------------------------------------------------


def _append_peak(state, steps, keep_old):
    k = mx.ones((state.batch_size, state.keys.shape[1], 1, state.keys.shape[3]))
    return append_peak(state, k, steps, keep_old)


@pytest.mark.parametrize("ragged_ends", [False, True], ids=["slice_update", "scatter"])
def test_append_is_in_place_when_the_old_record_is_dropped(ragged_ends):
    # capacity with room for the appends, so there is no growth in the loop
    B, Hh, C, Dd = 2, 4, 8192, 32
    keys = mx.random.normal((B, Hh, C, Dd))
    lengths = [C - 64, C - 70] if ragged_ends else [C - 64] * B
    s = kv.from_arrays(keys, keys + 1, lengths=lengths, step=256)
    del keys
    plane = s.keys.nbytes  # 8 MiB
    grew, after = _append_peak(s, 16, keep_old=False)
    assert after.lengths == tuple(n + 17 for n in lengths)
    # O(new tokens): far less than one plane copy (a copy would be >= 2 planes)
    assert grew < plane // 8, (grew, plane)
    # control: holding the old records forces a copy per append, so the measure can fail
    grew_held, _ = _append_peak(s, 2, keep_old=True)
    assert grew_held >= plane, (grew_held, plane)
