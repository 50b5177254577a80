"""Anthropic's Messages API on `kvstate serve`, called with the real `anthropic` client.

A tiny random llama with SmolLM2's tokenizer and chat template serves (its text is
noise, but greedy tokens are exact): the Messages reply must equal the chat
completions reply for the same conversation, streamed and not. Tool use runs with
the scheduler's handed-out tokens replaced by ones spelling a call (as
test_tools_serve.py does), the rest of the path as it is."""

import json
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

anthropic = pytest.importorskip("anthropic", reason="the tests call the server with anthropic")
pytest.importorskip("openai", reason="the chat endpoint is called with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")

from _faults import MARK, failing_sampler  # noqa: E402
from _server import Server  # noqa: E402

from kvstate.models import gguf  # noqa: E402
from kvstate.models.gguf import Loaded  # noqa: E402
from kvstate.models.load import fetch, tiny_llama  # noqa: E402
from kvstate.serving import anthropic as api  # noqa: E402
from kvstate.serving.prefix_cache import PrefixCache  # noqa: E402
from kvstate.serving.request import BadRequest  # noqa: E402
from kvstate.serving.scheduler import Scheduler  # noqa: E402

SYSTEM = "You are terse."
ASK = "What is the capital of France?"
GREEDY = {"temperature": 0}  # not in this SDK's signature: sent as extra_body


@pytest.fixture(scope="module")
def tiny():
    """A tiny llama with SmolLM2's vocabulary, tokenizer and template (read from the
    GGUF's metadata: the weights are not loaded)."""
    _, meta = gguf.read(fetch())
    tokenizer = gguf.tokenizer(meta)
    V = len(meta["tokenizer.ggml.tokens"])
    model = tiny_llama(0, layers=2, hidden=64, heads=2, kv_heads=1, vocab=V)
    return Loaded(model, tokenizer, "tiny llama, SmolLM2 tokenizer")


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, prefix_cache=PrefixCache(16 << 20))
    yield s
    s.close()


def client(server, **kw):
    kw.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=60, **kw)


