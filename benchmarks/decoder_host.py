"""Host time of a compiled decode step against the step itself (issue 15's B=1 bound).

A decode step is host work (the Python around the compiled call: flatten the
records, look up the trace, rebuild them; then MLX building and dispatching
the graph) followed by device work. With steps pipelined (``async_eval``, as
the suite and mlx-lm's generator run them) the step time is about the larger
of the two. This prints, per batch size, the median over ``--rounds`` rounds
of ``--steps`` steps of:

    host     seconds inside ``Decoder.__call__`` (returns before the device runs)
    dispatch seconds inside ``mx.async_eval`` of the step's outputs (MLX encoding
             and launching the graph on this thread)
    step     seconds per step, pipelined (what the suite reports)
    mlx-lm   seconds per step of mlx-lm's own loop on the same rows (eager)

``--split``: the host time inside ``Decoder.__call__`` by phase, per step and
per layer: ``flatten`` (each record prepared and flattened, or its remembered
``Spec`` reused), ``keys`` (the trace's cache key), ``replay`` (the compiled
call: MLX replaying the trace), ``rebuild`` (the new records), ``settle``
(``wait``), and the rest (argument checks, padding). ``--profile N``: the N
functions with the most own time over one round (``cProfile``).

``--cuda-route`` (any backend): the routes MLX's CUDA backend takes, kvstate's
launch code included, with the kernel object stubbed
(``shared_prefix.cuda_route``), so off CUDA the host work of the CUDA path is
measured. With ``--model llama-3.2-1b-host`` (Llama-3.2-1B's 16 layers and
32/8 heads of 64, hidden size 64) the compute is too small to hide it.

    python3 benchmarks/decoder_host.py --batch 1 32 --context 2048
    python benchmarks/decoder_host.py --model llama-3.2-1b-host --dtype float32 --batch 1 \
        --cuda-route --split
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import attrs
import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import suite  # noqa: E402  (the suite's model, rows and mlx-lm caches)

from kvstate import mlx_lm as br  # noqa: E402
from kvstate.bridge import decoder as _decoder  # noqa: E402

PHASES = ("flatten", "keys", "replay", "rebuild", "settle")


def timed(fn, name: str, acc: dict):
    """``fn``, adding the seconds of each call to ``acc[name]``."""

    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t

    return call


def split_phases(dec, acc: dict) -> None:
    """Time ``dec``'s phases into ``acc`` (seconds per phase name; a phase an
    older ``Decoder`` does not have is left out)."""
    for name in ("flatten", "rebuild", "settle"):
        if hasattr(dec, "_" + name):
            setattr(dec, "_" + name, timed(getattr(dec, "_" + name), name, acc))
    compiled = dec._compiled
    dec._compiled = lambda key: timed(compiled(key), "replay", acc)
    _decoder._keys = timed(_decoder._keys, "keys", acc)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(suite.MODELS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cuda-route", action="store_true", help="CUDA's routes, kernels stubbed")
    ap.add_argument("--split", action="store_true", help="host time by Decoder phase")
    ap.add_argument("--profile", type=int, default=0, help="top N functions (cProfile)")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's loop")
    ap.add_argument(
        "--quiet-device",
        action="store_true",
        help="wait for each step after its dispatch (off the host timing): on the CPU the "
        "step's compute then does not share the cores with the next step's host work",
    )
    ap.add_argument(
        "--layer-row-ids",
        action="store_true",
        help="each layer's record its own row ids (the suite's records before session 5)",
    )
    args = ap.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    if args.cuda_route:
        from shared_prefix import cuda_route

        cuda_route()
    model = suite.build_model(args.model, dtype)
    route = ", CUDA route, kernels stubbed" if args.cuda_route else ""
    print(f"mlx {mx.__version__} on {mx.default_device()}; {args.model} {args.dtype}{route}")
    print(f"kvstate from {os.path.dirname(br.__file__)}")
    layers = len(model.layers)
    for B in args.batch:
        lengths = suite.row_lengths(B, args.context, "aligned")
        cap = args.context + args.steps * (args.rounds + 2) + 8
        kvs = suite.random_kv(model, B, cap, dtype, seed=1)
        states = suite.kv_states(kvs, lengths, args.context)
        if args.layer_row_ids:
            states = [attrs.evolve(s, row_ids=None) for s in states]
        caches = None if args.no_mlx_lm else suite.mlx_lm_caches(kvs, lengths, args.context)
        del kvs
        dec = br.Decoder(model, attention="kernel" if args.cuda_route else "auto")
        acc: dict = {}
        tok = mx.zeros((B,), mx.int32)
        logits, states = dec(tok, states)  # the trace
        mx.eval(logits)
        if args.split:
            split_phases(dec, acc)
        host, disp, step, lm, phases = [], [], [], [], {n: [] for n in PHASES}
        prof = cProfile.Profile() if args.profile else None
        for r in range(args.rounds):
            h = d = 0.0
            acc.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                t = time.perf_counter()
                if prof is not None and r == args.rounds - 1:
                    prof.enable()
                logits, states = dec(tok, states)
                if prof is not None:
                    prof.disable()
                h += time.perf_counter() - t
                tok = mx.argmax(logits, axis=-1).astype(mx.int32)
                t = time.perf_counter()
                mx.async_eval(tok, [s.planes for s in states])
                d += time.perf_counter() - t
                if args.quiet_device:  # (the device's work off this thread's timing)
                    mx.eval(tok, [s.planes for s in states])
            mx.eval(tok)
            step.append((time.perf_counter() - t0) / args.steps)
            host.append(h / args.steps)
            disp.append(d / args.steps)
            for n in PHASES:
                phases[n].append(acc.get(n, 0.0) / args.steps)
            if caches is None:
                continue
            t0 = time.perf_counter()
            ltok = tok[:, None]
            for _ in range(args.steps):
                out = model(ltok, cache=caches)
                ltok = mx.argmax(out[:, -1, :], axis=-1)[:, None]
                mx.async_eval(ltok)
            mx.eval(ltok)
            lm.append((time.perf_counter() - t0) / args.steps)
        runs = (("host", host), ("disp", disp), ("step", step), ("lm", lm))
        med = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in runs}
        print(
            f"B={B} ctx={args.context} aligned: host {med['host']:.3f} ms "
            f"[{min(host) * 1e3:.3f}-{max(host) * 1e3:.3f}], dispatch {med['disp']:.3f} ms, "
            f"step {med['step']:.3f} ms "
            f"[{min(step) * 1e3:.3f}-{max(step) * 1e3:.3f}], mlx-lm step {med['lm']:.3f} ms; "
            f"(host + dispatch) / step {(med['host'] + med['disp']) / med['step']:.2f}"
        )
        if args.split:
            rest = [h - sum(phases[n][i] for n in PHASES) for i, h in enumerate(host)]
            print(f"  host by phase, ms/step median [min-max] of {args.rounds} (us/layer):")
            for n, v in (*phases.items(), ("rest", rest)):
                m = statistics.median(v) * 1e3
                print(
                    f"    {n:<8} {m:7.3f} [{min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}]"
                    f"  ({m / layers * 1e3:.1f} us/layer)"
                )
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        sys.stdout.flush()
        del states, caches


if __name__ == "__main__":
    main()
