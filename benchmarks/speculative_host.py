"""Host time of one speculative round against a plain decode step (same process).

A round's host time is its wall time less the time the thread waits in
``mx.eval`` (the device computing: the verify forward and the previous
round's lazy rollback); its thread CPU time (``time.thread_time``) is what
the calling thread computed (on the CPU device it includes the evaluation
MLX runs on that thread), less disturbed by other processes than wall time.
Printed per method: median ms per round of wall, sync, host and thread CPU
time over ``--rounds`` rounds, after a warm-up.

Methods: a plain step (``kvstate.mlx_lm.step`` and an argmax, read each step);
the same rounds through ``speculative.step`` with a window rule that never
widens (``Window(margin=inf)``: every round a plain round, prompt lookup never
run); both again pipelined (``--pipelined``: step n + 1 built and handed to the
device, ``mx.async_eval``, before step n is read, as mlx-lm's ``generate_step``;
a round's wall time is then the interval between two reads); prompt lookup
without a rule (k <= 4); the cost-aware window. For the drafting rounds the host
time is split by phase (``--phases``): the rule, drafting, checkpoint, the verify
forward's graph building, acceptance, the per-row rollback, its hand-over to the
device (submit), the draft model's settle, the new records, the rest of ``step``;
and the sync inside ``step``.
With ``--profile``, the top Python functions of the lookup rounds (cProfile).

``--tiny``: a random llama with the real model's 30 layers and attention geometry
(9 query heads, 3 KV heads, head dim 64) and hidden size 64 (as
``shared_prefix.py --part host --tiny``), so the host work is the real model's
without its compute; prompts of ``--prompt-tokens`` tokens, repeating.

    python benchmarks/speculative_host.py --batch 8 --rounds 40
    python benchmarks/speculative_host.py --tiny --batch 8 --rounds 60 --repeat 3 \
        --plain-only --pipelined
    python benchmarks/speculative_host.py --tiny --batch 8 --rounds 40 --phases
    python benchmarks/speculative_host.py --tiny --batch 8 --rounds 60 --repeat 3 \
        --plain-only --pipelined --asked
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import random
import statistics
import time
import types

import mlx.core as mx
import speculative as bench  # benchmarks/speculative.py: the model and prompts

from kvstate import mlx_lm as br
from kvstate.speculative import rounds as sp
from kvstate.speculative import window as _window
from kvstate.speculative.drafts import Lookup

WAIT = [0.0]
_eval = mx.eval


def timed_eval(*args, **kw):
    t0 = time.perf_counter()
    _eval(*args, **kw)
    WAIT[0] += time.perf_counter() - t0


DRAFTER: list = [Lookup()]  # what the speculative rounds draft with (--draft-layers)
PHASES: collections.Counter = collections.Counter()  # phase -> host seconds (sync excluded)


def phased(name, fn):
    """``fn`` whose host seconds (less any sync inside it) add to ``PHASES[name]``."""

    def run(*a, **kw):
        t0, w0 = time.perf_counter(), WAIT[0]
        try:
            return fn(*a, **kw)
        finally:
            PHASES[name] += (time.perf_counter() - t0) - (WAIT[0] - w0)

    return run


def instrument(model, forward=None):
    """Wrap the library's round phases (module attributes ``speculative.step`` looks
    up at call time); returns the verify ``forward`` (``forward``, default the eager
    one) to pass to ``step``."""
    sp.ops = types.SimpleNamespace(
        **{k: getattr(sp.ops, k) for k in dir(sp.ops) if not k.startswith("__")}
    )
    sp.ops.checkpoint = phased("checkpoint", sp.ops.checkpoint)
    sp.bridge = types.SimpleNamespace(
        **{k: getattr(sp.bridge, k) for k in dir(sp.bridge) if not k.startswith("__")}
    )
    sp.bridge.rollback = phased("rollback", sp.bridge.rollback)
    for name, phase in (
        ("_asked", "rule"),
        ("_propose_lookup", "draft"),
        ("_catch_up", "draft"),
        ("_propose_model", "draft"),
        ("accept_greedy", "acceptance"),
        ("accept_sampled", "acceptance"),
        ("_settle_model", "settle"),
        ("derived", "records"),
        ("_submit", "submit"),
    ):
        setattr(sp, name, phased(phase, getattr(sp, name)))
    for name in ("observe", "record"):
        setattr(_window.Window, name, phased("rule", getattr(_window.Window, name)))
    return phased("verify call", forward or sp.eager(model))


def _contrary_call(self, *args, **kw):
    """A draft model's forward with its logits rolled by one (``--contrary``)."""
    return mx.roll(super(type(self), self).__call__(*args, **kw), 1, axis=-1)


