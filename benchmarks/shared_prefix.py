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
``LRUPromptCache`` path for the shared system prompt. With ``--compiled``
each side's rows are also decoded by the compiled decoder
(``kv.compiled_decoder``, one per side, kept across rounds) from the same
rows and sampling keys: compiled shared against compiled unshared.

    python -m benchmarks shared-prefix --part attention --rounds 7
    python -m benchmarks shared-prefix --part model --rounds 5 --compiled
    python -m benchmarks shared-prefix --part bytes     # peak KV bytes only, no forward
    python -m benchmarks shared-prefix --part traces --tiny  # traces of the shared read under churn
    python -m benchmarks shared-prefix --part host --batch 1 32  # host time of a decode step
    python -m benchmarks shared-prefix --part cache --tiny --requests 64  # prefill host vs entries

``--part traces``: a server's churn over rows sharing one prompt: every
step one row leaves and a new one joins, reading a different number of the
prompt's tokens (as requests whose prompts match more or less of a cached
prefix); counts the traces of the shared read (``shared.cascade_attention``
calls: Python runs only while tracing) through the eager bridge and, where
the compiled decoder takes shared rows, through it.

``--part host``: the host time of one decode step of the real model (the
Python and graph building before the device runs: nothing is evaluated),
B rows reading a ``--prefix``-token prefix plus ``--suffix`` own tokens
(random keys and values), shared against the same rows stored unshared,
through the eager bridge (``kvstate.mlx_lm.step``) and the compiled decoder;
for the compiled decoder also the part spent inside the compiled call (MLX
replaying its trace; that graph differs between CPU and CUDA, the rest does
not). Where a step is host-bound (a small model on a GPU) this is the step.
Each step takes the rows the previous one returned (as a decode loop does;
they are evaluated between steps, outside the timing); the layers of each
side hold one set of row ids, as the bridge's prefill and merges leave
them. The ``wall`` rows time the same steps from the call to their
evaluated results (on a GPU, wall minus host is what the device adds).
``--cuda-route``
(any backend): the routes MLX's CUDA backend takes (kvstate's kernels for
the reads, the shared suffix write fused into the read), kvstate's launch
code included, with the kernel object replaced by a stub that returns
arrays of its inputs (one split: the reads here fit one), so off CUDA the
host work of the CUDA path is measured and nothing else differs.

(``--tiny``: a random llama with the real model's 30 layers and attention
geometry, hidden size 64, so that the host work is the real model's without
its compute.) ``--cuda-route`` applies to ``--part cache`` too.

``--part wide``: the read of a cached request's rest (``shared.prefix_read``,
uncompiled, as a rest wider than ``kernels.MAX_QUERIES`` runs), ``--queries``
queries per row over a ``--prefix``-token shared prefix plus the rest itself,
B rows (``--batch``): the route ``kernels.PREFIX_QUERIES`` allows (the kernel
with a prefix source, on CUDA) against the route past it (the cascade), same
inputs, same process, order alternating; the seconds per evaluated call and
their ratio, with the largest difference of the two outputs. Where the
kernel stops paying is where ``PREFIX_QUERIES`` belongs (off CUDA both sides
take the stock path: no figure).

