"""Per-token append cost at 1K and 64K stored tokens: kvstate vs mlx-lm, side by side.

Shows that ``kv.append`` is O(new tokens) when the caller drops the old
record (the write happens in place): the per-token time at 64K stored tokens
is about the time at 1K. mlx-lm's ``KVCache.update_and_fetch`` runs in the
same process on the same inputs as the reference. Each step appends one
token (``[B, H, 1, D]`` float32) and evaluates the stored key and value
planes; the two sides alternate in rounds so drift hits both alike. Capacity
growth (every ``step`` = 256 tokens on both sides) is part of the cost: the
median shows the steady step, the mean includes the amortized growth copies.

With ``--batch B > 1`` the kvstate rows have different ends (per-row scatter
writes) while mlx-lm's ``BatchKVCache`` shares one end (its only mode).

    python benchmarks/append.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

import kvstate as kv


def kvstate_side(keys, values, ragged):
    B = keys.shape[0]
    if ragged:
        # rows end 0, 1, 2, ... columns short of the widest: scatter writes
        S = keys.shape[2]
        s = kv.trim(kv.append(kv.empty(B), keys, values), list(range(B)))
        assert len(set(s.ends)) == B and s.width == S, s.ends
    else:
        s = kv.append(kv.empty(B), keys, values)
    mx.eval(*s.planes)
    holder = [s]

    def step(k, v):
        holder[0] = kv.append(holder[0], k, v)  # the old record is dropped here
        mx.eval(*holder[0].planes)

    return step, holder


def mlx_lm_side(keys, values):
    B = keys.shape[0]
    c = KVCache() if B == 1 else BatchKVCache([0] * B)
    c.update_and_fetch(keys, values)
    mx.eval(c.keys, c.values)

    def step(k, v):
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)

    return step, c


def measure(S, args):
    B, H, D = args.batch, args.heads, args.head_dim
    keys = mx.random.normal((B, H, S, D), key=mx.random.key(S))
    values = mx.random.normal((B, H, S, D), key=mx.random.key(S + 1))
    mx.eval(keys, values)
    toks = [mx.random.normal((B, H, 1, D), key=mx.random.key(i)) for i in range(16)]
    mx.eval(*toks)
    kv_step, kv_hold = kvstate_side(keys, values, ragged=B > 1)
    lm_step, lm_cache = mlx_lm_side(keys, values)
    del keys, values
    times = {"kvstate": [], "mlx-lm": []}
    for r in range(args.rounds):
        order = [("kvstate", kv_step), ("mlx-lm", lm_step)]
        if r % 2:
            order.reverse()
        for name, step in order:
            for i in range(args.steps):
                k = toks[i % len(toks)]
                t0 = time.perf_counter()
                step(k, k)
                times[name].append(time.perf_counter() - t0)
    stored = (kv_hold[0].width, lm_cache.keys.shape[2])
    return times, stored


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1024, 65536],
        help="stored tokens before the measured appends",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="appends per round per side")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()

    print(
        f"# append benchmark: B={args.batch} H={args.heads} D={args.head_dim} float32, "
        f"{args.rounds} rounds x {args.steps} one-token appends per side per size"
    )
    print(
        f"# mlx {mx.__version__}, {platform.machine()}, {platform.processor() or '?'}, "
        f"device {mx.default_device()}"
    )
    print(
        f"{'stored':>8} {'kvstate med us':>15} {'mlx-lm med us':>14} {'ratio med':>10} "
        f"{'kvstate mean us':>16} {'mlx-lm mean us':>15} {'ratio mean':>11}"
    )
    medians = {}
    for S in args.sizes:
        times, _ = measure(S, args)
        km, lm = (statistics.median(times[n]) * 1e6 for n in ("kvstate", "mlx-lm"))
        ka, la = (statistics.fmean(times[n]) * 1e6 for n in ("kvstate", "mlx-lm"))
        medians[S] = (km, lm)
        print(
            f"{S:>8} {km:>15.1f} {lm:>14.1f} {lm / km:>10.2f} {ka:>16.1f} {la:>15.1f} "
            f"{la / ka:>11.2f}"
        )
    if len(args.sizes) >= 2:
        lo, hi = args.sizes[0], args.sizes[-1]
        print(
            f"# growth {lo} -> {hi} stored tokens (median per token): "
            f"kvstate x{medians[hi][0] / medians[lo][0]:.2f}, "
            f"mlx-lm x{medians[hi][1] / medians[lo][1]:.2f}"
        )
    print("# ratio = mlx-lm time / kvstate time (above 1.0: kvstate faster)")


if __name__ == "__main__":
    main()
