"""RotatingState: layout, errors, batched rows equal rows alone (keep included),
row moves before and after the ring wraps, trim/rollback bounds, masks.

The reference throughout is ``RefRing`` (``_ring.py``), a plain numpy list of
one row's entries; mlx-lm itself is compared in ``tests/parity/test_parity_rotating.py``.
"""

from __future__ import annotations

import gc

import attrs
import mlx.core as mx
import numpy as np
import pytest
from _ring import RefRing, positions_of, rand, rows_of
from _rows import assert_unchanged, same_buffer, snapshot
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvstate as kv
from kvstate.kinds.rotating import (
    advance,
    from_temporal,
    read,
    read_width,
    ring_mask,
    ring_writer,
    update_and_read,
)

H, HQ, D = 2, 4, 8
SCALE = D**-0.5


def tokens(p0, n, B=1):
    """Keys/values whose every element is the token's position (row b adds 1000*b)."""
    x = (
        mx.arange(p0, p0 + n, dtype=mx.float32)[None, None, :, None]
        + 1000 * mx.arange(B, dtype=mx.float32)[:, None, None, None]
    )
    x = mx.broadcast_to(x, (B, H, n, D))
    return x, x + 0.5


def assert_row(state, b, ref, q=None, window=None):
    got = rows_of(state)[b]
    want = ref.kv()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert positions_of(state)[b] == ref.positions
    assert state.lengths[b] == ref.length


# --- layout and construction ----------------------------------------------------------


def test_layout_picture_in_records():
    s = kv.rotating(max_size=8, keep=2)
    for p in range(16):
        s = kv.append(s, *tokens(p, 1))
    assert (s.lengths, s.held, s.starts, s.capacity) == ((16,), (8,), (10,), 8)
    assert np.array(s.keys)[0, 0, :, 0].tolist() == [0, 1, 14, 15, 10, 11, 12, 13]
    assert np.array(kv.fetch(s)[0])[0, 0, :, 0].tolist() == [0, 1, 10, 11, 12, 13, 14, 15]
    s = kv.append(s, *tokens(16, 1))  # next write: column 4, over position 10
    assert np.array(s.keys)[0, 0, :, 0].tolist() == [0, 1, 14, 15, 16, 11, 12, 13]


def test_block_append_holds_max_size_plus_n_minus_1_then_shrinks():
    s = kv.rotating(max_size=4, keep=1)
    s = kv.append(s, *tokens(0, 6))
    s = kv.append(s, *tokens(6, 5))
    assert s.held == (4 - 1 + 5,) and s.capacity == 8
    assert positions_of(s) == [[0, 4, 5, 6, 7, 8, 9, 10]]
    s = kv.append(s, *tokens(11, 1))
    assert s.held == (4,) and s.capacity == 4
    assert np.array(kv.fetch(s)[0])[0, 0, :, 0].tolist() == [0, 9, 10, 11]


def test_capacity_grows_in_steps_up_to_max_size():
    s = kv.rotating(2, max_size=10, step=4)
    caps = []
    for p in range(12):
        s = kv.append(s, *tokens(p, 1, B=2))
        caps.append(s.capacity)
    assert caps == [4, 4, 4, 4, 8, 8, 8, 8, 10, 10, 10, 10]


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(max_size=0), "max_size"),
        (dict(max_size=4, keep=4), "keep"),
        (dict(max_size=4, keep=-1), "keep"),
        (dict(max_size=4, step=0), "step"),
        (dict(max_size=4.0), "max_size"),
        (dict(batch_size=-1, max_size=4), "batch_size"),
    ],
)
def test_construction_errors_name_the_argument(kwargs, arg):
    with pytest.raises(kv.KVStateError, match=arg):
        kv.rotating(**kwargs)


