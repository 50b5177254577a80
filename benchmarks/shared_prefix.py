"""Shared prefixes: bytes, time to first token and decode, shared against unshared.

Two parts, each in one process, sides interleaved round by round:

``--part attention``: one decode read of B rows that share a P-token prefix
(SmolLM2-135M's attention geometry by default: 9 query heads, 3 KV heads,
head dim 64), three ways: the rows stored unshared (``kv.attend`` on a
``CacheState`` holding B copies), the cascade read of a ``SharedState``
(``kv.attend``), and the materialising read (``kv.attend`` on
``kv.materialize(state)``: a per-row copy of the prefix every call).

``--part model``: the real model (SmolLM2-135M GGUF through ``kvstate``'s
loader): n samples of one prompt (peak KV bytes, time to first token, decode
step), and R requests sharing a system prompt (prefill tokens, time to first
token, peak KV bytes), with sharing on and off, and mlx-lm's
``LRUPromptCache`` path for the shared system prompt.

    python benchmarks/shared_prefix.py --part attention --rounds 7
    python benchmarks/shared_prefix.py --part model --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

import kvstate as kv


def timed(fn, reps):
    """Seconds per call of ``fn`` (evaluated), over ``reps`` calls after one warm-up."""
    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t) / reps


def spread(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e3:.3f} ms [{xs[0] * 1e3:.3f}, {xs[-1] * 1e3:.3f}]"


def ratio_spread(a, b):
    r = sorted(x / y for x, y in zip(a, b))
    return f"{statistics.median(r):.3f} [{r[0]:.3f}, {r[-1]:.3f}]"


def attention_part(args):
    B, P, S, H, HQ, D = args.batch, args.prefix, args.suffix, args.kv_heads, args.heads, 64
    dtype = getattr(mx, args.dtype)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    pk, pv = arr(1, H, P, D), arr(1, H, P, D)
    base = kv.append(kv.empty(1), pk, pv)
    sk, sv = arr(B, H, S, D), arr(B, H, S, D)
    shared = kv.append(kv.fork(base, 0, B - 1), sk, sv)
    unshared = kv.append(kv.filter_rows(base, [0] * B), sk, sv)
    mx.eval(shared.suffix.planes, unshared.planes)
    q = arr(B, HQ, 1, D)
    scale = D ** -0.5
    sides = {
        "unshared": lambda: kv.attend(unshared, q, scale=scale),
        "cascade": lambda: kv.attend(shared, q, scale=scale),
        "materialize": lambda: kv.attend(kv.materialize(shared), q, scale=scale),
    }
    np.testing.assert_allclose(np.array(sides["cascade"]().astype(mx.float32)),
                               np.array(sides["unshared"]().astype(mx.float32)),
                               atol=1e-3 if dtype != mx.float32 else 1e-5)
    times = {k: [] for k in sides}
    for _ in range(args.rounds):
        for k, fn in sides.items():
            times[k].append(timed(fn, args.reps))
    print(f"# attention read, B={B} prefix={P} suffix={S} H={H} Hq={HQ} D={D} {args.dtype} "
          f"device={mx.default_device()} rounds={args.rounds} reps={args.reps}")
    print(f"# KV bytes: unshared {unshared.nbytes}, shared {shared.nbytes} "
          f"({shared.nbytes / unshared.nbytes:.3f} of unshared)")
    for k, xs in times.items():
        print(f"{k:12s} {spread(xs)}  / unshared {ratio_spread(xs, times['unshared'])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["attention", "model"], default="attention")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    if args.part == "attention":
        attention_part(args)
    else:
        model_part(args)


def model_part(args):  # filled in below
    raise SystemExit("model part: not written yet")


if __name__ == "__main__":
    main()
