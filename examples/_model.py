"""The model the examples run: ``--model PATH`` (a llama-family ``.gguf`` file or an
mlx-lm model directory, through ``kvstate.models.load_model``), else a tiny llama with
seeded random float32 weights (no download; what CI runs)."""

import argparse

import mlx.core as mx


def load(description: str):
    """Parse ``--model`` and return ``(model, args)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        help="a .gguf file or an mlx-lm model directory "
        "(default: a tiny llama with random weights)",
    )
    args = parser.parse_args()
    if args.model:
        from kvstate.models import load_model

        return load_model(args.model, dequantize=True).model, args
    from kvstate.models import tiny_llama

    return tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, vocab=128), args


def mlx_lm_greedy(model, prompt, n):
    """The reference: ``n`` tokens of plain greedy decoding on mlx-lm's own caches."""
    from mlx_lm.models.cache import make_prompt_cache

    cache, out = make_prompt_cache(model), []
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    for _ in range(n):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1]
    return out
