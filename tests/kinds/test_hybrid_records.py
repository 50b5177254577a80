"""RecurrentState, ChunkedState, CompositeState at the record level.

The references are mlx-lm's own cache objects, one per row: a batch of
kvstate rows must hold, read and mask exactly what each row's mlx-lm
``ArraysCache`` / ``ChunkedKVCache`` holds when run alone. Model-level
parity (real mlx-lm models) is in ``tests/parity/test_parity_hybrid.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from mlx_lm.models import cache as lm_cache

import kvstate as kv
from kvstate.bridge.prompt_cache import to_prompt_cache
from kvstate.kinds import chunked as ch
from kvstate.kinds import recurrent as rc

H, D, CS = 2, 4, 4
SCALE = D**-0.5


def rand(seed, *shape):
    return mx.random.normal(shape, key=mx.random.key(seed))


def draw_rows(data, B):
    """Surviving row indices for ``filter_rows``, in a drawn order."""
    return data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True))


class RowMachine(RuleBasedStateMachine):
    """What both machines below share: ``state`` and one mlx-lm reference per
    row in ``refs`` (plus any per-row lists named in ``per_row``)."""

    per_row = ("refs",)

    @precondition(lambda self: self.state.batch_size > 1)
    @rule(data=st.data())
    def filter(self, data):
        rows = draw_rows(data, self.state.batch_size)
        self.state = kv.filter_rows(self.state, rows)
        for name in self.per_row:
            setattr(self, name, [getattr(self, name)[r] for r in rows])
        self.cp = None


# --- recurrent -----------------------------------------------------------------------------


class RecurrentRows(RowMachine):
    """A batch of recurrent rows against one mlx-lm ``ArraysCache`` per row."""

    per_row = ("refs", "counts")

    @initialize(B=st.integers(1, 3))
    def start(self, B):
        self.seed = 0
        self.state = kv.recurrent_state(B, slots=2)
        self.refs = [lm_cache.ArraysCache(2) for _ in range(B)]
        self.counts = [0] * B
        self.cp = None

    def _slots(self, B):
        self.seed += 2
        return rand(self.seed, B, 3, D), rand(self.seed + 1, B, H, D, D)

    @rule(n=st.integers(1, 4))
    def write(self, n):
        conv, ssm = self._slots(self.state.batch_size)
        s = rc.set_slot(rc.set_slot(self.state, 0, conv), 1, ssm)
        self.state = rc.advance(s, n)
        for b, ref in enumerate(self.refs):
            ref[0], ref[1] = conv[b : b + 1], ssm[b : b + 1]
            ref.advance(n)
            self.counts[b] += n

    @rule()
    def checkpoint(self):
        self.cp = (
            kv.checkpoint(self.state),
            [[None if a is None else mx.array(a) for a in r.cache] for r in self.refs],
            list(self.counts),
        )

    @precondition(lambda self: self.cp is not None)
    @rule(data=st.data())
    def rollback(self, data):
        cp, arrays, counts = self.cp
        keep = [data.draw(st.sampled_from([0, n - c])) for n, c in zip(self.counts, counts)]
        note(f"rollback keep={keep}")
        self.state = kv.rollback(self.state, cp, keep)
        for b, k in enumerate(keep):
            if k == 0 and self.counts[b] != counts[b]:
                self.refs[b].cache = list(arrays[b])
                self.counts[b] = counts[b]

    @rule(row=st.integers(0, 2))
    def extract_and_merge(self, row):
        row %= self.state.batch_size
        one = kv.extract_row(self.state, row)
        self.state = kv.merge_rows([self.state, one])
        ref = lm_cache.ArraysCache(2)
        ref.cache = list(self.refs[row].cache)  # (mlx-lm's extract fails on unwritten slots)
        self.refs.append(ref)
        self.counts.append(self.counts[row])
        self.cp = None

    @rule()
    def join_empty(self):
        self.state = kv.extend(self.state, kv.recurrent_state(1, slots=2))
        self.refs.append(lm_cache.ArraysCache(2))
        self.counts.append(0)
        self.cp = None

    @invariant()
    def rows_match(self):
        assert self.state.lengths == tuple(self.counts)
        for j, slot in enumerate(self.state.arrays):
            for b, ref in enumerate(self.refs):
                want = ref.cache[j]
                if slot is None:
                    assert want is None
                    continue
                got = np.array(slot[b : b + 1])
                if want is None:  # an unwritten slot merged in: zeros, as mlx-lm's extend
                    assert not got.any()
                else:
                    np.testing.assert_array_equal(got, np.array(want))


TestRecurrentRows = RecurrentRows.TestCase
TestRecurrentRows.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


def test_padding_mask_is_mlx_lm_make_mask():
    for left, until, n in (
        ([2, 0, 1], None, 4),
        ([0, 0, 0], [3, 5, 1], 4),
        ([1, 0, 2], [3, 4, 4], 4),
        ([0, 0, 0], None, 3),
    ):
        ref = lm_cache.ArraysCache(1, left_padding=left if any(left) else None)
        s = kv.recurrent_state(3, slots=1, left_padding=left)
        if until is not None:
            ref.prepare(lengths=until)
            s = rc.prepare(s, until=until)
        for _ in range(2):  # a chunked prefill: the padding counts down
            want, got = ref.make_mask(n), rc.mask(s, n)
            if want is None or not np.array(want).all():
                np.testing.assert_array_equal(np.array(got), np.array(want))
            else:
                assert got is None
            ref.advance(n)
            s = rc.advance(s, n)
        real = [
            max(0, min(2 * n, 10**9 if until is None else u) - p)
            for p, u in zip(left, until or [None] * 3)
        ]
        assert s.lengths == tuple(real)
        assert rc.finalize(s).until is None and not any(rc.finalize(s).left_padding)


def test_recurrent_refusals_change_nothing():
    s = rc.advance(rc.set_slot(kv.recurrent_state(2, slots=2), 0, mx.ones((2, 3))), 2)
    cp = kv.checkpoint(s)
    s2 = rc.advance(rc.set_slot(s, 0, mx.zeros((2, 3))), 3)
    for call, arg in (
        (lambda: kv.trim(s2, 1), "n for row 0"),
        (lambda: kv.rollback(s2, cp, 1), "keep for row 0"),
        (lambda: kv.rollback(s2, kv.checkpoint(kv.empty(2)), 0), "checkpoint"),
        (lambda: rc.set_slot(s2, 2, mx.ones((2, 3))), "index"),
        (lambda: rc.set_slot(s2, 0, mx.ones((3, 3))), "value batch size"),
        (lambda: rc.set_slot(s2, 0, mx.ones((2, 4))), "slot 0 shape"),
        (lambda: kv.append(s2, mx.ones((2, 1, 1, 2)), mx.ones((2, 1, 1, 2))), "state"),
        (lambda: kv.merge_rows([s2, kv.recurrent_state(1, slots=3)]), "states\\[1\\] slots"),
    ):
        with pytest.raises(kv.KVStateError, match=arg):
            call()
    assert s2.lengths == (5, 5) and not np.array(s2.arrays[0]).any()
    assert kv.trim(s2, 0) is s2


# --- chunked ---------------------------------------------------------------------------------


def ref_chunk_attend(keys, values, q, start, offset, cs):
    """numpy attention of one row's last N queries under llama4's chunk mask."""
    k, v, q = (np.array(x, dtype=np.float64) for x in (keys, values, q))  # [H,L,D], [Hq,N,D]
    N, L = q.shape[1], k.shape[1]
    kpos = np.arange(start, start + L)
    qpos = np.arange(offset - N, offset)
    m = (kpos[None] <= qpos[:, None]) & (kpos[None] // cs == qpos[:, None] // cs)
    rep = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
    s = np.einsum("hnd,hld->hnl", q, k) * SCALE
    s = np.where(m[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnl,hld->hnd", p, v)


class ChunkedRows(RowMachine):
    """Batched chunked rows against one mlx-lm ``ChunkedKVCache`` per row (the
    model's order: ``maybe_trim_front`` before every forward, then the append)."""

    @initialize(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def start(self, lengths):
        self.seed = 100
        rows, self.refs = [], []
        for n in lengths:
            s, ref = ch.chunked_state(1, chunk_size=CS, step=4), lm_cache.ChunkedKVCache(CS)
            if n:
                k, v = self._kv(1, n)
                s, _ = kv.append(s, k, v), ref.update_and_fetch(k, v)
            rows.append(s)
            self.refs.append(ref)
        self.state = kv.merge_rows(rows)
        self.cp = None

    def _kv(self, B, n):
        self.seed += 2
        return rand(self.seed, B, H, n, D), rand(self.seed + 1, B, H, n, D)

    @rule(n=st.integers(1, 5))
    def forward(self, n):
        self.state = ch.trim_front(self.state)
        k, v = self._kv(self.state.batch_size, n)
        self.state = kv.append(self.state, k, v)
        for b, ref in enumerate(self.refs):
            ref.maybe_trim_front()
            ref.update_and_fetch(k[b : b + 1], v[b : b + 1])
        q = rand(self.seed + 7, self.state.batch_size, 2 * H, n, D)
        got = np.array(kv.attend(self.state, q, scale=SCALE))
        for b, ref in enumerate(self.refs):
            keys, values = ref.keys_and_values()
            want = ref_chunk_attend(keys[0], values[0], q[b], ref.start_position, ref.offset, CS)
            np.testing.assert_allclose(got[b], want, atol=1e-5)

    @rule()
    def checkpoint(self):
        self.cp = (kv.checkpoint(self.state), [r.offset for r in self.refs])

    @precondition(lambda self: self.cp is not None)
    @rule(data=st.data())
    def rollback(self, data):
        cp, offsets = self.cp
        keep = [data.draw(st.integers(0, r.offset - o)) for r, o in zip(self.refs, offsets)]
        targets = [o + k for o, k in zip(offsets, keep)]
        # Exact iff the row holds the positions of the target's chunk before it.
        exact = [
            r.start_position <= t // CS * CS or t % CS == 0 for r, t in zip(self.refs, targets)
        ]
        note(f"rollback to {targets}, exact {exact}")
        if not all(exact):
            with pytest.raises(kv.KVStateError, match="dropped by a later trim_front"):
                kv.rollback(self.state, cp, keep)
            return
        self.state = kv.rollback(self.state, cp, keep)
        for r, t in zip(self.refs, targets):
            if t >= r.start_position:
                r.trim(r.offset - t)
            else:  # mlx-lm's trim stops at start_position: a new chunk starts at t
                r.offset = r.start_position = t

    @rule(row=st.integers(0, 2))
    def extract_and_merge(self, row):
        row %= self.state.batch_size
        one = kv.extract_row(self.state, row)
        assert one.left_pad == (0,) and one.capacity == one.lengths[0]
        self.state = kv.merge_rows([one, self.state])
        ref = self.refs[row]
        copy = lm_cache.ChunkedKVCache(CS)
        if ref.keys is not None:
            copy.state = (*ref.keys_and_values(), ref.offset, CS, ref.start_position)
        self.refs.insert(0, copy)
        self.cp = None

    @invariant()
    def rows_match(self):
        s = self.state
        assert s.offsets == tuple(r.offset for r in self.refs)
        if s.keys is None:
            return
        k, v = (np.array(x) for x in kv.fetch(s))
        for b, ref in enumerate(self.refs):
            if ref.keys is None:
                assert s.lengths[b] == 0
                continue
            keys, values = ref.keys_and_values()
            held = keys.shape[2]
            # The row holds at least what mlx-lm holds (a rollback keeps more of the
            # front, never less); its last ``held`` columns are mlx-lm's.
            assert s.lengths[b] >= held
            e = s.ends[b]
            np.testing.assert_array_equal(k[b, :, e - held : e], np.array(keys[0]))
            np.testing.assert_array_equal(v[b, :, e - held : e], np.array(values[0]))


TestChunkedRows = ChunkedRows.TestCase
TestChunkedRows.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


def test_chunked_refusals_change_nothing():
    s = kv.append(ch.chunked_state(2, chunk_size=4), *(mx.ones((2, 1, 6, 2)),) * 2)
    cp = kv.checkpoint(s)
    for call, arg in (
        (lambda: kv.rollback(s, cp, 1), "checkpoint \\+ keep for row 0"),
        (lambda: kv.trim(s, 7), "n for row 0"),
        (lambda: kv.attend(s, mx.ones((2, 1, 1, 2)), scale=1.0, window=2), "window"),
        (lambda: ch.chunked_state(1, chunk_size=0), "chunk_size"),
        (lambda: kv.merge_rows([s, ch.chunked_state(1, chunk_size=8)]), "chunk_size"),
    ):
        with pytest.raises(kv.KVStateError, match=arg):
            call()
    assert s.lengths == (6, 6) and s.start == (0, 0)


# --- composite and persistence ----------------------------------------------------------------


def _composite(B, seed):
    r = rc.advance(rc.set_slot(kv.recurrent_state(B, slots=1), 0, rand(seed, B, 3, D)), 3)
    d = kv.append(kv.empty(B), rand(seed + 1, B, H, 3, D), rand(seed + 2, B, H, 3, D))
    return kv.composite_state([r, d])


def test_composite_applies_every_function_to_each_part():
    a, b = _composite(2, 1), _composite(1, 5)
    m = kv.merge_rows([a, b])
    assert [type(p) for p in m.parts] == [kv.RecurrentState, kv.CacheState]
    assert m.batch_size == 3 and m.lengths == (3, 3, 3)
    one = kv.extract_row(m, 2)
    np.testing.assert_array_equal(np.array(one.parts[0].arrays[0]), np.array(b.parts[0].arrays[0]))
    for p, q in zip(kv.fetch(one.parts[1]), kv.fetch(b.parts[1])):
        np.testing.assert_array_equal(np.array(p), np.array(q))
    f = kv.filter_rows(m, [2, 0])
    np.testing.assert_array_equal(
        np.array(f.parts[0].arrays[0]), np.array(m.parts[0].arrays[0])[[2, 0]]
    )
    cp = kv.checkpoint(m)
    rec = rc.advance(rc.set_slot(m.parts[0], 0, rand(9, 3, 3, D)), 1)
    dense = kv.append(m.parts[1], rand(10, 3, H, 1, D), rand(11, 3, H, 1, D))
    back = kv.rollback(kv.composite_state([rec, dense]), cp, 0)
    np.testing.assert_array_equal(np.array(back.parts[0].arrays[0]), np.array(m.parts[0].arrays[0]))
    assert back.parts[1].lengths == (3, 3, 3)
    with pytest.raises(kv.KVStateError, match="parts"):
        kv.merge_rows([m, kv.composite_state([m.parts[1], m.parts[0]])])
    with pytest.raises(kv.KVStateError, match="one part"):
        kv.append(m, rand(1, 3, H, 1, D), rand(1, 3, H, 1, D))


def test_save_load_round_trip_of_every_new_kind(tmp_path):
    s = [
        _composite(2, 1),
        kv.append(ch.chunked_state(2, chunk_size=4), rand(3, 2, H, 5, D), rand(4, 2, H, 5, D)),
        rc.advance(rc.set_slot(kv.recurrent_state(2, slots=2), 1, rand(5, 2, H, D, D)), 2),
    ]
    s[1] = ch.trim_front(s[1])
    path = str(tmp_path / "h.safetensors")
    kv.save(path, s, {"note": "x"})
    back, meta = kv.load(path)
    assert meta == {"note": "x"}
    assert [type(x) for x in back] == [type(x) for x in s]
    assert back[1].start == s[1].start and back[2].arrays[0] is None
    for x, y in zip(back, s):
        assert x.lengths == y.lengths
        for p, q in zip(x.planes, y.planes):
            np.testing.assert_array_equal(np.array(p), np.array(q))


def test_mlx_lm_prompt_cache_files_of_these_caches_load(tmp_path):
    arrays = lm_cache.ArraysCache(2)
    arrays[0], arrays[1] = rand(1, 2, 3, D), rand(2, 2, H, D, D)
    chunked = lm_cache.ChunkedKVCache(4)
    chunked.update_and_fetch(rand(3, 1, H, 6, D), rand(4, 1, H, 6, D))
    chunked.maybe_trim_front()
    dense = lm_cache.KVCache()
    dense.update_and_fetch(rand(5, 2, H, 7, D), rand(6, 2, H, 7, D))
    both = lm_cache.CacheList(lm_cache.ArraysCache(1), lm_cache.KVCache())
    both[0][0] = rand(7, 2, 3, D)
    both[1].update_and_fetch(rand(8, 2, H, 7, D), rand(9, 2, H, 7, D))
    path = str(tmp_path / "m.safetensors")
    lm_cache.save_prompt_cache(path, [arrays, chunked, dense, both], {"a": "b"})
    states, meta = kv.load(path)
    assert meta == {"a": "b"}
    r, c, _d, comp = states
    assert isinstance(r, kv.RecurrentState) and r.lengths == (7, 7)  # counted by layer 2
    np.testing.assert_array_equal(np.array(r.arrays[1]), np.array(arrays[1]))
    assert c.start == (2,) and c.offsets == (6,)
    np.testing.assert_array_equal(np.array(kv.fetch(c)[0]), np.array(chunked.keys_and_values()[0]))
    assert isinstance(comp, kv.CompositeState) and comp.parts[0].lengths == (7, 7)
    # and back to mlx-lm objects holding the same
    lm = to_prompt_cache(states)
    np.testing.assert_array_equal(np.array(lm[0][1]), np.array(arrays[1]))
    assert (lm[1].offset, lm[1].start_position) == (6, 2)
    assert isinstance(lm[3], lm_cache.CacheList) and lm[3][1].offset.tolist() == [7, 7]