def post(server, path, body, headers=None) -> tuple:
    """``(status, JSON body or SSE text)`` of a raw POST."""
    req = urllib.request.Request(
        server.url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req) as r:
            text = r.read().decode()
            return r.status, text if body.get("stream") else json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(sse: str) -> list:
    """``(event name, data)`` of an SSE body; each data's type must be its event's name."""
    out = []
    for chunk in sse.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def test_a_greedy_reply_equals_chat_completions_and_streams_the_same(server, tiny):
    r = client(server).messages.create(
        model="any",
        max_tokens=10,
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
        extra_body=GREEDY,
    )
    assert isinstance(r, anthropic.types.Message) and r.id.startswith("msg_")
    want = server.client().chat.completions.create(
        model="x",
        max_tokens=10,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
    )
    assert r.content[0].type == "text" and r.content[0].text == want.choices[0].message.content
    assert len(r.content) == 1 and r.role == "assistant" and r.model == want.model
    assert (
        r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    )
    u = r.usage
    assert u.output_tokens == want.usage.completion_tokens
    assert u.input_tokens + u.cache_read_input_tokens == want.usage.prompt_tokens
    # the raw stream: the API's event order, the text in deltas equal to the whole reply
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}]}],
        "stream": True,
        **GREEDY,
    }
    status, sse = post(server, "/v1/messages", body)
    got = events(sse)
    names = [n for n, _ in got]
    assert status == 200
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
    assert text == r.content[0].text
    start, delta = got[0][1]["message"], got[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == (
        want.usage.prompt_tokens
    )
    assert start["usage"]["cache_read_input_tokens"] > 0  # asked before: the prefix cache
    assert delta["delta"]["stop_reason"] == r.stop_reason
    assert delta["usage"]["output_tokens"] == r.usage.output_tokens
    # the SDK's stream helper assembles the same message
    with client(server).messages.stream(
        model="m", max_tokens=10, system=SYSTEM, messages=body["messages"], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == r.content[0].text and final.stop_reason == r.stop_reason
    # count_tokens: the same template path
    n = client(server).messages.count_tokens(
        model="m", system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    )
    assert n.input_tokens == want.usage.prompt_tokens


def test_stop_sequences_cut_the_text_and_are_reported(server):
    kw = dict(model="m", max_tokens=12, messages=[{"role": "user", "content": ASK}])
    full = client(server).messages.create(**kw, extra_body=GREEDY).content[0].text
    stop = full[4:7]
    assert stop.strip(), full  # a non-blank piece of the reply to stop at
    cut = full[: full.index(stop)]
    r = client(server).messages.create(**kw, stop_sequences=["\x00never", stop], extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in r.content) == cut
    with client(server).messages.stream(**kw, stop_sequences=[stop], extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in final.content) == cut


@pytest.mark.parametrize(
    "change, names",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"frequency_penalty": 1}, "frequency_penalty"),  # OpenAI's field: unknown here
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "A"},
                ]
            },
            "last assistant message",
        ),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}, "type": "bash_20250124"}]},
            "tools[0].type",
        ),
        ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"metadata": {"user_id": 3}}, "metadata"),
        ({"max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(server, change, names):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in {**body, **change}.items() if v is not None}
    status, got = post(server, "/v1/messages", body)
    assert status == 400 and set(got) == {"type", "error"} and got["type"] == "error"
    assert got["error"]["type"] == "invalid_request_error" and names in got["error"]["message"]


def test_the_sdk_raises_its_errors_and_unknown_routes_are_anthropics_404(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"top_k": -1},
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "top_k" in e.value.body["error"]["message"]
    status, got = post(server, "/v1/messages/batches", {})
    assert status == 404 and got["error"]["type"] == "not_found_error"


# --- tool use ---------------------------------------------------------------------------

REPLY = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
OPENAI_WEATHER = {
    "type": "function",
    "function": {k: WEATHER[k] for k in ("name", "description")}
    | {"parameters": WEATHER["input_schema"]},
}
WHERE = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def scripted(tiny, monkeypatch):
    """A server whose every reply spells ``REPLY``; ``prompts`` collects what it was
    asked, as token ids."""
    script = tiny.tokenizer.encode(REPLY) + [tiny.tokenizer.eos_ids[0]]
    real = Scheduler._hand

    def hand(self, job, choice, tokens, lps=()):
        at = job.generated[choice]
        return real(self, job, choice, script[at : at + len(tokens)], lps)

    monkeypatch.setattr(Scheduler, "_hand", hand)
    s = Server(tiny)
    prompts: list = []
    submit = s.scheduler.submit
    s.scheduler.submit = lambda job: (prompts.append(list(job.prompt)), submit(job))[1]
    yield s, prompts
    s.close()


def test_tool_use_comes_back_whole_and_streamed_and_results_go_in(scripted, tiny):
    s, prompts = scripted
    r = client(s).messages.create(model="m", max_tokens=64, tools=[WEATHER], messages=WHERE)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
    use = r.content[1]
    assert r.content[0].text == "Checking." and use.id.startswith("toolu_")
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    # streamed: a text block, then the tool_use block with its input as JSON deltas
    body = {"model": "m", "max_tokens": 64, "tools": [WEATHER], "messages": WHERE, "stream": True}
    got = events(post(s, "/v1/messages", body)[1])
    starts = [d["content_block"] for n, d in got if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["input"] == {}
    assert starts[1]["name"] == "get_weather" and starts[1]["id"].startswith("toolu_")
    parts = [d["delta"] for n, d in got if n == "content_block_delta" and d["index"] == 1]
    assert {p["type"] for p in parts} == {"input_json_delta"}
    assert json.loads("".join(p["partial_json"] for p in parts)) == {"city": "Paris"}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client(s).messages.stream(
        model="m", max_tokens=64, tools=[WEATHER], messages=WHERE
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}
    # the results go back in: the model sees what the chat endpoint's conversation shows it
    for result, is_error in (("18 C and sunny", False), ("city not found", True)):
        history = [
            *WHERE,
            {"role": "assistant", "content": r.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": result}
                    | ({"is_error": True} if is_error else {}),
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ]
        client(s).messages.create(model="m", max_tokens=4, tools=[WEATHER], messages=history)
        call = {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
        chat = [
            *WHERE,
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": use.id, "type": "function", "function": call}
            ]},
            {"role": "tool", "tool_call_id": use.id, "content": "Error: " * is_error + result},
            {"role": "user", "content": "Thanks."},
        ]  # fmt: skip
        s.client().chat.completions.create(
            model="m", max_tokens=4, tools=[OPENAI_WEATHER], messages=chat
        )
        assert prompts[-2] == prompts[-1]
        assert "Error: " * is_error + result in tiny.tokenizer.decode(prompts[-1])


@pytest.mark.parametrize(
    "anthropic_choice, openai_choice",
    [
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
        ({"type": "none"}, "none"),
    ],
)
def test_tool_choice_is_served_as_the_chat_endpoint_serves_it(
    scripted, anthropic_choice, openai_choice
):
    s, prompts = scripted
    a_status, a = post(
        s,
        "/v1/messages",
        {"model": "m", "max_tokens": 64, "messages": WHERE, "tools": [WEATHER]}
        | {"tool_choice": anthropic_choice},
    )
    o_status, o = post(
        s,
        "/v1/chat/completions",
        {"model": "m", "max_tokens": 64, "messages": WHERE, "tools": [OPENAI_WEATHER]}
        | {"tool_choice": openai_choice},
    )
    assert a_status == o_status == 200
    assert prompts[-2] == prompts[-1]
    _same_reply(a, o)


def _same_reply(a: dict, o: dict) -> None:
    message = o["choices"][0]["message"]
    texts = [b["text"] for b in a["content"] if b["type"] == "text"]
    inputs = [b["input"] for b in a["content"] if b["type"] == "tool_use"]
    assert texts == [message["content"]] * bool(message["content"])
    calls = message.get("tool_calls") or []
    assert inputs == [json.loads(c["function"]["arguments"]) for c in calls]
    assert a["stop_reason"] == ("tool_use" if calls else "end_turn")


# A closed, bounded schema: a random model forced by the grammar ends its call in time.
CLOSED = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}},
    "required": ["unit"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "anthropic_choice, openai_choice",
    [
        ({"type": "any"}, "required"),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_forced_tool_choice_calls_the_tool_as_the_chat_endpoint_does(
    tiny, anthropic_choice, openai_choice
):
    """``any`` and ``tool`` reach the chat endpoint's grammar (``tools.tool_grammar``):
    the tiny random model, forced, calls the tool with arguments on its schema, and the
    greedy reply equals the chat endpoint's."""
    tool = WEATHER | {"input_schema": CLOSED}
    openai_tool = {
        "type": "function",
        "function": OPENAI_WEATHER["function"] | {"parameters": CLOSED},
    }
    s = Server(tiny)
    try:
        greedy = {"model": "m", "max_tokens": 64, "messages": WHERE, "temperature": 0}
        a_status, a = post(
            s, "/v1/messages", greedy | {"tools": [tool], "tool_choice": anthropic_choice}
        )
        o_status, o = post(
            s,
            "/v1/chat/completions",
            greedy | {"tools": [openai_tool], "tool_choice": openai_choice},
        )
    finally:
        s.close()
    assert a_status == o_status == 200, (a, o)
    uses = [b for b in a["content"] if b["type"] == "tool_use"]
    assert uses and all(b["name"] == "get_weather" for b in uses)
    assert all(b["input"]["unit"] in ("c", "f") for b in uses)
    _same_reply(a, o)


# --- the API key ----------------------------------------------------------------------


def test_the_api_key_is_taken_as_x_api_key_or_bearer(tiny):
    s = Server(tiny, api_key="sekret")
    kw = dict(model="m", max_tokens=2, messages=WHERE)
    try:
        by_header = client(s, api_key=None, default_headers={"x-api-key": "sekret"})
        assert by_header.messages.create(**kw).stop_reason == "max_tokens"
        assert client(s, api_key="sekret").messages.create(**kw).stop_reason == "max_tokens"
        for key in ("wrong", "sekret2"):
            with pytest.raises(anthropic.AuthenticationError) as e:
                client(s, api_key=None, default_headers={"x-api-key": key}).messages.create(**kw)
            assert e.value.body["error"]["type"] == "authentication_error"
        # the OpenAI routes take it too
        assert s.client(api_key="none", default_headers={"x-api-key": "sekret"}).models.list()
    finally:
        s.close()


# --- failures ---------------------------------------------------------------------------


def test_failures_are_anthropics_errors_before_and_after_the_stream_starts(tiny, monkeypatch):
    """A fault before the first token is a plain 500 (``api_error``), streamed or not; a
    deadline passing mid-stream is the stream's last event, ``error`` (``timeout_error``)."""
    failing_sampler(monkeypatch, "injected sampler fault")
    s = Server(tiny, timeout=1.5)
    real = s.scheduler._round
    s.scheduler._round = lambda: (time.sleep(0.2), real())[1]
    body = {"model": "m", "max_tokens": 40, "messages": WHERE}
    try:
        for stream in (False, True):
            status, got = post(s, "/v1/messages", {**body, "temperature": MARK, "stream": stream})
            assert status == 500 and got["error"]["type"] == "api_error"
            assert "injected sampler fault" in got["error"]["message"]
        with pytest.raises(anthropic.InternalServerError) as e:
            client(s).messages.create(**body, extra_body={"temperature": MARK})
        assert e.value.body["error"]["type"] == "api_error"
        status, sse = post(s, "/v1/messages", {**body, "stream": True, **GREEDY})
        got = events(sse)
        assert status == 200 and got[0][0] == "message_start"
        assert got[-1] == ("error", {"type": "error", "error": got[-1][1]["error"]})
        assert got[-1][1]["error"]["type"] == "timeout_error"
        assert "message_stop" not in [n for n, _ in got]
    finally:
        s.close()


# --- the translation alone --------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
BASE = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
PLACES = ["model", "max_tokens", "system", "stop_sequences", "tools", "tool_choice", "metadata"]
PLACES += ["output_config", "temperature", "thinking", "cache_control", "messages"]


@given(
    place=st.sampled_from(PLACES),
    value=JSON | st.builds(lambda v: [{"role": "user", "content": [v]}], JSON),
    block=st.dictionaries(
        st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content"]),
        JSON | st.sampled_from(["text", "tool_use", "tool_result", "image"]),
        max_size=5,
    ),
)
def test_any_body_is_translated_or_refused_with_a_400(place, value, block):
    """Whatever a field or a content block holds, the translation returns a body or raises
    BadRequest naming something; never another exception."""
    for body in (
        {**BASE, place: value},
        {**BASE, "messages": [{"role": "assistant", "content": [block]}, BASE["messages"][0]]},
    ):
        try:
            api.openai_body(body)
        except BadRequest as e:
            assert e.status == 400 and str(e)


@given(
    pieces=st.lists(
        st.text(max_size=4) | st.sampled_from(["get", "put"]).map(lambda n: {"name": n}),
        max_size=8,
    )
)
def test_blocks_open_fill_and_close_in_order(pieces):
    """Text pieces and calls (as ``tools.step`` streams them) make well-formed events:
    indices 0, 1, ... each started, filled and stopped once; the text and calls intact."""
    blocks, got = api.Blocks(), []
    for k, p in enumerate(pieces):
        if isinstance(p, str):
            got += blocks.push(p)
        else:
            head = {"index": k, "id": f"call_{k}", "type": "function"}
            call = {**head, "function": {"name": p["name"], "arguments": ""}}
            args = {"index": k, "function": {"arguments": '{"k": 1}'}}
            got += blocks.push([{"tool_calls": [call]}, {"tool_calls": [args]}])
    got += blocks.finish("end_turn", None, api.usage(3, 1, 2))
    names = [n for n, _ in got]
    assert names[-2:] == ["message_delta", "message_stop"] and names.count("ping") == 1
    open_, index, text, calls = None, -1, "", []
    for name, data in got[:-2]:
        if name == "content_block_start":
            assert open_ is None and data["index"] == index + 1
            open_, index = data["content_block"]["type"], data["index"]
            calls += [data["content_block"]["name"]] if open_ == "tool_use" else []
        elif name == "content_block_delta":
            assert data["index"] == index and open_ is not None
            text += data["delta"].get("text", "")
        elif name == "content_block_stop":
            assert data["index"] == index and open_ is not None
            open_ = None
    assert open_ is None
    assert text == "".join(p for p in pieces if isinstance(p, str))
    assert calls == [p["name"] for p in pieces if isinstance(p, dict)]