def test_append_errors_change_nothing():
    s = kv.append(kv.rotating(2, max_size=4), *tokens(0, 3, B=2))
    before = snapshot(s)
    good = mx.zeros((2, H, 1, D))
    for k, v, arg in [
        (mx.zeros((2, H, 1)), mx.zeros((2, H, 1)), "k rank"),
        (mx.zeros((3, H, 1, D)), mx.zeros((3, H, 1, D)), "k batch size"),
        (mx.zeros((2, H + 1, 1, D)), mx.zeros((2, H + 1, 1, D)), "k heads"),
        (mx.zeros((2, H, 1, D + 1)), mx.zeros((2, H, 1, D)), "k head dim"),
        (good.astype(mx.float16), good.astype(mx.float16), "k dtype"),
        (good, mx.zeros((2, H, 2, D)), "v shape"),
        (mx.zeros((2, H, 0, D)), mx.zeros((2, H, 0, D)), "k tokens"),
    ]:
        with pytest.raises(kv.KVStateError, match=arg):
            kv.append(s, k, v)
    assert_unchanged(s, before)


def test_append_leaves_the_input_record_unchanged():
    s = kv.append(kv.rotating(max_size=3), *tokens(0, 3))
    seen = np.array(kv.fetch(s)[0])
    s2 = kv.append(s, *tokens(3, 1))
    mx.eval(s2.keys)
    np.testing.assert_array_equal(np.array(kv.fetch(s)[0]), seen)
    assert s.lengths == (3,) and s2.lengths == (4,)


def test_positions_are_tokens_seen():
    s = kv.append(kv.rotating(2, max_size=3), *tokens(0, 5, B=2))
    assert kv.positions(s) is None
    s = kv.trim(s, [0, 1])
    assert kv.positions(s).tolist() == [5, 4]


def test_fetch_and_attend_need_keys():
    s = kv.rotating(max_size=4)
    with pytest.raises(kv.KVStateError, match="append first"):
        kv.fetch(s)
    with pytest.raises(kv.KVStateError, match="append first"):
        kv.attend(s, mx.zeros((1, HQ, 1, D)), scale=1.0)


def test_attend_errors():
    s = kv.append(kv.rotating(max_size=4), *tokens(0, 2))
    for q, arg in [
        (mx.zeros((1, HQ, 3, D)), "q tokens"),
        (mx.zeros((1, 3, 1, D)), "q heads"),
        (mx.zeros((2, HQ, 1, D)), "q batch"),
        (mx.zeros((1, HQ, 1, 4)), "q head dim"),
        (mx.zeros((1, HQ, 1, D), mx.float16), "q dtype"),
    ]:
        with pytest.raises(kv.KVStateError, match=arg):
            kv.attend(s, q, scale=1.0)
    with pytest.raises(kv.KVStateError, match="window"):
        kv.attend(s, mx.zeros((1, HQ, 1, D)), scale=1.0, window=0)


# --- batched rows equal rows alone ----------------------------------------------------------


rings = st.sampled_from([(1, 0), (3, 0), (3, 1), (4, 2), (5, 0), (6, 3), (8, 1)])
sizes = st.lists(st.sampled_from([1, 1, 1, 2, 3, 6]), min_size=1, max_size=8)


def grow(state, ref, ns, rng):
    for n in ns:
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        state = kv.append(state, mx.array(k), mx.array(v))
        ref.append(k[0], v[0])
    return state


