"""``kv.fork`` and ``SharedState``: shared rows read exactly as the same rows stored unshared.

A ``RuleBasedStateMachine`` applies every operation (append, trim, fork,
filter, extract, merge, checkpoint/rollback) to a ``SharedState`` and to a
plain numpy model of the rows, and after each rule compares what a model
sees: the fetched columns, and the cascade ``attend`` against numpy
attention and against ``kv.attend`` on the dense record holding the same
rows unshared.
"""

from __future__ import annotations

import gc

import attrs
import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import pytest
from _rows import np_of, rand, ref_attend, state_of_rows, visible
from hypothesis import note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvstate as kv
from kvstate.core.masks import rows_mask
from kvstate.kinds import shared

H, D = 2, 4
HQ = 4
STEP = 4


def cat(a, b):
    return np.concatenate([a, b], axis=1)


def rows_of(state):
    """What a model sees of each row (numpy), through the materialized read."""
    return visible(kv.materialize(state))


def assert_rows(state, rows):
    got = rows_of(state)
    assert len(got) == len(rows)
    for b, (g, (k, v)) in enumerate(zip(got, rows)):
        n = k.shape[1]
        if g is None:
            assert n == 0, f"row {b}: no columns, want {n} tokens"
            continue
        np.testing.assert_array_equal(g[0], k, err_msg=f"row {b} keys")
        np.testing.assert_array_equal(g[1], v, err_msg=f"row {b} values")


class SharedRows(RuleBasedStateMachine):
    """Shared rows against a numpy model; the cascade read against the dense read."""

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)

    @initialize(
        lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
        row=st.integers(0, 2),
        n=st.integers(0, 3),
    )
    def start(self, lengths, row, n):
        rows = [(rand(self.rng, H, m, D), rand(self.rng, H, m, D)) for m in lengths]
        base = state_of_rows(rows, step=STEP)
        row %= len(rows)
        self.state = kv.fork(base, row, n)
        self.base, self.base_planes = base, [np_of(p) for p in base.planes]
        self.rows = rows + [rows[row]] * n
        note(f"start {lengths} fork({row}, {n})")

    @rule(n=st.integers(1, 3))
    def append(self, n):
        B = self.state.batch_size
        k, v = rand(self.rng, B, H, n, D), rand(self.rng, B, H, n, D)
        self.state = kv.append(self.state, mx.array(k), mx.array(v))
        self.rows = [(cat(rk, k[b]), cat(rv, v[b])) for b, (rk, rv) in enumerate(self.rows)]
        note(f"append {n}")

    @rule(data=st.data())
    def trim(self, data):
        n = [data.draw(st.integers(0, k.shape[1])) for k, _ in self.rows]
        self.state = kv.trim(self.state, n)
        self.rows = [
            (k[:, : k.shape[1] - m], v[:, : v.shape[1] - m]) for (k, v), m in zip(self.rows, n)
        ]
        note(f"trim {n}")

    @rule(data=st.data())
    def fork(self, data):
        row = data.draw(st.integers(0, self.state.batch_size - 1))
        n = data.draw(st.integers(0, 2))
        self.state = kv.fork(self.state, row, n)
        self.rows = self.rows + [self.rows[row]] * n
        note(f"fork({row}, {n})")

    @rule(data=st.data())
    def filter(self, data):
        B = self.state.batch_size
        rows = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=4))
        self.state = kv.filter_rows(self.state, rows)
        self.rows = [self.rows[r] for r in rows]
        note(f"filter {rows}")

    @rule(data=st.data())
    def extract_and_merge(self, data):
        row = data.draw(st.integers(0, self.state.batch_size - 1))
        one = kv.extract_row(self.state, row)
        assert one.batch_size == 1 and one.left_pad == (0,)
        assert_rows(one, [self.rows[row]])
        self.state = kv.merge_rows([self.state, one])
        self.rows = self.rows + [self.rows[row]]
        note(f"extract {row} then merge")

    @rule(n=st.integers(1, 3), data=st.data())
    def speculate(self, n, data):
        B = self.state.batch_size
        cp = kv.checkpoint(self.state)
        k, v = rand(self.rng, B, H, n, D), rand(self.rng, B, H, n, D)
        grown = kv.append(self.state, mx.array(k), mx.array(v))
        keep = [data.draw(st.integers(0, n)) for _ in range(B)]
        self.state = kv.rollback(grown, cp, keep)
        self.rows = [
            (cat(rk, k[b, :, :m]), cat(rv, v[b, :, :m]))
            for b, ((rk, rv), m) in enumerate(zip(self.rows, keep))
        ]
        note(f"speculate {n} keep {keep}")

    @invariant()
    def same_rows(self):
        assert self.state.lengths == tuple(k.shape[1] for k, _ in self.rows)
        assert_rows(self.state, self.rows)

    @invariant()
    def prefix_shared_and_never_written(self):
        assert all(p is self.base for p in self.state.prefixes)  # shared, never copied
        for got, want in zip(self.base.planes, self.base_planes):
            np.testing.assert_array_equal(np_of(got), want)

    @precondition(lambda self: min(self.state.suffix.lengths) >= 1)
    @invariant()
    def cascade_equals_dense(self):
        s = self.state
        n = min(min(s.suffix.lengths), 2)
        q = rand(self.rng, s.batch_size, HQ, n, D)
        got = np_of(kv.attend(s, mx.array(q), scale=0.5))
        want = ref_attend(self.rows, q, 0.5)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
        dense = np_of(kv.attend(kv.materialize(s), mx.array(q), scale=0.5))
        np.testing.assert_allclose(got, dense, atol=2e-5, rtol=1e-4)


