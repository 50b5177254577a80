"""One decode round of ``kvstate serve``'s scheduler against mlx-lm's, paired, one process.

Where a token's time goes when one server serves B streams: the serve
scheduler's round (``Scheduler._round``: ``speculative.step`` with no drafter,
then handing each row's token to its job) on the rows its admission makes,
against one step of mlx-lm's ``BatchGenerator`` (what ``mlx_lm.server``
decodes with) on the same prompts. The real model in float32, chat prompts
with ``serve_load.py``'s shared system prompt. Each side prefills once; then
rounds interleave: every side takes ``--steps`` steps per round, so every side's
rows grow alike. Sides:

- ``serve, prefix cache``: rows from ``prefix_cache.prefill`` (``SharedState``
  rows reading the cached system prompt through the cascade), as served;
- ``serve, dense rows``: the same scheduler with no prefix cache (each row
  holds its whole prompt);
- ``mlx-lm BatchGenerator``.

    python -m benchmarks serve-step --batch 1 8 --rounds 5 --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.serve_load import QUESTIONS, SYSTEM


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up (5)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per side per round (4)")
    args = ap.parse_args(argv)
    from mlx_lm.generate import BatchGenerator

    from kvstate.models import load as models
    from kvstate.serving.http import Job, Scheduler
    from kvstate.serving.prefix_cache import PrefixCache

    loaded = models.load_model(None, dequantize=True)
    model, tok = loaded.model, loaded.tokenizer

    def chat(q):
        return tok.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])

    def serve_side(prompts, cache):
        s = Scheduler(model, (), max_batch=len(prompts), prefix_cache=cache)  # no eos: rows run on
        s._start([Job(prompt=p, max_tokens=10**9) for p in prompts])
        return s._round

    def mlx_lm_side(prompts):
        g = BatchGenerator(
            model, max_tokens=10**9, completion_batch_size=len(prompts), prefill_batch_size=8
        )
        g.insert(prompts)
        while len(g.next_generated()) < len(prompts):  # until every row decodes
            pass
        return g.next_generated

    print(f"{args.rounds} rounds x {args.steps} steps per side (median, min..max ms per step)")
    print("| B | side | ms / step | min..max | x mlx-lm |\n|---:|---|---:|---|---:|")
    for B in args.batch:
        prompts = [chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(B)]
        sides = {
            "serve, prefix cache": serve_side(prompts, PrefixCache(256 << 20)),
            "serve, dense rows": serve_side(prompts, None),
            "mlx-lm BatchGenerator": mlx_lm_side(prompts),
        }
        times: dict = {name: [] for name in sides}
        for r in range(args.rounds + 1):
            for name, step in sides.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - t0) / args.steps)
        base = statistics.median(times["mlx-lm BatchGenerator"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(
                f"| {B} | {name} | {1000 * m:.1f} | {1000 * min(ts):.1f}..{1000 * max(ts):.1f} "
                f"| {m / base:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
