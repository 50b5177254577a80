"""Grammar rows draft: a row's matcher steps over its drafts to mask each verified
position and back (``kvstate.serving.grammar.fill``), so structured output runs with
batched speculative decoding and keeps exactly the tokens it has without it.

A tiny random llama with SmolLM2's tokenizer and vocabulary (the grammar engine on the
real vocabulary; rounds take milliseconds)."""

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.models.gguf import Loaded
from kvstate.models.load import tiny_llama
from kvstate.serving.grammar import Grammar, Grammars, fill, matcher
from kvstate.serving.scheduler import Job, Scheduler
from kvstate.speculative import rounds
from kvstate.speculative.drafts import DraftModel, Lookup

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Ann", "Bob", "Cyd"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {"enum": ["red", "green", "blue"]},
    "minItems": 1,
    "maxItems": 6,
}
EXAMPLE = 'Copy: {"name":"Bob","age":42,"ok":true} {"name":"Bob","age":42,"ok":true}'
DIGITS = "[0-9]{1,8}"


@pytest.fixture(scope="module")
def tiny(smollm):
    V = smollm.model.args.vocab_size
    model = tiny_llama(0, layers=2, hidden=64, heads=2, kv_heads=1, vocab=V)
    return Loaded(model, smollm.tokenizer, "tiny llama, SmolLM2 tokenizer")


@pytest.fixture(scope="module")
def grammars(smollm):
    return Grammars(smollm.tokenizer, smollm.model.args.vocab_size)


def _words(m, V: int) -> np.ndarray:
    """The matcher's next-token bitmask (no change to it)."""
    return np.array(fill([m], V)[0, 0])


def _valid_path(m, V: int, picks: list) -> list:
    """Tokens the grammar allows one after another, ``picks[i]`` choosing among the
    allowed ones; ``m`` consumes them."""
    out = []
    for p in picks:
        bits = np.unpackbits(_words(m, V).view(np.uint8), bitorder="little")[:V]
        allowed = np.flatnonzero(bits)
        if not len(allowed) or m.is_stopped():
            break
        t = int(allowed[p % len(allowed)])
        assert m.consume_token(t)
        out.append(t)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=10), data=st.data())
def test_rollback_of_j_of_k_tokens_equals_consuming_k_minus_j(smollm, grammars, picks, data):
    """llguidance's rollback is exact: consume ``k`` tokens, roll ``j`` back, and the
    matcher's mask, acceptance and next steps equal those of one that consumed ``k - j``."""
    V = smollm.model.args.vocab_size
    g = grammars.compile(Grammar("json_schema", SCHEMA))
    walker = matcher(g)
    path = _valid_path(walker, V, picks)
    j = data.draw(st.integers(0, len(path)), label="j")
    a, b = matcher(g), matcher(g)
    assert a.consume_tokens(path) and a.rollback(j)
    assert b.consume_tokens(path[: len(path) - j])
    assert (_words(a, V) == _words(b, V)).all()
    assert (a.is_accepting(), a.is_stopped()) == (b.is_accepting(), b.is_stopped())
    rest = path[len(path) - j :]
    assert a.consume_tokens(rest) and b.consume_tokens(rest)
    assert (_words(a, V) == _words(b, V)).all()