SharedRows.TestCase.settings = settings(max_examples=25, stateful_step_count=8, deadline=None)
TestSharedRows = SharedRows.TestCase


# --- bytes: forks copy nothing --------------------------------------------------------


def test_fork_copies_no_prefix_bytes():
    rng = np.random.default_rng(1)
    k, v = rand(rng, 1, H, 300, D), rand(rng, 1, H, 300, D)
    base = kv.append(kv.empty(1, step=64), mx.array(k), mx.array(v))
    mx.eval(base.keys, base.values)
    forked = kv.fork(base, 0, 16)
    assert forked.prefixes[0] is base  # the very record, not a copy
    assert forked.nbytes == base.nbytes  # 17 rows, one prefix's bytes
    # The control: the unshared way to get 17 such rows holds 17 copies.
    unshared = kv.filter_rows(base, [0] * 17)
    assert unshared.nbytes == 17 * base.nbytes
    # After one decode step each row owns one suffix block (step columns).
    t = mx.zeros((17, H, 1, D))
    grown = kv.append(forked, t, t)
    block = 17 * 2 * H * 64 * D * 4  # 17 rows, keys and values, one 64-column block
    assert grown.nbytes == base.nbytes + block


def test_fork_memory_is_measured_not_assumed():
    """Peak memory of a 16-way fork stays near one prefix; the unshared control grows 16x."""
    rng = np.random.default_rng(2)
    k = mx.array(rand(rng, 1, 8, 2048, 64))
    base = kv.append(kv.empty(1), k, k)
    mx.eval(base.keys, base.values)
    del k
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    forked = kv.fork(base, 0, 16)
    t = mx.zeros((17, 8, 1, 64))
    forked = kv.append(forked, t, t)
    mx.eval(forked.suffix.planes)
    shared_growth = mx.get_peak_memory() - before
    del forked, t
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    unshared = kv.filter_rows(base, [0] * 17)
    mx.eval(unshared.planes)
    unshared_growth = mx.get_peak_memory() - before
    assert unshared_growth >= 16 * base.nbytes
    # The target: at most 1/n + 10% of the unshared bytes.
    assert shared_growth + base.nbytes <= (1 / 17 + 0.1) * unshared_growth, (
        shared_growth,
        unshared_growth,
    )


