"""MaskKey, MaskMemo, MaskLease and the mask builders (kvstate.core.masks)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _rows import np_of, np_rows_mask, rand
from hypothesis import given
from hypothesis import strategies as st

import kvstate as kv
from kvstate.core import ops
from kvstate.core.masks import rows_mask


def counting_build(value="m"):
    calls = []

    def build():
        calls.append(1)
        return f"{value}{len(calls)}"

    return build, calls


# --- MaskKey ----------------------------------------------------------------------


def test_mask_key_equality_and_hash():
    a = mx.array([True, False])
    b = mx.array([True, False])  # equal values, another object
    k1 = kv.MaskKey("enc", (2,), a)
    assert k1 == kv.MaskKey("enc", (2,), a)
    assert hash(k1) == hash(kv.MaskKey("enc", (2,), a))
    assert k1 != kv.MaskKey("enc", (2,), b)  # source compared by identity
    assert k1 != kv.MaskKey("enc", (3,), a)
    assert k1 != kv.MaskKey("other", (2,), a)
    assert kv.MaskKey("rows", (1, (0,), (3,), None)) == kv.MaskKey("rows", (1, (0,), (3,), None))
    assert kv.MaskKey("rows") != "rows"
    d = {k1: 1, kv.MaskKey("enc", (2,), b): 2}
    assert d[kv.MaskKey("enc", (2,), a)] == 1 and len(d) == 2
    with pytest.raises(AttributeError):
        k1.family = "x"  # frozen


# --- MaskMemo and leases ------------------------------------------------------------


def test_build_runs_once_per_key():
    memo = kv.MaskMemo()
    build, calls = counting_build()
    key = kv.MaskKey("rows", (1,))
    leases = [memo.mask_for(kv.MaskKey("rows", (1,)), build) for _ in range(5)]
    assert len(calls) == 1 and memo.builds == 1 and memo.live == 5
    assert all(ls.mask == "m1" for ls in leases) and all(ls.key == key for ls in leases)
    for ls in leases:
        ls.release()
    assert memo.live == 0
    # still memoized after every lease is released
    with memo.mask_for(key, build) as ls:
        assert ls.mask == "m1"
    assert len(calls) == 1


def test_one_slot_per_family():
    memo = kv.MaskMemo()
    full, full_calls = counting_build("full")
    slide, slide_calls = counting_build("slide")
    f1 = memo.mask_for(kv.MaskKey("rows", (1,)), full)
    s1 = memo.mask_for(kv.MaskKey("rows-window", (1,)), slide)
    # another family never evicts: both still memoized
    memo.mask_for(kv.MaskKey("rows", (1,)), full).release()
    memo.mask_for(kv.MaskKey("rows-window", (1,)), slide).release()
    assert memo.builds == 2 and len(full_calls) == len(slide_calls) == 1
    # a new key in a family replaces the old mask; the old lease stays valid
    f2 = memo.mask_for(kv.MaskKey("rows", (2,)), full)
    assert f2.mask == "full2" and f1.mask == "full1" and s1.mask == "slide1"
    assert memo.builds == 3
    # the replaced key builds again when asked for
    f3 = memo.mask_for(kv.MaskKey("rows", (1,)), full)
    assert f3.mask == "full3" and memo.builds == 4
    assert memo.live == 4
    for ls in (f1, s1, f2, f3):
        ls.release()
    assert memo.live == 0


def test_clear_keeps_leased_masks_valid():
    memo = kv.MaskMemo()
    build, calls = counting_build()
    held = memo.mask_for(kv.MaskKey("rows", (1,)), build)
    memo.clear()
    assert held.mask == "m1" and memo.live == 1
    again = memo.mask_for(kv.MaskKey("rows", (1,)), build)
    assert again.mask == "m2" and memo.builds == 2  # the memo's own hold was dropped
    held.release()
    again.release()
    assert memo.live == 0


MIB = 1 << 20


def _active() -> int:
    mx.synchronize()
    return mx.get_active_memory()


def test_last_release_frees_the_mask():
    """Once the last lease is released and the memo has let go (``clear``, or
    a new key in the family), nothing in kvstate holds the mask: active
    memory returns to the baseline though every lease object is still alive.
    The control holds one lease and sees the memory stay."""
    L = 4096  # a [1, 1, L, L] bool mask: 16 MiB
    bidirectional = mx.zeros((L,), mx.bool_)
    mx.eval(bidirectional)
    memo = kv.MaskMemo()
    base = _active()
    first = kv.encoder_window_mask(memo, L, bidirectional)
    mx.eval(first.mask)
    assert _active() - base >= 15 * MIB
    second = kv.encoder_window_mask(memo, L, bidirectional)  # the same mask, no build
    assert memo.builds == 1
    first.release()
    memo.clear()
    assert _active() - base >= 15 * MIB  # control: the second lease still holds it
    second.release()
    assert _active() - base < MIB  # freed, while first and second are still referenced
    assert first.key == second.key  # a released lease still names its key

    # A new key in the family replaces the slot: the old mask goes with its last lease.
    held = kv.encoder_window_mask(memo, L, bidirectional)
    mx.eval(held.mask)
    other = mx.ones((L,), mx.bool_)
    replaced = kv.encoder_window_mask(memo, L, other)
    mx.eval(replaced.mask)
    assert _active() - base >= 31 * MIB  # two masks: one in the slot, one leased
    held.release()
    assert _active() - base < 17 * MIB
    replaced.release()
    memo.clear()
    assert _active() - base < 2 * MIB


def test_lease_release_exactly_once_and_context_manager():
    memo = kv.MaskMemo()
    lease = memo.mask_for(kv.MaskKey("f"), lambda: None)
    assert lease.mask is None and not lease.released
    lease.release()
    assert lease.released and memo.live == 0
    with pytest.raises(kv.LeaseError):
        lease.release()
    with pytest.raises(kv.LeaseError):
        _ = lease.mask
    assert memo.live == 0
    with memo.mask_for(kv.MaskKey("f"), lambda: None) as ls:
        assert memo.live == 1 and ls.mask is None
    assert memo.live == 0 and ls.released
    with pytest.raises(RuntimeError):
        with memo.mask_for(kv.MaskKey("f"), lambda: None):
            assert memo.live == 1
            raise RuntimeError("released on the way out")
    assert memo.live == 0
    with memo.mask_for(kv.MaskKey("f"), lambda: None) as ls:
        ls.release()  # an explicit release inside the block is not repeated on exit
    assert memo.live == 0


def test_memos_are_independent():
    a, b = kv.MaskMemo(), kv.MaskMemo()
    a.mask_for(kv.MaskKey("rows", (1,)), lambda: "x").release()
    assert a.builds == 1 and b.builds == 0 and b.live == 0


# --- masks chosen by attend ------------------------------------------------------------


def aligned_state(rng, B=2, L=5):
    k = mx.array(rand(rng, B, 2, L, 4))
    return kv.from_arrays(k, k)


def test_aligned_rows_build_no_array():
    rng = np.random.default_rng(0)
    s = aligned_state(rng)
    assert s.aligned
    memo = kv.MaskMemo()
    for n, want in ((1, None), (3, "causal")):
        mask, held = ops.next_mask(kv.trim(s, n), n, memo=memo)
        assert mask == want and held is None
        out = kv.attend(s, mx.array(rand(rng, 2, 2, n, 4)), scale=0.5, memo=memo)
        assert out.shape == (2, 2, n, 4)
    assert memo.builds == 0 and memo.live == 0


def test_unaligned_rows_lease_one_array():
    rng = np.random.default_rng(1)
    s = kv.trim(aligned_state(rng), [1, 0])
    memo = kv.MaskMemo()
    mask, held = ops.next_mask(kv.trim(s, 2), 2, memo=memo)
    assert isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape == (2, 1, 2, 5)
    assert memo.builds == 1 and memo.live == 1
    held.release()
    for _ in range(3):
        kv.attend(s, mx.array(rand(rng, 2, 2, 2, 4)), scale=0.5, memo=memo)
    assert memo.builds == 1 and memo.live == 0  # same key as next_mask's: no rebuild
    kv.attend(s, mx.array(rand(rng, 2, 2, 2, 4)), scale=0.5, memo=memo, window=2)
    kv.attend(s, mx.array(rand(rng, 2, 2, 2, 4)), scale=0.5, memo=memo, window=2)
    assert memo.builds == 2


# --- builders against numpy -------------------------------------------------------------


@given(st.data())
def test_rows_mask_matches_formula(data):
    B = data.draw(st.integers(1, 3))
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    left_pad = data.draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    ends = [p + n for p, n in zip(left_pad, lengths)]
    n = data.draw(st.integers(1, min(lengths)))
    window = data.draw(st.sampled_from([None, 1, 2, 4]))
    width = max(ends)
    got = rows_mask(n, left_pad, ends, width, window)
    np.testing.assert_array_equal(np_of(got), np_rows_mask(n, left_pad, ends, width, window))
    # and from int32 arrays (as inside compiled code)
    got = rows_mask(n, mx.array(left_pad, mx.int32), mx.array(ends, mx.int32), width, window)
    np.testing.assert_array_equal(np_of(got), np_rows_mask(n, left_pad, ends, width, window))


@given(st.data())
def test_rows_mask_decode_of_rows_ending_together(data):
    # The decode step of merged (left-padded) rows: one query, every row
    # ending at the same column. The builder takes a shorter path there
    # (padding alone is hidden); past the shared end it must not.
    B = data.draw(st.integers(1, 4))
    end = data.draw(st.integers(1, 9))
    left_pad = data.draw(st.lists(st.integers(0, end - 1), min_size=B, max_size=B))
    ends = [end] * B
    for width in (end, end + data.draw(st.integers(1, 3))):
        got = rows_mask(1, left_pad, ends, width)
        np.testing.assert_array_equal(np_of(got), np_rows_mask(1, left_pad, ends, width))


@given(st.integers(1, 9), st.data())
def test_encoder_window_mask_matches_numpy(L, data):
    bidi = np.array(data.draw(st.lists(st.booleans(), min_size=L, max_size=L)))
    source = mx.array(bidi)
    memo = kv.MaskMemo()
    with kv.encoder_window_mask(memo, L, source) as lease:
        got = np_of(lease.mask)
    i = np.arange(L)
    want = (i[:, None] >= i[None, :]) | (bidi[:, None] & bidi[None, :])
    assert got.shape == (1, 1, L, L) and got.dtype == np.bool_
    np.testing.assert_array_equal(got[0, 0], want)
    # keyed by the caller's array identity
    kv.encoder_window_mask(memo, L, source).release()
    assert memo.builds == 1
    kv.encoder_window_mask(memo, L, mx.array(bidi)).release()
    assert memo.builds == 2
