"""The split-K decode read's launch shape, swept on the H200 (issues 13 and 15).

Per-layer attention reads, microseconds per call (``--reps`` calls pipelined
with ``async_eval``, median [min-max] of ``--rounds`` rounds), all cases of a
part interleaved round by round in one process:

``--part shape``: Llama-3.2-1B's attention geometry (32/8 heads, D=64, bf16),
B rows x context, aligned and ragged rows: the stock fused SDPA as mlx-lm
reads them (no mask over the exact width for aligned rows, a bool mask for
ragged ones) against ``kernels.ragged_attention`` at several threads per
block, unroll depths and split counts (``splits=1``: one launch, no merge).
Each line gives the share of the copy bandwidth the valid KV bytes make.

``--part prefix``: B rows forked from one P-token prompt plus a suffix of
their own (SmolLM2-135M's geometry by default): the rows stored unshared
(stock SDPA, and the kernel), the cascade (``shared.cascade_attention``,
compiled), the kernel with the prefix as its first source, and the
materialising read.

    python benchmarks/kernel_sweep.py --part shape --batch 1 32 --context 2048 8192
    python benchmarks/kernel_sweep.py --part prefix --batch 32 --prefix 512 --suffix 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvstate as kv  # noqa: E402
from kvstate.core.masks import rows_mask  # noqa: E402
from kvstate.kernels import cuda as kernels
from kvstate.kinds import shared  # noqa: E402


def copy_bandwidth(mb=2048):
    x = mx.random.normal((mb * 1024 * 1024 // 4,))
    mx.eval(x)
    for _ in range(3):
        mx.eval(x + 1)
    t = time.perf_counter()
    for _ in range(10):
        y = x + 1
        mx.async_eval(y)
    mx.eval(y)
    return 2 * x.nbytes * 10 / (time.perf_counter() - t)


def interleaved(cases, rounds, reps):
    """Microseconds per call of each case: median, min, max over rounds."""
    for f in cases.values():
        for _ in range(3):
            mx.eval(f())
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for k, f in cases.items():
            t = time.perf_counter()
            for _ in range(reps):
                y = f()
                mx.async_eval(y)
            mx.eval(y)
            times[k].append((time.perf_counter() - t) / reps * 1e6)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def report(title, res, kv_bytes, bw):
    print(f"\n## {title} (valid KV {kv_bytes / 1e6:.1f} MB)")
    for k, (med, lo, hi) in res.items():
        share = kv_bytes / (med * 1e-6) / bw * 100
        print(f"{k:44s} {med:8.1f} us [{lo:.1f}-{hi:.1f}]  {share:5.1f}% copy bw")
    sys.stdout.flush()


def shape_part(args, bw):
    for B in args.batch:
        for ctx in args.context:
            for layout in ("aligned", "ragged"):
                shape_case(args, bw, B, ctx, layout)


def shape_case(args, bw, B, ctx, layout):
    Hq, H, D, dt = 32, 8, 64, mx.bfloat16
    C = ctx + 256
    q = mx.random.normal((B, Hq, 1, D)).astype(dt)
    k = mx.random.normal((B, H, C, D)).astype(dt)
    v = mx.random.normal((B, H, C, D)).astype(dt)
    lens = (
        [ctx] * B
        if layout == "aligned"
        else [ctx - (ctx // 4) * i // max(1, B - 1) for i in range(B)]
    )
    lp = mx.array([ctx - n for n in lens], mx.int32)
    en = mx.array([ctx] * B, mx.int32)
    kw, vw = k[:, :, :ctx], v[:, :, :ctx]
    mx.eval(q, k, v, kw, vw)
    s = D**-0.5
    cases = {}
    if layout == "aligned":
        cases["sdpa, no mask, exact width"] = lambda: mx.fast.scaled_dot_product_attention(
            q, kw, vw, scale=s
        )
    else:
        m = rows_mask(1, lp, en, ctx)
        mx.eval(m)
        cases["sdpa, bool mask, exact width"] = lambda: mx.fast.scaled_dot_product_attention(
            q, kw, vw, scale=s, mask=m
        )
    auto = kernels.splits_for(B, H, C)
    variants = [(auto, 0, 0)] + [
        (S, nt, u)
        for S in sorted({auto, *args.splits})
        for nt in args.threads
        for u in args.unroll
        if (S, nt, u) != (auto, kernels.THREADS, kernels.UNROLL)
    ]
    for S, nt, u in variants:
        name = (
            f"kernel auto (S={S} NT={kernels.THREADS} U={kernels.UNROLL})"
            if nt == 0
            else f"kernel S={S} NT={nt} U={u}"
        )
        cases[name] = lambda S=S, nt=nt, u=u: kernels.ragged_attention(
            q, k, v, lp, en, scale=s, splits=S, threads=nt, unroll=u
        )
    res = interleaved(cases, args.rounds, args.reps)
    report(f"B={B} ctx={ctx} {layout}", res, sum(lens) * H * D * 2 * 2, bw)


def prefix_part(args, bw):
    for B in args.batch:
        prefix_case(args, bw, B)


def prefix_case(args, bw, B):
    Hq, H, D, dt = args.heads, args.kv_heads, 64, mx.bfloat16
    P, Sx = args.prefix, args.suffix
    pk = mx.random.normal((1, H, P, D)).astype(dt)
    pv = mx.random.normal((1, H, P, D)).astype(dt)
    base = kv.append(kv.empty(1), pk, pv)
    sk = mx.random.normal((B, H, Sx, D)).astype(dt)
    sv = mx.random.normal((B, H, Sx, D)).astype(dt)
    st = kv.append(kv.fork(base, 0, B - 1), sk, sv)
    un = kv.append(kv.filter_rows(base, [0] * B), sk, sv)
    q = mx.random.normal((B, Hq, 1, D)).astype(dt)
    s = D**-0.5
    sx = st.suffix
    i32 = mx.int32
    views = shared.view_arrays(st)
    planes = shared.prefix_planes(st)
    prefix = (*planes, *views[1:])  # one prefix record: (pk, pv, rows, starts, lens)
    slp, sen = mx.array(sx.left_pad, i32), mx.array(sx.ends, i32)
    ulp, uen = mx.array(un.left_pad, i32), mx.array(un.ends, i32)
    uk, uv = un.keys[:, :, : P + Sx], un.values[:, :, : P + Sx]
    smask = rows_mask(1, sx.left_pad, sx.ends, sx.capacity)
    mx.eval(q, sx.keys, sx.values, un.keys, un.values, uk, uv, smask, *prefix, *views)
    cascade = mx.compile(
        lambda q, a, b, m, pk, pv, *views: shared.cascade_attention(
            q, [(pk, pv)], views, (a, b), m, scale=s
        )
    )
    cases = {
        "unshared: sdpa, no mask, exact width": lambda: mx.fast.scaled_dot_product_attention(
            q, uk, uv, scale=s
        ),
        "unshared: kernel": lambda: kernels.ragged_attention(
            q, un.keys, un.values, ulp, uen, scale=s
        ),
        "shared: cascade (compiled)": lambda: cascade(
            q, sx.keys, sx.values, smask, *planes, *views
        ),
        "shared: kernel with prefix": lambda: kernels.ragged_attention(
            q, sx.keys, sx.values, slp, sen, scale=s, prefix=prefix
        ),
        "shared: kernel with prefix, 1 split": lambda: kernels.ragged_attention(
            q, sx.keys, sx.values, slp, sen, scale=s, prefix=prefix, splits=1
        ),
        "shared: materialize + sdpa": lambda: kv.attend(kv.materialize(st), q, scale=s),
    }
    want = cases["unshared: sdpa, no mask, exact width"]().astype(mx.float32)
    for name in ("shared: cascade (compiled)", "shared: kernel with prefix"):
        err = mx.abs(cases[name]().astype(mx.float32) - want).max().item()
        print(f"# B={B} {name}: max |diff| vs unshared sdpa {err:.2e}")
    res = interleaved(cases, args.rounds, args.reps)
    report(
        f"prefix B={B} P={P} suffix={Sx} Hq={Hq} H={H} D={D} bf16 "
        f"(S auto {kernels.splits_for(B, H, P + sx.capacity)})",
        res,
        B * (P + Sx) * H * D * 2 * 2,
        bw,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["shape", "prefix"], nargs="+", default=["shape"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--unroll", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"mlx {mx.__version__} on {mx.default_device()}; copy bandwidth {bw / 1e12:.3f} TB/s")
    for part in args.part:
        (shape_part if part == "shape" else prefix_part)(args, bw)


if __name__ == "__main__":
    main()