# --- errors --------------------------------------------------------------------------


def test_fork_refuses_bad_arguments():
    base = kv.append(kv.empty(2), mx.zeros((2, H, 3, D)), mx.zeros((2, H, 3, D)))
    for row, n, arg in ((2, 1, "row"), (-1, 1, "row"), (0, -1, "n"), (0, 1.5, "n")):
        with pytest.raises(kv.KVStateError, match=arg):
            kv.fork(base, row, n)
    with pytest.raises(kv.KVStateError, match="state"):  # (rings fork by copy: test_fork_kinds)
        kv.fork("not a record", 0, 1)
    s = kv.fork(base, 0, 1)
    with pytest.raises(kv.KVStateError, match="q tokens"):
        kv.attend(s, mx.zeros((3, H, 1, D)), scale=1.0)  # no suffix token yet
    with pytest.raises(kv.KVStateError, match="n for row"):
        kv.trim(s, 4)
    assert s.lengths == (3, 3, 3)


def test_fork_of_a_layer_list_gives_a_list():
    base = kv.append(kv.empty(1), mx.zeros((1, H, 3, D)), mx.zeros((1, H, 3, D)))
    out = kv.fork([base, base], 0, 2)
    assert isinstance(out, list) and len(out) == 2
    assert all(s.batch_size == 3 for s in out)


# --- mx.compile: one trace for a whole decode loop ------------------------------------------


def test_cascade_compiles_without_a_retrace_per_token_or_layout():
    """The compiled read traces once for a decode loop whose row map changes
    between steps (rows trimmed into their prefix view): the map goes in as
    arrays. Both prefix reads are exercised: a 2-row record (per row) and a
    1-row one (every row's queries folded against it)."""
    rng = np.random.default_rng(3)
    rows = [(rand(rng, H, n, D), rand(rng, H, n, D)) for n in (7, 4)]
    base = state_of_rows(rows, step=STEP)
    one = state_of_rows([(rand(rng, H, 5, D), rand(rng, H, 5, D))], step=STEP)
    s = kv.merge_rows([kv.fork(base, 0, 2, step=64), kv.fork(one, 0, 1, step=64)])
    traces = []

    def read(q, sk, sv, mask, source, prow, start, view, *prefix):
        traces.append(1)  # Python runs only while tracing
        pairs = [prefix[i : i + 2] for i in range(0, len(prefix), 2)]
        views = (source, prow, start, view)
        return shared.cascade_attention(q, pairs, views, (sk, sv), mask, scale=0.5)

    fn = mx.compile(read)
    prefix = shared.prefix_planes(s)  # (the read's order: by shape)
    seen = set()
    for t in range(6):
        if t == 3:  # rows 3 and 5 now read fewer prefix tokens: a new layout
            s = kv.trim(s, [0, 0, 0, 3 + 3, 0, 3 + 2])
        k, v = mx.array(rand(rng, 6, H, 1, D)), mx.array(rand(rng, 6, H, 1, D))
        s = kv.append(s, k, v)
        seen.add(s.shared)
        q = mx.array(rand(rng, 6, HQ, 1, D))
        sx = s.suffix
        mask = rows_mask(1, sx.left_pad, sx.ends, sx.capacity)
        out = fn(q, sx.keys, sx.values, mask, *shared.view_arrays(s), *prefix)
        want = kv.attend(kv.materialize(s), q, scale=0.5)
        np.testing.assert_allclose(np_of(out), np_of(want), atol=2e-5, rtol=1e-4)
    assert len(seen) == 2 and len(traces) == 1


# --- quantized rows: the shared record against the same rows stored unshared ----------------