@given(
    ring=rings,
    prefixes=st.lists(sizes, min_size=2, max_size=4),
    after=sizes,
    window=st.sampled_from([None, 1, 2, 4, 9]),
    seed=st.integers(0, 2**16),
)
def test_batch_equals_each_row_alone(ring, prefixes, after, window, seed):
    """Rows of different histories, merged, then appended together: each row holds
    and attends exactly as the same row alone (``keep`` included, windows < max_size)."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    refs = [RefRing(max_size, keep) for _ in prefixes]
    solos = [
        grow(kv.rotating(max_size=max_size, keep=keep, step=2), r, p, rng)
        for r, p in zip(refs, prefixes)
    ]
    s = kv.merge_rows(solos)
    for n in after:
        k, v = rand(rng, len(refs), H, n, D), rand(rng, len(refs), H, n, D)
        q = rand(rng, len(refs), HQ, n, D)
        s = kv.append(s, mx.array(k), mx.array(v))
        got = np.array(kv.attend(s, mx.array(q), scale=SCALE, window=window))
        for b, r in enumerate(refs):
            r.append(k[b], v[b])
            solos[b] = kv.append(solos[b], mx.array(k[b : b + 1]), mx.array(v[b : b + 1]))
            alone = np.array(
                kv.attend(solos[b], mx.array(q[b : b + 1]), scale=SCALE, window=window)
            )
            np.testing.assert_allclose(got[b], alone[0], atol=2e-5)
            np.testing.assert_allclose(got[b], r.attend(q[b], SCALE, window), atol=2e-5)
            assert_row(s, b, r)


@given(
    ring=rings,
    prefixes=st.lists(sizes, min_size=2, max_size=4),
    rows=st.data(),
    seed=st.integers(0, 2**16),
)
def test_merge_filter_extract_before_and_after_wrap(ring, prefixes, rows, seed):
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    refs = [RefRing(max_size, keep) for _ in prefixes]
    solos = [
        grow(kv.rotating(max_size=max_size, keep=keep), r, p, rng) for r, p in zip(refs, prefixes)
    ]
    s = kv.merge_rows(solos)
    for b, r in enumerate(refs):
        assert_row(s, b, r)
        e = kv.extract_row(s, b)
        assert e.batch_size == 1 and e.capacity == r.kv()[0].shape[1]
        assert_row(e, 0, r)
    pick = rows.draw(st.lists(st.integers(0, len(refs) - 1), min_size=1, max_size=5))
    f = kv.filter_rows(s, pick)
    for i, b in enumerate(pick):
        assert_row(f, i, refs[b])
    # extend = merge of two batches; then one more append agrees with the refs
    both = kv.extend(f, s)
    order = [refs[b] for b in pick] + refs
    k = rand(rng, len(order), H, 1, D)
    both = kv.append(both, mx.array(k), mx.array(k))
    for i, r in enumerate(order):
        c = RefRing(max_size, keep)
        c.entries, c.length = list(r.entries), r.length
        c.append(k[i], k[i])
        assert_row(both, i, c)


def test_merge_errors():
    a = kv.append(kv.rotating(max_size=4), *tokens(0, 2))
    for other, arg in [
        (kv.append(kv.rotating(max_size=5), *tokens(0, 2)), "max_size"),
        (kv.append(kv.rotating(max_size=4, keep=1), *tokens(0, 2)), "keep"),
        (kv.append(kv.empty(), *tokens(0, 2)), "RotatingState"),
        (
            kv.append(kv.rotating(max_size=4), tokens(0, 2)[0][:, :1], tokens(0, 2)[1][:, :1]),
            "geometry",
        ),
    ]:
        with pytest.raises(kv.KVStateError, match=arg):
            kv.merge_rows([a, other])


def test_merge_with_empty_rows_and_filter_errors():
    a = kv.append(kv.rotating(max_size=3), *tokens(0, 5))
    m = kv.merge_rows([kv.rotating(2, max_size=3), a])
    assert m.lengths == (0, 0, 5) and m.held == (0, 0, 5)  # a first block holds all of it
    m = kv.append(m, *tokens(0, 1, B=3))
    assert positions_of(m) == [[0], [0], [3, 4, 0 + 5]]
    for rows, arg in [([3], r"rows\[0\]"), (0, "rows")]:  # [] is legal: no rows
        with pytest.raises(kv.KVStateError, match=arg):
            kv.filter_rows(m, rows)
    with pytest.raises(kv.KVStateError, match="row"):
        kv.extract_row(m, -1)


@pytest.mark.parametrize("wrapped", [False, True])
def test_extract_row_does_not_pin_the_batch_buffer(wrapped):
    B, C = 8, 1024
    mx.eval(mx.zeros(1))
    gc.collect()
    base = mx.get_active_memory()
    s = kv.rotating(B, max_size=C, keep=4)
    n = C + 100 if wrapped else C - 1  # then one more: wrapped rows gather, full ones slice
    s = kv.append(s, mx.random.normal((B, H, n, 64)), mx.random.normal((B, H, n, 64)))
    s = kv.append(s, mx.random.normal((B, H, 1, 64)), mx.random.normal((B, H, 1, 64)))
    assert (s.lengths[0] > s.capacity) == wrapped
    mx.eval(*s.planes)
    batch_bytes = s.nbytes
    r = kv.extract_row(s, 3)
    mx.eval(*r.planes)
    want = np.array(kv.fetch(s)[0][3])
    del s
    gc.collect()
    assert mx.get_active_memory() - base < batch_bytes // 4
    assert r.capacity == r.held[0] == C
    np.testing.assert_array_equal(np.array(kv.fetch(r)[0][0]), want)


# --- trim, checkpoint, rollback -------------------------------------------------------------


def test_trim_within_the_ring_and_errors_beyond():
    s = kv.rotating(max_size=4, keep=1)
    for p in range(10):
        s = kv.append(s, *tokens(p, 1))
    assert positions_of(s) == [[0, 7, 8, 9]]
    # The next append reads max_size - 1 entries: the ring can give back one token.
    t = kv.trim(s, 1)
    assert positions_of(t) == [[0, 7, 8]]
    with pytest.raises(kv.KVStateError, match=r"lengths - n for row 0: expected >= 9"):
        kv.trim(s, 2)
    # Back into the kept prefix is exact too.
    assert positions_of(kv.trim(s, 9)) == [[0]] and kv.trim(s, 10).held == (0,)
    with pytest.raises(kv.KVStateError, match="tokens the row has seen"):
        kv.trim(s, 11)
    assert positions_of(s) == [[0, 7, 8, 9]]  # failed calls changed nothing
    # A block first drops the ring to max_size - 1, then holds all N: all N can be
    # given back (what a row that never saw the block reads next).
    b = kv.append(s, *tokens(10, 5))
    assert positions_of(kv.trim(b, 5)) == [[0, 8, 9]]
    with pytest.raises(kv.KVStateError):
        kv.trim(b, 6)


def test_rollback_per_row_and_checkpoint_holds_no_arrays():
    s = kv.merge_rows([kv.append(kv.rotating(max_size=5, keep=1), *tokens(0, n)) for n in (2, 9)])
    cp = kv.checkpoint(s)
    assert not any(isinstance(getattr(cp, f.name), mx.array) for f in attrs.fields(type(cp)))
    assert cp.lengths == (2, 9)
    draft = kv.append(s, *tokens(100, 3, B=2))
    r = kv.rollback(draft, cp, [1, 2])
    assert r.lengths == (3, 11)
    assert positions_of(r) == [[0, 1, 2], [0, 6, 7, 8, 9, 10]]
    with pytest.raises(kv.KVStateError, match="checkpoint \\+ keep for row 1"):
        kv.rollback(draft, cp, [0, 4])
    with pytest.raises(kv.KVStateError, match="checkpoint batch size"):
        kv.rollback(draft, kv.checkpoint(kv.rotating(max_size=5)), 0)
    with pytest.raises(kv.KVStateError, match="checkpoint"):
        kv.rollback(draft, (2, 9), 0)


@given(ring=rings, ns=sizes, cut=st.integers(0, 9), after=sizes, seed=st.integers(0, 2**16))
def test_trim_then_append_equals_the_row_that_never_saw_the_tokens(ring, ns, cut, after, seed):
    """Where a trim is allowed, every later read equals a row that never got the
    trimmed tokens; where it is refused the ring no longer holds what that needs."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    ref = RefRing(max_size, keep)
    s = grow(kv.rotating(max_size=max_size, keep=keep), ref, ns, rng)
    cut = min(cut, s.lengths[0])
    t = s.lengths[0] - cut
    if not ref.can_trim_to(t):
        with pytest.raises(kv.KVStateError):
            kv.trim(s, cut)
        return
    s = kv.trim(s, cut)
    ref.trim_to(t)
    for n in after:
        k, v, q = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D), rand(rng, 1, HQ, n, D)
        s = kv.append(s, mx.array(k), mx.array(v))
        ref.append(k[0], v[0])
        assert_row(s, 0, ref)
        np.testing.assert_allclose(
            np.array(kv.attend(s, mx.array(q), scale=SCALE))[0], ref.attend(q[0], SCALE), atol=2e-5
        )


