"""Ragged batched decode: kvstate ``forward`` versus mlx-lm's ``BatchKVCache``.

B rows of different prompt lengths (around 512 tokens) are prefilled alone, merged
(left-padded) and decoded greedily as one batch (float32) through the same mlx-lm
llama in one process. Each round starts every side from the same prefilled rows and
rotates the order of their steps, each step timed to its evaluated logits. Prints
the median step of each side, the ratio mlx-lm / kvstate (above 1: kvstate faster)
and the median of the per-step ratios of back-to-back steps (a shared machine). A
third side runs kvstate with ``start_early=False`` (no early device start of the
first layer; the default starts early on the CPU only).

    python -m benchmarks ragged-decode
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from benchmarks import _common as c
from kvstate import mlx_lm as br


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512, help="mean prompt length")
    p.add_argument("--spread", type=int, default=96, help="prompt lengths length +- spread")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = c.output_args(p).parse_args(argv)
    model = c.llama(c.shaped(args.hidden, args.layers, args.kv_heads, args.vocab))
    B, L = args.batch, len(model.layers)
    lengths = c.ragged(B, args.length, args.spread)
    prompts = [
        mx.random.randint(1, args.vocab, (n,), key=mx.random.key(i)).tolist()
        for i, n in enumerate(lengths)
    ]
    solo, last = [], []  # each row prefilled alone on both sides (untimed)
    for pr in prompts:
        cache = [KVCache() for _ in range(L)]
        last.append(model(mx.array([pr]), cache=cache)[:, -1])
        mx.eval(last[-1], [x.state for x in cache])
        solo.append(cache)
    first_lm = mx.argmax(mx.concatenate(last, axis=0), axis=-1)
    logits, prefilled = br.prefill(model, prompts)
    first = mx.argmax(logits, axis=-1)
    mx.eval(first_lm, first, [s.planes for s in prefilled])
    sides = ("kvstate", "kvstate start_early=False", "mlx-lm")
    times = {s: [] for s in sides}
    mismatched = 0
    for r in range(args.rounds):
        lm = [BatchKVCache.merge([cache[i] for cache in solo]) for i in range(L)]
        mx.eval([x.state for x in lm])
        states = {s: prefilled for s in sides[:2]}
        tok = {s: first for s in sides} | {"mlx-lm": first_lm}
        for s in range(args.steps):
            k = (r + s) % 3
            order = sides[k:] + sides[:k]
            for side in order[::-1] if (r + s) % 2 else order:
                t0 = time.perf_counter()
                if side == "mlx-lm":
                    logits = model(tok[side][:, None], cache=lm)[:, -1]
                else:
                    early = None if side == "kvstate" else False
                    logits, states[side] = br.step(
                        model, tok[side], states[side], start_early=early
                    )
                tok[side] = mx.argmax(logits, axis=-1)
                mx.eval(tok[side])
                times[side].append(time.perf_counter() - t0)
            mismatched += sum(int((tok[x] != tok["mlx-lm"]).sum().item()) for x in sides[:2])
        del states
    print(
        f"model: llama {args.layers} layers, hidden {args.hidden}, kv heads {args.kv_heads}, "
        f"head_dim 64, vocab {args.vocab}, float32, {mx.default_device()}"
    )
    print(f"rows: B={B}, prompt lengths {lengths}; {args.rounds} rounds x {args.steps} steps")
    print("median step  " + "   ".join(f"{s} {c.spread(t)}" for s, t in times.items()))
    print(f"token mismatches with mlx-lm (both kvstate sides): {mismatched}")
    ml, rows = statistics.median(times["mlx-lm"]), []
    for side in sides[:2]:
        paired = [a / b for a, b in zip(times["mlx-lm"], times[side])]
        q = statistics.quantiles(paired, n=4)
        m = statistics.median(times[side])
        rows.append(
            dict(side=side, ms=m * 1e3, paired=statistics.median(paired), of_medians=ml / m)
        )
        print(
            f"{side}: paired per-step ratio mlx-lm/kvstate median {statistics.median(paired):.3f} "
            f"(quartiles {q[0]:.3f} .. {q[2]:.3f}); ratio of medians {ml / m:.3f}"
        )
    c.write(args, "ragged-decode", rows, lengths=lengths, mismatched=mismatched)


if __name__ == "__main__":
    main()