def q_rows(state):
    """Per row, the quantized planes over its tokens (numpy), read through materialize."""
    s = kv.materialize(state) if isinstance(state, kv.SharedState) else state
    if s.keys is None:
        return [None] * s.batch_size
    planes = [np_of(p) for p in (*s.keys, *s.values)]
    return [tuple(p[b, :, a:e] for p in planes) for b, (a, e) in enumerate(zip(s.left_pad, s.ends))]


class SharedQuantizedRows(RuleBasedStateMachine):
    """A ``SharedState`` of ``QuantizedState`` rows and an unshared ``QuantizedState``
    under the same operations hold the same packed bytes per row."""

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(1)

    def tokens(self, B, n):
        k, v = rand(self.rng, B, H, n, 32), rand(self.rng, B, H, n, 32)
        return mx.array(k), mx.array(v)

    @initialize(m=st.integers(1, 5), n=st.integers(1, 3))
    def start(self, m, n):
        base = kv.append(kv.quantized(1, group_size=32, bits=4, step=STEP), *self.tokens(1, m))
        self.shared = kv.fork(base, 0, n)
        self.unshared = kv.filter_rows(base, [0] * (n + 1))

    @rule(n=st.integers(1, 3))
    def append(self, n):
        k, v = self.tokens(self.shared.batch_size, n)
        self.shared = kv.append(self.shared, k, v)
        self.unshared = kv.append(self.unshared, k, v)

    @rule(data=st.data())
    def trim(self, data):
        n = [data.draw(st.integers(0, m)) for m in self.shared.lengths]
        self.shared, self.unshared = kv.trim(self.shared, n), kv.trim(self.unshared, n)

    @rule(data=st.data())
    def fork_filter(self, data):
        B = self.shared.batch_size
        row, n = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, 2))
        rows = data.draw(st.lists(st.integers(0, B + n - 1), min_size=1, max_size=4))
        self.shared = kv.filter_rows(kv.fork(self.shared, row, n), rows)
        copies = [kv.extract_row(self.unshared, row)] * n
        self.unshared = kv.filter_rows(kv.merge_rows([self.unshared] + copies), rows)

    @invariant()
    def same_bytes(self):
        assert self.shared.lengths == self.unshared.lengths
        for b, (g, w) in enumerate(zip(q_rows(self.shared), q_rows(self.unshared))):
            if g is None or w is None:
                assert self.shared.lengths[b] == 0
                continue
            for x, y in zip(g, w):
                np.testing.assert_array_equal(x, y, err_msg=f"row {b}")


SharedQuantizedRows.TestCase.settings = settings(
    max_examples=15, stateful_step_count=6, deadline=None
)
TestSharedQuantizedRows = SharedQuantizedRows.TestCase


def test_a_shared_record_satisfies_its_invariants_or_is_refused():
    base = kv.append(kv.empty(1), mx.zeros((1, H, 3, D)), mx.zeros((1, H, 3, D)))
    good = kv.fork(base, 0, 1)
    for change, arg in (
        ({"shared": (3, 4)}, "shared"),
        ({"source": (0, 1)}, "source"),
        ({"prefix_row": (0, 1)}, "prefix_row"),
        ({"shared": (3,)}, "shared"),
        ({"suffix": kv.rotating(2, max_size=4)}, "suffix"),
    ):
        with pytest.raises(kv.KVStateError, match=arg):
            attrs.evolve(good, **change)
    # The first tokens of empty suffix rows must fit the prefix's geometry.
    with pytest.raises(kv.KVStateError, match="heads"):
        kv.append(good, mx.zeros((2, H + 1, 1, D)), mx.zeros((2, H + 1, 1, D)))
    with pytest.raises(kv.KVStateError, match="dtype"):
        kv.append(good, mx.zeros((2, H, 1, D), mx.float16), mx.zeros((2, H, 1, D), mx.float16))


