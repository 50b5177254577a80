"""Structured output on the real model: ``response_format`` and vLLM's
``structured_outputs`` through the ``openai`` client, the grammar engine on the real
vocabulary, and grammar rows batched with free rows (``kvstate.serving.grammar``)."""

import json
import math
import re

import jsonschema
import openai
import pytest
from _server import Server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from kvstate.serving.grammar import Grammar, Grammars, matcher
from kvstate.serving.scheduler import Job, Scheduler
from kvstate.speculative.drafts import Lookup

NAMES = st.sampled_from(["name", "age", "city", "tags", "ok", "kind", "score", "id"])


def _property():
    return st.one_of(
        st.just({"type": "string", "maxLength": 12}),
        st.just({"type": "integer", "minimum": 0, "maximum": 999}),
        st.just({"type": "boolean"}),
        st.lists(
            st.sampled_from(["red", "green", "blue", "on", "off"]),
            min_size=1,
            max_size=3,
            unique=True,
        ).map(lambda e: {"enum": e}),
        st.just(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "maxItems": 3,
            }
        ),
    )


@st.composite
def schemas(draw):
    """Small strict object schemas: a few typed properties, enums, arrays."""
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    props = {n: draw(_property()) for n in names}
    return {"type": "object", "properties": props, "required": names, "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(smollm):
    return Grammars(smollm.tokenizer, smollm.model.args.vocab_size)


@pytest.fixture(scope="module")
def server(smollm):
    s = Server(smollm, max_batch=8)
    yield s
    s.close()


def _compact(instance, schema) -> str:
    """``instance`` as the grammar writes it: keys in the schema's order, no spaces."""
    ordered = {k: instance[k] for k in schema["properties"] if k in instance}
    return json.dumps(ordered, separators=(",", ":"), ensure_ascii=False)


# Text a string property's instances draw from: printable text without escapes (the
# grammar writes JSON's strings; what it generates validates, and these are instances
# it must accept whatever the engine does with escapes and unassigned code points).
TEXT = st.text(
    st.characters(exclude_categories=("Cc", "Cs", "Co", "Cn"), exclude_characters='"\\'),
    max_size=12,
)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_matcher_accepts_every_valid_instance(grammars, smollm, data):
    """The engine on the real vocabulary: instances of a drawn schema (each property's
    from hypothesis-jsonschema, strings from ``TEXT``), tokenized by the model's
    tokenizer, are accepted token by token, the end-of-sequence token ends them, and
    an instance with a property missing is refused (a wrong vocabulary type refuses
    them all)."""
    schema = data.draw(schemas())
    # hypothesis-jsonschema 0.23.1's object strategy calls ``many.more()``, which
    # hypothesis 6.170 no longer has (AttributeError): the object is put together here.
    instance = {
        k: data.draw(TEXT if p.get("type") == "string" else from_schema(p))
        for k, p in schema["properties"].items()
    }
    jsonschema.validate(instance, schema)
    compiled = grammars.compile(Grammar("json_schema", schema))
    m = matcher(compiled)
    for t in smollm.tokenizer.encode(_compact(instance, schema)):
        assert m.consume_token(t), (schema, instance, t, m.get_error())
    assert m.consume_token(smollm.tokenizer.eos_ids[0]) and m.is_stopped()
    short = dict(list(instance.items())[1:])
    assert not matcher(compiled).consume_tokens(smollm.tokenizer.encode(_compact(short, schema)))


def _chat(client, content, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], **kw
    )


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=schemas(), temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**16))
def test_json_schema_replies_validate(server, schema, temperature, seed):
    c = server.client()
    r = _chat(
        c,
        "Describe a thing as JSON.",
        max_tokens=160,
        temperature=temperature,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema, "strict": True},
        },
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_replies_parse(server):
    r = _chat(
        server.client(),
        "List two fruits.",
        max_tokens=160,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": "[a-z]{1,12}@[a-z]{1,12}\\.com"}},
        {"guided_regex": "[a-z]{1,12}@[a-z]{1,12}\\.com"},
    ],
)
def test_a_regex_reply_matches_its_regex(server, extra):
    c = server.client()
    r = c.completions.create(
        model="m",
        prompt="Alan Turing's email address is",
        max_tokens=40,
        temperature=0.0,
        extra_body=extra,
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(
        extra.get("guided_regex") or extra["structured_outputs"]["regex"], r.choices[0].text
    )


def test_choice_and_grammar(server):
    c = server.client()
    r = _chat(
        c,
        "Is the sky blue?",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")
    ebnf = 'root ::= "(" [0-9] "+" [0-9] ")"'
    r = _chat(
        c, "Write a sum.", max_tokens=10, extra_body={"structured_outputs": {"grammar": ebnf}}
    )
    assert re.fullmatch(r"\([0-9]\+[0-9]\)", r.choices[0].message.content)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_its_field(server, extra, param):
    rounds = server.scheduler.stats["rounds"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server.client(), "Hi", max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert server.scheduler.stats["rounds"] == rounds  # nothing was queued


def test_logprobs_are_reported_after_the_mask(server):
    """As vLLM reports them: a token the grammar forbids has log-probability -inf
    (sent as -9999.0), so the allowed tokens' probabilities sum to one."""
    r = _chat(
        server.client(),
        "Is the sky blue?",
        max_tokens=4,
        logprobs=True,
        top_logprobs=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content in ("yes", "no") and content
    first = content[0]
    assert first.logprob > -9999.0
    allowed = [t for t in first.top_logprobs if t.logprob > -9999.0]
    assert all(("yes".startswith(t.token) or "no".startswith(t.token)) for t in allowed)
    assert len(allowed) < 20  # the rest of the top 20 are forbidden
    assert sum(math.exp(t.logprob) for t in allowed) == pytest.approx(1.0, abs=1e-3)


def _run(model, eos, jobs, **options) -> list:
    """Each job's tokens and finish reason, the jobs batched in one scheduler."""
    out = [([], []) for _ in jobs]
    sched = Scheduler(model, eos, max_batch=8, **options)
    for i, job in enumerate(jobs):
        job.emit = lambda kind, _c, v, i=i: out[i][0 if kind == "token" else 1].append(v)
        sched.submit(job)
    while sched.step():
        pass
    return out


SCHEMA_A = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,  # llguidance keeps JSON Schema's default: allowed
}
SCHEMA_B = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("drafter", [None, Lookup()], ids=["plain", "lookup"])
def test_grammar_rows_batched_with_free_rows_equal_each_alone(smollm, grammars, drafter):
    """Rows of two schemas, a regex and no grammar in one batch: every row's greedy
    tokens equal its run alone, and a grammar row's reply keeps to its grammar (with
    speculation on, every row drafts)."""
    tok = smollm.tokenizer
    asks = [
        ("A person as JSON:", Grammar("json_schema", SCHEMA_A)),
        ("Tell me about Paris.", None),
        ("Flags as JSON:", Grammar("json_schema", SCHEMA_B)),
        ("An email address:", Grammar("regex", "[a-z]{1,12}@[a-z]{1,12}\\.com")),
        ("Count to five: one, two,", None),
    ]

    def jobs():
        return [
            Job(
                prompt=tok.chat([{"role": "user", "content": q}]),
                max_tokens=48,
                grammar=g and grammars.compile(g),
            )
            for q, g in asks
        ]

    together = _run(smollm.model, tok.eos_ids, jobs(), drafter=drafter)
    alone = [_run(smollm.model, tok.eos_ids, [j], drafter=drafter)[0] for j in jobs()]
    assert together == alone
    for (tokens, done), (_, g) in zip(together, asks):
        if g is None:
            continue
        assert done == ["stop"], tok.decode(tokens)
        text = tok.decode(tokens)
        if g.kind == "regex":
            assert re.fullmatch(g.source, text)
        else:
            jsonschema.validate(json.loads(text), g.source)


def test_overlap_or_not_the_tokens_are_the_same(smollm, grammars):
    tok = smollm.tokenizer
    g = grammars.compile(Grammar("json_schema", SCHEMA_A))

    def jobs():
        return [
            Job(
                prompt=tok.chat([{"role": "user", "content": "A person:"}]),
                max_tokens=32,
                grammar=g,
            )
        ]

    assert _run(smollm.model, tok.eos_ids, jobs(), overlap=True) == _run(
        smollm.model, tok.eos_ids, jobs(), overlap=False
    )
