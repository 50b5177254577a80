"""Ring decode step: ``kv.append`` + ``kv.attend`` on a ``RotatingState`` versus
mlx-lm's ``RotatingKVCache`` (``update_and_fetch`` + fused SDPA), one layer.

Both rings are filled past ``max_size`` (wrapped), then decode one token per
step, alternating sides, each step timed to its evaluated output (float32,
CPU, same process, same inputs). Run at two ring sizes: a step that wrote
in place costs the same at both; one that copied the buffer would grow
with ``max_size`` (the append-only rows show the write alone). Prints the median step
time of each side and the ratio
(mlx-lm time / kvstate time; above 1.0 means kvstate is faster).

    python benchmarks/ring_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

import kvstate as kv


def run(max_size, keep, steps, B, H, Hq, D):
    mx.random.seed(0)
    scale = D**-0.5
    fill = mx.random.normal((1, H, max_size + 7, D))
    caches = [RotatingKVCache(max_size, keep) for _ in range(B)]
    for c in caches:
        c.update_and_fetch(fill, fill)
    s = kv.rotating(B, max_size=max_size, keep=keep)
    s = kv.append(s, mx.repeat(fill, B, axis=0), mx.repeat(fill, B, axis=0))
    mx.eval(*s.planes, *[c.keys for c in caches])
    ours, theirs = [], []
    for _ in range(steps):
        k = mx.random.normal((B, H, 1, D))
        q = mx.random.normal((B, Hq, 1, D))
        mx.eval(k, q)
        t0 = time.perf_counter()
        s = kv.append(s, k, k)
        out = kv.attend(s, q, scale=scale)
        mx.eval(out)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = []
        for b, c in enumerate(caches):
            mask = c.make_mask(1)
            ck, cv = c.update_and_fetch(k[b : b + 1], k[b : b + 1])
            outs.append(
                mx.fast.scaled_dot_product_attention(q[b : b + 1], ck, cv, scale=scale, mask=mask)
            )
        mx.eval(*outs)
        theirs.append(time.perf_counter() - t0)
    skip = steps // 5
    return statistics.median(ours[skip:]), statistics.median(theirs[skip:])


def run_append(max_size, keep, steps, B, H, D):
    """Append only, evaluated: the write itself (in place: flat in ``max_size``)."""
    mx.random.seed(0)
    fill = mx.random.normal((1, H, max_size + 7, D))
    caches = [RotatingKVCache(max_size, keep) for _ in range(B)]
    for c in caches:
        c.update_and_fetch(fill, fill)
    s = kv.rotating(B, max_size=max_size, keep=keep)
    s = kv.append(s, mx.repeat(fill, B, axis=0), mx.repeat(fill, B, axis=0))
    del fill
    mx.eval(*s.planes, *[c.keys for c in caches])
    ours, theirs = [], []
    for _ in range(steps):
        k = mx.random.normal((B, H, 1, D))
        mx.eval(k)
        t0 = time.perf_counter()
        s = kv.append(s, k, k)
        mx.eval(s.keys, s.values)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b, c in enumerate(caches):
            c.update_and_fetch(k[b : b + 1], k[b : b + 1])
        mx.eval(*[x for c in caches for x in (c.keys, c.values)])
        theirs.append(time.perf_counter() - t0)
    skip = steps // 5
    return statistics.median(ours[skip:]), statistics.median(theirs[skip:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    print(
        f"batch={a.batch} keep={a.keep} H={a.heads} Hq={a.q_heads} D={a.head_dim} "
        f"steps={a.steps} (mlx-lm: one RotatingKVCache per row)"
    )
    for m in a.sizes:
        ours, theirs = run(m, a.keep, a.steps, a.batch, a.heads, a.q_heads, a.head_dim)
        print(
            f"max_size={m:6d}  step    kvstate {ours * 1e3:7.3f} ms  mlx-lm "
            f"{theirs * 1e3:7.3f} ms  ratio {theirs / ours:5.2f}"
        )
        ours, theirs = run_append(m, a.keep, a.steps, a.batch, a.heads, a.head_dim)
        print(
            f"max_size={m:6d}  append  kvstate {ours * 1e3:7.3f} ms  mlx-lm "
            f"{theirs * 1e3:7.3f} ms  ratio {theirs / ours:5.2f}"
        )


if __name__ == "__main__":
    main()