def test_save_and_load_a_shared_state(tmp_path):
    """``kv.save`` writes a ``SharedState`` with its prefixes and suffix (nested
    records); ``kv.load`` gives the same rows, its rows still sharing one
    prefix record, and a tampered row map is refused by name."""
    rng = np.random.default_rng(5)
    base = state_of_rows([(rand(rng, H, n, D), rand(rng, H, n, D)) for n in (5, 3)], step=STEP)
    s = kv.fork(base, 1, 2)
    s = kv.append(s, mx.array(rand(rng, 4, H, 2, D)), mx.array(rand(rng, 4, H, 2, D)))
    s = kv.trim(s, [1, 1, 1, 4])  # row 3 reads 1 of its prefix row's 3 tokens
    s = kv.append(s, mx.array(rand(rng, 4, H, 1, D)), mx.array(rand(rng, 4, H, 1, D)))
    path = tmp_path / "shared.safetensors"
    kv.save(path, [s, s])
    (a, b), _ = kv.load(path)
    for got in (a, b):
        assert isinstance(got, kv.SharedState) and len(got.prefixes) == 1
        assert (got.source, got.prefix_row, got.shared) == (s.source, s.prefix_row, s.shared)
        assert got.lengths == s.lengths
        q = mx.array(rand(rng, 4, HQ, 1, D))
        np.testing.assert_array_equal(
            np_of(kv.materialize(got).keys), np_of(kv.materialize(s).keys)
        )
        np.testing.assert_allclose(
            np_of(kv.attend(got, q, scale=0.5)), np_of(kv.attend(s, q, scale=0.5)), atol=1e-6
        )
    # A file whose row map reads past its prefix row is refused by name.
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta["kvstate.records"] = meta["kvstate.records"].replace(
        '"shared":[5,3,3,1]', '"shared":[5,3,3,9]'
    )
    assert '"shared":[5,3,3,9]' in meta["kvstate.records"]
    mx.save_safetensors(str(path), arrays, meta)
    with pytest.raises(kv.KVStateError, match=r"shared\[3\]"):
        kv.load(path)


def test_a_forwards_layouts_reuse_arrays_only_for_an_equal_layout():
    """``Layouts.arrays`` (one forward's read arrays: the suffix's positions, then the
    row map) hands a layer the last layer's arrays only when its layout is the same:
    the very same suffix lengths tuple and an equal map, first columns and left_pad.
    Layers that hold the same suffix bookkeeping but another map (fewer shared tokens,
    another prefix row, a prefix record with other first columns) get their own."""
    prefix = kv.from_arrays(
        mx.ones((2, 1, 8, 4)), mx.ones((2, 1, 8, 4)), lengths=[6, 5], left_pad=[2, 3]
    )
    other = kv.from_arrays(
        mx.ones((2, 1, 8, 4)), mx.ones((2, 1, 8, 4)), lengths=[6, 5], left_pad=[1, 3]
    )
    base = kv.append(kv.fork(prefix, 0, 3), mx.ones((5, 1, 2, 4)), mx.ones((5, 1, 2, 4)))
    sx = base.suffix
    layers = [
        base,
        shared.with_suffix(base, sx),  # (the same layout: the same arrays)
        kv.SharedState((prefix,), base.source, base.prefix_row, (6, 5, 4, 6, 6), sx),
        kv.SharedState((prefix,), base.source, (0, 1, 1, 0, 0), (6, 5, 5, 6, 6), sx),
        kv.SharedState((other,), base.source, base.prefix_row, base.shared, sx),
    ]
    lay = shared.Layouts()
    got = [lay.arrays(s) for s in layers]
    assert all(a is b for a, b in zip(got[1], got[0]))
    for s, g in zip(layers, got):
        want = (sx.left_pad, sx.ends, *shared.views_of(s))
        assert [np.array(a).tolist() for a in g] == [list(w) for w in want]
    assert [np.array(a).tolist() for a in got[4][2:]] != [np.array(a).tolist() for a in got[0][2:]]