def rounds_plain(model, prompts, n, pipelined=False):
    logits, states = br.prefill(model, prompts)
    y = mx.argmax(logits, axis=-1)
    mx.eval(y, states)
    out, last = [], None
    for _ in range(n):
        WAIT[0] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        logits, states = br.step(model, y, states)
        y = mx.argmax(logits, axis=-1)
        if pipelined:  # this step to the device, then the one before it read
            mx.async_eval(y)
            if last is not None:
                t1 = time.perf_counter()
                last.tolist()  # waits for the step before (tolist syncs): timed as a wait
                WAIT[0] += time.perf_counter() - t1
            last = y
        else:
            mx.eval(y)
            y.tolist()
        out.append((time.perf_counter() - t0, WAIT[0], time.thread_time() - c0, 1))
    return out


def rounds_spec(model, prompts, n, window, profile=None, pipelined=False, forward=None):
    kw = {} if window is None else {"window": window}
    drafter = DRAFTER[0]
    spec = sp.start(model, prompts, drafter=drafter, num_draft=4, **kw)
    mx.eval(spec.states)
    out, last = [], None
    for _ in range(n):
        WAIT[0] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        w0 = sum(PHASES.values())
        if profile is not None:
            profile.enable()
        spec, r = sp.step(model, spec, drafter=drafter, forward=forward)
        if pipelined:  # as rounds_plain: this round to the device, the one before read
            mx.async_eval(spec.batch.tokens)
            if last is not None:
                _ = last.emitted  # the read
            last = r
        else:
            _ = r.emitted  # read, as a plain loop's tolist (after spec is rebound)
        if profile is not None:
            profile.disable()
        dt = time.perf_counter() - t0
        out.append((dt, WAIT[0], time.thread_time() - c0, r.width, sum(PHASES.values()) - w0))
    return out


def rounds_forward(model, prompts, n, W, forward=None):
    """The verify forward alone: ``[B, W]`` tokens through ``kvstate.mlx_lm.forward``
    (or ``forward``: ``--compiled``) from the same prefilled records each time (held,
    as a round's input records are held by its caller), the argmax, evaluated: the
    device cost of a W-wide window without any speculation bookkeeping (``W = 1``: a
    decode step). Host ms is the graph building; sync ms the wait in ``mx.eval``
    (the kernels' launch and the device's run)."""
    logits, states = br.prefill(model, prompts)
    mx.eval(logits, states)
    tokens = mx.zeros((len(prompts), W), mx.uint32)
    run = forward or (lambda t, s: br.forward(model, t, s))
    out = []
    for _ in range(n):
        WAIT[0] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        logits, new = run(tokens, list(states))
        mx.eval(mx.argmax(logits, axis=-1))
        out.append((time.perf_counter() - t0, WAIT[0], time.thread_time() - c0, W))
    return out


