"""Compressed rows across the compile boundary (``kvstate.kinds.compressed``'s
``compiled`` registrations): ``kv.flatten``/``unflatten`` and the compiled
decoder, against the eager bridge loop (``kvstate.mlx_lm.step``) in the same
process: greedy tokens equal, logits within ``_tol.atol`` (float32), the same
kept positions, through eviction and compaction, with a constant trace count."""

import attrs
import mlx.core as mx
import pytest
from _tol import atol

import kvstate as kv
import kvstate.compiled.boundary as kc
from kvstate import mlx_lm as km
from kvstate.kinds import compressed as C
from tests.tiny_models import llama_model, prompt

ATOL = atol(mx.float32)
POLICIES = ("sinks", "snapkv", "h2o")


@pytest.fixture(scope="module")
def model():
    return llama_model(layers=2)


def _rows(model, policy, lens=(40, 29), budget=24, step=16):
    """Ragged rows prefilled (the prompts longer than the budget), capacity step ``step``."""
    prompts = [prompt(10 + i, n) for i, n in enumerate(lens)]
    logits, states = km.prefill(model, prompts, kv_budget=budget, policy=policy)
    return logits, [attrs.evolve(s, step=step) for s in states]


def _squeezed(states):
    return [s for s in states if isinstance(s, kv.CompressedState)]


def _kept_scores(s):
    """Each row's folded scores and recent slots at its kept columns, in position order
    (the slots matter for a rollback, which subtracts them)."""
    cols = [mx.array(c) for c in C.kept_columns(s)]
    return mx.concatenate(
        [mx.concatenate([s.score[b][c], s.recent[b][:, c].reshape(-1)]) for b, c in enumerate(cols)]
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_decode_equals_eager_through_eviction(model, policy, monkeypatch):
    flattened = []  # the steps that took the general path (prepare, flatten)
    real = kc.flatten
    monkeypatch.setattr(kc, "flatten", lambda *a, **k: flattened.append(t) or real(*a, **k))
    logits, states = _rows(model, policy)
    dec = km.compiled_decoder(model, attention="mask")
    te = tc = mx.argmax(logits, axis=-1)
    se = sc = states
    worst, traces, compacted, caps, t = 0.0, None, False, set(), -1
    for t in range(56):
        le, se = km.step(model, te, se)
        before = _squeezed(sc)[0].held
        lc, sc = dec(tc, sc)
        compacted |= any(a > b for a, b in zip(before, _squeezed(sc)[0].held))
        caps.add(_squeezed(sc)[0].capacity)
        worst = max(worst, mx.abs(le - lc).max().item())
        te, tc = mx.argmax(le, axis=-1), mx.argmax(lc, axis=-1)
        assert te.tolist() == tc.tolist(), f"greedy tokens differ at step {t}"
        for a, b in zip(_squeezed(se), _squeezed(sc)):
            assert C.kept_positions(a) == C.kept_positions(b), f"kept columns differ at step {t}"
            assert (a.lengths, a.kept, a.floor) == (b.lengths, b.kept, b.floor)
            if a.scored:  # (where few columns compete, a wrong score may still evict alike)
                assert mx.allclose(_kept_scores(a), _kept_scores(b), atol=ATOL).item()
        if t == 28:  # (a new capacity bucket while the first marks are within reach)
            traces = dec.traces
    assert worst <= ATOL
    # evicted every step; compacted outside the compiled call, in at most two buckets
    assert all(len(e) > 0 for e in _squeezed(sc)[0].evictions)
    assert compacted and len(caps) <= 2
    assert dec.traces == traces, dec.trace_reasons
    # the compiled records' bookkeeping rolls back as the eager ones' does
    for a, b in zip(_squeezed(se), _squeezed(sc)):
        a, b = kv.trim(a, 5), kv.trim(b, 5)
        assert C.kept_positions(a) == C.kept_positions(b)
        if a.scored:
            assert mx.allclose(_kept_scores(a), _kept_scores(b), atol=ATOL).item()
    # the steady path (no per-layer host work) between compactions
    assert 0 < len(set(flattened)) < 12, sorted(set(flattened))


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_blocks_equal_eager(model, policy):
    """A verify-sized block (4 tokens per row), and for ``snapkv`` a prompt chunk
    (longer than ``observe``: it ranks every column), through the decoder."""
    _, states = _rows(model, policy)
    dec = km.compiled_decoder(model, attention="mask")
    for n in (4, 40) if policy == "snapkv" else (4,):
        toks = mx.array([prompt(30, n), prompt(31, n)])
        le, se = km.forward(model, toks, states)
        lc, sc = dec(toks, states)
        assert mx.abs(le - lc).max().item() <= ATOL
        for a, b in zip(_squeezed(se), _squeezed(sc)):
            assert C.kept_positions(a) == C.kept_positions(b)
            assert (a.lengths, a.kept, a.floor) == (b.lengths, b.kept, b.floor)
            if a.scored:
                assert mx.allclose(_kept_scores(a), _kept_scores(b), atol=ATOL).item()
        states = se


@pytest.mark.parametrize("policy", POLICIES)
def test_flatten_unflatten_round_trip(model, policy):
    _, states = _rows(model, policy)
    s = _squeezed(states)[0]
    flat, spec = kv.flatten(s)
    assert len(flat.planes) == (6 if s.scored else 4)
    assert [p.tolist() for p in flat.positions] == [
        list(s.lengths),
        list(s.held),
        [k - n for k, n in zip(s.kept, s.budget)],  # the columns the next append marks
    ]
    static = (("policy", policy), ("sinks", 4), ("window", 16), ("margin", 16), ("observe", 32))
    assert spec.key == (kv.CompressedState, (*static, ("step", 16)), False)
    back, ready = kv.unflatten(spec, flat), kc.prepare(s)  # (flatten moves it to its bucket)
    assert back.capacity == ready.capacity == 48 < s.capacity
    assert all(mx.array_equal(a, b) for a, b in zip(kv.fetch(back), kv.fetch(s)))
    for f in attrs.fields(kv.CompressedState):
        a, b = getattr(back, f.name), getattr(ready, f.name)
        if isinstance(a, mx.array):
            assert mx.array_equal(a, b), f.name
        elif f.name != "row_ids":
            assert a == b, f.name
    # the spec of a later record has new rows, the same key: no trace per token
    later = km.step(model, mx.array([1, 2]), states)[1]
    assert kc.spec_of(_squeezed(later)[0]).key == spec.key
    with pytest.raises(kv.KVStateError, match="planes"):
        kv.unflatten(spec, flat.planes[:-1])
