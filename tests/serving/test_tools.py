# ruff: noqa: E501  (table rows kept on one line each)
"""Tool calls (``kvstate.serving.tools``): each family's parser whole and streamed in any
chunking, the request's ``tools`` and ``tool_choice`` validated, OpenAI's shapes."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.serving import tools
from kvstate.serving.http import parse
from kvstate.serving.request import BadRequest

H, L, M = (tools.FAMILIES[k] for k in ("hermes", "llama3", "mistral"))

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
G = {"name": "g", "arguments": "{}"}

# (family, reply text, content, calls without ids)
CASES = [
    (H, f"<tool_call>\n{CALL}\n</tool_call>", "", [WEATHER]),
    (H, f"Let me check.\n\n<tool_call>\n{CALL}\n</tool_call>", "Let me check.", [WEATHER]),
    (H, f'<tool_call>{CALL}</tool_call>\n<tool_call>{{"name": "g"}}</tool_call>', "", [WEATHER, G]),
    (H, f"<tool_call>\n{CALL}", "", [WEATHER]),  # the end token came before the close
    (H, '<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut: content
    (H, "a < b and <tool is not a call", "a < b and <tool is not a call", []),
    (H, "plain answer  ", "plain answer  ", []),
    (L, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    (L, ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    (L, f'{CALL}; {{"name": "g", "parameters": {{}}}}', "", [WEATHER, G]),
    (L, "{not json}", "{not json}", []),
    (L, "I think {x} is fine.", "I think {x} is fine.", []),
    (M, f"[TOOL_CALLS][{CALL}]", "", [WEATHER]),
    (M, f"[{CALL}, {{\"name\": \"g\", \"arguments\": {{}}}}]", "", [WEATHER, G]),
    (M, 'Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]g[ARGS]{}', "Sure", [WEATHER, G]),
    (M, "[1] is a citation", "[1] is a citation", []),
]  # fmt: skip


def _strip(calls):
    assert all(c["id"].startswith("call_") and len(c["id"]) > 10 for c in calls)
    return [{k: c[k] for k in ("name", "arguments")} for c in calls]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_each_family_parses_whole(family, text, content, calls):
    got_content, got_calls = tools.parse(text, family)
    assert (got_content, _strip(got_calls)) == (content, calls)


def _chunked(text, family, cuts):
    stream = tools.ToolStream(family)
    events, at = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += stream.push(text[at:cut])
        at = cut
    events += stream.finish()
    content = "".join(v for k, v in events if k == "content")
    return content, [v for k, v in events if k == "call"]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_gives_the_same_content_and_calls(case, data):
    family, text, content, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    got_content, got_calls = _chunked(text, family, cuts)
    assert (got_content, _strip(got_calls)) == (content, calls)


@settings(max_examples=200, deadline=None)
@given(
    family=st.sampled_from([H, L, M]),
    pieces=st.lists(
        st.sampled_from(
            [
                "<tool_call>",
                "</tool_call>",
                CALL,
                "[TOOL_CALLS]",
                "<|python_tag|>",
                "{",
                "[",
                " ",
                "\n",
                "x",
                "<",
                "<tool",
                '"',
                "name",
            ]
        ),
        max_size=12,
    ),  # fmt: skip
    data=st.data(),
)
def test_any_text_in_any_chunking_parses_as_whole(family, pieces, data):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    whole_content, whole_calls = tools.parse(text, family)
    content, calls = _chunked(text, family, cuts)
    assert (content, _strip(calls)) == (whole_content, _strip(whole_calls))
    if not whole_calls:
        assert content == text  # nothing lost


def test_markup_never_streams_as_content_before_the_end():
    stream = tools.ToolStream(H)
    out = []
    for ch in f"Hi <tool_call>{CALL}</tool_call>":
        out += stream.push(ch)
    assert "".join(v for _, v in out) == "Hi"


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{% for m in messages %}[TOOL_CALLS]{% endfor %}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
        ("<tool_call>\n{{ tool_call.name }}</tool_call>", "hermes"),
        ("{{ messages }}", "hermes"),  # tools described to it in the Hermes form
    ],
)
def test_family_of_the_template(template, family):
    assert tools.family_of(template).name == family


def test_step_streams_content_then_the_call_in_openais_shape():
    stream = tools.ToolStream(H)
    deltas, finish = tools.step(stream, "Ok <tool_", None)
    assert (deltas, finish) == ([{"content": "Ok"}], None)
    deltas, finish = tools.step(stream, f"call>{CALL}</tool_call>", "stop")
    assert finish == "tool_calls"
    head, args = deltas
    call = head["tool_calls"][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}
    msg = tools.message(stream, "ignored")
    assert msg["content"] == "Ok" and msg["tool_calls"][0]["id"] == call["id"]


def test_a_cut_reply_keeps_length_and_no_call_stays_content():
    stream = tools.ToolStream(H)
    deltas, finish = tools.step(stream, "<tool_call>{", "length")
    assert (deltas, finish) == ([{"content": "<tool_call>{"}], "length")
    assert tools.message(stream, "") == {"role": "assistant", "content": "<tool_call>{"}


def test_parallel_false_keeps_the_first_call():
    text = f'<tool_call>{CALL}</tool_call><tool_call>{{"name": "g"}}</tool_call>'
    assert _strip(tools.parse(text, H, parallel=False)[1]) == [WEATHER]


# --- the request side -----------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
MSGS = [{"role": "user", "content": "weather?"}]


def _parse(**fields):
    seen = {}

    def tok(messages=None, text=None, tools=None):
        seen["tools"] = tools
        return [1, 2, 3]

    p = parse({"messages": MSGS, **fields}, chat=True, tokenize=tok, context=100)
    return p, seen.get("tools")


def test_tools_reach_the_template_and_pick_the_parser():
    p, given_tools = _parse(tools=[TOOL])
    assert given_tools == [TOOL] and p.tools[1].name == "hermes"
    p, given_tools = _parse(tools=[TOOL], tool_choice="none")
    assert given_tools is None and p.tools[1] is None
    p, given_tools = _parse()
    assert given_tools is None and p.tools[1] is None


@pytest.mark.parametrize(
    ("tools_value", "param", "words"),
    [
        ({"a": 1}, "tools", "must be a list"),
        ([1], "tools[0].type", "'function', got 1"),
        ([{"type": "web"}], "tools[0].type", 'got "web"'),
        ([{"type": "function"}], "tools[0].function", "must be an object, got null"),
        ([{"type": "function", "function": {}}], "tools[0].function.name", "got null"),
        ([{"type": "function", "function": {"name": 3}}], "tools[0].function.name", "a string, got 3"),
        ([TOOL, {"type": "function", "function": {"name": "a b"}}], "tools[1].function.name", 'got "a b"'),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters", "an object, got []"),
        ([{"type": "function", "function": {"name": "f", "description": 1}}], "tools[0].function.description", "a string, got 1"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], "tools[0].function.extra", "unknown field"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(tools_value, param, words):
    with pytest.raises(BadRequest) as e:
        _parse(tools=tools_value)
    assert e.value.param == param and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("choice", "words"),
    [
        ("sometimes", "must be 'auto', 'none', 'required'"),
        ({"type": "function", "function": {"name": "nope"}}, "one of the tools ['get_weather']"),
        ({"type": "function", "name": "get_weather"}, "must be 'auto'"),
        ({"type": "function", "function": {"name": "get_weather", "x": 1}}, "must be 'auto'"),
    ],
)
def test_a_bad_tool_choice_is_a_400_naming_it(choice, words):
    with pytest.raises(BadRequest) as e:
        _parse(tools=[TOOL], tool_choice=choice)
    assert e.value.param == "tool_choice" and words in str(e.value), str(e.value)


def test_required_and_named_choices_constrain_the_reply_with_a_grammar():
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        p, given_tools = _parse(tools=[TOOL], tool_choice=choice)
        assert given_tools == [TOOL] and p.grammar.kind == "lark"
        assert p.grammar.arg == "tool_choice" and "<tool_call>" in p.grammar.source
    assert _parse(tools=[TOOL])[0].grammar is None  # auto: free text
    with pytest.raises(BadRequest, match="no 'tools'") as e:
        _parse(tool_choice="required")
    with pytest.raises(BadRequest, match="cannot be combined") as e:
        _parse(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"})
    assert e.value.param == "tool_choice"


def test_tool_choice_auto_without_tools_and_bad_parallel_are_400s():
    with pytest.raises(BadRequest, match="no 'tools'"):
        _parse(tool_choice="auto")
    with pytest.raises(BadRequest) as e:
        _parse(tools=[TOOL], parallel_tool_calls="yes")
    assert e.value.param == "parallel_tool_calls"
    assert _parse(tools=[TOOL], parallel_tool_calls=False)[0].tools[2] is False


def test_tools_on_completions_are_unknown():
    with pytest.raises(BadRequest, match="unknown field 'tools'"):
        parse({"prompt": "x", "tools": [TOOL]}, chat=False, tokenize=lambda **k: [1], context=9)


def test_arguments_are_json_strings_of_objects():
    _, calls = tools.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>', H)
    assert json.loads(calls[0]["arguments"]) == {"a": [1]}
