"""``PrefixCache``: longest-prefix lookup, byte budget, LRU, pins, save/load."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _rows import rand, visible

import kvstate as kv
from kvstate.serving.prefix_cache import PrefixCache, common_prefix, model_identity

H, D = 2, 4
LAYERS = 2


def entry(rng, n):
    """One-row records (one per layer) holding ``n`` random tokens, and their numpy rows."""
    states, rows = [], []
    for _ in range(LAYERS):
        k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
        states.append(kv.append(kv.empty(1, step=8), mx.array(k), mx.array(v)))
        rows.append((k[0], v[0]))
    return states, rows


def test_lookup_finds_the_longest_prefix_and_shares_it(rng):
    cache = PrefixCache(1 << 20)
    a, a_rows = entry(rng, 6)
    b, _ = entry(rng, 3)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    cache.insert([1, 2, 9], b)
    assert cache.lookup([7, 7, 7]) is None
    hit = cache.lookup([1, 2, 3, 4, 8, 8])
    assert hit.matched == 4 and hit.tokens == (1, 2, 3, 4, 5, 6)
    for s, (k, v) in zip(hit.states, a_rows):
        assert isinstance(s, kv.SharedState) and s.lengths == (4,)
        got = visible(kv.materialize(s))[0]
        np.testing.assert_array_equal(got[0], k[:, :4])
        np.testing.assert_array_equal(got[1], v[:, :4])
    hit.release()
    # The whole entry matches: one token is always left to prefill.
    assert cache.lookup([1, 2, 3, 4, 5, 6]).matched == 5
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_leased_rows_copy_nothing(rng):
    cache = PrefixCache(1 << 20)
    a, _ = entry(rng, 100)
    cache.insert(list(range(100)), a)
    stored = cache._entries[tuple(range(100))].states
    with cache.lookup(list(range(100)) + [5]) as hit:
        assert all(s.prefixes[0] is r for s, r in zip(hit.states, stored))
        assert sum(s.nbytes for s in hit.states) == sum(r.nbytes for r in stored)


def test_budget_evicts_least_recently_used(rng):
    one, _ = entry(rng, 8)
    size = sum(s.nbytes for s in one)
    cache = PrefixCache(2 * size)
    cache.insert([1] * 8, one)
    cache.insert([2] * 8, entry(rng, 8)[0])
    assert len(cache) == 2 and cache.nbytes == 2 * size
    cache.lookup([1] * 9).release()  # [1]*8 is now the most recently used
    cache.insert([3] * 8, entry(rng, 8)[0])
    assert [1] * 8 in cache and [3] * 8 in cache and [2] * 8 not in cache
    assert cache.evictions == 1 and cache.nbytes <= cache.max_bytes
    assert cache.peak_bytes == 3 * size


def test_pinned_entries_are_never_evicted(rng):
    one, _ = entry(rng, 8)
    size = sum(s.nbytes for s in one)
    cache = PrefixCache(size)
    cache.insert([1] * 8, one)
    hit = cache.lookup([1] * 9)
    assert cache.pinned == 1
    kept = cache.insert([2] * 8, entry(rng, 8)[0])
    # Over budget, but the only other entry is pinned: the new one goes.
    assert not kept and [1] * 8 in cache and cache.evictions == 1
    hit.release()
    assert cache.pinned == 0
    with pytest.raises(kv.KVStateError, match="lease"):
        hit.release()
    cache.insert([2] * 8, entry(rng, 8)[0])
    assert [1] * 8 not in cache and [2] * 8 in cache


def test_entries_sharing_a_prefix_count_its_bytes_once(rng):
    base, _ = entry(rng, 16)
    cache = PrefixCache(1 << 20)
    cache.insert(list(range(16)), base)
    with cache.lookup(list(range(16)) + [99]) as hit:
        # A longer sequence built on the leased rows (a second chat turn).
        t = mx.array(rand(rng, 1, H, 4, D))
        assert hit.matched == 16
        longer = [kv.append(s, t, t) for s in hit.states]
        assert longer[0].lengths == (20,)
        cache.insert(list(range(16)) + [1, 2, 3, 4], longer)
    own = sum(s.suffix.nbytes for s in cache._entries[tuple(range(16)) + (1, 2, 3, 4)].states)
    assert cache.nbytes == sum(s.nbytes for s in base) + own


def test_a_lease_inside_the_prefix_holds_no_suffix_planes(rng):
    """A lease whose matched tokens all lie in an entry's prefix records (the
    entry's own tokens cut away) holds no suffix planes, as a fork of a prompt:
    the request's tokens go to fresh planes of the suffix's step, never into a
    copy of the entry's exact-width compacted suffix."""
    base, rows = entry(rng, 16)
    cache = PrefixCache(1 << 20)
    cache.insert(list(range(16)), base)
    with cache.lookup(list(range(16)) + [99]) as hit:
        t = mx.array(rand(rng, 1, H, 4, D))
        cache.insert(list(range(16)) + [1, 2, 3, 4], [kv.append(s, t, t) for s in hit.states])
    # Only the entry built on shared rows matches 18 tokens; its own tokens start at 16.
    cache._drop(tuple(range(16)))
    with cache.lookup(list(range(16)) + [1, 2, 7]) as hit:
        assert hit.matched == 18 and all(s.suffix.planes for s in hit.states)
    with cache.lookup(list(range(14)) + [5, 5]) as hit:
        assert hit.matched == 14
        for s, (k, v) in zip(hit.states, rows):
            assert s.suffix.planes == () and s.lengths == (14,)
            got = visible(kv.materialize(s))[0]
            np.testing.assert_array_equal(got[0], k[:, :14])
            np.testing.assert_array_equal(got[1], v[:, :14])
        grown = [kv.append(s, t, t) for s in hit.states]
        assert grown[0].suffix.capacity == grown[0].suffix.step


