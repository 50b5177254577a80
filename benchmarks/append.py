"""Per-token append cost at 1K and 64K stored tokens: kvstate vs mlx-lm, side by side.

``kv.append`` is O(new tokens) when the caller drops the old record (the write
happens in place): the per-token time at 64K stored tokens is about the time at 1K.
mlx-lm's ``KVCache.update_and_fetch`` runs in the same process on the same inputs.
Each step appends one token (``[B, H, 1, D]`` float32) and evaluates the planes; the
sides alternate round by round. Growth (every 256 tokens on both sides) is part of
the cost: the median shows the steady step, the mean the amortized growth copies.
With ``--batch B > 1`` kvstate's rows have different ends (per-row scatter writes),
mlx-lm's ``BatchKVCache`` one shared end (its only mode).

    python -m benchmarks append --sizes 1024 65536 --rounds 6 --steps 100
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

import kvstate as kv
from benchmarks import _common as c


def sides(keys, values, toks):
    """Two callables, each one one-token append evaluated; kvstate drops the old record
    each step (rows end 0, 1, 2, ... columns short of the widest when B > 1)."""
    B = keys.shape[0]
    s = kv.append(kv.empty(B), keys, values)
    held = [kv.trim(s, list(range(B))) if B > 1 else s]
    lm = KVCache() if B == 1 else BatchKVCache([0] * B)
    lm.update_and_fetch(keys, values)
    mx.eval(*held[0].planes, lm.keys, lm.values)

    n = [0, 0]

    def ours():
        n[0] += 1
        held[0] = kv.append(held[0], toks[n[0] % 16], toks[n[0] % 16])
        return held[0].planes

    def theirs():
        n[1] += 1
        lm.update_and_fetch(toks[n[1] % 16], toks[n[1] % 16])
        return lm.keys, lm.values

    return {"kvstate": ours, "mlx-lm": theirs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 65536], help="stored tokens")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="appends per round per side")
    p.add_argument("--rounds", type=int, default=6)
    args = c.output_args(p).parse_args(argv)
    B, H, D = args.batch, args.heads, args.head_dim
    print(
        f"# append: B={B} H={H} D={D} float32, {args.rounds} rounds x {args.steps}; {c.machine()}"
    )
    print(
        "# us per one-token append, median [min-max] of the rounds' medians; "
        "ratio = mlx-lm / kvstate"
    )
    rows = []
    for S in args.sizes:
        keys, values = (mx.random.normal((B, H, S, D), key=mx.random.key(S + i)) for i in (0, 1))
        toks = [mx.random.normal((B, H, 1, D), key=mx.random.key(i)) for i in range(16)]
        mx.eval(keys, values, toks)
        each = c.rounds(sides(keys, values, toks), args.rounds * args.steps)
        del keys, values
        n = args.steps  # per side: the median over rounds of each round's median append
        t = {
            k: [statistics.median(v[i : i + n]) for i in range(0, len(v), n)]
            for k, v in each.items()
        }
        rows.append(dict(stored=S, **{k: c.summary(v, 1e6) for k, v in t.items()}))
        mean = {k: statistics.fmean(v) * 1e6 for k, v in each.items()}
        rows[-1].update(mean_us=mean)
        print(
            f"{S:>8}  kvstate {c.spread(t['kvstate'], 1e6, 'us', 1)}  "
            f"mlx-lm {c.spread(t['mlx-lm'], 1e6, 'us', 1)}  "
            f"ratio {c.ratio(t['mlx-lm'], t['kvstate'])}; "
            f"mean kvstate {mean['kvstate']:.1f} us, mlx-lm {mean['mlx-lm']:.1f} us"
        )
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        print(
            f"# growth {lo['stored']} -> {hi['stored']} stored tokens (median): kvstate "
            f"x{hi['kvstate']['median'] / lo['kvstate']['median']:.2f}, mlx-lm "
            f"x{hi['mlx-lm']['median'] / lo['mlx-lm']['median']:.2f}"
        )
    c.write(args, "append", rows)


if __name__ == "__main__":
    main()
