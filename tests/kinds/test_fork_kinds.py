"""``kv.fork`` of the kinds that share no prefix: rings, chunked, recurrent and
composite rows are copied (``extract_row`` + ``merge_rows``). Law: the result's
first rows read as the input's rows, each new row reads exactly as the forked
row, and the input is unchanged. Rows are read out through the numpy row
readers of ``_rows`` and ``_ring``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _ring import rows_of as ring_rows
from _rows import filled, visible
from hypothesis import given
from hypothesis import strategies as st

import kvstate as kv
from kvstate.kinds import chunked as ch
from kvstate.kinds import recurrent as rc

H, D = 2, 4


def _recurrent(lengths, seed):
    B = len(lengths)
    conv = mx.random.normal((B, 3, D), key=mx.random.key(seed))
    s = rc.set_slot(kv.recurrent_state(B, slots=2), 0, conv)
    rows = [rc.advance(kv.extract_row(s, b), n) for b, n in enumerate(lengths)]
    return kv.merge_rows(rows)


def make(kind, lengths, seed):
    if kind == "ring":  # each row a block, then one token more: some rows evict
        s = filled(lambda B: kv.rotating(B, max_size=4, keep=1), lengths, seed, H, D)
        one = mx.random.normal((len(lengths), H, 1, D), key=mx.random.key(seed + 50))
        return kv.append(s, one, one)
    if kind == "chunked":
        return ch.trim_front(
            filled(lambda B: ch.chunked_state(B, chunk_size=4), lengths, seed, H, D)
        )
    if kind == "recurrent":
        return _recurrent(lengths, seed)
    dense = filled(lambda B: kv.empty(B, step=8), lengths, seed, H, D)
    return kv.composite_state([_recurrent(dense.lengths, seed), dense])


def read(state) -> list:
    """Per row, what the row reads, as numpy (and its host bookkeeping)."""
    if isinstance(state, kv.CompositeState):
        return [tuple(p) for p in zip(*(read(part) for part in state.parts))]
    if isinstance(state, kv.RotatingState):
        return [(k, v, n) for (k, v), n in zip(ring_rows(state), state.lengths)]
    if isinstance(state, kv.RecurrentState):
        slots = [np.array(a) if a is not None else None for a in state.arrays]
        return [
            ([None if a is None else a[b] for a in slots], n) for b, n in enumerate(state.lengths)
        ]
    return [
        (*row, off) for row, off in zip(visible(state), getattr(state, "offsets", state.lengths))
    ]


def equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and bool((a == b).all())
    return a == b


@pytest.mark.parametrize("kind", ["ring", "chunked", "recurrent", "composite"])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    row=st.integers(0, 2),
    n=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_a_forked_row_reads_exactly_like_its_source(kind, lengths, row, n, seed):
    state = make(kind, lengths, seed)
    row %= state.batch_size
    before = read(state)
    forked = kv.fork(state, row, n)
    assert type(forked) is type(state)
    got = read(forked)
    assert len(got) == state.batch_size + n
    assert equal(got[: state.batch_size], before)
    for r in got[state.batch_size :]:
        assert equal(r, before[row])
    assert equal(read(state), before)  # the input is unchanged
    if n == 0:
        assert forked is state


def test_forked_ring_rows_append_on_their_own():
    """A copy is no alias: an append to the forked batch leaves the source
    record as it was, and equal appends keep the copy equal to its source row."""
    state = make("ring", [6, 3], 7)
    before = read(state)
    forked = kv.fork(state, 0, 2)
    k = mx.random.normal((1, H, 1, D), key=mx.random.key(3))
    grown = kv.append(forked, mx.repeat(k, 4, 0), mx.repeat(k, 4, 0))
    after = read(grown)
    assert equal(after[2], after[0]) and equal(after[3], after[0])
    assert not equal(after[0], before[0])
    assert equal(read(state), before)


def test_fork_of_another_kind_refuses_bad_rows_and_changes_nothing():
    state = make("recurrent", [3, 4], 1)
    before = read(state)
    for call, arg in (
        (lambda: kv.fork(state, 2, 1), "row"),
        (lambda: kv.fork(state, 0, -1), "n"),
        (lambda: kv.fork(object(), 0, 1), "state"),
    ):
        with pytest.raises(kv.KVStateError, match=arg):
            call()
    assert equal(read(state), before)


def test_a_shared_row_anchors_and_commits_like_a_dense_row():
    """``kv.anchor`` of a ``SharedState`` (what a draft model's forked rows are) is
    its checkpoint, and ``kv.commit`` returns each row to it plus what it keeps."""
    dense = filled(lambda B: kv.empty(B, step=8), [5, 3], 2, H, D)
    shared = kv.fork(dense, 0, 1)
    a = kv.anchor(shared)
    assert isinstance(a, kv.Checkpoint)
    k = mx.random.normal((3, H, 3, D), key=mx.random.key(9))
    grown = kv.append(shared, k, k)
    back = kv.commit(grown, a, [0, 1, 3])
    assert back.lengths == (5, 4, 8)
    want = read(kv.materialize(grown))
    got = read(kv.materialize(back))
    for b, n in enumerate(back.lengths):  # each row: the first n tokens it had grown to
        assert equal(got[b][:2], tuple(x[:, :n] for x in want[b][:2]))