def linear_rows(model, M, reps):
    """Median us of each linear layer of the first layer applied to ``M`` rows
    (``[M, in]``), evaluated alone: a verify window of ``B x W`` tokens runs every
    matmul of the model at ``M = B x W`` rows (on CUDA a quantized matmul picks its
    kernel by ``M``)."""
    layer = model.model.layers[0]
    fs = {
        "q": layer.self_attn.q_proj,
        "k": layer.self_attn.k_proj,
        "v": layer.self_attn.v_proj,
        "o": layer.self_attn.o_proj,
        "gate": layer.mlp.gate_proj,
        "up": layer.mlp.up_proj,
        "down": layer.mlp.down_proj,
    }
    out = {}
    for name, f in fs.items():
        quantized = hasattr(f, "bits")
        width = f.weight.shape[1] * (32 // f.bits) if quantized else f.weight.shape[1]
        dtype = f.scales.dtype if quantized else f.weight.dtype
        x = mx.random.normal((M, width)).astype(dtype)
        _eval(x)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _eval(f(x))
            ts.append((time.perf_counter() - t0) * 1e6)
        out[name] = statistics.median(ts)
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


def show_phases(name, rows, n):
    """Mean host ms per round of each phase over the ``n`` rounds just run."""
    host = sum((r[0] - r[1]) for r in rows) * 1e3 / n
    parts = {k: v * 1e3 / n for k, v in PHASES.items()}
    rest = host - sum(parts.values())
    text = ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    sync = sum(r[1] for r in rows) * 1e3 / n
    print(f"  phases of {name} (host ms a round, mean): {text}, rest {rest:.2f}; sync {sync:.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=bench.GGUF)
    ap.add_argument("--tiny", action="store_true", help="the real geometry, hidden 64, random")
    ap.add_argument("--quantized", action="store_true", help="keep the GGUF's 4-bit layers")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--kind", default="rewrite")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases", action="store_true", help="split drafting rounds by phase")
    ap.add_argument("--repeat", type=int, default=1, help="plain step / plain round pairs")
    ap.add_argument("--plain-only", action="store_true", help="only the plain step / round pairs")
    ap.add_argument("--pipelined", action="store_true", help="also the pipelined pairs")
    ap.add_argument(
        "--widths", type=int, nargs="*", default=[], help="also rounds of exactly these widths"
    )
    ap.add_argument(
        "--forward-widths", type=int, nargs="*", default=[], help="the bare verify forward first"
    )
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="draft with the target's first N layers instead of prompt lookup (a random "
        "--tiny model's output never repeats its prompt: lookup finds nothing to draft)",
    )
    ap.add_argument(
        "--contrary",
        action="store_true",
        help="--draft-layers: the draft's logits rolled by one, so every draft is rejected "
        "(a random model repeats its input token: the target's own layers always agree)",
    )
    ap.add_argument(
        "--linear-rows", type=int, nargs="*", default=[], help="time the linears at M rows"
    )
    ap.add_argument(
        "--probe-only", action="store_true", help="only --forward-widths and --linear-rows"
    )
    ap.add_argument(
        "--asked",
        action="store_true",
        help="also pipelined rounds whose rule asks every row for lookup drafts that are "
        "not found (prompts of distinct trigrams, Lookup(min_ngram=3)): each ends plain",
    )
    bench.dtype_option(ap)
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="the target's forward (probes and rounds) through one compiled Decoder",
    )
    ap.add_argument("--tiny-layers", type=int, default=30, help="--tiny: its layers")
    ap.add_argument("--prompt-tokens", type=int, default=300, help="--tiny: prompt length")
    args = ap.parse_args(argv)
    if args.tiny or args.model == "tiny":
        from kvstate.models.load import tiny_llama

        model = tiny_llama(
            0, layers=args.tiny_layers, hidden=64, heads=9, kv_heads=3, head_dim=64, vocab=512
        )
        prompts = [
            [(7 * b + 3 * (i % 40)) % 500 + 1 for i in range(args.prompt_tokens)]
            for b in range(args.batch)
        ]
        args.kind = f"tiny llama {args.tiny_layers} layers, 9/3 heads, D=64, hidden 64"
    else:
        model, tok = bench.load(args.model, not args.quantized, args.dtype)
        texts = bench.KINDS[args.kind]
        prompts = [
            tok.chat([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(args.batch)
        ]
    if args.draft_layers:
        from kvstate.speculative.drafts import DraftModel, truncated

        draft = truncated(model, args.draft_layers)
        if args.contrary:  # every draft rejected: each round rolls back
            draft.__class__ = type("Contrary", (type(draft),), {"__call__": _contrary_call})
        DRAFTER[0] = DraftModel(draft)
    mx.eval = timed_eval  # every sync, including the library's, is timed
    sp.mx.eval = timed_eval
    compiled = sp.compiled(model) if args.compiled else None
    what = "quantized" if args.quantized else args.dtype
    print(
        f"B={args.batch} kind={args.kind} rounds={args.rounds} device {mx.default_device()} "
        f"weights {what}{', compiled forward' if compiled else ''}"
    )
    print("method | wall ms | sync ms | host ms median [min-max] | thread CPU ms | widths")
    never = sp.Window(margin=float("inf"))
    for W in args.forward_widths:  # warm-up, then interleaved rounds of every width
        rounds_forward(model, prompts, 3, W, compiled)
    for _ in range(args.repeat if args.forward_widths else 0):
        for W in args.forward_widths:
            show(
                f"verify forward alone, W = {W}",
                rounds_forward(model, prompts, args.rounds, W, compiled),
            )
    for M in args.linear_rows:
        linear_rows(model, M, 3)  # warm-up
    for M in args.linear_rows:
        us = linear_rows(model, M, args.rounds)
        total = sum(us.values())
        parts = ", ".join(f"{k} {v:.0f}" for k, v in us.items())
        print(f"linears of layer 0 at M = {M} rows: {total:.0f} us ({parts})", flush=True)
    if args.probe_only:
        return
    rounds_plain(model, prompts, 3)
    rounds_plain(model, prompts, 3, True)
    rounds_spec(model, prompts, 3, None)
    rounds_spec(model, prompts, 3, never, pipelined=True)
    print("warm", flush=True)
    unmatched = [random.Random(b).sample(range(1, 500), len(p)) for b, p in enumerate(prompts)]
    drafter = DRAFTER[0]
    if args.asked:  # distinct tokens: no trigram repeats, so lookup finds nothing
        DRAFTER[0] = Lookup(min_ngram=3)
        rounds_spec(model, unmatched, 3, fixed(args.batch, 5), pipelined=True)
    for _ in range(args.repeat):  # interleaved: load drifts hit both alike
        show("plain step", rounds_plain(model, prompts, args.rounds))
        show("plain round (step, W = 1)", rounds_spec(model, prompts, args.rounds, never))
        if args.pipelined:
            show("plain step, pipelined", rounds_plain(model, prompts, args.rounds, True))
            show(
                "plain round, pipelined",
                rounds_spec(model, prompts, args.rounds, never, pipelined=True),
            )
        if args.asked:  # every row asked for a draft every round, none found
            show(
                "plain step, pipelined (unmatched prompts)",
                rounds_plain(model, unmatched, args.rounds, True),
            )
            show(
                "asked round, none found, pipelined",
                rounds_spec(model, unmatched, args.rounds, fixed(args.batch, 5), pipelined=True),
            )
    DRAFTER[0] = drafter
    if args.plain_only:
        return
    forward = instrument(model, compiled) if args.phases else compiled
    prof = cProfile.Profile() if args.profile else None
    PHASES.clear()
    rows = rounds_spec(model, prompts, args.rounds, None, prof, forward=forward)
    source = "draft-model" if args.draft_layers else "lookup"
    show(f"{source} round (k<=4)", rows)
    if args.phases:
        show_phases(f"{source} round (k<=4)", rows, args.rounds)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    PHASES.clear()
    rows = rounds_spec(model, prompts, args.rounds, sp.Window(), forward=forward)
    show("cost-aware round", rows)
    if args.phases:
        show_phases("cost-aware round", rows, args.rounds)
    for W in args.widths:  # every round W wide (where lookup finds W - 1 tokens)
        PHASES.clear()
        rows = rounds_spec(model, prompts, args.rounds, fixed(args.batch, W), forward=forward)
        show(f"{W}-wide round", rows)
        if args.phases:
            show_phases(f"{W}-wide round", rows, args.rounds)


def fixed(B, W):
    """A window rule that picks width ``W`` whenever the drafts allow: every other
    width priced out, rows' acceptance pinned at 1 (a prior no evidence moves)."""
    costs = {(_window.bucket(B), w): (1.0 if w in (1, W) else 1e9,) * 3 for w in range(1, 9)}
    return sp.Window(costs=costs, prior=1.0, weight=1e12, stale=10**9)


if __name__ == "__main__":
    main()
