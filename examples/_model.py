"""The model the examples run and its tokenizer: ``--model PATH`` (a llama-family
``.gguf`` file or an mlx-lm model directory with its tokenizer, through
``kvstate.models.load_model``), ``--model default`` (SmolLM2-135M-Instruct, fetched once
and cached, as ``kvstate generate`` runs it), else a tiny llama with seeded random
float32 weights and a tokenizer of one character per id (no download; what CI runs:
its text is random characters, but text)."""

import argparse
import string

import mlx.core as mx

# The tiny model's characters: id i is CHARS[i % len(CHARS)]; id 0 is its end of sequence.
CHARS = "\n" + string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,;:!?'-()"


def char_tokenizer():
    """A ``kvstate.models.tokenizer.Tokenizer`` of one character per id (``CHARS``)."""
    from kvstate.models.tokenizer import Tokenizer

    def encode(text):
        return [CHARS.index(c) for c in text if c in CHARS]

    def decode(ids):
        return "".join(CHARS[i % len(CHARS)] for i in ids)

    return Tokenizer(encode, encode, decode, None, (0,))


def load(description: str):
    """Parse ``--model`` and return ``(model, tokenizer, args)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        help="a .gguf file, an mlx-lm model directory, or 'default' (SmolLM2-135M-Instruct) "
        "(default: a tiny llama with random weights)",
    )
    args = parser.parse_args()
    if args.model:
        from kvstate.models import load_model

        loaded = load_model(None if args.model == "default" else args.model, dequantize=True)
        return loaded.model, loaded.tokenizer, args
    from kvstate.models import tiny_llama

    model = tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, vocab=128)
    return model, char_tokenizer(), args


def mlx_lm_greedy(model, prompt, n):
    """The reference: ``n`` tokens of plain greedy decoding on mlx-lm's own caches."""
    from mlx_lm.models.cache import make_prompt_cache

    cache, out = make_prompt_cache(model), []
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    for _ in range(n):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out
