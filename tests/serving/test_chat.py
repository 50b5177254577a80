"""``kvstate.serving.chat.Chat`` and ``kvstate chat``: messages in, text out, each turn
prefilling only its new tokens; replies equal mlx-lm's greedy run on the whole
conversation; a saved and resumed session continues as the uninterrupted one (greedy
and sampled); metadata any JSON value; the cache trimmed where the template renders
an earlier turn otherwise; the command line's save and resume."""

from __future__ import annotations

import io

import attrs
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import kvstate as kv
from kvstate import cli
from kvstate import mlx_lm as bridge
from kvstate.serving.chat import Chat

pytestmark = pytest.mark.slow  # the real model


def mlx_lm_greedy(model, ids, n, eos):
    """mlx-lm's own greedy tokens after ``ids`` (its cache, its step), to EOS or ``n``."""
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n):
        if tok in eos:
            break
        out.append(int(tok))
    return out


@pytest.fixture
def fed(monkeypatch):
    """The token counts each ``bridge.feed`` and ``bridge.admit`` call prefills."""
    counts: list = []
    feed, admit = bridge.feed, bridge.admit

    def counted_feed(model, batch, tokens, **kw):
        counts.append(1 + len(tokens[0]))  # the pending token, then the rest
        return feed(model, batch, tokens, **kw)

    def counted_admit(model, prompts, **kw):
        counts.append(len(prompts[0]))
        return admit(model, prompts, **kw)

    monkeypatch.setattr(bridge, "feed", counted_feed)
    monkeypatch.setattr(bridge, "admit", counted_admit)
    return counts


def test_each_turn_prefills_its_new_tokens_and_replies_as_mlx_lm(smollm, fed):
    model, tok = smollm.model, smollm.tokenizer
    chat = Chat.start(system="Answer in one sentence.")
    streamed: list = []
    chat, first = chat.say(model, tok, "What is the capital of France?", on_text=streamed.append)
    assert "Paris" in first and "".join(streamed) == first
    before = len(chat.tokens)
    chat, second = chat.say(model, tok, "And of Italy?", max_tokens=24)
    ids = tok.chat(list(chat.messages[:-1]))  # the conversation up to the second question
    assert tok.decode(mlx_lm_greedy(model, ids, 24, tok.eos_ids)) == second
    assert list(chat.tokens) == tok.chat(list(chat.messages))[: len(chat.tokens)]
    assert fed[-1] == len(ids) - before  # only what the cache did not hold


def test_a_resumed_session_continues_as_the_uninterrupted_one(smollm, tmp_path):
    model, tok = smollm.model, smollm.tokenizer
    meta = {"title": "demo", "tags": [1, 2.5, None], "nested": {"ok": True}}
    for sampling in (kv.Sampling(), kv.Sampling(temperature=0.9, top_p=0.95, seed=7)):
        chat, _ = Chat.start(sampling=sampling).say(model, tok, "Name a fruit.", max_tokens=10)
        chat.save(tmp_path / "chat.safetensors", meta)
        resumed, got = Chat.resume(tmp_path / "chat.safetensors", model)
        assert got == meta and resumed.messages == chat.messages
        assert resumed.tokens == chat.tokens and resumed.sampling == sampling
        _, straight = chat.say(model, tok, "Another one?", max_tokens=10)
        _, again = resumed.say(model, tok, "Another one?", max_tokens=10)
        assert again == straight


def test_an_earlier_turn_rendered_otherwise_is_trimmed_and_refed(smollm, fed):
    model, tok = smollm.model, smollm.tokenizer
    chat, _ = Chat.start().say(model, tok, "What is 2 + 2?", max_tokens=12)
    edited = list(chat.messages)
    edited[-1] = {"role": "assistant", "content": "It is four, of course."}
    chat = attrs.evolve(chat, messages=tuple(edited))  # the cache still holds the old reply
    chat, reply = chat.say(model, tok, "And 3 + 3?", max_tokens=12)
    ids = tok.chat(list(chat.messages[:-1]))
    assert tok.decode(mlx_lm_greedy(model, ids, 12, tok.eos_ids)) == reply
    assert list(chat.tokens) == tok.chat(list(chat.messages))[: len(chat.tokens)]


def test_bad_input_is_refused_and_changes_nothing(smollm, tmp_path):
    model, tok = smollm.model, smollm.tokenizer
    with pytest.raises(kv.KVStateError, match="an empty chat"):
        Chat.start().save(tmp_path / "empty.safetensors")
    chat, _ = Chat.start().say(model, tok, "Hi", max_tokens=3)
    with pytest.raises(kv.KVStateError, match="metadata"):
        chat.save(tmp_path / "bad.safetensors", {"a set": {1, 2}})
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(kv.KVStateError, match="content"):
        chat.say(model, tok, ["not", "text"])
    kv.save(tmp_path / "batch.safetensors", chat.batch)
    with pytest.raises(kv.KVStateError, match="no chat session"):
        Chat.resume(tmp_path / "batch.safetensors", model)


def test_kvstate_chat_saves_and_resumes(tmp_path, capsys):
    path = tmp_path / "chat.safetensors"
    base = ["chat", "--float32", "--max-tokens", "16"]
    out = io.StringIO()
    args = cli.parse([*base, "--save", str(path)])
    assert cli.chat(args, stdin=io.StringIO("What is the capital of France?\n"), out=out) == 0
    assert "Paris" in out.getvalue() and path.is_file()
    out = io.StringIO()
    args = cli.parse([*base, "--resume", str(path)])
    assert cli.chat(args, stdin=io.StringIO("And of Italy?\n"), out=out) == 0
    resumed = out.getvalue()
    out = io.StringIO()
    args = cli.parse(base)
    both = io.StringIO("What is the capital of France?\nAnd of Italy?\n")
    assert cli.chat(args, stdin=both, out=out) == 0
    assert out.getvalue().splitlines()[1] == resumed.strip()  # as the uninterrupted session
    assert cli.main([*base, "--resume", str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err