def test_byte_count_follows_inserts_and_evictions(rng):
    """``nbytes`` (kept as entries come and go) always equals ``resident_bytes``
    over every record the entries hold, shared records counted once, through
    inserts of dense and shared entries, leases and budget evictions."""
    from kvstate.kinds.shared import resident_bytes

    sizes = [3, 8, 5, 12, 8, 2, 9, 6, 4, 10, 7, 11]
    one = sum(s.nbytes for s in entry(rng, 8)[0])
    cache, shared = PrefixCache(3 * one), 0
    for i, n in enumerate(sizes):
        tokens = [i % 3] * 4 + [100 + i] * (n - 4) if n > 4 else [i % 3] * n
        hit = cache.lookup(tokens + [7])
        if hit is not None and hit.matched < n:  # a longer entry built on the leased rows
            extra = mx.array(rand(rng, 1, H, n - hit.matched, D))
            cache.insert(tokens, [kv.append(s, extra, extra) for s in hit.states])
            shared += 1
        elif hit is None:
            cache.insert(tokens, entry(rng, n)[0])
        if hit is not None:
            hit.release()
        assert cache.nbytes == resident_bytes(cache.records())
        assert cache.nbytes <= cache.max_bytes or cache.pinned
    assert cache.evictions > 0 and shared > 0


def test_save_load_round_trip_and_identity(rng, tmp_path):
    a, a_rows = entry(rng, 5)
    cache = PrefixCache(1 << 20, identity="model-a")
    cache.insert([4, 5, 6, 7, 8], a)
    with cache.lookup([4, 5, 6, 7, 8, 9]) as hit:
        t = mx.array(rand(rng, 1, H, 2, D))
        cache.insert([4, 5, 6, 7, 8, 9, 10], [kv.append(s, t, t) for s in hit.states])
    path = tmp_path / "prefixes.safetensors"
    cache.save(path)
    back = PrefixCache.load(path, 1 << 20, identity="model-a")
    assert len(back) == 2 and back.identity == "model-a"
    hit = back.lookup([4, 5, 6, 7, 8, 1])
    for s, (k, v) in zip(hit.states, a_rows):
        got = visible(kv.materialize(s))[0]
        np.testing.assert_array_equal(got[0], k)
        np.testing.assert_array_equal(got[1], v)
    with pytest.raises(kv.KVStateError, match="another model"):
        PrefixCache.load(path, 1 << 20, identity="model-b")
    anon = PrefixCache(1 << 20)
    anon.insert([1, 2], entry(rng, 2)[0])
    anon.save(tmp_path / "anon.safetensors")
    with pytest.raises(kv.KVStateError, match="no model identity"):
        PrefixCache.load(tmp_path / "anon.safetensors", 1 << 20, identity="model-a")


