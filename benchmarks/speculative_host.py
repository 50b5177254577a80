"""Host time of one speculative round against a plain decode step (real model, same process).

A round's host time is its wall time less the time the thread waits in
``mx.eval`` (the device computing: the verify forward and the previous
round's lazy rollback); its thread CPU time (``time.thread_time``) is what
the calling thread computed (on the CPU device it includes the evaluation
MLX runs on that thread), less disturbed by other processes than wall time.
Printed per method: median ms per round of wall, sync, host and thread CPU
time over ``--rounds`` rounds, after a warm-up; and with ``--profile``, the
top Python functions of the speculative rounds (cProfile, cumulative).

Methods: a plain step (``kvstate.mlx_lm.step`` and an argmax); the same
rounds through ``speculative.step`` with a window rule that never widens
(``Window(margin=inf)``: every round a plain round, prompt lookup never
run); prompt lookup without a rule (k <= 4); the cost-aware window.

    python benchmarks/speculative_host.py --batch 8 --rounds 40
    python benchmarks/speculative_host.py --model tiny --batch 8 --rounds 60 --repeat 3 --plain-only
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx

from kvstate import mlx_lm as br
from kvstate import speculative as sp
from kvstate.drafts import Lookup

import speculative as bench  # benchmarks/speculative.py: the model and prompts

WAIT = [0.0]
_eval = mx.eval


def timed_eval(*args, **kw):
    t0 = time.perf_counter()
    _eval(*args, **kw)
    WAIT[0] += time.perf_counter() - t0


def rounds_plain(model, prompts, n):
    logits, states = br.prefill(model, prompts)
    y = mx.argmax(logits, axis=-1)
    mx.eval(y, states)
    out = []
    for _ in range(n):
        WAIT[0] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        logits, states = br.step(model, y, states)
        y = mx.argmax(logits, axis=-1)
        mx.eval(y)
        y.tolist()
        out.append((time.perf_counter() - t0, WAIT[0], time.thread_time() - c0, 1))
    return out


def rounds_spec(model, prompts, n, window, profile=None):
    kw = {} if window is None else {"window": window}
    spec = sp.start(model, prompts, drafter=Lookup(), num_draft=4, **kw)
    mx.eval(spec.states)
    out = []
    for _ in range(n):
        WAIT[0] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        if profile is not None:
            profile.enable()
        spec, r = sp.step(model, spec, drafter=Lookup())
        made = len(r.emitted)  # read, as a plain loop's tolist (after spec is rebound)
        if profile is not None:
            profile.disable()
        out.append((time.perf_counter() - t0, WAIT[0], time.thread_time() - c0, r.width, made))
    return out


def show(name, rows):
    wall = [r[0] * 1e3 for r in rows]
    sync = [r[1] * 1e3 for r in rows]
    cpu = [r[2] * 1e3 for r in rows]
    host = [w - s for w, s in zip(wall, sync)]
    widths = sorted({r[3] for r in rows})
    print(
        f"{name} | {statistics.median(wall):.2f} | {statistics.median(sync):.2f} | "
        f"{statistics.median(host):.2f} [{min(host):.2f}-{max(host):.2f}] | "
        f"{statistics.median(cpu):.2f} [{min(cpu):.2f}-{max(cpu):.2f}] | {widths}",
        flush=True,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=bench.GGUF)
    ap.add_argument("--quantized", action="store_true", help="keep the GGUF's 4-bit layers")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--kind", default="rewrite")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="plain step / plain round pairs")
    ap.add_argument("--plain-only", action="store_true", help="only the plain step / round pairs")
    ap.add_argument("--tiny-layers", type=int, default=8, help="--model tiny: its layers")
    ap.add_argument("--prompt-tokens", type=int, default=300, help="--model tiny: prompt length")
    args = ap.parse_args(argv)
    if args.model == "tiny":  # kvstate's tiny llama, random weights: host work shows more
        from kvstate.models import tiny_llama

        model = tiny_llama(0, layers=args.tiny_layers)
        prompts = [
            [(7 * b + 3 * (i % 40)) % 500 + 1 for i in range(args.prompt_tokens)]
            for b in range(args.batch)
        ]
    else:
        model, tok = bench.load(args.model, not args.quantized)
        texts = bench.KINDS[args.kind]
        prompts = [
            tok.chat([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(args.batch)
        ]
    mx.eval = timed_eval  # every sync, including the library's, is timed
    sp.mx.eval = timed_eval
    print(f"B={args.batch} kind={args.kind} rounds={args.rounds} device {mx.default_device()}")
    print("method | wall ms | sync ms | host ms median [min-max] | thread CPU ms | widths")
    never = sp.Window(margin=float("inf")) if hasattr(sp, "Window") else None
    rounds_plain(model, prompts, 3)
    rounds_spec(model, prompts, 3, None)
    print("warm", flush=True)
    for _ in range(args.repeat):  # interleaved: load drifts hit both alike
        show("plain step", rounds_plain(model, prompts, args.rounds))
        if never is not None:
            show("plain round (step, W = 1)", rounds_spec(model, prompts, args.rounds, never))
    if args.plain_only:
        return
    prof = cProfile.Profile() if args.profile else None
    show("lookup round (k<=4)", rounds_spec(model, prompts, args.rounds, None, prof))
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if hasattr(sp, "Window"):  # the cost-aware rule: widths it picks on this device
        show("cost-aware round", rounds_spec(model, prompts, args.rounds, sp.Window()))


if __name__ == "__main__":
    main()