# --- masks -------------------------------------------------------------------------------------


def np_block_mask(max_size, offset, n, stored):
    m = np.zeros(stored + n, bool)
    valid = min(offset, stored)
    m[max(0, valid - (max_size - 1)) : valid] = True
    m[stored:] = True
    return m


@given(
    max_size=st.integers(1, 9),
    offset=st.integers(0, 20),
    n=st.integers(0, 5),
    stored=st.integers(0, 12),
)
def test_rotating_block_mask_values(max_size, offset, n, stored):
    memo = kv.MaskMemo()
    with kv.rotating_block_mask(memo, max_size, offset, n, stored) as lease:
        assert lease.mask.shape == (1, 1, 1, stored + n) and lease.mask.dtype == mx.bool_
        np.testing.assert_array_equal(
            np.array(lease.mask)[0, 0, 0], np_block_mask(max_size, offset, n, stored)
        )
    assert memo.live == 0


def test_rotating_block_mask_memo_and_errors():
    memo = kv.MaskMemo()
    a = kv.rotating_block_mask(memo, 4, 10, 2, 4)
    b = kv.rotating_block_mask(memo, 4, 10, 2, 4)
    assert memo.builds == 1 and same_buffer(a.mask, b.mask)
    c = kv.rotating_block_mask(memo, 4, 11, 2, 4)  # replaces the family's slot
    assert memo.builds == 2 and not same_buffer(a.mask, c.mask) and memo.live == 3
    for lease in (a, b, c):
        lease.release()
    for args, arg in [
        ((0, 1, 1, 1), "max_size"),
        ((4, -1, 1, 1), "offset"),
        ((4, 1, -1, 1), "n"),
        ((4, 1, 1, 1.5), "stored"),
    ]:
        with pytest.raises(kv.KVStateError, match=arg):
            kv.rotating_block_mask(memo, *args)
    with pytest.raises(kv.KVStateError, match="memo"):
        kv.rotating_block_mask(None, 4, 1, 1, 1)


