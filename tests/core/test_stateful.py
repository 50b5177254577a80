"""Model-based stateful test: dense kvstate rows against a plain numpy model.

The model is a list of rows, each ``(keys [H, L, Dk], values [H, L, Dv])`` in
numpy, updated with list and ``np.concatenate`` operations only. Every rule
applies one kvstate function to the record and the obvious edit to the
model; after every rule the record's mask-visible columns must equal the
model byte for byte, and ``kv.attend`` must equal numpy attention over the
model rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from _rows import assert_rows_equal, np_of, rand, ref_attend, visible
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvstate as kv

H, D, DV = 2, 4, 4
STEP = 4


def cat(a, b):
    return np.concatenate([a, b], axis=1)


class DenseRows(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)
        self.state = None
        self.rows = []

    def fresh(self, lengths):
        """A new batch holding random rows of ``lengths`` and its model rows."""
        singles, rows = [], []
        for n in lengths:
            k, v = rand(self.rng, 1, H, n, D), rand(self.rng, 1, H, n, DV)
            s = kv.empty(1, step=STEP)
            if n:
                s = kv.append(s, mx.array(k), mx.array(v))
            singles.append(s)
            rows.append((k[0], v[0]))
        return kv.merge_rows(singles), rows

    def show(self, what):
        s = self.state
        note(
            f"{what} -> lengths={s.lengths} left_pad={s.left_pad} width={s.width} "
            f"capacity={s.capacity}"
        )

    @initialize(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=3))
    def start(self, lengths):
        self.state, self.rows = self.fresh(lengths)
        self.show(f"start {lengths}")

    @rule(n=st.integers(1, 3), seed=st.integers(0, 2**16))
    def append(self, n, seed):
        rng = np.random.default_rng(seed)
        B = self.state.batch_size
        k, v = rand(rng, B, H, n, D), rand(rng, B, H, n, DV)
        self.state = kv.append(self.state, mx.array(k), mx.array(v))
        self.rows = [(cat(rk, k[b]), cat(rv, v[b])) for b, (rk, rv) in enumerate(self.rows)]
        self.show(f"append {n}")

    @rule(data=st.data())
    def trim(self, data):
        if data.draw(st.booleans(), label="per row"):
            n = [
                data.draw(st.integers(0, m), label=f"n[{b}]")
                for b, m in enumerate(self.state.lengths)
            ]
        else:
            n = data.draw(st.integers(0, min(self.state.lengths)), label="n")
        self.state = kv.trim(self.state, n)
        per = n if isinstance(n, list) else [n] * len(self.rows)
        self.rows = [
            (k[:, : k.shape[1] - t], v[:, : v.shape[1] - t]) for (k, v), t in zip(self.rows, per)
        ]
        self.show(f"trim {n}")

    @rule(data=st.data(), n=st.integers(1, 4), seed=st.integers(0, 2**16))
    def speculate(self, data, n, seed):
        """checkpoint, append a draft of ``n``, roll back keeping ``keep`` per row."""
        rng = np.random.default_rng(seed)
        B = self.state.batch_size
        keep = data.draw(st.lists(st.integers(0, n), min_size=B, max_size=B), label="keep")
        k, v = rand(rng, B, H, n, D), rand(rng, B, H, n, DV)
        cp = kv.checkpoint(self.state)
        drafted = kv.append(self.state, mx.array(k), mx.array(v))
        self.state = kv.rollback(drafted, cp, keep)
        self.rows = [
            (cat(rk, k[b, :, : keep[b]]), cat(rv, v[b, :, : keep[b]]))
            for b, (rk, rv) in enumerate(self.rows)
        ]
        self.show(f"draft {n} keep {keep}")

    @precondition(lambda self: self.state.batch_size < 6)
    @rule(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=2), first=st.booleans())
    def merge(self, lengths, first):
        other, rows = self.fresh(lengths)
        if first:
            self.state = kv.merge_rows([other, self.state])
            self.rows = rows + self.rows
        else:
            self.state = kv.extend(self.state, other)
            self.rows = self.rows + rows
        self.show(f"merge {lengths} {'before' if first else 'after'}")

    @rule(data=st.data())
    def filter(self, data):
        B = self.state.batch_size
        keep = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B), label="keep")
        self.state = kv.filter_rows(self.state, keep)
        self.rows = [self.rows[r] for r in keep]
        assert min(self.state.left_pad) == 0  # shared padding removed
        self.show(f"filter {keep}")

    @rule(data=st.data())
    def extract(self, data):
        i = data.draw(st.integers(0, self.state.batch_size - 1), label="row")
        row = kv.extract_row(self.state, i)
        assert row.left_pad == (0,) and row.capacity == (
            row.lengths[0] if row.keys is not None else 0
        )
        assert_rows_equal(visible(row), [self.rows[i]])
        if data.draw(st.booleans(), label="continue with the row alone"):
            self.state, self.rows = row, [self.rows[i]]
        self.show(f"extract {i}")

    @invariant()
    def rows_match(self):
        if self.state is None:
            return
        s = self.state
        assert s.lengths == tuple(k.shape[1] for k, _ in self.rows)
        assert s.width == max(s.ends) and s.capacity >= s.width
        assert_rows_equal(visible(s), self.rows)

    @invariant()
    def attention_matches(self):
        s = self.state
        if s is None or s.keys is None or min(s.lengths) == 0:
            return
        for n, window in ((1, None), (min(2, min(s.lengths)), 2)):
            q = rand(self.rng, s.batch_size, 2 * H, n, D)
            got = kv.attend(s, mx.array(q), scale=0.5, window=window)
            np.testing.assert_allclose(np_of(got), ref_attend(self.rows, q, 0.5, window), atol=1e-5)


DenseRows.TestCase.settings = settings(stateful_step_count=12)
TestDenseRows = DenseRows.TestCase
