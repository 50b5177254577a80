"""Compressed rows (``kv.compressed``): the bridge against mlx-lm's KVCache while
nothing is evicted, the read against numpy over exactly the kept columns after
eviction, rollback laws, and bad arguments."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
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
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_logits_equal_full_kv_before_any_eviction(request, arch, policy):
    """Budget above every length: each step's logits are mlx-lm's caches' (gemma3: its
    sliding layers stay rings beside the compressed full-attention layers)."""
    model = request.getfixturevalue(arch)
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
    squeezed = [s for s in states if isinstance(s, kv.CompressedState)]
    assert squeezed and all(s.kept == (18,) and not s.evictions[0] for s in squeezed)


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


@settings(max_examples=15, deadline=None)
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
@settings(max_examples=10, deadline=None)
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


# --- the state machine against a numpy model of the rows ---------------------------------


H_K, H_Q, DIM, SCALE = 2, 4, 4, 0.5


def _replay(blocks, budget, policy, sinks=1, window=2, observe=3):
    """The specification: a row that saw ``blocks`` (``(k, v, q)`` numpy, ``[H, N, D]``),
    each appended as one block and read by its queries. Returns ``(kept positions,
    {position: score}, outputs of the last block [Hq, N, D])``."""
    kept, score, t, out = [], {}, 0, None
    for k, _v, q in blocks:
        N = k.shape[1]
        if len(kept) > budget and not (policy == "snapkv" and N > observe):
            cand = sorted((score[p], p) for p in kept if p >= sinks and p < t - window)
            gone = {p for _, p in cand[: len(kept) - budget]}
            kept = [p for p in kept if p not in gone]
        kept = kept + list(range(t, t + N))
        for i in range(N):
            score[t + i] = 0.0
        out = np.zeros((H_Q, N, DIM))
        contrib = np.zeros((N, len(kept)))
        for i in range(N):
            p = t + i
            vis = [j for j, x in enumerate(kept) if x <= p]
            keys = np.stack([_ALL[0][x] for x in (kept[j] for j in vis)], axis=1)
            vals = np.stack([_ALL[1][x] for x in (kept[j] for j in vis)], axis=1)
            rep = H_Q // H_K
            kk = np.repeat(keys, rep, axis=0).astype(np.float64)
            vv = np.repeat(vals, rep, axis=0).astype(np.float64)
            s = np.einsum("hd,htd->ht", q[:, i].astype(np.float64), kk) * SCALE
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, i] = np.einsum("ht,htd->hd", w, vv)
            contrib[i, vis] = w.sum(0)
        if policy == "h2o":
            for j, x in enumerate(kept):
                score[x] += contrib[:, j].sum()
        elif policy == "snapkv" and N > observe:
            c = contrib.copy()
            c[: N - observe] = 0
            half = C.POOL // 2
            pad = np.pad(c, ((0, 0), (half, half)))
            pooled = np.max([pad[:, s : s + len(kept)] for s in range(C.POOL)], axis=0)
            score = {x: pooled[:, j].sum() for j, x in enumerate(kept)}
        t += N
    return kept, score, out


_ALL: list = [{}, {}]  # position -> key / value of the row being replayed (set per row)


class CompressedRows(RuleBasedStateMachine):
    """Rows of one policy driven by appends (read and scored, as the bridge does),
    checkpoints, rollbacks, trims, filters and merges; after each step every row
    equals its replay: kept positions, scores of kept columns, the last read."""

    @initialize(
        policy=st.sampled_from(POLICIES),
        budgets=st.lists(st.integers(3, 6), min_size=1, max_size=3),
        seed=st.integers(0, 2**16),
    )
    def start(self, policy, budgets, seed):
        self.policy, self.rng = policy, np.random.default_rng(seed)
        self.s = kv.compressed(
            len(budgets), budgets, policy=policy, sinks=1, window=2, margin=4, observe=3, step=4
        )
        self.rows = [{"budget": b, "blocks": []} for b in budgets]
        self.cp = None
        self.out = None

    def _tokens(self, row) -> int:
        return sum(k.shape[1] for k, _, _ in row["blocks"])

    @rule(n=st.integers(1, 5))
    def append(self, n):
        B = self.s.batch_size
        k = self.rng.standard_normal((B, H_K, n, DIM)).astype(np.float32)
        v = self.rng.standard_normal((B, H_K, n, DIM)).astype(np.float32)
        q = self.rng.standard_normal((B, H_Q, n, DIM)).astype(np.float32)
        self.s = kv.append(self.s, mx.array(k), mx.array(v))
        out, self.s = C.attend_and_score(self.s, mx.array(q), scale=SCALE, n=n)
        self.out = np.array(out)
        for b, row in enumerate(self.rows):
            row["blocks"].append((k[b], v[b], q[b]))

    @rule()
    def checkpoint(self):
        self.cp = (kv.checkpoint(self.s), [self._tokens(r) for r in self.rows])

    @precondition(lambda self: self.cp is not None and self.cp[0].row_ids == self.s.row_ids)
    @rule(data=st.data())
    def rollback(self, data):
        cp, base = self.cp
        if any(self._tokens(r) < t0 for r, t0 in zip(self.rows, base)):  # trimmed below it
            with pytest.raises(kv.KVStateError, match="checkpoint \\+ keep for row"):
                kv.rollback(self.s, cp, 0)
            return
        keep = [data.draw(st.integers(0, self._tokens(r) - t0)) for r, t0 in zip(self.rows, base)]
        target = [t0 + a for t0, a in zip(base, keep)]
        if not self._cuttable(target):
            return
        if any(t < f for t, f in zip(target, self.s.floor)):
            with pytest.raises(kv.KVStateError, match="checkpoint \\+ keep for row"):
                kv.rollback(self.s, cp, keep)
            return
        self.s = kv.rollback(self.s, cp, keep)
        for r, t in zip(self.rows, target):
            self._cut(r, t)
        self.out = None

    @rule(n=st.integers(0, 3))
    def trim(self, n):
        if any(L - n < f for L, f in zip(self.s.lengths, self.s.floor)) or any(
            L < n for L in self.s.lengths
        ):
            with pytest.raises(kv.KVStateError):
                kv.trim(self.s, n)
            return
        if not self._cuttable([self._tokens(r) - n for r in self.rows]):
            return
        self.s = kv.trim(self.s, n)
        for r in self.rows:
            self._cut(r, self._tokens(r) - n)
        self.out = None

    def _cuttable(self, target) -> bool:
        """Whether cutting to ``target`` is inside the law: snapkv scores a block by its
        length (longer than ``observe``), so a cut inside such a block keeps scores a
        shorter block would not have given (``notes/kinds.md``)."""
        if self.policy != "snapkv":
            return True
        for row, t in zip(self.rows, target):
            seen = 0
            for k, _, _ in row["blocks"]:
                n = k.shape[1]
                if seen < t < seen + n and n > 3:
                    return False
                seen += n
        return True

    def _cut(self, row, t):
        """The row's history cut to its first ``t`` tokens (the last block shortened)."""
        out, seen = [], 0
        for k, v, q in row["blocks"]:
            n = k.shape[1]
            if seen + n <= t:
                out.append((k, v, q))
            elif seen < t:
                m = t - seen
                out.append((k[:, :m], v[:, :m], q[:, :m]))
            seen += n
        row["blocks"] = out

    @rule(data=st.data())
    def filter(self, data):
        B = self.s.batch_size
        rows = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=3))
        self.s = kv.filter_rows(self.s, rows)
        self.rows = [dict(self.rows[r], blocks=list(self.rows[r]["blocks"])) for r in rows]
        self.out = None

    @precondition(lambda self: self.s.batch_size < 4)
    @rule(budget=st.integers(3, 6))
    def merge_an_empty_row(self, budget):
        new = kv.compressed(
            1, budget, policy=self.policy, sinks=1, window=2, margin=4, observe=3, step=4
        )
        self.s = kv.merge_rows([self.s, new])
        self.rows.append({"budget": budget, "blocks": []})
        self.out = None

    @invariant()
    def rows_equal_their_replay(self):
        got = C.kept_positions(self.s)
        total = None if not self.s.scored or self.s.keys is None else np.array(C._total(self.s))
        cols = C.kept_columns(self.s)
        for b, row in enumerate(self.rows):
            flat_k = [k[:, i] for k, _, _ in row["blocks"] for i in range(k.shape[1])]
            flat_v = [v[:, i] for _, v, _ in row["blocks"] for i in range(v.shape[1])]
            _ALL[0] = dict(enumerate(flat_k))
            _ALL[1] = dict(enumerate(flat_v))
            kept, score, out = _replay(row["blocks"], row["budget"], self.policy)
            assert got[b] == kept, (b, got[b], kept)
            assert self.s.lengths[b] == len(flat_k)
            if total is not None and kept:
                np.testing.assert_allclose(
                    total[b, cols[b]], [score[p] for p in kept], rtol=1e-4, atol=1e-4
                )
            if self.out is not None and row["blocks"]:
                n = row["blocks"][-1][0].shape[1]
                np.testing.assert_allclose(self.out[b, :, :n], out, atol=1e-4)


