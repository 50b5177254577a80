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

    python3 benchmarks/decoder_host.py --batch 1 32 --context 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import suite  # noqa: E402  (the suite's model, rows and mlx-lm caches)

from kvstate import mlx_lm as br  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(suite.MODELS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    model = suite.build_model(args.model, dtype)
    print(f"mlx {mx.__version__} on {mx.default_device()}; {args.model} {args.dtype}")
    for B in args.batch:
        lengths = suite.row_lengths(B, args.context, "aligned")
        cap = args.context + args.steps * (args.rounds + 1) + 8
        kvs = suite.random_kv(model, B, cap, dtype, seed=1)
        states = suite.kv_states(kvs, lengths, args.context)
        caches = suite.mlx_lm_caches(kvs, lengths, args.context)
        del kvs
        dec = br.Decoder(model)
        tok = mx.zeros((B,), mx.int32)
        logits, states = dec(tok, states)  # the trace
        mx.eval(logits)
        host, disp, step, lm = [], [], [], []
        for _ in range(args.rounds):
            h = d = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                t = time.perf_counter()
                logits, states = dec(tok, states)
                h += time.perf_counter() - t
                tok = mx.argmax(logits, axis=-1).astype(mx.int32)
                t = time.perf_counter()
                mx.async_eval(tok, [s.planes for s in states])
                d += time.perf_counter() - t
            mx.eval(tok)
            step.append((time.perf_counter() - t0) / args.steps)
            host.append(h / args.steps)
            disp.append(d / args.steps)
            t0 = time.perf_counter()
            ltok = tok[:, None]
            for _ in range(args.steps):
                out = model(ltok, cache=caches)
                ltok = mx.argmax(out[:, -1, :], axis=-1)[:, None]
                mx.async_eval(ltok)
            mx.eval(ltok)
            lm.append((time.perf_counter() - t0) / args.steps)
        runs = (("host", host), ("disp", disp), ("step", step), ("lm", lm))
        med = {k: statistics.median(v) * 1e3 for k, v in runs}
        print(
            f"B={B} ctx={args.context} aligned: host {med['host']:.3f} ms "
            f"[{min(host) * 1e3:.3f}-{max(host) * 1e3:.3f}], dispatch {med['disp']:.3f} ms, "
            f"step {med['step']:.3f} ms "
            f"[{min(step) * 1e3:.3f}-{max(step) * 1e3:.3f}], mlx-lm step {med['lm']:.3f} ms "
            f"[{min(lm) * 1e3:.3f}-{max(lm) * 1e3:.3f}]; "
            f"(host + dispatch) / step {(med['host'] + med['disp']) / med['step']:.2f}"
        )
        sys.stdout.flush()
        del states, caches


if __name__ == "__main__":
    main()