def test_model_identity_of_a_file_and_refusals(tmp_path):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"abc")
    g = tmp_path / "v.gguf"
    g.write_bytes(b"abd")
    assert model_identity(f) != model_identity(g) and len(model_identity(f)) == 64
    with pytest.raises(kv.KVStateError, match="path"):
        model_identity(tmp_path / "missing")
    cache = PrefixCache(10)
    with pytest.raises(kv.KVStateError, match="tokens"):
        cache.insert([1, 2, 3], entry(np.random.default_rng(1), 2)[0])
    with pytest.raises(kv.KVStateError, match="max_bytes"):
        PrefixCache(-1)
    assert len(cache) == 0


def test_insert_row_copies_one_row_cut_to_its_tokens_and_replaces_its_prefixes(rng):
    """A finished request's row: ``insert_row`` stores the row's first ``len(tokens)``
    tokens (a compact copy of its own tokens, its prefix still shared) and drops the
    unpinned entries whose tokens are a strict prefix of them; a pinned one stays."""
    base, rows = entry(rng, 6)
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3, 4, 5, 6], base)
    cache.insert([1, 2], entry(rng, 2)[0])
    cache.insert([1, 9], entry(rng, 2)[0])  # not a prefix of what follows
    with cache.lookup([1, 2, 3, 4, 5, 6, 7]) as hit:
        assert hit.matched == 6
        own = [rand(rng, 1, H, 3, D) for _ in range(LAYERS)]
        batch = [  # row 1 reads the entry's 6 tokens, then writes 3 of its own
            kv.merge_rows([kv.fork(o, 0, 0), kv.append(s, mx.array(x), mx.array(x))])
            for o, s, x in zip(entry(rng, 2)[0], hit.states, own)
        ]
        assert batch[0].lengths == (2, 9)
        pinned = cache.pin([1, 2])
        with pytest.raises(kv.KVStateError, match="at most 9"):
            cache.insert_row(list(range(10)), batch, 1)
        with pytest.raises(kv.KVStateError, match="row"):
            cache.insert_row([1], batch, 2)
        assert len(cache) == 3  # refused calls change nothing
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]  # the row's first 8 tokens (its last one left out)
    assert cache.insert_row(tokens, batch, 1)  # (the row left: [1..6] no longer pinned)
    pinned.release()
    assert set(cache._entries) == {(1, 2), (1, 9), tuple(tokens)}  # [1..6] gave way
    for s, r, (k, v), x in zip(cache._entries[tuple(tokens)].states, base, rows, own):
        assert s.prefixes == (r,) and s.suffix.lengths == (2,)  # the prefix shared, not copied
        got = visible(kv.materialize(s))[0]
        np.testing.assert_array_equal(got[0], np.concatenate([k, x[0, :, :2]], axis=1))
        np.testing.assert_array_equal(got[1], np.concatenate([v, x[0, :, :2]], axis=1))


def test_a_copy_holds_the_same_records_and_goes_its_own_way(rng):
    cache = PrefixCache(1 << 20, identity="m")
    a, _ = entry(rng, 6)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    lease = cache.lookup([1, 2, 3, 9])
    twin = cache.copy()
    assert twin.keys() == cache.keys() and twin.identity == "m" and twin.max_bytes == 1 << 20
    assert twin.nbytes == cache.nbytes and twin.pinned == 0 and cache.pinned == 1
    assert all(
        x is y for x, y in zip(twin._entries[(1, 2, 3, 4, 5, 6)].states, cache.records())
    )  # the same record values: nothing copied
    b, _ = entry(rng, 3)
    twin.insert([7, 8, 9], b)
    twin._drop((1, 2, 3, 4, 5, 6))
    assert cache.keys() == [(1, 2, 3, 4, 5, 6)] and twin.keys() == [(7, 8, 9)]
    lease.release()