def test_masks_need_no_array_in_the_common_cases():
    memo = kv.MaskMemo()
    s = kv.rotating(2, max_size=4)
    assert kv.next_mask(s, 3, memo=memo) == ("causal", None)  # prefill
    s = kv.append(s, *tokens(0, 3, B=2))
    assert kv.next_mask(s, 1, memo=memo) == (None, None)  # decode, ring filling
    for p in range(3, 9):
        s = kv.append(s, *tokens(p, 1, B=2))
        assert kv.next_mask(s, 1, memo=memo) == (None, None)  # decode, ring full
    mask, lease = kv.next_mask(s, 2, memo=memo)  # a block after the wrap
    assert mask.shape == (2, 1, 2, 5) and memo.builds == 1
    again, lease2 = kv.next_mask(s, 2, memo=memo)  # another layer: same array
    assert same_buffer(again, mask) and memo.builds == 1
    lease.release(), lease2.release()
    assert memo.live == 0


@given(
    ring=rings,
    prefixes=st.lists(sizes, min_size=1, max_size=3),
    n=st.integers(1, 4),
    window=st.sampled_from([None, 1, 2, 3, 7]),
    seed=st.integers(0, 2**16),
)
def test_next_mask_is_the_mask_attend_uses(ring, prefixes, n, window, seed):
    """``next_mask`` before an append + ``update_and_read`` after = ``attend``."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    s = kv.merge_rows(
        [
            grow(kv.rotating(max_size=max_size, keep=keep), RefRing(max_size, keep), p, rng)
            for p in prefixes
        ]
    )
    B = s.batch_size
    mask, held = kv.next_mask(s, n, window=window)
    s, keys, values = update_and_read(
        s, mx.array(rand(rng, B, H, n, D)), mx.array(rand(rng, B, H, n, D))
    )
    assert keys.shape[2] == read_width(s) and read(s)[0] is keys or keys.shape == read(s)[0].shape
    q = mx.array(rand(rng, B, HQ, n, D))
    got = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask=mask)
    want = kv.attend(s, q, scale=SCALE, window=window)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    if held is not None:
        assert mask.shape == (B, 1, n, keys.shape[2])
        held.release()


def test_ring_mask_takes_arrays_and_compiles_once():
    """Positions as arrays: the same function builds the mask inside ``mx.compile``."""
    traces = []

    def f(lengths, held):
        traces.append(1)
        return ring_mask(1, lengths, held, keep=2, capacity=8, width=8, window=5)

    cf = mx.compile(f)
    for lengths, held in [((9, 3), (8, 3)), ((12, 4), (8, 4)), ((30, 8), (8, 8))]:
        got = cf(mx.array(lengths, dtype=mx.int32), mx.array(held, dtype=mx.int32))
        want = ring_mask(1, lengths, held, keep=2, capacity=8, width=8, window=5)
        np.testing.assert_array_equal(np.array(got), np.array(want))
    assert len(traces) == 1


# --- from_temporal ----------------------------------------------------------------------------


@given(ring=rings, prefixes=st.lists(sizes, min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_from_temporal_rebuilds_what_fetch_shows(ring, prefixes, seed):
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    refs = [RefRing(max_size, keep) for _ in prefixes]
    s = kv.merge_rows(
        [grow(kv.rotating(max_size=max_size, keep=keep), r, p, rng) for r, p in zip(refs, prefixes)]
    )
    k, v = kv.fetch(s)
    r = from_temporal(k, v, lengths=s.lengths, held=s.held, max_size=max_size, keep=keep)
    for b, ref in enumerate(refs):
        assert_row(r, b, ref)
    k1 = mx.array(rand(rng, s.batch_size, H, 1, D))
    a, b_ = kv.append(s, k1, k1), kv.append(r, k1, k1)
    for x, y in zip(rows_of(a), rows_of(b_)):
        np.testing.assert_array_equal(x[0], y[0])


def test_from_temporal_errors():
    k = mx.zeros((1, H, 4, D))
    with pytest.raises(kv.KVStateError, match=r"held\[0\]"):
        from_temporal(k, k, lengths=3, max_size=8)
    with pytest.raises(kv.KVStateError, match=r"held\[0\]"):
        from_temporal(k, k, lengths=9, held=1, max_size=8, keep=2)
    with pytest.raises(kv.KVStateError, match="keep"):
        from_temporal(k, k, lengths=9, max_size=4, keep=4)


# --- a state machine against the numpy rows -------------------------------------------------


class RingMachine(RuleBasedStateMachine):
    """Random appends, trims, rollbacks, filters, merges and extracts on a batch of
    rings, checked after every step against one ``RefRing`` per row."""

    @initialize(ring=rings, B=st.integers(1, 3), seed=st.integers(0, 2**16))
    def start(self, ring, B, seed):
        self.max_size, self.keep = ring
        self.rng = np.random.default_rng(seed)
        self.s = kv.rotating(B, max_size=self.max_size, keep=self.keep, step=3)
        self.refs = [RefRing(*ring) for _ in range(B)]
        self.cp = None

    def _ref_copy(self, r):
        c = RefRing(self.max_size, self.keep)
        c.entries, c.length = list(r.entries), r.length
        return c

    @rule(n=st.sampled_from([1, 1, 1, 2, 4, 7]), window=st.sampled_from([None, 2, 5]))
    def append(self, n, window):
        B = self.s.batch_size
        k, v, q = (rand(self.rng, B, h, n, D) for h in (H, H, HQ))
        self.s = kv.append(self.s, mx.array(k), mx.array(v))
        got = np.array(kv.attend(self.s, mx.array(q), scale=SCALE, window=window))
        for b, r in enumerate(self.refs):
            r.append(k[b], v[b])
            np.testing.assert_allclose(got[b], r.attend(q[b], SCALE, window), atol=2e-5)

    @rule(cuts=st.lists(st.integers(0, 8), min_size=4, max_size=4))
    def trim(self, cuts):
        cuts = [min(c, r.length) for c, r in zip(cuts, self.refs)]
        ok = all(r.can_trim_to(r.length - c) for c, r in zip(cuts, self.refs))
        note(f"trim {cuts} ok={ok}")
        if not ok:
            before = (self.s.lengths, self.s.held)
            with pytest.raises(kv.KVStateError):
                kv.trim(self.s, cuts)
            assert (self.s.lengths, self.s.held) == before
            return
        self.s = kv.trim(self.s, cuts)
        for c, r in zip(cuts, self.refs):
            r.trim_to(r.length - c)

    @rule()
    def checkpoint(self):
        self.cp = kv.checkpoint(self.s)

    @rule(accept=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def rollback(self, accept):
        if self.cp is None or self.cp.batch_size != self.s.batch_size:
            return
        targets = [min(c + a, r.length) for c, a, r in zip(self.cp.lengths, accept, self.refs)]
        accept = [t - c for t, c in zip(targets, self.cp.lengths)]
        if any(t < c for t, c in zip(targets, self.cp.lengths)):
            return
        if not all(r.can_trim_to(t) for t, r in zip(targets, self.refs)):
            with pytest.raises(kv.KVStateError):
                kv.rollback(self.s, self.cp, accept)
            return
        self.s = kv.rollback(self.s, self.cp, accept)
        for t, r in zip(targets, self.refs):
            r.trim_to(t)

    @rule(data=st.data())
    def filter(self, data):
        rows = data.draw(st.lists(st.integers(0, self.s.batch_size - 1), min_size=1, max_size=3))
        self.s = kv.filter_rows(self.s, rows)
        self.refs = [self._ref_copy(self.refs[b]) for b in rows]
        self.cp = None

    @rule(ns=sizes)
    def extend_with_a_new_row(self, ns):
        if self.s.batch_size >= 4:
            return
        r = RefRing(self.max_size, self.keep)
        one = grow(kv.rotating(max_size=self.max_size, keep=self.keep), r, ns, self.rng)
        self.s = kv.extend(self.s, one)
        self.refs.append(r)
        self.cp = None

    @rule(data=st.data())
    def extract(self, data):
        b = data.draw(st.integers(0, self.s.batch_size - 1))
        if self.refs[b].entries:  # a trimmed ring row can hold a length but no entry
            assert_row(kv.extract_row(self.s, b), 0, self.refs[b])

    @invariant()
    def rows_match(self):
        if not hasattr(self, "s"):
            return
        assert self.s.batch_size == len(self.refs)
        for b, r in enumerate(self.refs):
            assert self.s.lengths[b] == r.length and self.s.held[b] == len(r.entries)
            assert positions_of(self.s)[b] == r.positions
        if self.s.keys is not None and self.s.width:
            for b, r in enumerate(self.refs):
                if r.entries:
                    assert_row(self.s, b, r)


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


@given(
    ring=rings,
    prefixes=st.lists(sizes, min_size=1, max_size=3),
    n=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_array_bookkeeping_and_write_equal_append(ring, prefixes, n, seed):
    """``advance`` + ``ring_writer`` (positions as arrays, for compiled steps) = ``append``."""
    max_size, keep = ring
    rng = np.random.default_rng(seed)
    s = kv.merge_rows(
        [
            grow(kv.rotating(max_size=max_size, keep=keep), RefRing(max_size, keep), p, rng)
            for p in prefixes
        ]
    )
    k = mx.array(rand(rng, s.batch_size, H, n, D))
    want = kv.append(s, k, k)
    lengths = mx.array(s.lengths, dtype=mx.int32)
    ln, hd = advance(lengths, mx.array(s.held, dtype=mx.int32), n, max_size=max_size, keep=keep)
    assert ln.tolist() == list(want.lengths) and hd.tolist() == list(want.held)
    if want.capacity == s.capacity:

        def write(p, x, ln):
            return ring_writer(ln, n, keep=keep, capacity=s.capacity)(p, x)

        got = mx.compile(write)(s.keys, k, lengths)
        np.testing.assert_array_equal(np.array(got), np.array(want.keys))


def test_row_moves_after_wrap_deterministic():
    """Rows that wrapped (single steps and a block), one that has not, one mid-block:
    merge, filter, extract and the next append all agree with the reference."""
    rng = np.random.default_rng(7)
    plans = [[1] * 13, [5, 1, 1, 1, 1, 1, 1, 1, 1], [2, 1], [6, 4]]  # max_size 5, keep 2
    refs = [RefRing(5, 2) for _ in plans]
    solos = [grow(kv.rotating(max_size=5, keep=2, step=2), r, p, rng) for r, p in zip(refs, plans)]
    assert [s.lengths[0] > s.capacity for s in solos] == [True, True, False, True]
    s = kv.merge_rows(solos)
    for b, r in enumerate(refs):
        assert_row(s, b, r)
        assert_row(kv.extract_row(s, b), 0, r)
    f = kv.filter_rows(s, [3, 0, 0])
    for i, b in enumerate([3, 0, 0]):
        assert_row(f, i, refs[b])
    k = rand(rng, 3, H, 1, D)
    f = kv.append(f, mx.array(k), mx.array(k))
    for i, b in enumerate([3, 0, 0]):
        c = RefRing(5, 2)
        c.entries, c.length = list(refs[b].entries), refs[b].length
        c.append(k[i], k[i])
        assert_row(f, i, c)
