"""Differential tests: kvstate dense rows against mlx-lm's KVCache and BatchKVCache.

Both sides run in this process on the same float32 inputs. Hypothesis draws a
program (prefill single rows, some with no tokens, merge them, then append /
trim / filter / extend (also with empty rows) / extract in any order) and applies every step
to an mlx-lm cache object and to a kvstate record. After every step we compare:

- the fetch shape: mlx-lm's ``update_and_fetch`` / ``keys_and_values``
  against ``kv.fetch`` (``[B, H, width, D]``, the same width on both sides);
- the row layout: mlx-lm's ``left_padding`` and per-row token counts
  (``offset``; ``_idx - left_padding`` for a batch) against ``left_pad`` and
  ``lengths``;
- the mask-visible columns of every row, ``[left_pad[b], ends[b])``,
  byte-exact, keys and values;
- on each append, the attention output under each side's own mask: mlx-lm
  takes ``cache.make_mask(N)`` *before* ``update_and_fetch`` and calls
  ``mx.fast.scaled_dot_product_attention``; kvstate appends then calls
  ``kv.attend``. float32, ``atol=1e-5``; with and without a sliding window,
  with grouped-query heads.

Not compared: the contents of padding columns and of columns past a row's end
(stale or spare). No mask on either side ever exposes them, the contract
leaves them unspecified (a rejected draft may linger there), and capacities
differ on purpose (kvstate grows to a multiple of its ``step``, here drawn
small to exercise growth; mlx-lm grows by 256).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from _rows import np_of, rand
from hypothesis import given, note
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache

import kvstate as kv

H, D, DV = 2, 8, 4


class Side:
    """One row group on both sides: an mlx-lm cache and a kvstate record."""

    def __init__(self, cache, state):
        self.cache, self.state = cache, state

    @property
    def batch(self) -> bool:
        return isinstance(self.cache, BatchKVCache)

    def mlx_layout(self):
        c = self.cache
        if self.batch:
            lp = c.left_padding.tolist()
            return tuple(lp), tuple(c._idx - p for p in lp), c._idx
        return (0,), (c.offset,), c.offset

    def check(self, fetched=None):
        """Compare layout, fetch shape and visible columns of both sides."""
        lp, lengths, width = self.mlx_layout()
        s = self.state
        assert s.left_pad == lp, (s.left_pad, lp)
        assert s.lengths == lengths, (s.lengths, lengths)
        assert s.width == width, (s.width, width)
        if self.batch:
            assert self.cache.offset.tolist() == list(s.lengths)  # RoPE offsets
        pos = kv.positions(s)
        assert (pos is None) == s.aligned
        if pos is not None:
            assert pos.tolist() == list(s.lengths)
        if self.cache.keys is None:
            assert s.keys is None or s.width == 0
            return
        if fetched is None:
            fetched = (
                self.cache.keys_and_values()
                if self.batch or self.cache.offset
                else (self.cache.keys[..., :0, :], self.cache.values[..., :0, :])
            )
        mk, mv = (np_of(x) for x in fetched)
        sk, sv = (np_of(x) for x in kv.fetch(s))
        assert mk.shape == sk.shape and mv.shape == sv.shape, (mk.shape, sk.shape)
        for b, (p, e) in enumerate(zip(s.left_pad, s.ends)):
            np.testing.assert_array_equal(sk[b, :, p:e], mk[b, :, p:e], err_msg=f"keys row {b}")
            np.testing.assert_array_equal(sv[b, :, p:e], mv[b, :, p:e], err_msg=f"values row {b}")

    def append(self, rng, n, hq, window):
        B = self.state.batch_size
        k, v, q = rand(rng, B, H, n, D), rand(rng, B, H, n, DV), rand(rng, B, hq, n, D)
        k, v, q = mx.array(k), mx.array(v), mx.array(q)
        scale = D**-0.5
        mask = self.cache.make_mask(n, return_array=False, window_size=window)
        fetched = self.cache.update_and_fetch(k, v)
        want = mx.fast.scaled_dot_product_attention(q, *fetched, scale=scale, mask=mask)
        self.state = kv.append(self.state, k, v)
        got = kv.attend(self.state, q, scale=scale, window=window)
        self.check(fetched)
        assert got.shape == want.shape
        np.testing.assert_allclose(np_of(got), np_of(want), atol=1e-5, rtol=1e-5)


def single(rng, data, step, label):
    """A single row on both sides, prefilled in 0-2 chunks (0: a row with no tokens)."""
    side = Side(KVCache(), kv.empty(1, step=step))
    for n in data.draw(st.lists(st.integers(1, 5), max_size=2), label=label):
        side.append(rng, n, H, None)
    return side


def merged(sides):
    batch = Side(
        BatchKVCache.merge([s.cache for s in sides]), kv.merge_rows([s.state for s in sides])
    )
    batch.check()
    return batch


@given(st.data())
def test_random_programs_match_mlx_lm(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    step = data.draw(st.sampled_from([4, 8, 256]), label="kvstate step")
    n_rows = data.draw(st.integers(1, 3), label="rows")
    batch = merged([single(rng, data, step, f"prefill row {i}") for i in range(n_rows)])
    for t in range(data.draw(st.integers(1, 8), label="ops")):
        B = batch.state.batch_size
        op = data.draw(
            st.sampled_from(["append", "append", "trim", "filter", "extend", "extract"]),
            label=f"op {t}",
        )
        if op == "append":
            n = data.draw(st.integers(1, 4), label="n")
            hq = data.draw(st.sampled_from([H, 2 * H]), label="query heads")
            window = data.draw(st.sampled_from([None, None, 1, 3]), label="window")
            note(f"append n={n} hq={hq} window={window} onto {batch.state.lengths}")
            batch.append(rng, n, hq, window)
        elif op == "trim":
            n = data.draw(st.integers(0, min(batch.state.lengths)), label="n")
            note(f"trim {n} from {batch.state.lengths}")
            assert batch.cache.trim(n) == n
            batch.state = kv.trim(batch.state, n)
            batch.check()
        elif op == "filter":
            rows = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B), label="rows")
            note(f"filter {rows} of {batch.state.lengths} pad {batch.state.left_pad}")
            batch.cache.filter(rows)
            batch.state = kv.filter_rows(batch.state, rows)
            batch.check()
        elif op == "extend":
            k = data.draw(st.integers(1, 2), label="new rows")
            if data.draw(st.booleans(), label="empty batch"):
                other = Side(BatchKVCache([0] * k), kv.empty(k, step=step))
            else:
                other = merged([single(rng, data, step, f"new row {i}") for i in range(k)])
            note(f"extend {batch.state.lengths} with {other.state.lengths}")
            batch.cache.extend(other.cache)
            batch.state = kv.extend(batch.state, other.state)
            batch.check()
        elif batch.cache.keys is None:
            note("extract skipped: no row holds a token yet (mlx-lm's extract needs keys)")
        else:
            i = data.draw(st.integers(0, B - 1), label="row")
            note(f"extract {i} of {batch.state.lengths}")
            before = kv.fetch(batch.state)
            row = Side(batch.cache.extract(i), kv.extract_row(batch.state, i))
            row.check()
            # the extracted row lives on by itself; the batch is untouched
            row.append(rng, data.draw(st.integers(1, 3), label="row append"), H, None)
            after = kv.fetch(batch.state)
            for x, y in zip(before, after):
                np.testing.assert_array_equal(np_of(x), np_of(y))
            batch.check()


def test_continuous_batching_scenario():
    """A fixed, longer program: rows join, decode together, finish and leave."""
    rng = np.random.default_rng(7)
    step = 8

    def prefill(n):
        side = Side(KVCache(), kv.empty(1, step=step))
        side.append(rng, n, H, None)
        return side

    batch = merged([prefill(n) for n in (5, 11, 3)])
    for t in range(30):
        batch.append(rng, 1, 2 * H, None)
        if t == 6:  # a draft of 3, two rejected on every row
            batch.append(rng, 3, H, None)
            batch.cache.trim(2)
            batch.state = kv.trim(batch.state, 2)
            batch.check()
        if t == 9:
            batch.cache.filter([0, 2])
            batch.state = kv.filter_rows(batch.state, [0, 2])
            batch.check()
        if t in (12, 20):
            other = merged([prefill(n) for n in (17, 2)])
            batch.cache.extend(other.cache)
            batch.state = kv.extend(batch.state, other.state)
            batch.check()
        if t == 25:
            done = Side(batch.cache.extract(1), kv.extract_row(batch.state, 1))
            done.check()
            done.append(rng, 2, H, 4)
            keep = [0, 2, 3, 4]
            batch.cache.filter(keep)
            batch.state = kv.filter_rows(batch.state, keep)
            batch.check()
    assert batch.state.batch_size == 4
