"""The server's request parsing and text streaming (no model, no network)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.serving.http import BadRequest, TextStream, parse

# A toy vocabulary: some tokens are half a UTF-8 character, as byte-level BPE can give.
PIECES = [b"a", b"b", b" ", b"ab", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"STOP", b"\n"]


def decode(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def released(ids, stop):
    t = TextStream(decode, stop)
    out = "".join(t.push(i) for i in ids if not t.stopped)
    return out + t.flush(), t.stopped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=30))
def test_streamed_text_is_the_decoded_text(ids):
    text, stopped = released(ids, ())
    assert not stopped
    assert text == decode(ids)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, len(PIECES) - 1), max_size=30),
    st.lists(st.sampled_from(["STOP", "b a", "\n\n", "é", "ab"]), min_size=1, max_size=3),
)
def test_stop_strings_cut_the_text_before_the_first_match(ids, stop):
    text, stopped = released(ids, tuple(stop))
    full = decode(ids)
    hits = [full.find(s) for s in stop if s in full]
    if hits:
        # the first stop string to complete, at the earliest position among those
        assert stopped
        assert text == full[: text.__len__()] and len(text) <= min(hits) + max(map(len, stop))
        assert not any(s in text for s in stop)
        assert any(full[len(text) :].startswith(s) for s in stop)
    else:
        assert not stopped and text == full


def _tok(messages=None, text=None):
    return [1, 2, 3] if messages is not None else list(range(len(text)))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": -0.1}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}, "seed"),
        # values that used to reach the scheduler's thread and stop it for good
        ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ""}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 98}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, "stream_options"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": 1},
            "stream_options",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True, "x": 1},
            },
            "stream_options",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": "yes"},
            },
            "stream_options",
        ),
    ],
)
def test_bad_chat_requests_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        parse(body, chat=True, tokenize=_tok, context=100)
    assert e.value.param == param
    assert e.value.body()["error"]["param"] == param


def test_prompt_longer_than_the_context_is_refused_not_truncated():
    with pytest.raises(BadRequest) as e:
        parse({"prompt": "x" * 120, "max_tokens": 1}, chat=False, tokenize=_tok, context=100)
    assert e.value.code == "context_length_exceeded"
    p = parse({"prompt": "x" * 99, "max_tokens": 1}, chat=False, tokenize=_tok, context=100)
    assert len(p.prompt) == 99


def test_a_good_request_parses():
    p = parse(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "stop": "\n",
            "n": 2,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
        tokenize=_tok,
        context=100,
    )
    assert p.include_usage
    assert (p.prompt, p.max_tokens, p.temperature, p.stop, p.n, p.seed, p.stream) == (
        [1, 2, 3],
        5,
        0.0,
        ("\n",),
        2,
        7,
        True,
    )


def test_a_held_back_tail_shorter_than_the_hold_releases_nothing():
    # found by hypothesis: "b " with a 3-character hold must release nothing yet
    assert released([1, 2, 0], ("STOP", "b a")) == ("", True)
