"""Ring decode step: ``kv.append`` + ``kv.attend`` (``RotatingState``) against mlx-lm's ring.

mlx-lm's side is one ``RotatingKVCache`` per row (``update_and_fetch`` + fused
SDPA), one layer. Both rings are filled past ``max_size`` (wrapped), then decode one
token per step, alternating sides, each step timed to its evaluated output (float32,
same process, same inputs). At two ring sizes: a step that writes in place costs the
same at both; one that copied the buffer would grow with ``max_size`` (the
append-only rows show the write alone). Ratio: mlx-lm / kvstate (above 1: kvstate
faster).

    python -m benchmarks ring-decode [--batch 4]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

import kvstate as kv
from benchmarks import _common as c


def sides(max_size, a, attend: bool):
    """kvstate's and mlx-lm's one-token step (append, then attend when ``attend``)."""
    B, H, Hq, D = a.batch, a.heads, a.q_heads, a.head_dim
    mx.random.seed(0)
    fill = mx.random.normal((1, H, max_size + 7, D))
    caches = [RotatingKVCache(max_size, a.keep) for _ in range(B)]
    for cache in caches:
        cache.update_and_fetch(fill, fill)
    s = [kv.append(kv.rotating(B, max_size=max_size, keep=a.keep), *[mx.repeat(fill, B, 0)] * 2)]
    new = [(mx.random.normal((B, H, 1, D)), mx.random.normal((B, Hq, 1, D))) for _ in range(8)]
    mx.eval(s[0].planes, [x.keys for x in caches], new)
    n = [0, 0]

    def ours():
        k, q = new[n[0] % 8]
        n[0] += 1
        s[0] = kv.append(s[0], k, k)
        return kv.attend(s[0], q, scale=D**-0.5) if attend else (s[0].keys, s[0].values)

    def theirs():
        k, q = new[n[1] % 8]
        n[1] += 1
        outs = []
        for b, cache in enumerate(caches):
            mask = cache.make_mask(1)
            ck, cv = cache.update_and_fetch(k[b : b + 1], k[b : b + 1])
            if attend:
                sdpa = mx.fast.scaled_dot_product_attention
                outs.append(sdpa(q[b : b + 1], ck, cv, scale=D**-0.5, mask=mask))
            else:
                outs += [cache.keys, cache.values]
        return outs

    return {"kvstate": ours, "mlx-lm": theirs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    a = c.output_args(p).parse_args(argv)
    print(
        f"batch={a.batch} keep={a.keep} H={a.heads} Hq={a.q_heads} D={a.head_dim} "
        f"steps={a.steps} (mlx-lm: one RotatingKVCache per row); the first fifth untimed"
    )
    rows = []
    for m in a.sizes:
        for what in ("step", "append"):
            t = c.rounds(sides(m, a, what == "step"), a.steps, warmup=a.steps // 5)
            ours, theirs = c.median(t["kvstate"]), c.median(t["mlx-lm"])
            rows.append(dict(max_size=m, what=what, kvstate_ms=ours * 1e3, mlx_lm_ms=theirs * 1e3))
            print(
                f"max_size={m:6d}  {what:<6}  kvstate {ours * 1e3:7.3f} ms  mlx-lm "
                f"{theirs * 1e3:7.3f} ms  ratio {theirs / ours:5.2f}"
            )
    c.write(a, "ring-decode", rows)


if __name__ == "__main__":
    main()
