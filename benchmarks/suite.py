"""Decode benchmark suite: mlx-lm, kvstate eager and kvstate compiled, side by side.

One process, one model, the same prefilled rows for every implementation:

    mlx-lm       the model on mlx-lm's own caches: ``KVCache`` (B rows) for
                 aligned rows, ``BatchKVCache`` (left-padded) for ragged rows
    eager        ``kvstate.mlx_lm.step`` (the bridge: records behind cache shells)
    compiled     ``kvstate.mlx_lm.Decoder(attention="mask")``: forward and
                 state update in one ``mx.compile``d function, per-row bool mask
    kernel       ``Decoder(attention="kernel")``: the same, dense decode reads
                 through ``ragged_attention`` (mask-free split-K CUDA kernel;
                 on the CPU it is the masked SDPA, so this row is skipped there)
    floor        the compiled model forward with no cache at that batch size

Cases: B rows x context x layout. Aligned rows all hold ``context`` tokens;
ragged rows hold between 3/4 ``context`` and ``context`` (evenly spread),
right-aligned as mlx-lm's ``BatchKVCache`` holds them. The caches are filled
with random keys and values (decode time does not depend on their values),
with room for every timed step so no implementation grows during timing.

Timing: greedy decode with the next token fed back lazily (``async_eval``,
as mlx-lm's generator does); ``--rounds`` rounds of ``--steps`` steps after
``--warmup`` steps (the warm-up includes the compiled traces); ms/step is
the median over rounds. Roofline share: (weight bytes + valid KV bytes) /
copy bandwidth / step time, the bandwidth measured in the same run by an
elementwise pass over a large array (bytes read + written).

    python -m benchmarks suite --preset cpu --out results/  # or python benchmarks/suite.py
    python -m benchmarks suite --preset h200 --out $OUT       # MLX CUDA build
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.core.masks import rows_mask
from kvstate.core.records import share_row_ids
from kvstate.kernels import cuda as kernels
from kvstate.kinds import rows as _rows
from kvstate.kinds.rows import round_up

if not __package__:  # python benchmarks/suite.py (README): the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common as common  # noqa: E402

PRESETS = {
    "cpu": dict(
        model="small",
        dtype="float32",
        batch="1,8,32",
        context="512,2048",
        impl="mlx-lm,eager,compiled",
        copy_mb=512,
        mem_gb=4,
    ),
    "h200": dict(
        model="llama-3.2-1b",
        dtype="bfloat16",
        batch="1,8,32",
        context="2048,8192,32768",
        impl="mlx-lm,eager,compiled,kernel",
        copy_mb=4096,
        mem_gb=110,
    ),
}

IMPLS = ("mlx-lm", "eager", "compiled", "kernel")


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def copy_bandwidth(mb: int, dtype) -> float:
    """Bytes/s of an elementwise pass (read + write) over ``mb`` MiB."""
    n = mb * (1 << 20) // dtype.size
    x = mx.random.uniform(shape=(n // 4096, 4096)).astype(dtype)
    mx.eval(x)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        y = x + 1
        mx.eval(y)
        times.append(time.perf_counter() - t0)
        del y
    return 2 * x.nbytes / statistics.median(times[2:])


# --- rows -----------------------------------------------------------------------


def row_lengths(B, ctx, layout):
    if layout == "aligned" or B == 1:
        return [ctx] * B
    lo = ctx - ctx // 4
    return [lo + (ctx - lo) * b // (B - 1) for b in range(B)][::-1]


def random_kv(model, B, cap, dtype, seed):
    """Per layer ``(keys, values)`` ``[B, H, cap, D]`` of random data."""
    a = model.args
    shape = (B, a.num_key_value_heads, cap, a.head_dim)
    out = []
    for i in range(a.num_hidden_layers):
        k1, k2 = mx.random.split(mx.random.key(seed * 1000 + i))
        out.append(
            (
                (0.5 * mx.random.normal(shape, key=k1)).astype(dtype),
                (0.5 * mx.random.normal(shape, key=k2)).astype(dtype),
            )
        )
    mx.eval(out)
    return out


def mlx_lm_caches(kvs, lengths, ctx):
    caches = []
    for k, v in kvs:
        if len(set(lengths)) == 1:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, ctx
        else:
            c = BatchKVCache([ctx - n for n in lengths])
            c.keys, c.values = k, v
            c.offset = mx.array(lengths)
            c._idx = ctx
        caches.append(c)
    return caches


def kv_states(kvs, lengths, ctx):
    """One record per layer over the same rows: one set of row ids, as a model's
    records have (``kvstate.mlx_lm.make_states``, ``share_row_ids``)."""
    lp = [ctx - n for n in lengths]
    return share_row_ids([kv.from_arrays(k, v, lengths=lengths, left_pad=lp) for k, v in kvs])


# --- timing ----------------------------------------------------------------------


def run_steps(step, n, tokens, state, sync=False):
    """``n`` greedy steps, each token fed back lazily (``sync``: waited for);
    returns the last tokens and state."""
    for _ in range(n):
        logits, state = step(tokens, state)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        (mx.eval if sync else mx.async_eval)(tokens)
    mx.eval(tokens)
    return tokens, state


def time_interleaved(runs, warmup, steps, rounds, spread=None):
    """Median seconds per step for each of ``runs`` (name -> [step, tokens, state]);
    ``spread`` (a dict), when given, gets each name's per-round seconds.

    Every round times each implementation once, one after another, so a
    load change on a shared machine touches all of them alike.

    The state is handed over (``r.pop()``), not kept in ``runs`` while it
    runs: a decode loop drops each step's input records, so their appends
    write in place; records still held by the harness make the round's first
    step copy every plane (mlx-lm's caches, mutated in place, never pay it).
    """
    for name, r in runs.items():
        r[1:] = run_steps(r[0], warmup, r[1], r.pop(), "sync" in name)
    per = {name: [] for name in runs}
    for _ in range(rounds):
        for name, r in runs.items():
            t0 = time.perf_counter()
            r[1:] = run_steps(r[0], steps, r[1], r.pop(), "sync" in name)
            per[name].append((time.perf_counter() - t0) / steps)
    if spread is not None:
        spread.update(per)
    return {name: statistics.median(v) for name, v in per.items()}


def impl_step(name, model, decoders):
    if name == "mlx-lm":

        def step(tokens, caches):
            return model(tokens[:, None], cache=caches)[:, -1, :], caches

        return step
    if name == "eager":
        return lambda tokens, states: br.step(model, tokens, states)
    return decoders[name]


def floor_step(model):
    fwd = mx.compile(lambda t: model(t[:, None])[:, -1, :])
    return lambda tokens, _: (fwd(tokens), None)


# --- kernel checks and attention micro-benchmarks ---------------------------------------


def kernel_check(model, dtype, B=8, ctx=2048):
    """Max |ragged_attention - masked SDPA| on random ragged rows (and fp32)."""
    a = model.args
    out = {}
    for dt in (mx.float32, dtype):
        mx.random.seed(1)
        Hq, H, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        C = ctx + 256
        q = mx.random.normal((B, Hq, 1, D)).astype(dt)
        k = mx.random.normal((B, H, C, D)).astype(dt)
        v = mx.random.normal((B, H, C, D)).astype(dt)
        lens = row_lengths(B, ctx, "ragged")
        lp = mx.array([ctx - n for n in lens], mx.int32)
        en = mx.array([ctx] * B, mx.int32)
        got = kernels.ragged_attention(q, k, v, lp, en, scale=D**-0.5)
        mask = rows_mask(1, lp, en, C)
        want = mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32),
            k.astype(mx.float32),
            v.astype(mx.float32),
            scale=D**-0.5,
            mask=mask,
        )
        err = mx.abs(got.astype(mx.float32) - want)
        out[str(dt).replace("mlx.core.", "")] = (
            err.max().item(),
            (mx.sqrt((err**2).sum() / (want**2).sum())).item(),
        )
    out["write_and_read"] = fused_check(model, dtype, 32, ctx)
    return out


def fused_check(model, dtype, B, ctx):
    """``kernels.write_and_read`` at a step's size (B ragged rows, the suite's
    capacity) against the compiled step's scatter and ``ragged_attention``:
    ``(planes byte-equal, max |out - out|)``."""
    a = model.args
    mx.random.seed(2)
    Hq, H, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    C = round_up(ctx + 117, 256)
    q = mx.random.normal((B, Hq, 1, D)).astype(dtype)
    k, v, kn, vn = (mx.random.normal((B, H, c, D)).astype(dtype) for c in (C, C, 1, 1))
    lens = row_lengths(B, ctx, "ragged")
    lp = mx.array([ctx - n for n in lens], mx.int32)
    en = mx.array([ctx + 1] * B, mx.int32)
    out, keys, values = kernels.write_and_read(q, k, v, kn, vn, lp, en, scale=D**-0.5)
    write = _rows.column_writer(en - 1, 1)
    wk, wv = write(k, kn), write(v, vn)
    want = kernels.ragged_attention(q, wk, wv, lp, en, scale=D**-0.5)
    same = mx.array_equal(keys, wk).item() and mx.array_equal(values, wv).item()
    return same, mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item()


def attention_micro(model, dtype, B, ctx, layout, reps=50, splits=(1, 16, 64)):
    """Per-layer attention read at B rows x ctx (``layout`` rows): microseconds per
    call of each candidate read, and the valid KV bytes it must read."""
    a = model.args
    Hq, H, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    C = round_up(ctx + 1, 256)
    q = mx.random.normal((B, Hq, 1, D)).astype(dtype)
    k = mx.random.normal((B, H, C, D)).astype(dtype)
    v = mx.random.normal((B, H, C, D)).astype(dtype)
    lens = row_lengths(B, ctx, layout)
    lp = mx.array([ctx - n for n in lens], mx.int32)
    en = mx.array([ctx] * B, mx.int32)
    kw, vw = k[:, :, :ctx], v[:, :, :ctx]
    s = D**-0.5
    cases = {}
    if layout == "aligned":  # mlx-lm's read of aligned rows: exact width, no mask
        cases["sdpa, no mask, width ctx"] = lambda: mx.fast.scaled_dot_product_attention(
            q, kw, vw, scale=s
        )
    else:  # mlx-lm's read of ragged rows (BatchKVCache): a bool mask
        cases["sdpa, bool mask, width ctx"] = lambda: mx.fast.scaled_dot_product_attention(
            q, kw, vw, scale=s, mask=rows_mask(1, lp, en, ctx)
        )
    cases["compiled: mask from arrays, capacity C"] = mx.compile(
        lambda q, k, v, lp, en: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=s, mask=rows_mask(1, lp, en, C)
        )
    )
    if kernels.kernel_available():
        auto = kernels.splits_for(B, H, C)
        cases[f"kernel, capacity C, splits auto ({auto})"] = mx.compile(
            lambda q, k, v, lp, en: kernels.ragged_attention(q, k, v, lp, en, scale=s)
        )
        for S in splits:
            if S != auto and S <= max(1, C // 16):
                cases[f"kernel, capacity C, splits {S}"] = mx.compile(
                    lambda q, k, v, lp, en, S=S: kernels.ragged_attention(
                        q, k, v, lp, en, scale=s, splits=S
                    )
                )
    out = {}
    for name, f in cases.items():
        call = (lambda f=f: f(q, k, v, lp, en)) if name.startswith(("compiled", "kernel")) else f
        for _ in range(5):
            mx.eval(call())
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                y = call()
                mx.async_eval(y)
            mx.eval(y)
            rounds.append((time.perf_counter() - t0) / reps * 1e6)
        out[name] = (statistics.median(rounds), min(rounds), max(rounds))
    kv_bytes = sum(lens) * H * D * 2 * dtype.size
    return out, kv_bytes


# --- ablation: where a compiled step's time goes ------------------------------------------


def patched(step, names):
    """``step`` with module globals ``{(module, name): value}`` replaced while it
    runs (so while it traces)."""

    def run(tokens, state):
        old = {k: getattr(*k) for k in names}
        for (mod, k), v in names.items():
            setattr(mod, k, v)
        try:
            return step(tokens, state)
        finally:
            for (mod, k), v in old.items():
                setattr(mod, k, v)

    return run


def ablation(model, dtype, B, ctx, layout, args, decoders_ok):
    """Interleaved variants of one case: each removes or swaps one part of the step."""
    lengths = row_lengths(B, ctx, layout)
    room = args.warmup + args.steps * args.rounds + 1
    cap = round_up(ctx + room, 256)
    scatter = {(kernels, "FUSED_BYTES"): 0}  # the write by scatter, never in the read
    fused = {(kernels, "FUSED_BYTES"): 1 << 50}  # the write in the read's launch
    split = {(kernels, "SINGLE_SPAN"): 0}  # short rows split over blocks too (B=1)
    no_write = {(_rows, "column_writer"): lambda ends, N, **kw: lambda plane, new: plane}

    def fused_nomask(q, k, v, lp, en, *, scale):  # wrong result: timing only
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    variants = {
        "mlx-lm": None,
        "mlx-lm, sync each step": None,
        "compiled": ("mask", {}, "scatter"),
        "compiled, no cache write": ("mask", no_write, "scatter"),
    }
    if decoders_ok:
        variants.update(
            {
                "kernel, scatter writes": ("kernel", scatter, "scatter"),
                "kernel, slice_update writes": ("kernel", scatter, "slice"),
                "kernel, scatter writes, wait": ("kernel", scatter, "scatter"),
                "kernel, slice_update writes, wait": ("kernel", scatter, "slice"),
                "kernel, scatter writes, sync each step": ("kernel", scatter, "scatter"),
                "kernel, no cache write": ("kernel", {**no_write, **scatter}, "scatter"),
                "kernel -> fused SDPA, no mask (wrong, timing)": (
                    "kernel",
                    {(kernels, "ragged_attention"): fused_nomask, **scatter},
                    "scatter",
                ),
                "kernel, fused write": ("kernel", fused, "scatter"),
                "kernel, fused write, wait": ("kernel", fused, "scatter"),
                "kernel, fused write, split reads": ("kernel", {**fused, **split}, "scatter"),
                "kernel, scatter writes, split reads": ("kernel", {**scatter, **split}, "scatter"),
            }
        )
        for u in (1, 4, 8):
            unroll = {(kernels, "UNROLL"): u}
            variants[f"kernel, scatter writes, unroll {u}"] = (
                "kernel",
                {**scatter, **unroll},
                "scatter",
            )
            variants[f"kernel, fused write, unroll {u}"] = (
                "kernel",
                {**fused, **unroll},
                "scatter",
            )
    if args.ablate_variants:
        keep = set(args.ablate_variants.split(";"))
        variants = {k: v for k, v in variants.items() if k in keep}
    runs = {}
    for name, v in variants.items():
        kvs = random_kv(model, B, cap, dtype, seed=3)
        tokens = mx.array([(7 * b) % 1000 + 1 for b in range(B)], mx.int32)
        if v is None:
            runs[name] = [impl_step("mlx-lm", model, {}), tokens, mlx_lm_caches(kvs, lengths, ctx)]
        else:
            mode, names, write = v
            dec = br.Decoder(model, attention=mode, write=write, wait=name.endswith(", wait"))
            runs[name] = [patched(dec, names), tokens, kv_states(kvs, lengths, ctx)]
        del kvs
    runs["floor"] = [floor_step(model), mx.zeros((B,), mx.int32), None]
    spread: dict = {}
    times = time_interleaved(runs, args.warmup, args.steps, args.rounds, spread)
    print(f"ablation B={B} ctx={ctx} {layout} (median [min-max] of {args.rounds} rounds):")
    for name, t in times.items():
        lo, hi = min(spread[name]) * 1e3, max(spread[name]) * 1e3
        print(f"  {name:<48} {t * 1e3:8.2f} ms [{lo:.2f}-{hi:.2f}]")
    return {name: t * 1e3 for name, t in times.items()}


# --- the run ---------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--model", choices=sorted(common.MODELS))
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", help="comma list of batch sizes")
    p.add_argument("--context", help="comma list of context lengths")
    p.add_argument("--layout", default="aligned,ragged")
    p.add_argument("--impl", help=f"comma list of {','.join(IMPLS)}")
    p.add_argument("--steps", type=int, default=16, help="steps per timed round (16)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (5)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (4)")
    p.add_argument("--copy-mb", type=int)
    p.add_argument(
        "--mem-gb",
        type=float,
        help="skip step cases whose caches (all "
        "implementations together) need more than this (h200: 110)",
    )
    p.add_argument(
        "--cases",
        default="",
        help="only these step cases of the --batch x --context x --layout grid, "
        "B:ctx:layout,... (e.g. 1:2048:aligned,32:2048:ragged)",
    )
    p.add_argument("--micro", action="store_true", help="attention micro-benchmarks too")
    p.add_argument(
        "--micro-cases",
        default="",
        help="attention micro-benchmarks of only these cases, B:ctx:layout,... "
        "(e.g. 32:8192:ragged; implies --micro)",
    )
    p.add_argument(
        "--write",
        choices=["scatter", "slice", "auto"],
        default="scatter",
        help="compiled decoders' cache writes; auto: the fastest kernel variant "
        "of the first --ablate case (scatter)",
    )
    p.add_argument(
        "--wait",
        choices=["no", "yes", "auto"],
        default="no",
        help="Decoder(wait=...); auto: as --write auto (no)",
    )
    p.add_argument(
        "--ablate",
        default="",
        help="cases B:ctx:layout,... to take apart (e.g. 1:2048:aligned,32:2048:ragged)",
    )
    p.add_argument(
        "--ablate-variants",
        default="",
        help="only these ablation variants (names as printed, ';'-separated; floor always)",
    )
    args = common.output_args(p).parse_args(argv)
    pre = PRESETS[args.preset]
    model_name = args.model or pre["model"]
    dtype = getattr(mx, args.dtype or pre["dtype"])
    batches = [int(x) for x in (args.batch or pre["batch"]).split(",")]
    contexts = [int(x) for x in (args.context or pre["context"]).split(",")]
    layouts = args.layout.split(",")
    mem_gb = args.mem_gb or pre["mem_gb"]
    only = {
        (int(B), int(c), lay)
        for B, c, lay in (x.split(":") for x in filter(None, args.cases.split(",")))
    }
    impls = (args.impl or pre["impl"]).split(",")
    for i in impls:
        if i not in IMPLS:
            p.error(f"--impl: unknown {i!r}")
    if "kernel" in impls and not kernels.kernel_available():
        print("note: kernel rows skipped (no MLX CUDA backend here; it would equal 'compiled')")
        impls = [i for i in impls if i != "kernel"]

    device = str(mx.default_device())
    limits = {
        k: os.environ[k]
        for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")
        if k in os.environ
    }
    print(
        f"mlx {mx.__version__} on {device}; model {model_name} {dtype}; "
        f"MLX batch limits set: {limits}"
    )
    t0 = time.perf_counter()
    model = common.llama(model_name, dtype)
    wbytes = weight_bytes(model)
    bw = copy_bandwidth(args.copy_mb or pre["copy_mb"], dtype)
    print(
        f"weights {wbytes / 1e9:.3f} GB; copy bandwidth {bw / 1e12:.3f} TB/s "
        f"(setup {time.perf_counter() - t0:.1f} s)"
    )
    a = model.args
    meta = dict(
        model=model_name,
        dtype=str(dtype),
        weight_bytes=wbytes,
        copy_bandwidth=bw,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
    )

    checks = {}
    if "kernel" in impls:
        try:
            checks = kernel_check(model, dtype)
            print("kernel check (max abs err, rel l2) vs masked SDPA in float32:", checks)
            low = checks[str(dtype).replace("mlx.core.", "")]
            bad = checks["float32"][1] > 1e-4 or low[1] > 2e-2
            bad = bad or not checks["write_and_read"][0] or checks["write_and_read"][1] > 5e-2
            if bad:
                print("kernel check FAILED: kernel rows skipped")
                impls = [i for i in impls if i != "kernel"]
        except Exception as e:  # report and carry on without the kernel
            print(f"kernel unavailable: {type(e).__name__}: {e}")
            checks = {"error": f"{type(e).__name__}: {e}"}
            impls = [i for i in impls if i != "kernel"]
    meta["kernel_check"] = checks

    abl = {}
    for case in filter(None, args.ablate.split(",")):
        B, ctx, layout = case.split(":")
        abl[case] = ablation(model, dtype, int(B), int(ctx), layout, args, "kernel" in impls)
    meta["ablation"] = abl

    def choose(B):
        """(write, wait) for batch size B: fixed by flags, or the fastest kernel variant
        of the ablation case whose batch size is nearest B."""
        write, wait = args.write, args.wait == "yes"
        if "auto" not in (args.write, args.wait):
            return write, wait, {}
        write = "scatter" if args.write == "auto" else args.write
        if not abl:
            return write, wait, {}
        case = min(abl, key=lambda c: abs(int(c.split(":")[0]) - B))
        names = {
            ("scatter", False): "kernel, scatter writes",
            ("slice", False): "kernel, slice_update writes",
            ("scatter", True): "kernel, scatter writes, wait",
            ("slice", True): "kernel, slice_update writes, wait",
        }
        options = {
            k: abl[case][n]
            for k, n in names.items()
            if n in abl[case]
            and (args.write == "auto" or k[0] == args.write)
            and (args.wait == "auto" or k[1] == (args.wait == "yes"))
        }
        if options:
            write, wait = min(options, key=options.get)
        return (
            write,
            wait,
            {case: {f"{k[0]}, wait={k[1]}": round(v, 3) for k, v in options.items()}},
        )

    chosen, all_decoders = {}, {}
    for B in batches:
        write, wait, why = choose(B)
        chosen[B] = dict(write=write, wait=wait, from_ablation=why)
        print(f"compiled decoders for B={B}: write={write!r} wait={wait} {why}")
        if (write, wait) not in all_decoders:
            d = {"compiled": br.Decoder(model, attention="mask", write=write, wait=wait)}
            if "kernel" in impls:
                d["kernel"] = br.Decoder(model, attention="kernel", write=write, wait=wait)
            all_decoders[(write, wait)] = d
    meta["decoder"] = {str(B): v for B, v in chosen.items()}
    room = args.warmup + args.steps * args.rounds + 1

    rows, floors = [], {}
    for B in batches:
        for ctx in contexts:
            for layout in layouts:
                if layout == "ragged" and B == 1:
                    continue
                if only and (B, ctx, layout) not in only:
                    continue
                lengths = row_lengths(B, ctx, layout)
                cap = round_up(ctx + room, 256)
                need = (
                    len(impls)
                    * 2
                    * a.num_hidden_layers
                    * B
                    * a.num_key_value_heads
                    * cap
                    * a.head_dim
                    * dtype.size
                )
                if need > mem_gb * 1e9:
                    print(
                        f"  B={B} ctx={ctx} {layout}: skipped: its caches need "
                        f"{need / 1e9:.0f} GB for {len(impls)} implementations "
                        f"(--mem-gb {mem_gb:g})"
                    )
                    continue
                kv_valid = (
                    (sum(lengths) + B * (args.warmup + args.steps * args.rounds / 2))
                    * a.num_hidden_layers
                    * a.num_key_value_heads
                    * a.head_dim
                    * 2
                    * dtype.size
                )
                runs = {}
                for name in impls:
                    kvs = random_kv(model, B, cap, dtype, seed=B * 7 + ctx)
                    state = (
                        mlx_lm_caches(kvs, lengths, ctx)
                        if name == "mlx-lm"
                        else kv_states(kvs, lengths, ctx)
                    )
                    del kvs
                    tokens = mx.array([(7 * b) % 1000 + 1 for b in range(B)], mx.int32)
                    c = chosen[B]
                    runs[name] = [
                        impl_step(name, model, all_decoders[(c["write"], c["wait"])]),
                        tokens,
                        state,
                    ]
                for name in list(runs):  # a failing implementation is dropped, not the case
                    try:
                        runs[name][1], runs[name][2] = run_steps(runs[name][0], 1, *runs[name][1:])
                    except Exception as e:
                        print(f"  {name} B={B} ctx={ctx} {layout}: FAILED {type(e).__name__}: {e}")
                        del runs[name]
                runs["floor"] = [floor_step(model), mx.zeros((B,), mx.int32), None]
                try:
                    per = {}
                    times = time_interleaved(runs, args.warmup, args.steps, args.rounds, per)
                except Exception as e:
                    print(f"  B={B} ctx={ctx} {layout}: FAILED {type(e).__name__}: {e}")
                    continue
                del runs
                fl = floors.setdefault(B, {})[(ctx, layout)] = times.pop("floor")
                base = times.get("mlx-lm")
                for name, t in times.items():
                    row = dict(
                        B=B,
                        context=ctx,
                        layout=layout,
                        impl=name,
                        ms=t * 1e3,
                        tok_s=B / t,
                        roofline=(wbytes + kv_valid) / bw / t,
                        floor_ms=fl * 1e3,
                        vs_mlx_lm=(base / t) if base else float("nan"),
                        min_ms=min(per[name]) * 1e3,
                        max_ms=max(per[name]) * 1e3,
                        rounds=len(per[name]),
                    )
                    if base and name != "mlx-lm":  # the ratio in each round, paired
                        r = [x / y for x, y in zip(per["mlx-lm"], per[name])]
                        row.update(ratio_min=min(r), ratio_max=max(r))
                    rows.append(row)
                    print(
                        f"  B={B:<3} ctx={ctx:<5} {layout:<8} {name:<9} {t * 1e3:8.2f} ms"
                        f" [{row['min_ms']:.2f}-{row['max_ms']:.2f}]"
                        f" {B / t:9.0f} tok/s  roofline {row['roofline']:6.1%}"
                        f"  x{row['vs_mlx_lm']:.2f} vs mlx-lm  (floor {fl * 1e3:.2f} ms)"
                    )
                mx.clear_cache()
    micro = {}
    if args.micro or args.micro_cases:
        cases = [
            (B, c, lay)
            for B in batches
            for c in contexts
            for lay in layouts
            if not (lay == "ragged" and B == 1)
        ]
        if args.micro_cases:
            cases = [
                (int(B), int(c), lay)
                for B, c, lay in (x.split(":") for x in args.micro_cases.split(","))
            ]
        for B, ctx, layout in cases:
            res, kvb = attention_micro(model, dtype, B, ctx, layout)
            micro[f"B={B} ctx={ctx} {layout}"] = dict(us=res, kv_bytes=kvb)
            print(
                f"attention per layer, B={B}, {layout} ctx {ctx} ({kvb / 1e6:.1f} MB valid KV;"
                f" median [min-max] of 5 rounds of 50 calls):"
            )
            for n, (us, lo, hi) in res.items():
                rate = kvb / (us * 1e-6)
                print(
                    f"  {n:<44} {us:8.1f} us [{lo:.1f}-{hi:.1f}]  {rate / 1e12:5.2f} TB/s"
                    f" = {rate / bw:6.1%} of copy bandwidth"
                )
            mx.clear_cache()
    meta["micro"] = micro
    print_table(rows, floors, meta)
    common.write(args, "suite", rows, **meta)
    return rows


def print_table(rows, floors, meta):
    print()
    print(
        f"model {meta['model']} {meta['dtype']} on {mx.default_device()}; copy bandwidth "
        f"{meta['copy_bandwidth'] / 1e12:.3f} TB/s; weights {meta['weight_bytes'] / 1e9:.3f} GB"
    )
    print(
        f"{'B':>3} {'ctx':>5} {'layout':<8} {'impl':<9} {'ms/step':>8} {'tok/s':>8} "
        f"{'roofline':>8} {'floor ms':>8} {'vs mlx-lm':>9}  per-round ms [min-max], ratio"
    )
    for r in rows:
        ratio = f", x{r['ratio_min']:.2f}-{r['ratio_max']:.2f}" if "ratio_min" in r else ""
        print(
            f"{r['B']:>3} {r['context']:>5} {r['layout']:<8} {r['impl']:<9} {r['ms']:8.2f} "
            f"{r['tok_s']:8.0f} {r['roofline']:8.1%} {r['floor_ms']:8.2f} "
            f"{r['vs_mlx_lm']:9.2f}  [{r['min_ms']:.2f}-{r['max_ms']:.2f}]{ratio}"
        )


if __name__ == "__main__":
    main()
