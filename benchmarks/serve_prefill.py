"""The serve scheduler's admission prefill, before and after issue 17's fix (paired rounds).

One process, interleaved rounds, the real model in float32, chat prompts with
one shared system prompt (``serve_load.py``'s), the system prefix cached:

- ``logits per token`` (what ``prefix_cache.prefill`` did before): the
  uncached rest of one prompt through ``kvstate.mlx_lm.forward``, logits
  ``[1, N, V]`` evaluated for every token, the last row kept;
- ``prefix_cache.prefill`` now: the rest but the last token with no logits,
  then the last token as a step (``[1, V]``);
- ``B prompts, one call``: ``prefix_cache.prefill`` of ``--batch`` prompts at
  once (one batched step for the last tokens), per prompt.

    python benchmarks/serve_prefill.py --rounds 5 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import QUESTIONS, SYSTEM  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    from kvstate import mlx_lm as bridge
    from kvstate.models import load as models
    from kvstate.serving import prefix_cache

    loaded = models.load_model(None, dequantize=True)
    model, tok = loaded.model, loaded.tokenizer

    def chat(q):
        return tok.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])

    system = tok.chat([{"role": "system", "content": SYSTEM}])

    def fresh_cache():
        c = prefix_cache.PrefixCache(1 << 30)
        mx.eval(prefix_cache.prefill(model, [system], c)[0])
        return c

    def old(p, c):
        hit = c.lookup(p)
        logits, _ = bridge.forward(model, mx.array([p[hit.matched :]]), hit.states)
        mx.eval(logits[:, -1, :])

    def new(p, c):
        logits, *_ = prefix_cache.prefill(model, [p], c)
        mx.eval(logits)

    def batched(ps, c):
        logits, *_ = prefix_cache.prefill(model, ps, c)
        mx.eval(logits)

    times = {
        "logits per token (before), per prompt": [],
        "prefix_cache.prefill, per prompt": [],
        f"{args.batch} prompts in one call, per prompt": [],
    }
    names = list(times)
    for r in range(args.rounds + 1):
        p = chat(QUESTIONS[r % len(QUESTIONS)])
        ps = [chat(QUESTIONS[(r + i) % len(QUESTIONS)]) for i in range(args.batch)]
        for name, f, div in (
            (names[0], lambda c, p=p: old(p, c), 1),
            (names[1], lambda c, p=p: new(p, c), 1),
            (names[2], lambda c, ps=ps: batched(ps, c), args.batch),
        ):
            c = fresh_cache()  # (not timed)
            t0 = time.perf_counter()
            f(c)
            if r:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / div)
    base = statistics.median(times[names[0]])
    print(
        f"{args.rounds} rounds (median, min..max s); prompt {len(p)} tokens, system "
        f"{len(system)} cached"
    )
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.3f} | {min(ts):.3f}..{max(ts):.3f} | {base / m:.1f}x |")


if __name__ == "__main__":
    main()
