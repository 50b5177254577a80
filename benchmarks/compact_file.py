"""File size of a saved chat: kvstate's compact ``kv.save`` beside its exact layout and
mlx-lm's ``save_prompt_cache``, for the same conversation in one process.

A chat on the real model (SmolLM2-135M-Instruct, dequantized float32 by default)
is run until its cache holds ``--tokens`` tokens (the prompt through the chat
template, then greedy replies); the three files are written and their sizes
printed beside the bytes of the tokens held (layers x KV heads x (Dk + Dv) x
itemsize x tokens). Sizes are exact (no timing), so one run suffices.

    python benchmarks/compact_file.py [--model PATH] [--tokens 46] [--float16]
"""

import argparse
import os
import struct
import tempfile

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

import kvstate as kv
from kvstate import mlx_lm as bridge
from kvstate.models.load import load_model


def header_bytes(path):
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf file or mlx-lm directory (default: the default real model)",
    )
    ap.add_argument("--tokens", type=int, default=46)
    ap.add_argument("--float16", action="store_true")
    args = ap.parse_args()
    loaded = load_model(
        args.model, dequantize=True, dtype=mx.float16 if args.float16 else mx.float32
    )
    model, tok = loaded.model, loaded.tokenizer
    prompt = tok.chat([{"role": "user", "content": "Name three colours."}])
    batch = bridge.admit(model, [prompt], payload=[{"chat": "demo"}])
    history = list(prompt)
    while batch.lengths[0] < args.tokens:
        history.append(batch.tokens.item())
        batch = bridge.advance(model, batch)
    held = batch.lengths[0]
    assert len(history) == held  # the pending token is not in the cache
    per_token = sum(p.shape[1] * p.shape[3] * p.itemsize for s in batch.states for p in s.planes)
    with tempfile.TemporaryDirectory() as d:
        sizes = {}
        for name, write in [
            ("kvstate compact (kv.Batch)", lambda p: kv.save(p, batch)),
            ("kvstate exact=True", lambda p: kv.save(p, list(batch.states), exact=True)),
            (
                "mlx-lm save_prompt_cache",
                lambda p: save_prompt_cache(p, mlx_lm_cache(model, history)),
            ),
        ]:
            path = os.path.join(d, name.split()[0] + str(len(sizes)) + ".safetensors")
            write(path)
            sizes[name] = (os.path.getsize(path), header_bytes(path))
    print(
        f"model {loaded.name}, {'float16' if args.float16 else 'float32'}, "
        f"{held} tokens held, {per_token} bytes per token: {held * per_token} bytes of tokens"
    )
    for name, (size, header) in sizes.items():
        print(
            f"  {name:30s} {size:>10d} bytes (header {header}, data {size - header}, "
            f"data / tokens held = {(size - header) / (held * per_token):.3f})"
        )


def mlx_lm_cache(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


if __name__ == "__main__":
    main()