TestCompressedRows = CompressedRows.TestCase
TestCompressedRows.settings = settings(max_examples=20, stateful_step_count=10, deadline=None)


# --- rows that leave and come back: poison, fork, save/load -------------------------------


def _filled(lengths, policy="h2o", seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        s = kv.compressed(1, 5, policy=policy, sinks=1, window=2, margin=4, observe=3, step=4)
        for block in (n, 1, 1):  # a block, then two steps: rows past 5 mark columns
            k, v, q = (
                mx.array(rng.standard_normal(sh).astype(np.float32))
                for sh in ((1, 2, block, 4), (1, 2, block, 4), (1, 4, block, 4))
            )
            s = _scored_append(s, k, v, q)
        rows.append(s)
    return kv.merge_rows(rows)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_rejected_draft_cannot_poison_its_row(poison):
    s = _filled([6, 3, 9])
    cp = kv.checkpoint(s)
    rng = np.random.default_rng(1)
    draft = mx.concatenate(
        [mx.full((1, 2, 3, 4), poison), mx.array(rng.standard_normal((2, 2, 3, 4)), mx.float32)]
    )
    q = mx.array(rng.standard_normal((3, 4, 3, 4)), mx.float32)
    r = kv.rollback(_scored_append(s, draft, draft, q), cp, [0, 3, 1])
    step = mx.array(rng.standard_normal((3, 2, 1, 4)), mx.float32)
    q1 = mx.array(rng.standard_normal((3, 4, 1, 4)), mx.float32)
    r = _scored_append(r, step, step, q1)
    out, _ = C.read(r, q1, scale=0.5)
    assert np.isfinite(np.array(out)).all() and np.isfinite(np.array(C._total(r))).all()
    for b in range(3):
        alone, _ = C.read(kv.extract_row(r, b), q1[b : b + 1], scale=0.5)
        np.testing.assert_allclose(np.array(out[b : b + 1]), np.array(alone), atol=1e-5)


def test_fork_copies_the_row_and_save_load_round_trips(tmp_path):
    s = _filled([6, 9], seed=3)
    assert any(s.evictions)  # marked columns travel too
    forked = kv.fork(s, 1, 2)
    assert C.kept_positions(forked) == C.kept_positions(s) + [C.kept_positions(s)[1]] * 2
    np.testing.assert_array_equal(np.array(C._total(forked))[2], np.array(C._total(s))[1])
    path = tmp_path / "rows.safetensors"
    kv.save(path, [s])
    (back,) = kv.load(path)[0]
    assert (back.lengths, back.held, back.kept, back.floor, back.evictions) == (
        s.lengths,
        s.held,
        s.kept,
        s.floor,
        s.evictions,
    )
    rng = np.random.default_rng(4)
    k, q = (mx.array(rng.standard_normal(sh), mx.float32) for sh in ((2, 2, 1, 4), (2, 4, 1, 4)))
    a, b = _scored_append(s, k, k, q), _scored_append(back, k, k, q)
    assert C.kept_positions(a) == C.kept_positions(b)
    np.testing.assert_array_equal(
        np.array(C.read(a, q, scale=0.5)[0]), np.array(C.read(b, q, scale=0.5)[0])
    )
    assert kv.rollback(a, kv.checkpoint(s), 0).lengths == s.lengths


# --- speculative decoding on compressed rows ----------------------------------------------


def _greedy(model, prompts, T, **make):
    logits, states = km.prefill(model, prompts, **make)
    y = mx.argmax(logits, axis=-1)
    out = [[t] for t in y.tolist()]
    for _ in range(T):
        logits, states = km.step(model, y, states)
        y = mx.argmax(logits, axis=-1)
        for o, t in zip(out, y.tolist()):
            o.append(t)
    return out, states


def _speculate(model, prompts, T, **make):
    from kvstate.speculative import rounds as sp
    from kvstate.speculative.drafts import Lookup

    drafter = Lookup(min_ngram=1)
    batch = sp.start(model, prompts, drafter=drafter, num_draft=3, **make)
    accepted = 0
    while min(len(c) - len(p) for c, p in zip(batch.context, prompts)) < T + 1:
        batch, r = sp.step(model, batch, drafter=drafter)
        accepted += sum(r.accepted)
    return (
        [list(c[len(p) : len(p) + T + 1]) for c, p in zip(batch.context, prompts)],
        batch,
        accepted,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_speculative_greedy_equals_plain_within_the_budget(model, policy):
    """Verify blocks, per-row rollback and their scores through the bridge: with the
    budget above every length, speculation gives the plain loop's tokens."""
    prompts = [(prompt(3, 4) * 4)[:13], (prompt(4, 3) * 4)[:9]]
    make = {"kv_budget": 64, "policy": policy}
    got, _, accepted = _speculate(model, prompts, 10, **make)
    want, _ = _greedy(model, prompts, 10, **make)
    assert got == want and accepted > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_speculative_rounds_keep_rows_bounded_and_valid(model, policy):
    """Past the budget: rounds give back rejected drafts within the margin, and every
    row keeps at most its budget (plus the last block) after each round."""
    prompts = [(prompt(5, 4) * 6)[:21], (prompt(6, 3) * 6)[:15]]
    make = {"kv_budget": 8, "policy": policy, "kv_sinks": 1, "kv_window": 2, "kv_margin": 6}
    got, batch, _ = _speculate(model, prompts, 12, **make)
    assert all(len(g) == 13 for g in got)
    for s in batch.states:
        kv.CompressedState(
            **{
                f: getattr(s, f)
                for f in ("lengths", "held", "kept", "floor", "budget", "evictions")
            },
            policy=s.policy,
            sinks=s.sinks,
            window=s.window,
            margin=s.margin,
            observe=s.observe,
            step=s.step,
            keys=s.keys,
            values=s.values,
            pos=s.pos,
            dropped=s.dropped,
            score=s.score,
            recent=s.recent,
        )  # validated
        assert all(k <= 8 + 4 for k in s.kept)  # budget + the last verify block (1 + 3)
