"""Compressed rows (``kv.compressed``): the bridge against mlx-lm's KVCache while
nothing is evicted, the read against numpy over exactly the kept columns after
eviction, rollback laws, and bad arguments."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as lm_cache

import kvstate as kv
from kvstate import mlx_lm as km
from kvstate.kinds import compressed as C
from tests.tiny_models import llama_model, prompt

POLICIES = ("sinks", "snapkv", "h2o")


@pytest.fixture(scope="module")
def model():
    return llama_model()


@pytest.mark.parametrize("policy", POLICIES)
def test_logits_equal_full_kv_before_any_eviction(model, policy):
    """Budget above every length: each step's logits are mlx-lm's KVCache's."""
    toks = prompt(0, 12)
    states = km.make_states(model, 1, kv_budget=64, policy=policy)
    cache = lm_cache.make_prompt_cache(model)
    logits, states = km.forward(model, mx.array([toks]), states)
    ref = model(mx.array([toks]), cache=cache)
    np.testing.assert_allclose(np.array(logits), np.array(ref), atol=1e-5)
    for _ in range(6):
        nxt = mx.array([[int(mx.argmax(ref[0, -1]))]])
        logits, states = km.forward(model, nxt, states)
        ref = model(nxt, cache=cache)
        np.testing.assert_allclose(np.array(logits), np.array(ref), atol=1e-5)
    assert states[0].kept == (18,) and not states[0].evictions[0]


