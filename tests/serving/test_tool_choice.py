"""``tool_choice: "required"`` and a named function, enforced by a grammar
(``kvstate.serving.tools.tool_grammar``): each family's call markup on the real
vocabulary, and end to end through the real ``openai`` client against a real server
(a tiny random llama with SmolLM2's tokenizer: even a model that knows nothing
returns calls whose arguments validate)."""

import json

import jsonschema
import pytest

pytest.importorskip("openai", reason="the serve tests call the server with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")

from _server import Server  # noqa: E402

from kvstate.models.gguf import Loaded  # noqa: E402
from kvstate.models.load import tiny_llama  # noqa: E402
from kvstate.serving import tools  # noqa: E402
from kvstate.serving.grammar import Grammars, matcher  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "additionalProperties": False,  # not strict: the schema as written (else open)
    "$defs": {"zone": {"enum": ["UTC", "CET"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def grammars(smollm):
    return Grammars(smollm.tokenizer, smollm.model.args.vocab_size)


@pytest.fixture(scope="module")
def server(smollm):
    V = smollm.model.args.vocab_size
    model = tiny_llama(0, layers=2, hidden=64, heads=2, kv_heads=1, vocab=V)
    s = Server(Loaded(model, smollm.tokenizer, "tiny llama, SmolLM2 tokenizer"))
    yield s
    s.close()


def _accepts(grammars, grammar, tokens) -> bool:
    m = matcher(grammars.compile(grammar))
    return m.consume_tokens(tokens) and m.is_accepting()


W = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c", "days": 2}}'
T = '{"name": "get_time", "arguments": {"zone": "CET"}}'


WP, TP = (x.replace("arguments", "parameters") for x in (W, T))
HW, HT = (f"<tool_call>\n{x}\n</tool_call>" for x in (W, T))


@pytest.mark.parametrize(
    ("family", "one", "two"),
    [
        ("hermes", HW, f"{HW}\n{HT}"),
        ("llama3", WP, f"{WP}; {TP}"),
        ("mistral", f"[TOOL_CALLS][{W}]", f"[TOOL_CALLS][{W}, {T}]"),
    ],
)
def test_each_family_writes_the_calls_its_parser_reads(smollm, grammars, family, one, two):
    """The grammar of ``required`` accepts one call or several (``parallel``) in the
    family's markup, which its parser reads back; a named choice accepts only its own
    function, once; arguments off the schema (a strict tool's extra property, a value
    out of its enum) are refused."""
    tok, fam = smollm.tokenizer, tools.FAMILIES[family]
    required = tools.tool_grammar(TOOLS, "required", fam)
    single = tools.tool_grammar(TOOLS, "required", fam, parallel=False)
    named = tools.tool_grammar(TOOLS, ("function", "get_time"), fam)
    for text, calls in ((one, ["get_weather"]), (two, ["get_weather", "get_time"])):
        assert _accepts(grammars, required, tok.encode(text)), text
        assert [c["name"] for c in tools.parse(text, fam)[1]] == calls
    assert not _accepts(grammars, single, tok.encode(two))
    assert not _accepts(grammars, named, tok.encode(one))
    assert _accepts(
        grammars,
        named,
        tok.encode(
            one.replace(W, T).replace(
                W.replace("arguments", "parameters"), T.replace("arguments", "parameters")
            )
        ),
    )
    extra = one.replace('"days": 2}', '"days": 2, "x": 1}')
    assert not _accepts(grammars, required, tok.encode(extra))  # strict: closed
    assert not _accepts(grammars, required, tok.encode(one.replace('"c"', '"k"')))
    assert tools.tool_grammar(TOOLS, "auto", fam) is None


def test_a_special_marker_is_written_as_its_token(smollm, grammars):
    """Where the tokenizer has the marker as a special token (Mistral's
    ``[TOOL_CALLS]``), the grammar asks for that token, not its text."""
    tok, fam = smollm.tokenizer, tools.FAMILIES["mistral"]
    marker = tok.special_tokens["<|im_start|>"]  # a special token standing in for it
    g = tools.tool_grammar(TOOLS, "required", fam, special={"[TOOL_CALLS]": marker})
    assert _accepts(grammars, g, [marker] + tok.encode(f"[{W}]"))
    assert not _accepts(grammars, g, tok.encode(f"[TOOL_CALLS][{W}]"))


def _check(call, name=None) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_returns_calls_that_validate_whole_and_streamed(server, temperature):
    client = server.client()
    kw = dict(model="m", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=200)
    r = client.chat.completions.create(**kw, temperature=temperature, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        _check(call)
    chunks = list(
        client.chat.completions.create(**kw, temperature=temperature, seed=3, stream=True)
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert text == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
    heads = [d for d in deltas if d.id]
    assert [h.function.name for h in heads] == [t.function.name for t in c.message.tool_calls]
    for h in heads:
        args = "".join(d.function.arguments or "" for d in deltas if d.index == h.index)
        jsonschema.validate(json.loads(args), SCHEMAS[h.function.name])


def test_a_named_function_is_the_one_called_once(server):
    client = server.client()
    for name in SCHEMAS:
        choice = {"type": "function", "function": {"name": name}}
        r = client.chat.completions.create(
            model="m", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=1
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        _check(c.message.tool_calls[0], name)


def test_parallel_false_makes_one_call_and_none_makes_text(server):
    client = server.client()
    r = client.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        n=2,
        temperature=1.0,
        seed=5,
    )
    assert all(len(c.message.tool_calls) == 1 for c in r.choices)
    r = client.chat.completions.create(
        model="m", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
