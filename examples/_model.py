"""The model the examples run: ``--model PATH`` (an mlx-lm model directory), else a
tiny llama with seeded random float32 weights (no download; what CI runs)."""

import argparse


def load(description: str):
    """Parse ``--model`` and return ``(model, args)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", help="an mlx-lm model directory (default: a tiny llama)")
    args = parser.parse_args()
    if args.model:
        from mlx_lm import load as load_mlx_lm

        return load_mlx_lm(args.model)[0], args
    from kvstate.cli import tiny_llama

    return tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, vocab=128), args