def _numpy_attention(q, keys, values, scale):
    """q [Hq, D] against keys/values [Hk, T, D] (GQA by repetition), float64."""
    Hq, Hk = q.shape[0], keys.shape[0]
    k = np.repeat(keys, Hq // Hk, axis=0).astype(np.float64)
    v = np.repeat(values, Hq // Hk, axis=0).astype(np.float64)
    s = np.einsum("hd,htd->ht", q.astype(np.float64), k) * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("ht,htd->hd", w, v)


class _Rows:
    """The numpy model: per row every token seen (keys, values by position) and the
    positions kept under the ``sinks`` policy."""

    def __init__(self, B, budget, sinks):
        self.budget, self.sinks = budget, sinks
        self.k = [[] for _ in range(B)]
        self.v = [[] for _ in range(B)]
        self.kept = [[] for _ in range(B)]

    def append(self, b, ks, vs):
        n = len(self.k[b])
        keep = self.kept[b]
        if len(keep) > self.budget[b]:  # mark before writing: oldest non-sink go
            extra = len(keep) - self.budget[b]
            cand = [p for p in keep if p >= self.sinks]
            gone = set(cand[:extra])
            keep = [p for p in keep if p not in gone]
        self.kept[b] = keep + list(range(n, n + len(ks)))
        self.k[b] += ks
        self.v[b] += vs


@settings(max_examples=25, deadline=None)
@given(
    budgets=st.lists(st.integers(3, 7), min_size=1, max_size=3),
    blocks=st.lists(st.lists(st.integers(1, 3), min_size=3, max_size=3), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_sinks_rows_and_read_match_numpy(budgets, blocks, seed):
    """Ragged blocks on rows of different budgets: the kept positions are the numpy
    model's, and each query's output is numpy attention over its row's kept columns
    (causal by position)."""
    B = len(budgets)
    rng = np.random.default_rng(seed)
    s = kv.compressed(B, budgets, sinks=1, window=2, margin=3, step=4)
    model = _Rows(B, budgets, 1)
    for block in blocks:
        N = block[0]
        k = rng.standard_normal((B, 2, N, 4)).astype(np.float32)
        v = rng.standard_normal((B, 2, N, 4)).astype(np.float32)
        s = kv.append(s, mx.array(k), mx.array(v))
        for b in range(B):
            model.append(b, list(k[b].transpose(1, 0, 2)), list(v[b].transpose(1, 0, 2)))
        assert C.kept_positions(s) == model.kept
        q = rng.standard_normal((B, 4, N, 4)).astype(np.float32)
        out, _ = C.read(s, mx.array(q), scale=0.5)
        out = np.array(out)
        for b in range(B):
            L = len(model.k[b])
            for i in range(N):
                p = L - N + i
                seen = [x for x in model.kept[b] if x <= p]
                keys = np.stack([model.k[b][x] for x in seen], axis=1)
                vals = np.stack([model.v[b][x] for x in seen], axis=1)
                ref = _numpy_attention(q[b, :, i], keys, vals, 0.5)
                np.testing.assert_allclose(out[b, :, i], ref, atol=1e-5)


def _scored_append(s, k, v, q):
    s = kv.append(s, k, v)
    _, s = C.attend_and_score(s, q, scale=0.5, n=k.shape[2])
    return s


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None)
@given(
    warm=st.lists(st.integers(1, 7), min_size=2, max_size=6),
    draft=st.integers(1, 4),
    accepted=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_rollback_equals_appending_only_the_accepted(policy, warm, draft, accepted, seed):
    """checkpoint, append a block (its evictions and scores too), rollback keeping
    ``a`` == appending only the first ``a`` tokens: same kept positions, same
    scores, and the next read is the same. (Drafts of at most ``observe`` tokens:
    snapkv scores only longer blocks, a prompt.)"""
    accepted = min(accepted, draft)
    rng = np.random.default_rng(seed)

    def arrays(n):
        return [
            mx.array(rng.standard_normal(sh).astype(np.float32))
            for sh in ((1, 2, n, 4), (1, 2, n, 4), (1, 4, n, 4))
        ]

    s = kv.compressed(1, 6, policy=policy, sinks=1, window=2, margin=4, observe=4, step=4)
    for n in warm:
        s = _scored_append(s, *arrays(n))
    cp = kv.checkpoint(s)
    k, v, q = arrays(draft)
    tried = kv.rollback(_scored_append(s, k, v, q), cp, accepted)
    plain = (
        s
        if accepted == 0
        else _scored_append(s, k[:, :, :accepted], v[:, :, :accepted], q[:, :, :accepted])
    )
    assert C.kept_positions(tried) == C.kept_positions(plain)
    assert tried.lengths == plain.lengths and tried.kept == plain.kept
    k2, v2, q2 = arrays(2)
    a, b = _scored_append(tried, k2, v2, q2), _scored_append(plain, k2, v2, q2)
    assert C.kept_positions(a) == C.kept_positions(b)
    oa, _ = C.read(a, q2, scale=0.5)
    ob, _ = C.read(b, q2, scale=0.5)
    np.testing.assert_allclose(np.array(oa), np.array(ob), atol=1e-5)
    if policy != "sinks":
        cols_a, cols_b = C.kept_columns(a)[0], C.kept_columns(b)[0]
        sa = np.array(C._total(a))[0, cols_a]
        sb = np.array(C._total(b))[0, cols_b]
        np.testing.assert_allclose(sa, sb, atol=1e-5)


def test_rollback_past_the_margin_is_refused():
    s = kv.compressed(1, 4, sinks=1, window=2, margin=2, step=4)
    k = mx.zeros((1, 1, 6, 4))
    s = kv.append(s, k, k)
    with pytest.raises(kv.KVStateError, match=r"lengths - n for row 0: expected in \[4, 6\]"):
        kv.trim(s, 3)
    assert kv.trim(s, 2).lengths == (4,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"budget": 5, "sinks": 4, "window": 2},
            r"budget\[0\]: expected >= sinks \+ window = 6, got 5",
        ),
        ({"budget": 64, "policy": "lru"}, r"policy: expected one of"),
        ({"budget": 64, "margin": 0}, r"margin: expected >= 1, got 0"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(kv.KVStateError, match=match):
        kv.compressed(1, **kwargs)


def test_make_states_refusals(model):
    with pytest.raises(kv.KVStateError, match="max_kv_size: expected None with kv_budget"):
        km.make_states(model, 1, kv_budget=64, max_kv_size=128)
    with pytest.raises(kv.KVStateError, match="policy: expected None without kv_budget"):
        km.make_states(model, 1, policy="h2o")
    with pytest.raises(kv.KVStateError, match="policy: expected one of"):
        km.make_states(model, 1, kv_budget=64, policy="nope")


def test_rows_move_filter_merge_extract(model):
    """Ragged rows: filter, merge and extract keep each row's columns and scores."""
    a = km.make_states(model, 1, kv_budget=24, policy="h2o")
    b = km.make_states(model, 1, kv_budget=32, policy="h2o")
    _, a = km.forward(model, mx.array([prompt(1, 30)]), a)
    _, b = km.forward(model, mx.array([prompt(2, 9)]), b)
    m = kv.merge_rows([a[0], b[0]])
    assert m.lengths == (30, 9) and m.budget == (24, 32)
    assert C.kept_positions(m) == C.kept_positions(a[0]) + C.kept_positions(b[0])
    back = kv.extract_row(m, 0)
    assert C.kept_positions(back) == C.kept_positions(a[0])
    f = kv.filter_rows(m, [1])
    np.testing.assert_array_equal(np.array(kv.fetch(f)[0]), np.array(kv.fetch(b[0])[0]))
