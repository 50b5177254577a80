"""What the benchmarks share: model builders, timing with spreads, result rows as JSON.

Models: ``llama(name)`` builds a seeded random mlx-lm llama of a preset of ``MODELS``
(``tiny``, ``small``, ``llama-3.2-1b``, ``llama-3.2-1b-host``) or of ``shaped(...)``;
``real()`` loads the real model (SmolLM2-135M-Instruct, GGUF) through ``kvstate.models``.

Timing: ``rounds(sides, n)`` runs every side once a round, the order alternating
round by round in one process, and returns each side's seconds per round;
``spread`` / ``ratio`` print a median with its min-max spread.

Output: ``output_args(parser)`` adds ``--json PATH`` and ``--out DIR``;
``write(args, name, rows, **meta)`` writes ``{"meta": ..., "rows": [...]}`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

# --- models -------------------------------------------------------------------------

LLAMA_1B = dict(  # meta-llama/Llama-3.2-1B config.json (geometry; random weights)
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    rope_scaling={
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
)


def shaped(hidden: int, layers: int, kv_heads: int, vocab: int, **extra) -> dict:
    """A llama of ``hidden // 64`` query heads of 64, MLP ``2 * hidden``, untied."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        head_dim=64,
        vocab_size=vocab,
        tie_word_embeddings=False,
        **extra,
    )


MODELS = {
    "llama-3.2-1b": LLAMA_1B,
    # its layers and attention with a tiny hidden size: the host work without the compute
    "llama-3.2-1b-host": dict(LLAMA_1B, hidden_size=64, intermediate_size=128, vocab_size=512),
    # per-step overhead, not matmuls, dominates a CPU step
    "tiny": dict(
        shaped(128, 4, 1, 1024, rope_theta=10000.0),
        intermediate_size=256,
        num_attention_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    "small": dict(  # CPU runs of the suite
        shaped(512, 8, 2, 8192, rope_theta=10000.0),
        intermediate_size=1536,
        tie_word_embeddings=True,
    ),
}


def llama(model: str | dict, dtype="float32", seed: int = 0, evaluate: bool = True):
    """A seeded random ``mlx_lm`` llama: a ``MODELS`` name or ``ModelArgs`` fields."""
    from mlx_lm.models import llama as mlx_llama

    fields = MODELS[model] if isinstance(model, str) else model
    mx.random.seed(seed)
    m = mlx_llama.Model(
        mlx_llama.ModelArgs(**{"model_type": "llama", "rms_norm_eps": 1e-5, **fields})
    )
    m.set_dtype(getattr(mx, dtype) if isinstance(dtype, str) else dtype)
    if evaluate:
        mx.eval(m.parameters())
    return m


def real(path=None, *, quantized: bool = False, dtype="float32"):
    """The real model through ``kvstate.models`` (default: SmolLM2-135M-Instruct's GGUF,
    fetched once): ``Loaded`` (``.model``, ``.tokenizer``, ``.name``); 4-bit layers kept
    (``quantized``) or dequantized to ``dtype``."""
    from kvstate.models import load

    dt = getattr(mx, dtype) if isinstance(dtype, str) else dtype
    return load.load_model(path, dequantize=not quantized, dtype=dt)


def ragged(B: int, mean: int, spread: int) -> list[int]:
    """``B`` row lengths evenly spread over ``mean +- spread``."""
    return [mean - spread + (2 * spread * i) // max(B - 1, 1) for i in range(B)]


# --- timing --------------------------------------------------------------------------


def timed(fn: Callable, reps: int = 1, warmup: int = 0) -> float:
    """Seconds per call of ``fn`` (its result evaluated), over ``reps`` calls."""
    for _ in range(warmup):
        mx.eval(fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t) / reps


def rounds(sides: dict, n: int, reps: int = 1, warmup: int = 0) -> dict:
    """Seconds per call of each side (``name -> fn``, its result evaluated), one entry
    per round: every round times every side once (``reps`` calls), the order turning
    round by round (rotated, and reversed every other round), so drift on a shared
    machine touches every side alike."""
    names = list(sides)
    for name in names:
        for _ in range(warmup):
            mx.eval(sides[name]())
    out: dict = {name: [] for name in names}
    for r in range(n):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            out[name].append(timed(sides[name], reps))
    return out


def median(xs) -> float:
    return statistics.median(xs)


def spread(xs, scale: float = 1e3, unit: str = "ms", digits: int = 3) -> str:
    """``median [min-max]`` of ``xs`` times ``scale``."""
    m, lo, hi = (scale * f(xs) for f in (statistics.median, min, max))
    return f"{m:.{digits}f} {unit} [{lo:.{digits}f}-{hi:.{digits}f}]".replace(" []", "")


def ratio(a, b, digits: int = 3) -> str:
    """The paired per-round ratio ``a / b``: ``median [min-max]``."""
    return spread([x / y for x, y in zip(a, b)], 1, "", digits).replace("  [", " [")


def summary(xs, scale: float = 1e3) -> dict:
    return dict(median=scale * statistics.median(xs), min=scale * min(xs), max=scale * max(xs))


# --- output --------------------------------------------------------------------------


def output_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", metavar="PATH", help="write the result rows here as JSON")
    p.add_argument("--out", metavar="DIR", help="write the result rows to DIR/NAME.json")
    return p


def machine() -> dict:
    return dict(
        mlx=mx.__version__,
        device=str(mx.default_device()),
        machine=f"{platform.machine()} {platform.processor() or platform.node()}",
        load=round(os.getloadavg()[0], 2),
        command=" ".join(sys.argv),
    )


def write(args, name: str, rows: list, **meta) -> Path | None:
    """Write ``rows`` (dicts) with ``meta`` and the machine as JSON to ``--json`` or
    ``--out/NAME.json``; returns the path (None: neither given)."""
    path = args.json or (args.out and os.path.join(args.out, f"{name}.json"))
    if not path:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine(), **meta}
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    print(f"wrote {path}")
    return path