``--part cache``: the host time of ``prefix_cache.prefill`` per request
(before its evaluation) as the cache fills, ``--requests`` requests of
``--system`` + ``--user`` tokens sharing the system prompt (``--tiny``:
a random 30-layer llama, the real model's layer count).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

import kvstate as kv
from benchmarks import _common as common


def timed(fn, reps):
    """Seconds per call of ``fn`` (evaluated), over ``reps`` calls after one warm-up."""
    return common.timed(fn, reps, warmup=1)


def spread(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e3:.3f} ms [{xs[0] * 1e3:.3f}, {xs[-1] * 1e3:.3f}]"


def ratio_spread(a, b):
    r = sorted(x / y for x, y in zip(a, b))
    return f"{statistics.median(r):.3f} [{r[0]:.3f}, {r[-1]:.3f}]"


def attention_part(args):
    for B in args.batch:
        attention_read(args, B)


def attention_read(args, B):
    """One decode read of ``B`` rows sharing a prefix, five ways (see the module;
    ``ragged``: ``kernels.ragged_attention`` over the unshared rows, what the
    compiled decoder reads dense rows with on CUDA, the masked SDPA elsewhere;
    ``shared read``: ``kv.attend`` on the ``SharedState``, which takes the
    split-K kernel with a prefix source where it runs (CUDA), else the
    cascade; ``cascade``: the portable cascade alone)."""
    from kvstate.core.masks import rows_mask
    from kvstate.kernels import cuda as kernels
    from kvstate.kinds import shared

    P, S, H, HQ, D = args.prefix, args.suffix, args.kv_heads, args.heads, 64
    dtype = getattr(mx, args.dtype)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    pk, pv = arr(1, H, P, D), arr(1, H, P, D)
    base = kv.append(kv.empty(1), pk, pv)
    sk, sv = arr(B, H, S, D), arr(B, H, S, D)
    forked = kv.append(kv.fork(base, 0, B - 1), sk, sv)
    unshared = kv.append(kv.filter_rows(base, [0] * B), sk, sv)
    mx.eval(forked.suffix.planes, unshared.planes)
    q = arr(B, HQ, 1, D)
    scale = D**-0.5
    sx = forked.suffix
    lp, ends = (mx.array(x, dtype=mx.int32) for x in (unshared.left_pad, unshared.ends))
    views = shared.view_arrays(forked)
    mask = rows_mask(1, sx.left_pad, sx.ends, sx.capacity)
    cascade = mx.compile(
        lambda q, k, v, m, *a: shared.cascade_attention(
            q, [(a[4], a[5])], a[:4], (k, v), m, scale=scale
        )
    )
    sides = {
        "unshared": lambda: kv.attend(unshared, q, scale=scale),
        "ragged": lambda: kernels.ragged_attention(
            q, unshared.keys, unshared.values, lp, ends, scale=scale
        ),
        "shared read": lambda: kv.attend(forked, q, scale=scale),
        "cascade": lambda: cascade(q, sx.keys, sx.values, mask, *views, pk, pv),
        "materialize": lambda: kv.attend(kv.materialize(forked), q, scale=scale),
    }
    want = np.array(sides["unshared"]().astype(mx.float32))
    for k in sides:
        np.testing.assert_allclose(
            np.array(sides[k]().astype(mx.float32)),
            want,
            atol=2e-2 if dtype != mx.float32 else 1e-5,
            err_msg=k,
        )
    times: dict = {k: [] for k in sides}
    for _ in range(args.rounds):
        for k, fn in sides.items():
            times[k].append(timed(fn, args.reps))
    prefix_kernel = kernels.kernel_available()
    print(
        f"# attention read, B={B} prefix={P} suffix={S} H={H} Hq={HQ} D={D} {args.dtype} "
        f"device={mx.default_device()} rounds={args.rounds} reps={args.reps} "
        f"shared read={'split-K kernel with a prefix source' if prefix_kernel else 'cascade'}"
    )
    print(
        f"# KV bytes: unshared {unshared.nbytes}, shared {forked.nbytes} "
        f"({forked.nbytes / unshared.nbytes:.3f} of unshared)"
    )
    for k, xs in times.items():
        print(f"{k:12s} {spread(xs)}  / unshared {ratio_spread(xs, times['unshared'])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part",
        choices=["attention", "model", "bytes", "traces", "host", "cache", "wide"],
        default="attention",
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf or mlx-lm directory (default: "
        "kvstate's default real model, SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama (development)")
    ap.add_argument(
        "--quantized",
        action="store_true",
        help="keep the GGUF's quantized linears (GPU); default: dequantized",
    )
    ap.add_argument(
        "--queries",
        type=int,
        nargs="+",
        default=[16, 32, 64, 128, 256, 512],
        help="wide part: queries per row (a cached request's rest)",
    )
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument(
        "--samples",
        type=int,
        nargs="*",
        default=[1, 4, 16],
        help="n of the n-samples table (model part; none: that table is not run)",
    )
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--user", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="also decode each side's rows with the compiled decoder (model part)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="host part: after the rounds, profile the eager steps of each side "
        "(cProfile, this many lines by own time) and time the calls a layer's read makes",
    )
    ap.add_argument(
        "--cuda-route",
        action="store_true",
        help="host/cache parts: CUDA's routes with stub kernel launches (host work only)",
    )
    args = ap.parse_args(argv)
    if args.part == "attention":
        attention_part(args)
    elif args.part == "bytes":
        bytes_part(args)
    elif args.part == "traces":
        traces_part(args)
    elif args.part == "host":
        host_part(args)
    elif args.part == "cache":
        cache_part(args)
    elif args.part == "wide":
        wide_part(args)
    else:
        model_part(args)


# --- the real model ------------------------------------------------------------------------


def load(args):
    """The model: the real SmolLM2-135M (float32, dequantized) or a tiny llama (``--tiny``)."""
    if args.tiny:
        from kvstate.cli import tiny_llama

        return tiny_llama(0), "tiny llama (random weights)"
    loaded = common.real(args.model, quantized=args.quantized, dtype=args.dtype)
    return loaded.model, f"{loaded.name} ({'quantized' if args.quantized else args.dtype})"


def tokens(rng, n, vocab):
    return rng.integers(1, vocab, n).tolist()


def lm_bytes(caches) -> int:
    return sum(c.nbytes for c in caches)


def decode(model, logits, states, steps, key, step=None):
    """``steps`` sampled decode steps (temperature 0.8) by ``step`` (default the
    eager bridge's); returns the median step time, the states and the peak KV
    bytes held."""
    from kvstate import mlx_lm as bridge
    from kvstate.kinds.shared import resident_bytes

    step = step or bridge.step
    times, peak = [], resident_bytes(states)
    for _ in range(steps):
        key, k = mx.random.split(key)
        tok = mx.random.categorical(logits * (1 / 0.8), key=k)
        t = time.perf_counter()
        logits, states = step(model, tok, states)
        mx.eval(logits)
        times.append(time.perf_counter() - t)
        peak = max(peak, resident_bytes(states))
    return statistics.median(times), states, peak


def compiled_decode(model, logits, states, steps, seed, compiled):
    """The median compiled step time (``nan`` without ``compiled``: {side: step})."""
    if compiled is None:
        return float("nan")
    return decode(model, logits, states, steps, mx.random.key(seed), compiled)[0]


def samples_round(model, prompt, ns, steps, seed, compiled=None):
    """n samples of one prompt, for each n in ``ns``, three ways; each side
    prefills the prompt once per round (timed) and serves every n from it:
    TTFT = that prefill + the side's own fork or copies and first token.
    ``compiled``: {side: compiled step}, each side's rows also decoded by it.
    Returns {(n, side): (ttft, step, peak bytes, compiled step)}."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.server import LRUPromptCache

    from kvstate import mlx_lm as bridge

    out = {}
    for side in ("shared", "unshared", "mlx-lm LRU"):
        mx.clear_cache()
        t = time.perf_counter()
        if side == "mlx-lm LRU":
            lru = LRUPromptCache()
            cache = make_prompt_cache(model)
            logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
            mx.eval(logits, [c.state for c in cache])
            lru.insert_cache("m", prompt, cache)
            prefill_s = time.perf_counter() - t
            for n in ns:
                t = time.perf_counter()
                rows = [lru.fetch_nearest_cache("m", prompt)[0] for _ in range(n)]
                first = mx.argmax(mx.repeat(logits, n, axis=0), axis=-1)
                mx.eval(first, [c.state for r in rows for c in r])
                out[(n, side)] = (
                    prefill_s + time.perf_counter() - t,
                    float("nan"),
                    lm_bytes(cache) + sum(lm_bytes(r) for r in rows),
                    float("nan"),
                )
                del rows
            continue
        logits, base = bridge.forward(model, mx.array([prompt]), bridge.make_states(model, 1))
        logits = logits[:, -1, :]
        mx.eval(logits, [p for s in base for p in s.planes])
        prefill_s = time.perf_counter() - t
        for n in ns:
            t = time.perf_counter()
            if side == "shared":
                states = kv.fork(base, 0, n - 1)
            else:
                states = [kv.filter_rows(s, [0] * n) for s in base]
            rows = mx.repeat(logits, n, axis=0)
            first = mx.argmax(rows, axis=-1)
            mx.eval(first, [p for s in states for p in s.planes])
            ttft = prefill_s + time.perf_counter() - t
            cstep = compiled_decode(model, rows, states, steps, seed, compiled and compiled[side])
            step, states, peak = decode(model, rows, states, steps, mx.random.key(seed))
            out[(n, side)] = (ttft, step, peak, cstep)
            del states
    return out


def system_round(model, system, users, steps, seed, compiled=None):
    """R requests sharing a system prompt, served one after another then decoded
    together. Returns {side: (mean ttft, prefill tokens, step, peak bytes,
    compiled step)}."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.server import LRUPromptCache

    from kvstate import mlx_lm as bridge
    from kvstate.kinds.shared import resident_bytes
    from kvstate.serving.prefix_cache import PrefixCache, prefill

    prompts = [system + u for u in users]
    out = {}
    for side in ("shared", "unshared", "mlx-lm LRU"):
        mx.clear_cache()
        t0 = time.perf_counter()
        ttfts, ran = [], 0
        if side == "mlx-lm LRU":
            lru, running = LRUPromptCache(), []
            for p in prompts:
                cache, rest = lru.fetch_nearest_cache("m", p)
                if cache is None:
                    cache, rest = make_prompt_cache(model), p
                logits = model(mx.array([rest]), cache=cache)[:, -1, :]
                mx.eval(mx.argmax(logits, axis=-1))
                ttfts.append(time.perf_counter() - t0)
                ran += len(rest)
                import copy

                lru.insert_cache("m", p, copy.deepcopy(cache))
                running.append(cache)
            peak = sum(lm_bytes(r) for r in running) + lru.nbytes
            out[side] = (statistics.mean(ttfts), ran, float("nan"), peak, float("nan"))
            print(f"#   {side}: {time.perf_counter() - t0:.1f} s", flush=True)
            continue
        cache = PrefixCache(1 << 34) if side == "shared" else None
        rows, last, leases = [], [], []
        for p in prompts:
            if side == "shared":
                logits, states, held, count = prefill(model, [p], cache)
                leases += [h for h in held if h is not None]
            else:
                logits, states = bridge.forward(model, mx.array([p]), bridge.make_states(model, 1))
                logits, count = logits[:, -1, :], [len(p)]
            mx.eval(mx.argmax(logits, axis=-1))
            ttfts.append(time.perf_counter() - t0)
            ran += count[0]
            rows.append(states)
            last.append(logits)
        states = bridge.merge_rows(rows)
        logits = mx.concatenate(last, axis=0)
        extra = [] if cache is None else cache.records()
        peak0 = resident_bytes(list(states) + extra)
        t1 = time.perf_counter()
        cstep = compiled_decode(model, logits, states, steps, seed, compiled and compiled[side])
        t2 = time.perf_counter()
        step, states, peak = decode(model, logits, states, steps, mx.random.key(seed))
        peak = max(peak0, peak + (resident_bytes(list(states) + extra) - resident_bytes(states)))
        for lease in leases:
            lease.release()
        out[side] = (statistics.mean(ttfts), ran, step, peak, cstep)
        print(
            f"#   {side}: prefill {t1 - t0:.1f} s, compiled decode {t2 - t1:.1f} s, "
            f"eager decode {time.perf_counter() - t2:.1f} s",
            flush=True,
        )
    return out


def traces_part(args):
    """Traces of the shared read while rows join and leave (see the module)."""
    from kvstate import mlx_lm as bridge
    from kvstate.kinds import shared

    model, name = load(args)
    real, count = shared.cascade_attention, [0]

    def counted(*a, **k):
        count[0] += 1  # Python runs only while tracing
        return real(*a, **k)

    shared.cascade_attention = counted
    rng = np.random.default_rng(0)
    prompt = tokens(rng, args.system, model.args.vocab_size)
    _, base = bridge.forward(model, mx.array([prompt]), bridge.make_states(model, 1))
    B, steps = args.batch[0], args.steps
    print(f"# traces: {name}, B={B}, prompt {args.system}, {steps} steps, one row in and out each")
    sides = [("eager", bridge.step)]
    try:
        from kvstate.bridge.decoder import make_step

        sides.append(("compiled", make_step(model)))
    except ImportError:
        pass
    for side, step in sides:
        count[0] = 0
        rows = kv.fork(base, 0, B - 1)
        tok = mx.array(tokens(rng, B, model.args.vocab_size))
        try:
            for t in range(steps):
                logits, rows = step(model, tok, rows)
                tok = mx.argmax(logits, axis=-1)
                view = int(rng.integers(1, args.system + 1))  # the new row reads `view` tokens
                new = [kv.trim(s, [args.system - view]) for s in kv.fork(base, 0, 0)]
                keep = [r for r in range(B) if r != t % B]
                rows = [kv.merge_rows([kv.filter_rows(s, keep), n]) for s, n in zip(rows, new)]
                tok = mx.concatenate([tok[mx.array(keep)], tok[:1]])
            mx.eval(tok)
            d = getattr(step, "decoder", None)
            why = "" if d is None else f"; decoder traces {d.traces}: {'; '.join(d.trace_reasons)}"
            print(f"{side:9s} shared-read traces (layer calls): {count[0]} over {steps} steps{why}")
        except kv.KVStateError as e:
            print(f"{side:9s} refused: {e}")


def cache_part(args):
    """Host time of each cached request's prefill as the cache fills (see the module)."""
    from kvstate.serving.prefix_cache import PrefixCache, prefill

    if args.cuda_route:
        cuda_route()
    if args.tiny:
        from kvstate.models.load import tiny_llama

        model, name = tiny_llama(0, layers=30), "tiny llama, 30 layers (random weights)"
    else:
        model, name = load(args)
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    system = tokens(rng, args.system, vocab)
    cache, times = PrefixCache(1 << 40), []
    for _ in range(args.requests):
        t = time.perf_counter()
        logits, _, _, _ = prefill(model, [system + tokens(rng, args.user, vocab)], cache)
        times.append(time.perf_counter() - t)
        mx.eval(logits)
    at = sorted({1, 2, 3, 4, len(times) // 4, len(times) // 2, 3 * len(times) // 4, len(times) - 1})
    print(
        f"# prefill host ms per request (nothing evaluated), {name}, "
        f"{len(cache)} entries at the end"
    )
    print("| request | " + " | ".join(str(i + 1) for i in at) + " |")
    print("|---|" + "---|" * len(at))
    print("| host ms | " + " | ".join(f"{times[i] * 1e3:.1f}" for i in at) + " |")


def cuda_route():
    """Route reads as on MLX's CUDA backend, kernel launches stubbed (``--cuda-route``)."""
    from kvstate.bridge import routing
    from kvstate.kernels import cuda as kernels

    def route(N, q=None, k=None, *, written=False, prefix=False, **kw):
        most = getattr(kernels, "PREFIX_QUERIES", 128) if prefix else kernels.MAX_QUERIES
        return ("fused" if written else "kernel") if N <= most else "masked"

    def kernel(*variant):  # kvstate's launch code runs; the kernel object is a stub
        def call(*, inputs, output_shapes, **launch):
            out = [inputs[0] + 0]  # (q's shape: one split, the output itself)
            return out + [inputs[1] + 0, inputs[2] + 0] if len(output_shapes) == 3 else out

        return call

    routing.routes_reads = lambda: True
    kernels.decode_read, kernels._split_kernel = route, kernel
    kernels._kernel_reads = lambda *a: True


def host_part(args):
    """Host time of a decode step, shared against unshared (see the module)."""
    if args.cuda_route:
        cuda_route()
    if args.tiny:  # the real model's layer count and attention geometry, random weights
        from kvstate.models.load import tiny_llama

        model = tiny_llama(0, layers=30, hidden=64, heads=9, kv_heads=3, head_dim=64, vocab=512)
        name = "tiny llama, 30 layers, 9/3 heads, D=64, hidden 64 (random weights)"
    else:
        model, name = load(args)
    route = ", CUDA route, launches stubbed" if args.cuda_route else ""
    print(
        f"# host time per decode step: {name}, device={mx.default_device()}{route}, "
        f"rounds={args.rounds}"
    )
    print("| B | step | shared ms | unshared ms | shared / unshared |")
    print("|---|---|---|---|---|")
    for B in args.batch:
        res = host_rounds(model, args, B)
        for step in ("eager", "compiled", "compiled call", "eager wall", "compiled wall"):
            a, b = res[(step, "shared")], res[(step, "unshared")]
            print(
                f"| {B} | {step} | {spread(a)} | {spread(b)} | {ratio_spread(a, b)} |", flush=True
            )
        if args.profile:
            res["profile"]()


def host_rounds(model, args, B) -> dict:
    """{(step, side): seconds per round} of ``host_part`` for ``B`` rows."""
    from kvstate import mlx_lm as bridge
    from kvstate.bridge.decoder import Decoder
    from kvstate.core.records import share_row_ids

    _, probe = bridge.forward(model, mx.array([[1]]), bridge.make_states(model, 1))
    H, D, dtype = probe[0].keys.shape[1], probe[0].keys.shape[3], probe[0].keys.dtype

    def kv_rand(b, n):
        return mx.random.normal((b, H, n, D)).astype(dtype)

    base = [
        kv.append(s, kv_rand(1, args.prefix), kv_rand(1, args.prefix))
        for s in bridge.make_states(model, 1)
    ]
    own = [(kv_rand(B, args.suffix), kv_rand(B, args.suffix)) for _ in base]
    # (one model's layers hold one set of row ids, as the bridge's prefill and merges
    # give them: the compiled decoder's layers of one layout then share one Spec)
    rows = {
        "shared": share_row_ids([kv.append(s, *o) for s, o in zip(kv.fork(base, 0, B - 1), own)]),
        "unshared": share_row_ids(
            [kv.append(kv.filter_rows(s, [0] * B), *o) for s, o in zip(base, own)]
        ),
    }
    mx.eval(
        [p for s in base for p in s.planes], [p for r in rows.values() for s in r for p in s.planes]
    )
    tok = mx.zeros((B,), mx.int32)
    inside: list = []
    attention = "kernel" if args.cuda_route else "auto"
    decoders = {side: Decoder(model, attention=attention) for side in rows}
    for side, d in decoders.items():
        mx.eval(d(tok, rows[side])[0])  # the trace
        ((key, fn),) = d._fns.items()
        d._fns[key] = _timed_calls(fn, inside)
    steps = {
        "eager": lambda side, tok, states: bridge.step(model, tok, states),
        "compiled": lambda side, tok, states: decoders[side](tok, states),
    }

    def loop(fn, side):
        """Median host seconds of ``args.reps`` steps, each on the last one's rows,
        and the median seconds from the call to the step's evaluated results."""
        times, walls, states = [], [], rows[side]
        for _ in range(args.reps):
            t = time.perf_counter()
            logits, states = fn(side, tok, states)
            times.append(time.perf_counter() - t)
            mx.eval(logits, [p for s in states for p in s.planes])
            walls.append(time.perf_counter() - t)
        return statistics.median(times), statistics.median(walls)

    res: dict = {}
    for r in range(args.rounds):
        for step, fn in steps.items():
            for side in rows:
                inside.clear()
                host, wall = loop(fn, side)
                res.setdefault((step, side), []).append(host)
                res.setdefault((f"{step} wall", side), []).append(wall)
                if step == "compiled":
                    res.setdefault(("compiled call", side), []).append(statistics.median(inside))
        print(f"# B={B} round {r} done", flush=True)
    res["profile"] = functools.partial(profile_eager, model, args, rows, tok)
    return res


def profile_eager(model, args, rows, tok):
    """``--profile``: where an eager step's host time goes, per side (cProfile's
    own time per function: a C++ call counts in its Python caller's), then the
    seconds of single calls one layer's read makes (not evaluated)."""
    import cProfile
    import pstats

    from kvstate import mlx_lm as bridge
    from kvstate.kernels import cuda as kernels
    from kvstate.kinds import shared

    for side, states in rows.items():
        traced = shared.traces()
        prof = cProfile.Profile()
        for _ in range(args.reps):
            prof.enable()
            logits, states = bridge.step(model, tok, states)
            prof.disable()
            mx.eval(logits, [p for s in states for p in s.planes])
        print(
            f"# profile: eager {side}, {args.reps} steps, "
            f"{shared.traces() - traced} traces of the shared read",
            flush=True,
        )
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)
    state = rows["shared"][0]
    B = state.batch_size
    q = mx.random.normal((B, args.heads, 1, state.suffix.keys.shape[3])).astype(
        state.suffix.keys.dtype
    )
    k, v = state.suffix.keys, state.suffix.values
    lay = shared.Layouts()
    arrays = lay.arrays(state)  # (left_pad, ends, *row map): what shared.read passes
    pos, views = arrays[:2], arrays[2:]
    planes = shared.prefix_planes(state)
    fn = shared._compiled_read(0.125)
    ints = list(range(B))
    mx.eval(q, fn(q, k, v, *pos, *views, *planes))
    calls = {
        "compiled shared read": lambda: fn(q, k, v, *pos, *views, *planes),
        "shared.read (layouts kept)": lambda: shared.read(state, q, scale=0.125, layouts=lay),
        "shared.read (fresh layouts)": lambda: shared.read(state, q, scale=0.125),
        "mx.fast.sdpa, N=1, no mask": lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.125
        ),
        "kernels.ragged_attention with the prefix (uncompiled)": lambda: kernels.ragged_attention(
            q, k, v, *pos, scale=0.125, prefix=(*planes, *views[1:])
        ),
        "mx.array of B ints": lambda: mx.array(ints, dtype=mx.int32),
        "layout_key": lambda: shared.layout_key(state),
    }
    print("| call | us per call (median of 5 x 200) |")
    print("|---|---|")
    for name, call in calls.items():
        per = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                call()
            per.append((time.perf_counter() - t) / 200)
        print(f"| {name} | {statistics.median(per) * 1e6:.1f} |", flush=True)


def wide_part(args):
    """A cached request's rest read by the prefix kernel vs the cascade (see the module)."""
    from kvstate.kernels import cuda as kernels

    dtype = getattr(mx, args.dtype)
    H, Hq, D, P = args.kv_heads, args.heads, 64, args.prefix
    print(
        f"# wide prefix read: device={mx.default_device()}, {args.dtype}, prefix {P}, "
        f"Hq/H {Hq}/{H}, D {D}, rounds={args.rounds}, reps={args.reps}, "
        f"PREFIX_QUERIES={kernels.PREFIX_QUERIES}, MAX_QUERIES={kernels.MAX_QUERIES}"
    )
    print("| B | queries | route | kernel ms | cascade ms | kernel / cascade | max diff |")
    print("|---|---|---|---|---|---|---|")
    for B in args.batch:
        for N in args.queries:
            C = -(-N // 64) * 64  # (the rest's suffix, in 64-column blocks)
            key = mx.random.key(N * 131 + B)
            ks = mx.random.split(key, 5)
            q = mx.random.normal((B, Hq, N, D), key=ks[0]).astype(dtype)
            sk = mx.random.normal((B, H, C, D), key=ks[1]).astype(dtype)
            sv = mx.random.normal((B, H, C, D), key=ks[2]).astype(dtype)
            pk = mx.random.normal((1, H, P, D), key=ks[3]).astype(dtype)
            pv = mx.random.normal((1, H, P, D), key=ks[4]).astype(dtype)
            zeros = mx.zeros((B,), mx.int32)
            ends = mx.full((B,), N, mx.int32)
            views = (zeros, zeros, zeros, mx.full((B,), P, mx.int32))
            mx.eval(q, sk, sv, pk, pv, ends, views)

            args_ = (N, q, (sk, sv), zeros, ends, [(pk, pv)], views, D**-0.5)
            (a, route), (b, _) = _wide_read(1 << 20, *args_), _wide_read(0, *args_)
            diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            times: dict = {"kernel": [], "cascade": []}
            for r in range(args.rounds):
                order = [("kernel", 1 << 20), ("cascade", 0)]
                for side, most in order if r % 2 == 0 else order[::-1]:
                    call = functools.partial(_wide_read, most, *args_)
                    times[side].append(timed(lambda call=call: call()[0], args.reps))
            k, c = times["kernel"], times["cascade"]
            print(
                f"| {B} | {N} | {route} | {spread(k)} | {spread(c)} | {ratio_spread(k, c)} | "
                f"{diff:.2e} |",
                flush=True,
            )


def _wide_read(most, N, q, suffix_kv, left_pad, ends, prefix_kv, views, scale):
    """``shared.prefix_read`` with ``kernels.PREFIX_QUERIES`` = ``most``: ``(out, route)``."""
    from kvstate.kernels import cuda as kernels
    from kvstate.kinds import shared

    bound, kernels.PREFIX_QUERIES = kernels.PREFIX_QUERIES, most
    try:
        route = kernels.decode_read(N, q, suffix_kv[0], prefix=True)
        out, _ = shared.prefix_read(q, suffix_kv, left_pad, ends, prefix_kv, views, scale=scale)
    finally:
        kernels.PREFIX_QUERIES = bound
    return out, route


def _timed_calls(fn, times: list):
    """``fn``, appending the seconds of each call to ``times``."""

    def call(*a):
        t = time.perf_counter()
        out = fn(*a)
        times.append(time.perf_counter() - t)
        return out

    return call


def bytes_part(args):
    """Peak KV bytes at the issue's sizes, from the real model's cache geometry.

    Bytes depend on shapes alone, not on values, so the rows hold zeros of
    each layer's geometry (``kvstate.persist.files.model_geometry``) and no forward
    runs: the same appends, forks, copies, cache inserts and ``steps`` decode
    appends as the model part, at n = 1, 4, 16 samples of a ``--prompt``-token
    prompt and ``--requests`` requests sharing a ``--system``-token prompt.
    """
    import copy

    from mlx_lm.models.cache import KVCache
    from mlx_lm.server import LRUPromptCache

    from kvstate.kinds.shared import resident_bytes
    from kvstate.persist.files import model_geometry
    from kvstate.serving.prefix_cache import PrefixCache

    model, name = load(args)
    geo = model_geometry(model)

    def rows(B, n):
        return [
            (mx.zeros((B, H, n, dk), dt), mx.zeros((B, H, n, dv), dt)) for H, dk, dv, dt, _ in geo
        ]

    def grow(states, B, n):
        return [kv.append(s, k, v) for s, (k, v) in zip(states, rows(B, n))]

    def lm_grow(caches, n):
        for c, (k, v) in zip(caches, rows(1, n)):
            c.update_and_fetch(k, v)
        return caches

    def prompt_states(n):
        return grow([kv.empty(1) for _ in geo], 1, n)

    print(
        f"# KV bytes, {name}: {len(geo)} layers, geometry {geo[0][:4]}; "
        f"{args.steps} decode tokens per row"
    )
    print("| case | shared | unshared | mlx-lm LRU | shared / unshared | target |")
    print("|---|---|---|---|---|---|")
    for n in args.samples:
        base = prompt_states(args.prompt)
        shared = grow(kv.fork(base, 0, n - 1), n, 1)
        unshared = grow([kv.filter_rows(s, [0] * n) for s in base], n, 1)
        entry = lm_grow([KVCache() for _ in geo], args.prompt)
        lru = LRUPromptCache()
        lru.insert_cache("m", list(range(args.prompt)), entry)
        copies = [
            lm_grow(lru.fetch_nearest_cache("m", list(range(args.prompt)))[0], 1) for _ in range(n)
        ]
        for _ in range(args.steps - 1):
            shared, unshared = grow(shared, n, 1), grow(unshared, n, 1)
            copies = [lm_grow(c, 1) for c in copies]
        a, b = resident_bytes(shared), resident_bytes(unshared)
        lm = lm_bytes(entry) + sum(lm_bytes(c) for c in copies)
        print(
            f"| n={n} samples of {args.prompt} tokens | {a} | {b} | {lm} | {a / b:.3f} | "
            f"<= {1 / n + 0.1:.3f} |"
        )
    # R requests sharing a system prompt: the prefix cache flow, without the model.
    R, S, U = args.requests, args.system, args.user
    cache, batch = PrefixCache(1 << 40), []
    first = list(range(1, S + 1)) + [10_000] * U
    cache.insert(first, prompt_states(S + U))
    batch.append([kv.fork(s, 0, 0) for s in cache.pin(first).states])
    for r in range(1, R):
        p = list(range(1, S + 1)) + [10_000 + r] * U
        hit = cache.lookup(p)
        states = grow(hit.states, 1, len(p) - hit.matched)
        cache.insert(p, states)
        batch.append(cache.pin(p).states)
    shared = [kv.merge_rows(list(layer)) for layer in zip(*batch)]
    unshared = [kv.merge_rows([s] * R) for s in prompt_states(S + U)]
    lru, running = LRUPromptCache(), []
    for r in range(R):
        p = list(range(1, S + 1)) + [10_000 + r] * U
        c, rest = lru.fetch_nearest_cache("m", p)
        if c is None:
            c, rest = [KVCache() for _ in geo], p
        lm_grow(c, len(rest))
        lru.insert_cache("m", p, copy.deepcopy(c))
        running.append(c)
    for _ in range(args.steps):
        shared, unshared = grow(shared, R, 1), grow(unshared, R, 1)
        running = [lm_grow(c, 1) for c in running]
    a = resident_bytes(shared + cache.records())
    b = resident_bytes(unshared)
    lm = sum(lm_bytes(c) for c in running) + lru.nbytes
    print(f"| {R} requests, {S}-token system prompt + {U} | {a} | {b} | {lm} | {a / b:.3f} | - |")


def model_part(args):
    t0 = time.perf_counter()
    model, name = load(args)
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    prompt = tokens(rng, args.prompt, vocab)
    system = tokens(rng, args.system, vocab)
    users = [tokens(rng, args.user, vocab) for _ in range(args.requests)]
    print(
        f"# model: {name}, device={mx.default_device()}, rounds={args.rounds}, "
        f"decode steps={args.steps} (loaded in {time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    compiled = None
    if args.compiled:
        from kvstate.bridge.decoder import make_step

        compiled = {side: make_step(model) for side in ("shared", "unshared")}
    res: dict = {}
    done: dict = {}  # the rounds completed (what a cut run prints)

    def cut(*_):  # (`timeout`'s SIGTERM: the completed rounds' tables, then exit)
        print(f"# cut (SIGTERM) after {len(next(iter(done.values()), []))} complete rounds")
        if done:
            model_tables(args, done, compiled)
        sys.stdout.flush()
        os._exit(124)

    signal.signal(signal.SIGTERM, cut)
    for r in range(args.rounds):
        if args.samples:
            got = samples_round(model, prompt, args.samples, args.steps, r, compiled)
            for (n, side), v in got.items():
                res.setdefault(("samples", n, side), []).append(v)
        if args.requests:
            for side, v in system_round(model, system, users, args.steps, r, compiled).items():
                res.setdefault(("system", args.requests, side), []).append(v)
        done = {k: list(v) for k, v in res.items()}
        print(f"# round {r} done ({time.perf_counter() - t0:.1f} s since start)", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    model_tables(args, res, compiled)


def model_tables(args, res, compiled):
    """The model part's tables from ``res`` (per case and side, one tuple per round)."""
    if args.samples:
        print(f"\n## n samples of one {args.prompt}-token prompt")
        print(
            "| n | side | peak KV bytes | / unshared | TTFT ms | decode step ms | step / unshared "
            "| compiled step ms | compiled / unshared compiled |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for n in args.samples:
        base = res[("samples", n, "unshared")]
        for side in ("shared", "unshared", "mlx-lm LRU"):
            v = res[("samples", n, side)]
            peak = v[0][2]
            print(
                f"| {n} | {side} | {peak} | {peak / base[0][2]:.3f} | "
                f"{spread([x[0] for x in v])} | {steps_cells(side, v, base, 1, compiled)} |"
            )
    if args.requests:
        print(
            f"\n## {args.requests} requests sharing a {args.system}-token system prompt "
            f"(+{args.user} tokens each)"
        )
        print(
            "| side | tokens prefilled | peak KV bytes | / unshared | mean TTFT ms | "
            "decode step ms | step / unshared | compiled step ms | compiled / unshared compiled |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        base = res[("system", args.requests, "unshared")]
        for side in ("shared", "unshared", "mlx-lm LRU"):
            v = res[("system", args.requests, side)]
            print(
                f"| {side} | {v[0][1]} | {v[0][3]} | {v[0][3] / base[0][3]:.3f} | "
                f"{spread([x[0] for x in v])} | {steps_cells(side, v, base, 2, compiled)} |"
            )
    if compiled:
        for side, fn in compiled.items():
            d = fn.decoder
            print(f"# compiled {side}: {d.traces} traces: {'; '.join(d.trace_reasons)}")


def steps_cells(side, v, base, i, compiled) -> str:
    """The eager and compiled decode step cells of one table row (``i``: the
    eager step's index in the row's tuple; the compiled step is the last)."""
    cells = []
    for j in (i, -1):
        if side == "mlx-lm LRU" or (j == -1 and not compiled):
            cells += ["-", "-"]
            continue
        steps = [x[j] for x in v]
        cells += [spread(steps), ratio_spread(steps, [x[j] for x in base])]
    return " | ".join(cells)


if __name__ == "__main__":
    main()
