"""Where a compiled decode step's cache time goes on the H200 (issue 15), in one process.

``--part step``: one case (B rows x context x layout) of whole greedy decode
steps, variants interleaved round by round (``suite.ablation``'s harness),
each timed four ways: pipelined wall ms/step (the next token fed back
lazily, as mlx-lm's generator does), the host's share of it (time spent
inside the step call and ``async_eval``: the graph replay and its launches),
the step call alone (Python and the compiled replay, no launch), and
ms/step when every step is waited for (host + device, no overlap; so
"sync - host" is about the device's time). Each variant's graph is counted
(primitives by name, ``mx.export_to_dot``; the first step's and the second's,
a Decoder's steady call). Variants remove or swap one
part: the fused write, the split count (``splits_for`` forced), the read
itself (identity or the stock unmasked SDPA over the capacity: wrong
results, timing only), the write (dropped), the Decoder's host path
("general host path": every call through its general path, no steady call).

``--part write``: one layer's plane write in place or copied (fused kernel,
scatter, slice_update), in a pipelined loop, one that waits for the last
step before dispatching the next, and one that waits for every step.

``--part read``: per-layer reads, ``--layers`` of them chained in one
compiled call (layer i's output is layer i+1's query, each layer its own
planes), so a call's host cost is that of a compiled step's reads; µs per
layer pipelined and waited for, against a trivial custom kernel chained the
same way (the floor of one custom-kernel launch) and the stock SDPA as
mlx-lm reads (no mask over the exact width: cuDNN's decode path).

    python3 benchmarks/decode_cost.py --part step --batch 1 --context 2048
    python3 benchmarks/decode_cost.py --part read --batch 1 --context 2048 --splits 1,2,4,8,16,32,64
    python3 benchmarks/decode_cost.py --part write --write-cases 32:2048:ragged,1:2048:aligned
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import suite  # noqa: E402

from kvstate import mlx_lm as br  # noqa: E402
from kvstate.core.masks import rows_mask  # noqa: E402
from kvstate.kernels import cuda as kernels  # noqa: E402
from kvstate.kinds import rows as _rows
from kvstate.kinds.rows import round_up  # noqa: E402


def graph_counts(*arrays) -> dict:
    """Primitives in the lazy graph of ``arrays``, by name."""
    s = io.StringIO()
    mx.export_to_dot(s, *arrays)
    names = [
        line.split('label ="', 1)[1].split('"', 1)[0]
        for line in s.getvalue().splitlines()
        if "shape=rectangle" in line
    ]
    return dict(collections.Counter(names))


def timed_steps(runs, warmup, steps, rounds, sync_rounds):
    """Per name: pipelined wall, host and synced ms/step, and the pipelined rounds'
    peak memory over their start in MB (lists over rounds): about a plane pair per
    layer in flight when the writes copy, ~0 in place."""
    out = {n: dict(wall=[], host=[], call=[], sync=[], extra_mb=[]) for n in runs}
    for r in runs.values():
        r[1], r[2] = suite.run_steps(r[0], warmup, r[1], r[2])

    def one(r, sync):
        host = call = 0.0
        tok, st = r[1], r[2]
        r[2] = None  # (held here, the first step's planes could not be written in place)
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        for _ in range(steps):
            h0 = time.perf_counter()
            logits, st = r[0](tok, st)
            tok = mx.argmax(logits, axis=-1).astype(mx.int32)
            call += time.perf_counter() - h0
            (mx.eval if sync else mx.async_eval)(tok)
            host += time.perf_counter() - h0
        mx.eval(tok)
        r[1], r[2] = tok, st
        wall = (time.perf_counter() - t0) / steps * 1e3
        extra = (mx.get_peak_memory() - base) / 1e6
        return wall, host / steps * 1e3, call / steps * 1e3, extra

    for _ in range(rounds):
        for name, r in runs.items():
            wall, host, call, extra = one(r, False)
            out[name]["wall"].append(wall)
            out[name]["host"].append(host)
            out[name]["call"].append(call)
            out[name]["extra_mb"].append(extra)
    for _ in range(sync_rounds):
        for name, r in runs.items():
            out[name]["sync"].append(one(r, True)[0])
    return out


def step_part(model, args, dtype):
    B, ctx, layout = args.batch, args.context, args.layout
    lengths = suite.row_lengths(B, ctx, layout)
    room = args.warmup + args.steps * (args.rounds + args.sync_rounds) + 8
    cap = round_up(ctx + room, 256)
    fused = {(kernels, "FUSED_BYTES"): 1 << 50}
    scatter = {(kernels, "FUSED_BYTES"): 0}
    no_write = {(_rows, "column_writer"): lambda ends, N, **kw: lambda plane, new: plane}

    def split(S):
        return {(kernels, "splits_for"): lambda *a, **k: S}

    def stock(q, k, v, lp, en, *, scale, **kw):  # wrong result: timing only
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    def identity(q, k, v, lp, en, *, scale, **kw):  # no read at all: timing only
        return q

    variants = {
        "mlx-lm": None,
        "floor": "floor",
        "kernel, fused write (default route)": {},
        "kernel, fused write (default route), general host path": "general",
        "kernel, fused write, no Spec reuse": "forget",
        "kernel, fused write": fused,
        "kernel, scatter writes": scatter,
        "kernel, scatter writes, wait": scatter,
        "kernel, fused write, wait": fused,
        "kernel, no write": {**scatter, **no_write},
        "kernel, no write, stock SDPA no mask over C (timing)": {
            **scatter,
            **no_write,
            (kernels, "ragged_attention"): stock,
        },
        "kernel, no write, no read (timing)": {
            **scatter,
            **no_write,
            (kernels, "ragged_attention"): identity,
        },
    }
    if args.step_prefetch:
        variants["kernel, fused write, prefetch"] = {**fused, (kernels, "PREFETCH"): True}
        variants["kernel, scatter writes, prefetch"] = {**scatter, (kernels, "PREFETCH"): True}
    for u in args.step_unroll:
        variants[f"kernel, fused write, unroll {u}"] = {**fused, (kernels, "UNROLL"): u}
    for S in args.step_splits:
        variants[f"kernel, fused write, splits {S}"] = {**fused, **split(S)}
        variants[f"kernel, no write, splits {S}"] = {**scatter, **no_write, **split(S)}
    if args.only:
        keep = set(args.only.split(";"))
        variants = {k: v for k, v in variants.items() if k in keep}
    runs, counts = {}, {}
    for name, v in variants.items():
        tokens = mx.array([(7 * b) % 1000 + 1 for b in range(B)], mx.int32)
        if v == "floor":
            runs[name] = [suite.floor_step(model), mx.zeros((B,), mx.int32), None]
            continue
        kvs = suite.random_kv(model, B, cap, dtype, seed=3)
        if v is None:
            caches = suite.mlx_lm_caches(kvs, lengths, ctx)
            runs[name] = [suite.impl_step("mlx-lm", model, {}), tokens, caches]
        elif v == "forget":  # the Decoder's host path before it reused its records' Specs
            dec = br.Decoder(model, attention="kernel", write="scatter", wait=False)

            def forget(tok, st, dec=dec):
                dec._last = None  # (nothing remembered: no steady call, no Spec reuse)
                return dec(tok, st)

            runs[name] = [forget, tokens, suite.kv_states(kvs, lengths, ctx)]
        elif v == "general":  # every call through the general path (no steady calls)
            dec = br.Decoder(model, attention="kernel", write="scatter", wait=False)
            dec._steady = False
            runs[name] = [dec, tokens, suite.kv_states(kvs, lengths, ctx)]
        else:
            wait = name.endswith(", wait")
            dec = br.Decoder(model, attention="kernel", write="scatter", wait=wait)
            runs[name] = [suite.patched(dec, v), tokens, suite.kv_states(kvs, lengths, ctx)]
        del kvs
    second = {}
    for name, r in runs.items():  # graphs (two steps each, each evaluated)
        for i in range(2):  # (the second: a Decoder's steady call, its records its own)
            logits, st = r[0](r[1], r[2])
            (second if i else counts)[name] = graph_counts(logits)
            r[1], r[2] = mx.argmax(logits, axis=-1).astype(mx.int32), st
            mx.eval(r[1], r[2])
        print(
            f"  built {name}: {sum(counts[name].values())} primitives, "
            f"second step {sum(second[name].values())}",
            flush=True,
        )
    t = timed_steps(runs, args.warmup, args.steps, args.rounds, args.sync_rounds)
    print(f"step B={B} ctx={ctx} {layout}: ms/step median [min-max] of {args.rounds} rounds")
    print(
        f"  {'variant':<56} {'wall':>18} {'host':>18} {'call':>18} {'sync':>18}"
        " prims (2nd step)  extra MB (peak over start, max of rounds)"
    )
    for name, d in t.items():
        cols = [
            f"{statistics.median(x):6.3f} [{min(x):.2f}-{max(x):.2f}]"
            for k, x in d.items()
            if x and k != "extra_mb"
        ]
        print(
            f"  {name:<56} " + " ".join(f"{c:>18}" for c in cols),
            sum(counts[name].values()),
            f"({sum(second[name].values())})",
            f"{max(d['extra_mb']):9.1f}",
        )
    return dict(times=t, counts=counts, second_counts=second)


_COPY_SRC = r"""
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n[0]) out[i] = q[i];
"""


def read_part(model, args, dtype):
    """Chained per-layer reads at B x ctx, µs per layer."""
    a = model.args
    Hq, H, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    B, ctx, layout, L = args.batch, args.context, args.layout, args.layers
    C = round_up(ctx + 1, 256)
    distinct = max(1, min(L, (args.plane_mb << 20) // (2 * B * H * C * D * dtype.size)))
    planes = []
    for i in range(distinct):
        k1, k2 = mx.random.split(mx.random.key(100 + i))
        planes.append(
            (
                (0.5 * mx.random.normal((B, H, C, D), key=k1)).astype(dtype),
                (0.5 * mx.random.normal((B, H, C, D), key=k2)).astype(dtype),
            )
        )
    new = [(p[0][:, :, :1] * 1, p[1][:, :, :1] * 1) for p in planes]
    mx.eval(planes, new)
    lens = suite.row_lengths(B, ctx, layout)
    lp = mx.array([ctx - n for n in lens], mx.int32)
    en = mx.array([ctx] * B, mx.int32)
    q = mx.random.normal((B, Hq, 1, D)).astype(dtype)
    mx.eval(q, lp, en)
    s = D**-0.5
    n = mx.array([q.size], mx.int32)
    copy = (
        mx.fast.cuda_kernel(
            name="kvstate_bench_copy",
            input_names=["q", "n"],
            output_names=["out"],
            source=_COPY_SRC,
        )
        if kernels.kernel_available()
        else None
    )

    def chain(read):
        def f(q, lp, en, *kv):
            for i in range(L):
                j = i % distinct
                q = read(q, kv[2 * j], kv[2 * j + 1], lp, en, j)
            return q

        return mx.compile(f)

    flat = [x for p in planes for x in p]
    cases = {
        "trivial custom kernel (copy q)": chain(
            lambda q, k, v, lp, en, j: copy(
                inputs=[q, n],
                output_shapes=[q.shape],
                output_dtypes=[q.dtype],
                grid=(q.size, 1, 1),
                threadgroup=(256, 1, 1),
            )[0]
        ),
        "stock SDPA, no mask, exact width (mlx-lm aligned)": chain(
            lambda q, k, v, lp, en, j: mx.fast.scaled_dot_product_attention(
                q, k[:, :, :ctx], v[:, :, :ctx], scale=s
            )
        ),
    }
    if layout != "aligned":
        cases["stock SDPA, bool mask, width ctx (mlx-lm ragged)"] = chain(
            lambda q, k, v, lp, en, j: mx.fast.scaled_dot_product_attention(
                q, k[:, :, :ctx], v[:, :, :ctx], scale=s, mask=rows_mask(1, lp, en, ctx)
            )
        )
    auto = kernels.splits_for(B, H, C)
    shapes = [
        (S, U, T, P)
        for S in args.splits
        for U in args.unroll
        for T in args.threads
        for P in args.prefetch
    ]
    for S, U, T, P in shapes:
        name = (
            f"kernel S={S} U={U} T={T}" + (" PF" if P else "") + (" (auto S)" if S == auto else "")
        )
        cases[name] = chain(
            lambda q, k, v, lp, en, j, S=S, U=U, T=T, P=P: kernels.ragged_attention(
                q, k, v, lp, en, scale=s, splits=S, unroll=U, threads=T, prefetch=bool(P)
            )
        )
    for S in args.fused_splits:
        for P in args.prefetch:
            cases[f"fused write_and_read S={S}" + (" PF" if P else "")] = chain(
                lambda q, k, v, lp, en, j, S=S, P=P: kernels.write_and_read(
                    q, k, v, new[j][0], new[j][1], lp, en, scale=s, splits=S, prefetch=bool(P)
                )[0]
            )
    results, ref = {}, None
    for name, f in cases.items():
        try:
            for _ in range(3):
                y = f(q, lp, en, *flat)
                mx.eval(y)
            if name.startswith("kernel"):  # every kernel variant against the first one
                if ref is None:
                    ref = y.astype(mx.float32)
                diff = mx.abs(y.astype(mx.float32) - ref).max().item()
                print(f"  {name}: max |out - first kernel case's| = {diff:.3g}", flush=True)
        except Exception as e:  # a variant that does not build is reported, not fatal
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        results[name] = dict(wall=[], host=[], sync=[])  # the header's order
    for _ in range(args.rounds):
        for name in results:
            f = cases[name]
            host = 0.0
            t0 = time.perf_counter()
            for _ in range(args.reps):
                h0 = time.perf_counter()
                y = f(q, lp, en, *flat)
                mx.async_eval(y)
                host += time.perf_counter() - h0
            mx.eval(y)
            wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(max(1, args.reps // 4)):
                mx.eval(f(q, lp, en, *flat))
            sync = (time.perf_counter() - t0) / max(1, args.reps // 4)
            r = results[name]
            r["wall"].append(wall / args.reps / L * 1e6)
            r["host"].append(host / args.reps / L * 1e6)
            r["sync"].append(sync / L * 1e6)
        print(".", end="", flush=True)
    print()
    kv_bytes = sum(lens) * H * D * 2 * dtype.size
    print(
        f"read B={B} ctx={ctx} {layout}, {L} chained layers ({distinct} distinct plane pairs), "
        f"valid KV {kv_bytes / 1e6:.1f} MB/layer: us/layer median [min-max] of {args.rounds}"
    )
    print(f"  {'case':<52} {'wall':>20} {'host':>20} {'sync':>20}  TB/s(wall)")
    for name, r in results.items():
        if not r["wall"]:
            continue
        cols = [f"{statistics.median(x):7.1f} [{min(x):.1f}-{max(x):.1f}]" for x in r.values()]
        bw = kv_bytes / (statistics.median(r["wall"]) * 1e-6) / 1e12
        print(f"  {name:<52} " + " ".join(f"{c:>20}" for c in cols) + f"  {bw:.2f}")
    return dict(results=results, kv_bytes=kv_bytes, auto_splits=auto)


def write_part(model, args, dtype):
    """One step's plane writes in place or copied, per layer, for each case.

    Each "step" chains ``--layers`` layers in one compiled call, each layer its
    own ``[B, H, C, D]`` plane pair: write one new column at the rows' ends
    (taken from the query, so it is lazy as in a decode step), then read the
    rows. Write routes: ``fused`` (``kernels.write_and_read``: the custom
    kernel copies both planes), ``scatter`` (``put_along_axis`` per plane, as
    ``_rows.column_writer``), ``slice`` (a dynamic ``slice_update``: aligned
    rows only), ``read only`` (the planes passed through: the baseline). Loop
    modes: ``pipelined`` (each step dispatched while the last still runs, the
    old planes dropped: a decode loop), ``wait`` (the next step built, then
    the last one waited for, ``mx.synchronize``, then dispatched:
    ``Decoder(wait=True)``), ``sync`` (each step waited for). MLX writes a
    plane in place only when nothing else holds its buffer, and a kernel that
    read it holds it until a worker thread sees that kernel finish; "extra
    MB" is the peak memory over the round's start: about one plane pair per
    layer in flight when the write copies, ~0 in place."""
    out = {}
    for case in args.write_cases.split(","):
        B, ctx, layout = case.split(":")
        out[case] = write_case(model, args, dtype, int(B), int(ctx), layout)
        mx.clear_cache()
    return out


def write_step(route, B, H, L, scale):
    """A compiled step of ``L`` layers: write a column at ``ends``, read the rows."""

    def f(q, ends, lp, *kv):
        after = ends + 1
        index = mx.broadcast_to(ends[:, None, None, None], (B, H, 1, q.shape[-1]))
        planes = []
        for i in range(L):
            k, v = kv[2 * i], kv[2 * i + 1]
            nk, nv = q[:, :H], q[:, H : 2 * H]
            if route == "fused":
                q, k, v = kernels.write_and_read(q, k, v, nk, nv, lp, after, scale=scale)
            else:
                if route == "scatter":
                    k = mx.put_along_axis(k, index, nk, axis=2)
                    v = mx.put_along_axis(v, index, nv, axis=2)
                elif route == "slice":
                    k = mx.slice_update(k, nk, ends[:1], (2,))
                    v = mx.slice_update(v, nv, ends[:1], (2,))
                q = kernels.ragged_attention(q, k, v, lp, after, scale=scale)
            planes += [k, v]
        return (q, after, lp, *planes)

    return mx.compile(f)


def write_loop(f, states, r, mode, steps):
    """``steps`` steps of route ``r`` (its state taken from ``states`` and put
    back): seconds, and the peak memory over the start in bytes."""
    st = states.pop(r)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    prev = None
    for _ in range(steps):
        new = list(f(*st))
        st = None
        if mode == "sync":
            mx.eval(new)
        elif mode == "wait":
            if prev is not None:
                mx.eval(prev)
                mx.synchronize()
            mx.async_eval(new)
            prev = new[0]
        else:
            mx.async_eval(new)
        st, new = new, None
    mx.eval(st)
    mx.synchronize()
    dt = time.perf_counter() - t0
    states[r] = st
    return dt, mx.get_peak_memory() - base


def write_case(model, args, dtype, B, ctx, layout):
    a = model.args
    Hq, H, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    L, steps, rounds = args.layers, args.steps, args.rounds
    modes = ["pipelined", "wait", "sync"]
    C = round_up(ctx + args.warmup + steps * rounds * len(modes) + 8, 256)
    lens = suite.row_lengths(B, ctx, layout)
    lp = mx.array([ctx - n for n in lens], mx.int32)
    plane_mb = B * H * C * D * dtype.size / 1e6
    routes = ["read only", "fused", "scatter"] + (["slice"] if layout == "aligned" else [])
    fns = {r: write_step(r, B, H, L, D**-0.5) for r in routes}
    states = {}
    for r in routes:
        st = [mx.random.normal((B, Hq, 1, D)).astype(dtype), mx.array([ctx] * B, mx.int32), lp]
        for i in range(2 * L):
            st.append((0.5 * mx.random.normal((B, H, C, D), key=mx.random.key(i))).astype(dtype))
        mx.eval(st)
        for _ in range(args.warmup):
            st = list(fns[r](*st))
            mx.eval(st)
        states[r] = st
        del st
    res = {f"{r}, {m}": dict(us=[], extra_mb=[]) for r in routes for m in modes}
    for _ in range(rounds):
        for m in modes:
            for r in routes:
                dt, extra = write_loop(fns[r], states, r, m, steps)
                res[f"{r}, {m}"]["us"].append(dt / steps / L * 1e6)
                res[f"{r}, {m}"]["extra_mb"].append(extra / 1e6)
        print(".", end="", flush=True)
    print()
    print(
        f"write B={B} ctx={ctx} {layout} C={C}, {L} layers chained, plane {plane_mb:.1f} MB: "
        f"us/layer median [min-max] of {rounds} rounds x {steps} steps; "
        "extra MB = peak over start"
    )
    print(f"  {'route, loop':<24} {'us/layer':>22} {'- read only':>12} {'extra MB':>10}")
    for name, d in res.items():
        med = statistics.median(d["us"])
        base_us = statistics.median(res["read only, " + name.split(", ")[1]]["us"])
        print(
            f"  {name:<24} {med:8.1f} [{min(d['us']):.1f}-{max(d['us']):.1f}]"
            f" {med - base_us:12.1f} {max(d['extra_mb']):10.1f}"
        )
    return dict(C=C, plane_mb=plane_mb, results=res)


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["step", "read", "write"], required=True)
    p.add_argument("--model", default="llama-3.2-1b", choices=sorted(suite.MODELS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--layout", default="aligned", choices=["aligned", "ragged"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sync-rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--step-splits", type=ints, default=[])
    p.add_argument("--step-unroll", type=ints, default=[], help="step variants with UNROLL")
    p.add_argument("--step-prefetch", action="store_true", help="step variants with PREFETCH")
    p.add_argument("--only", help="only these step variants (names as printed, ';'-separated)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--plane-mb", type=int, default=8192, help="most MiB of distinct planes")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--splits", type=ints, default=[1])
    p.add_argument("--unroll", type=ints, default=[2])
    p.add_argument("--threads", type=ints, default=[256])
    p.add_argument("--prefetch", type=ints, default=[0], help="0 and/or 1 (kernels.PREFETCH)")
    p.add_argument("--fused-splits", type=ints, default=[])
    p.add_argument(
        "--write-cases",
        default="32:2048:ragged,1:2048:aligned",
        help="--part write: B:ctx:layout cases, comma-separated",
    )
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    limits = {k: os.environ.get(k) for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")}
    print(
        f"mlx {mx.__version__} on {mx.default_device()}; {args.model} {dtype}; {limits}", flush=True
    )
    model = suite.build_model(args.model, dtype)
    part = dict(step=step_part, read=read_part, write=write_part)[args.part]
    res = part(model, args, dtype)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), **res), f, indent=1)


if __name__ == "__main__":
    main()
