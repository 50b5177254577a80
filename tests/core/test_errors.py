"""Bad input: one test per error class of CONTRACT section 5.

Each raises ``kv.KVStateError`` (a ``ValueError``) whose message names the
argument, the expected and the actual value, and leaves every input record
exactly as it was (same lengths, padding, step, and arrays by value).
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from _rows import assert_unchanged, rand, snapshot

import kvstate as kv

H, D = 2, 4


@pytest.fixture
def state():
    """Two rows, ragged (left_pad (0, 2)), float32, H=2, D=4."""
    rng = np.random.default_rng(3)
    a = kv.append(
        kv.empty(1, step=8), mx.array(rand(rng, 1, H, 5, D)), mx.array(rand(rng, 1, H, 5, D))
    )
    b = kv.append(
        kv.empty(1, step=8), mx.array(rand(rng, 1, H, 3, D)), mx.array(rand(rng, 1, H, 3, D))
    )
    return kv.merge_rows([a, b])


def z(*shape, dtype=mx.float32):
    return mx.zeros(shape, dtype)


def refused(call, states, *fragments):
    """``call()`` raises KVStateError naming ``fragments``; ``states`` are unchanged."""
    snaps = [snapshot(s) for s in states]
    with pytest.raises(kv.KVStateError) as info:
        call()
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert re.search(r": expected .+, got .+", msg), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    for s, snap in zip(states, snaps):
        assert_unchanged(s, snap)
    return msg


# --- wrong rank ---------------------------------------------------------------


def test_wrong_rank(state):
    refused(lambda: kv.append(state, z(2, H, D), z(2, H, D)), [state], "k rank", "4", "3")
    refused(lambda: kv.attend(state, z(2, H, D), scale=1.0), [state], "q rank", "4", "3")
    refused(lambda: kv.from_arrays(z(1, 2, 3), z(1, 2, 3)), [], "keys rank", "4", "3")


# --- batch size -------------------------------------------------------------------


def test_wrong_batch_size(state):
    refused(
        lambda: kv.append(state, z(3, H, 1, D), z(3, H, 1, D)),
        [state],
        "k batch size",
        "expected 2",
        "got 3",
    )
    refused(
        lambda: kv.attend(state, z(1, H, 1, D), scale=1.0),
        [state],
        "q batch size",
        "expected 2",
        "got 1",
    )
    refused(lambda: kv.trim(state, [1, 1, 1]), [state], "n", "2 values", "3 values")
    refused(
        lambda: kv.rollback(state, kv.checkpoint(kv.empty(3)), 0),
        [state],
        "checkpoint batch size",
        "expected 2",
        "got 3",
    )
    refused(lambda: kv.empty(-1), [], "batch_size", ">= 0", "-1")  # 0 rows is legal


# --- head count -------------------------------------------------------------------


def test_wrong_head_count(state):
    refused(
        lambda: kv.append(state, z(2, 3, 1, D), z(2, 3, 1, D)),
        [state],
        "k heads",
        "expected 2",
        "got 3",
    )
    refused(
        lambda: kv.attend(state, z(2, 3, 1, D), scale=1.0),
        [state],
        "q heads",
        "multiple of 2",
        "got 3",
    )
    refused(
        lambda: kv.append(state, z(2, H, 1, D), z(2, 1, 1, D)),
        [state],
        "v shape[:3]",
        "[2, 2, 1]",
        "[2, 1, 1]",
    )


# --- head dim ---------------------------------------------------------------------


def test_wrong_head_dim(state):
    refused(
        lambda: kv.append(state, z(2, H, 1, 8), z(2, H, 1, D)),
        [state],
        "k head dim",
        "expected 4",
        "got 8",
    )
    refused(
        lambda: kv.append(state, z(2, H, 1, D), z(2, H, 1, 6)),
        [state],
        "v head dim",
        "expected 4",
        "got 6",
    )
    refused(
        lambda: kv.attend(state, z(2, H, 1, 8), scale=1.0),
        [state],
        "q head dim",
        "expected 4",
        "got 8",
    )


# --- dtype ------------------------------------------------------------------------


def test_dtype_mismatch(state):
    f16 = mx.float16
    refused(
        lambda: kv.append(state, z(2, H, 1, D, dtype=f16), z(2, H, 1, D, dtype=f16)),
        [state],
        "k dtype",
        "float32",
        "float16",
    )
    refused(
        lambda: kv.append(state, z(2, H, 1, D), z(2, H, 1, D, dtype=f16)),
        [state],
        "v dtype",
        "float32",
        "float16",
    )
    refused(
        lambda: kv.attend(state, z(2, H, 1, D, dtype=f16), scale=1.0),
        [state],
        "q dtype",
        "float32",
        "float16",
    )


# --- trim / rollback past what a row holds -----------------------------------------------


def test_trim_past_a_row(state):
    refused(lambda: kv.trim(state, 4), [state], "n for row 1", "<= 3", "got 4")
    refused(lambda: kv.trim(state, [6, 0]), [state], "n for row 0", "<= 5", "got 6")
    refused(lambda: kv.trim(state, -1), [state], "n", ">= 0", "-1")


def test_rollback_past_a_row(state):
    cp = kv.checkpoint(state)
    refused(
        lambda: kv.rollback(state, cp, [0, 1]),
        [state],
        "checkpoint + keep for row 1",
        "<= 3",
        "got 4",
    )
    trimmed = kv.trim(state, 2)  # the rows now hold less than the checkpoint
    refused(
        lambda: kv.rollback(trimmed, cp, 0),
        [trimmed, state],
        "checkpoint + keep for row 0",
        "<= 3",
        "got 5",
    )
    refused(lambda: kv.rollback(state, cp, -1), [state], "keep", ">= 0", "-1")
    other = kv.filter_rows(state, [1, 0])  # the rows reordered
    refused(lambda: kv.rollback(other, cp, 0), [other], "checkpoint rows")


def test_attend_more_queries_than_a_row_holds(state):
    refused(
        lambda: kv.attend(state, z(2, H, 4, D), scale=1.0), [state], "q tokens", "<= 3", "got 4"
    )
    refused(
        lambda: kv.attend(state, z(2, H, 1, D), scale=1.0, window=0), [state], "window", ">= 1", "0"
    )


# --- row indices --------------------------------------------------------------------


def test_row_index_out_of_range(state):
    refused(lambda: kv.extract_row(state, 2), [state], "row", "[0, 2)", "got 2")
    refused(lambda: kv.extract_row(state, -1), [state], "row", "[0, 2)", "got -1")
    refused(lambda: kv.filter_rows(state, [0, 5]), [state], "rows[1]", "[0, 2)", "got 5")
    refused(lambda: kv.filter_rows(state, [-1]), [state], "rows[0]", "[0, 2)", "got -1")
    refused(lambda: kv.filter_rows(state, mx.array([2])), [state], "rows[0]", "got 2")
    refused(lambda: kv.extract_row(state, 1.0), [state], "row", "an int", "float")


# --- merging kinds and geometries -------------------------------------------------------


def test_merge_different_kinds(state):
    q = kv.quantized(1)
    refused(
        lambda: kv.merge_rows([state, q]), [state, q], "states[1]", "CacheState", "QuantizedState"
    )
    refused(lambda: kv.extend(state, q), [state, q], "states[1]")
    refused(lambda: kv.merge_rows([]), [], "states", "at least one")


@pytest.mark.parametrize(
    "shape,dtype,what",
    [
        ((1, 1, 2, D), mx.float32, "(1, 4, 4"),  # heads
        ((1, H, 2, 8), mx.float32, "(2, 8, 8"),  # head dim
        ((1, H, 2, D), mx.float16, "float16"),  # dtype
    ],
)
def test_merge_different_geometries(state, shape, dtype, what):
    other = kv.append(kv.empty(1, step=8), z(*shape, dtype=dtype), z(*shape, dtype=dtype))
    refused(
        lambda: kv.merge_rows([state, other]),
        [state, other],
        "states[1] geometry",
        "(2, 4, 4, mlx.core.float32)",
        what,
    )


# --- leases --------------------------------------------------------------------------


def test_reusing_a_released_lease():
    memo = kv.MaskMemo()
    lease = memo.mask_for(kv.MaskKey("f", (1,)), lambda: mx.ones((1, 1, 1, 1), mx.bool_))
    lease.release()
    for call in (lease.release, lambda: lease.mask):
        with pytest.raises(kv.KVStateError) as info:
            call()
        assert isinstance(info.value, kv.LeaseError)
        assert "lease" in str(info.value) and "unreleased" in str(info.value)
    assert memo.live == 0  # the failed second release took nothing away


def test_bad_arguments_elsewhere():
    refused(lambda: kv.MaskMemo().mask_for(("f", ()), lambda: None), [], "key", "MaskKey")
    refused(
        lambda: kv.encoder_window_mask(kv.MaskMemo(), 0, mx.zeros((0,), mx.bool_)),
        [],
        "L",
        "an int >= 1",
        "0",
    )
    refused(
        lambda: kv.encoder_window_mask(kv.MaskMemo(), 3, mx.zeros((4,), mx.bool_)),
        [],
        "bidirectional",
        "[3]",
        "[4]",
    )
    refused(
        lambda: kv.from_arrays(z(1, H, 4, D), z(1, H, 4, D), lengths=[3], left_pad=[2]),
        [],
        "left_pad[0] + lengths[0]",
        "<= 4",
        "got 5",
    )
    refused(
        lambda: kv.append(kv.empty(1), np.zeros((1, 1, 1, 1)), z(1, 1, 1, 1)),
        [],
        "k",
        "mx.array",
        "ndarray",
    )


# --- per-row arguments as arrays ----------------------------------------------------------


def _three_kinds():
    """One ragged two-row record of each kind (rows hold 5 and 3 tokens)."""
    rng = np.random.default_rng(5)
    out = []
    for make in (
        lambda: kv.empty(1, step=8),
        lambda: kv.quantized(1, group_size=32),
        lambda: kv.rotating(1, max_size=16, keep=1),
    ):
        rows = [
            kv.append(make(), mx.array(rand(rng, 1, H, n, 32)), mx.array(rand(rng, 1, H, n, 32)))
            for n in (5, 3)
        ]
        out.append(kv.merge_rows(rows))
    return out


@pytest.mark.parametrize("as_array", [np.array, mx.array], ids=["numpy", "mlx"])
def test_per_row_counts_as_integer_arrays(as_array):
    # Accepted draft counts usually come from the device (a sum over a
    # verify mask): trim and rollback take a 1-D integer array like a list.
    for s in _three_kinds():
        assert kv.trim(s, as_array([1, 2])).lengths == kv.trim(s, [1, 2]).lengths == (4, 1)
        cp = kv.checkpoint(s)
        drafted = kv.append(s, *(mx.zeros((2, H, 3, 32)),) * 2)
        got = kv.rollback(drafted, cp, as_array([1, 3]))
        assert got.lengths == kv.rollback(drafted, cp, [1, 3]).lengths == (6, 6)
        refused(lambda s=s: kv.trim(s, as_array([6, 0])), [s], "n for row 0", "<= 5", "got 6")
        refused(
            lambda drafted=drafted, cp=cp: kv.rollback(drafted, cp, as_array([-1, 0])),
            [drafted],
            "keep[0]",
            ">= 0",
            "-1",
        )


def test_per_row_arrays_of_the_wrong_kind(state):
    for value, actual in (
        (mx.array([1.0, 2.0]), "float32 [2]"),
        (mx.array([True, False]), "bool [2]"),
        (np.array([[1, 2]]), "int64 [1, 2]"),
        (np.array([0.5, 1.0]), "float64 [2]"),
    ):
        refused(
            lambda value=value: kv.trim(state, value), [state], "n", "1-D integer array", actual
        )
    refused(lambda: kv.trim(state, mx.array([1, 1, 1])), [state], "n", "2 values", "3 values")


def test_memo_arguments_are_checked():
    bd = mx.array([True, False, True])
    refused(lambda: kv.encoder_window_mask(None, 3, bd), [], "memo", "MaskMemo", "NoneType")
    s = kv.trim(kv.append(kv.empty(2), mx.zeros((2, 1, 2, 4)), mx.zeros((2, 1, 2, 4))), [1, 0])
    refused(
        lambda: kv.attend(s, mx.zeros((2, 1, 1, 4)), scale=1.0, memo={}),
        [s],
        "memo",
        "MaskMemo",
        "dict",
    )


def test_numpy_ints_and_index_arrays_are_taken_like_ints():
    import numpy as np

    bd = mx.array([True, False, True])
    assert kv.encoder_window_mask(kv.MaskMemo(), np.int64(3), bd).mask.shape == (1, 1, 3, 3)
    assert kv.rotating_block_mask(kv.MaskMemo(), np.int64(4), 3, 1, 3).mask.shape == (1, 1, 1, 4)
    for s in (
        kv.append(kv.empty(3), mx.ones((3, 1, 2, 4)), mx.ones((3, 1, 2, 4))),
        kv.append(kv.rotating(3, max_size=8), mx.ones((3, 1, 2, 4)), mx.ones((3, 1, 2, 4))),
    ):
        assert kv.filter_rows(s, np.array([2, 0])).batch_size == 2
        assert kv.extract_row(s, np.int64(1)).batch_size == 1
        refused(lambda s=s: kv.filter_rows(s, np.array([[0]])), [s], "rows", "[1, 1]")


@pytest.mark.parametrize("scale", [None, "a", True])
def test_attend_scale_must_be_a_number(scale):
    s = kv.append(kv.empty(1), mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
    r = kv.append(kv.rotating(1, max_size=4), mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
    q = kv.append(kv.quantized(1, group_size=32), mx.ones((1, 1, 2, 64)), mx.ones((1, 1, 2, 64)))
    for st, d in ((s, 4), (r, 4), (q, 64)):
        refused(lambda st=st, d=d: kv.attend(st, mx.ones((1, 1, 1, d)), scale=scale), [st], "scale")


def test_records_refuse_non_integer_bookkeeping():
    # (a float length would otherwise be truncated silently)
    with pytest.raises(kv.KVStateError, match="expected a sequence of ints"):
        kv.CacheState((2.7,), (0,))
    keys = mx.zeros((1, 1, 4, 2))
    s = kv.CacheState((np.int64(2),), (0,), keys=keys, values=keys)
    assert s.lengths == (2,) and type(s.lengths[0]) is int
