# ruff: noqa: E501
"""Tool calls end to end: the real model and server, the real `openai` client; the
scheduler's handed-out tokens are replaced by ones spelling a tool call (the rest of the
scheduler and the HTTP path run as they are)."""

import json

import pytest

pytest.importorskip("openai", reason="the serve tests call the server with openai")
pytest.importorskip("aiohttp", reason="kvstate serve runs on aiohttp")

from _server import Server  # noqa: E402

from kvstate.serving.scheduler import Scheduler  # noqa: E402

REPLY = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm):
    script = smollm.tokenizer.encode(REPLY) + [smollm.tokenizer.eos_ids[0]]
    real = Scheduler._hand

    def hand(self, job, choice, tokens, lps=()):
        at = job.generated[choice]
        forced = script[at : at + len(tokens)]
        return real(self, job, choice, forced, lps)

    Scheduler._hand = hand
    s = Server(smollm)
    yield s
    s.close()
    Scheduler._hand = real


def test_tool_calls_come_back_whole_and_streamed(server):
    client = server.client()
    r = client.chat.completions.create(model="m", messages=MSGS, tools=[TOOL], max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MSGS, tools=[TOOL], max_tokens=64, stream=True
        )
    )
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert content == "Checking." and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