def test_fill_masks_each_position_and_leaves_the_matchers_as_they_were(smollm, grammars):
    """Position ``i`` of a row is the mask after its first ``i`` drafts; a draft the
    grammar refuses ends the row's masks (later positions free); a free row is free;
    every matcher is where it was."""
    tok, V = smollm.tokenizer, smollm.model.args.vocab_size
    g = grammars.compile(Grammar("json_schema", SCHEMA))
    text = tok.encode('{"name":"Bob","age":42,"ok":true}')
    bad = tok.encode(" hello")[-1]
    drafts = [text[:4], [], text[:2] + [bad] + text[3:5], [bad, bad]]
    ms = [matcher(g), None, matcher(g), matcher(g)]
    before = [None if m is None else _words(m, V) for m in ms]
    got = np.array(fill(ms, V, drafts))
    N = 1 + max(map(len, drafts))
    assert got.shape == (4, N, (V + 31) // 32)
    for b, (m, d) in enumerate(zip(ms, drafts)):
        if m is None:
            assert (got[b] == -1).all()
            continue
        assert (_words(m, V) == before[b]).all()  # rolled back
        ref = matcher(g)
        for i in range(N):
            if i <= len(d) and (i == 0 or ref.try_consume_tokens([d[i - 1]]) == 1):
                assert (got[b, i] == _words(ref, V)).all(), (b, i)
            else:  # past a refused draft (or the row's drafts): nothing forbidden
                assert (got[b, i] == -1).all(), (b, i)
                break
    assert fill([None, None], V, [[1], [2]]) is None


def _run(model, eos, jobs, **options) -> tuple:
    """Each job's tokens and finish reason, the jobs batched in one scheduler; and per
    job, the most tokens one round handed it (more than 1: it accepted drafts)."""
    out = [([], []) for _ in jobs]
    widest = {id(job): 0 for job in jobs}
    sched = Scheduler(model, eos, max_batch=8, **options)
    real = sched._hand

    def hand(job, choice, tokens, lps=()):
        widest[id(job)] = max(widest[id(job)], len(tokens))
        return real(job, choice, tokens, lps)

    sched._hand = hand  # type: ignore[method-assign]
    for i, job in enumerate(jobs):
        job.emit = lambda kind, _c, v, i=i: out[i][0 if kind == "token" else 1].append(v)
        sched.submit(job)
    while sched.step():
        pass
    return out, [widest[id(job)] for job in jobs]


def _asks(grammars) -> list:
    return [
        (EXAMPLE, Grammar("json_schema", SCHEMA)),
        ("Tell me about Paris. Paris is", None),
        ('Colours: ["red","green","red","green"] again:', Grammar("json_schema", ITEMS)),
        ("Numbers: 12345 12345 12345", Grammar("regex", DIGITS)),
        (EXAMPLE + " and once more", None),
        (EXAMPLE, Grammar("json_schema", SCHEMA)),
    ]


def _jobs(tok, grammars, asks, max_tokens=28) -> list:
    return [
        Job(
            prompt=tok.encode(q),
            max_tokens=max_tokens,
            grammar=g and grammars.compile(g),
        )
        for q, g in asks
    ]


def _validates(tokens, done, g, tok) -> None:
    text = tok.decode(tokens)
    assert done == ["stop"], text
    if g.kind == "regex":
        assert re.fullmatch(g.source, text)
    else:
        jsonschema.validate(json.loads(text), g.source)


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_grammar_rows_draft_and_emit_the_tokens_they_emit_without(tiny, grammars, drafter):
    """At B = 6, grammar rows (two schemas, a regex) beside free rows: greedy tokens
    with speculation (lookup; a draft model) equal those without, and each grammar
    reply validates. With lookup the grammar rows accept drafts (rounds hand them
    several tokens); the draft model (the target itself, not constrained) proposes
    what the target prefers before the mask, which the grammar mostly forbids."""
    tok, model = tiny.tokenizer, tiny.model
    asks = _asks(grammars)
    plain, _ = _run(model, tok.eos_ids, _jobs(tok, grammars, asks))
    draft = Lookup() if drafter == "lookup" else DraftModel(model)
    spec, widest = _run(model, tok.eos_ids, _jobs(tok, grammars, asks), drafter=draft, num_draft=4)
    assert spec == plain
    multi = [w > 1 for w, (_, g) in zip(widest, asks)]
    if drafter == "lookup":
        assert all(m for m, (_, g) in zip(multi, asks) if g is not None), widest
    assert any(multi), widest  # the round drafted
    for (tokens, done), (_, g) in zip(spec, asks):
        if g is not None:
            _validates(tokens, done, g, tok)


def test_drafts_that_break_the_grammar_are_rejected_by_the_mask(tiny, grammars, monkeypatch):
    """A drafter that proposes, for every row, a valid token then tokens the grammar
    forbids: the forbidden ones are never accepted (the mask, not the model, rejects
    them), the replies validate and equal the plain loop's."""
    tok, model = tiny.tokenizer, tiny.model
    bad = tok.encode(" hello")[-1]
    digit = tok.encode("7")[-1]

    def propose(contexts, drafter, asked):
        return [[digit, bad, bad, digit][:k] for k in asked]

    asks = [("Numbers: 1 2 3", Grammar("regex", DIGITS)), ("Say something", None)] * 2
    plain, _ = _run(model, tok.eos_ids, _jobs(tok, grammars, asks, 12))
    monkeypatch.setattr(rounds, "_propose_lookup", propose)
    spec, widest = _run(
        model, tok.eos_ids, _jobs(tok, grammars, asks, 12), drafter=Lookup(), num_draft=4
    )
    assert spec == plain
    assert max(widest) <= 2  # a round accepts the valid draft at most, never a bad one
    for (tokens, done), (_, g) in zip(spec, asks):
        if g is not None:
            assert bad not in tokens
            _validates(tokens, done, g, tok)
