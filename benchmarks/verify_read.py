"""The verify read: stock GQA attention against the folded read, same process.

A verify window has few queries (``N = 1 + k <= 8``). The folded read
(``kvstate.kernels.cuda.folded_attention``) moves the ``G = Hq / H`` query heads
of each KV head into query rows (``[B, H, G*N, D]``), so the fused kernel
sees one query head per KV head; the per-row mask is repeated over the
``G`` groups. Paired, interleaved rounds; ratio = stock time / folded time
(> 1: folding is faster).

    python benchmarks/verify_read.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from kvstate.kernels.cuda import folded_attention


def stock(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def timed(f, args, reps):
    mx.eval(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(f(*args))
    return (time.perf_counter() - t0) / reps


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", default="9:3", help="query heads:KV heads (SmolLM2-135M: 9:3)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    hq, h = map(int, args.heads.split(":"))
    dt = getattr(mx, args.dtype)
    D = args.head_dim
    print(
        f"device {mx.default_device()}, {args.dtype}, heads {hq}:{h}, head dim {D}, "
        f"{args.rounds} paired rounds x {args.reps} reps"
    )
    print("B | context | N | stock us | folded us | stock/folded median [min-max]")
    for B in args.batch:
        for C in args.context:
            k = mx.random.normal((B, h, C, D)).astype(dt)
            v = mx.random.normal((B, h, C, D)).astype(dt)
            for N in (1, 2, 3, 4, 5, 8, 16):
                q = mx.random.normal((B, hq, N, D)).astype(dt)
                ends = mx.array([C - 3 * b for b in range(B)])[:, None, None, None]
                col = mx.arange(C)[None, None, None, :]
                qi = mx.arange(N)[None, None, :, None]
                mask = col <= ends - N + qi  # per-row ends: a ragged verify window
                a = (q, k, v, D**-0.5, mask)
                ref, got = stock(*a), folded_attention(*a)
                err = mx.abs(ref - got).max().item()
                # the two reads sum in different orders: a float32 bound, a bfloat16 one
                assert err < (1e-3 if dt == mx.float32 else 2e-2), err
                ts, tf = [], []
                for r in range(args.rounds):
                    pair = [(stock, ts), (folded_attention, tf)]
                    for f, out in pair if r % 2 == 0 else pair[::-1]:
                        out.append(timed(f, a, args.reps))
                ratios = [s / f for s, f in zip(ts, tf)]
                print(
                    f"{B} | {C} | {N} | {statistics.median(ts) * 1e6:.0f} | "
                    f"{statistics.median(tf) * 1e6:.0f} | {statistics.median(ratios):.2f} "
                    f"[{min(ratios):.2f}-{max(ratios):.2f}]",
                    flush=True,
                )


if __name__ == "__main__":
    main()
