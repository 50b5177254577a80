"""Batched speculative decoding against batched plain decoding, same process.

For each prompt kind (where prompt lookup pays: rewrite, code edit,
summarize; where it does not: open-ended writing) and each batch size, the
script times, in paired rounds whose order alternates:

* plain: ``kvstate.mlx_lm.prefill`` then one ``step`` per token (greedy);
* lookup: ``kvstate.speculative.rounds`` with prompt lookup (``Lookup``), every row
  drafting up to its adapted ``num_draft`` each round (no window rule);
* lookup cost: the same with the cost-aware window (``Window``);
* lookup entry: the same with ``Window(hysteresis=True)`` (entering drafting
  priced apart from staying in it);
* lookup fresh: the same as lookup cost with a new ``Window`` for each prompt kind
  and batch size (what one ``kvstate generate`` process has: no round costs
  measured under another kind's mix);
* draft cost: a draft model (the target's first ``--draft-layers`` layers)
  with the cost-aware window (``draft``: without it, with ``--fixed-draft``);

and, as the anchor at B = 1, mlx-lm's own single-stream generation on the
same prompt (``generate_step`` and ``speculative_generate_step`` with the
same draft model; mlx-lm 0.32.2 has no prompt lookup). Every speculative run
must give exactly the plain run's tokens (greedy); the script exits non-zero
if not. Decode time only (after prefill); ``T`` new tokens per row, EOS
ignored. A cost-aware method keeps one ``Window`` for the whole process
(what a server does: its measured round costs carry from the warm-up runs
and earlier runs on the same device into later ones; rows start at the
prior acceptance every run); its measured cost ratios are printed at the end.
Acceptance, tokens per round and the share of plain rounds are summed over
the timed runs (not the warm-up).

Both loops are pipelined as mlx-lm's ``generate_step``: each step (round) is
handed to the device (``mx.async_eval``) before the one before it is read, so
the host builds step n + 1 while the device runs step n (a drafting round reads
its acceptance inside ``speculative.step``; a plain round does not).

The fixed batch above is the issue's measure (B rows, each to ``T`` tokens: the
run ends with its slowest row). With ``--stream S`` (B > 1) each method also
runs continuous batching (``... stream``): ``S x B`` prompts (the batch's,
cycled), B rows at a time; a row with ``T`` tokens leaves and the next prompt
joins (``speculative.leave``/``join``; the plain loop ``filter_rows``/
``merge_rows``), prefills done before the clock; tokens/s counts ``T`` per
prompt over the whole stream, against the plain loop doing the same
(``notes/speculative.md``: why both).

    python -m benchmarks speculative --rounds 5 --tokens 64
    python -m benchmarks speculative --batch 8 --kinds "code edit" --stream 2

``--compiled``: the target's plain steps (plain loop) and verify windows (every
speculative method) run through one compiled ``Decoder`` (the draft model and
mlx-lm's loops as before): a drafting round builds its graph while the device
waits (it cannot pipeline), and the compiled step builds it in a fraction of the
eager forward's host time.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import attrs
import mlx.core as mx

from benchmarks import _common as common
from kvstate import mlx_lm as br
from kvstate.core import ops
from kvstate.speculative import rounds as sp
from kvstate.speculative.drafts import DraftModel, Lookup, truncated

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the new budget. Members argued about "
    "the cost of repairing the old bridge, and several residents spoke about the need for "
    "more parks. In the end the council agreed to delay the vote until next month.",
    "Our team released version two of the app last week. It adds offline mode, a dark theme "
    "and faster search. Users reported a few bugs with notifications, which we plan to fix "
    "in the next update.",
    "The museum will open a new exhibition about ancient Egypt in May. Visitors will see "
    "statues, jewelry and a real mummy. Tickets cost ten dollars for adults and are free "
    "for children under twelve.",
    "Maria started running three years ago. At first she could only run for five minutes, "
    "but she kept practicing every morning. Last Sunday she finished her first marathon in "
    "four hours and twelve minutes.",
]

CODE = [
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n"
    "    return result\n\n\ndef average(items):\n    if not items:\n        return 0\n"
    "    return total(items) / len(items)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def empty(self):\n        return not self.items\n",
    "def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    config = {}\n    for line in lines:\n        key, value = line.split('=')\n"
    "        config[key.strip()] = value.strip()\n    return config\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\nprint([fib(i) for i in range(10)])\n",
]

KINDS = {
    "rewrite": [
        f"Rewrite this paragraph exactly, but in the past tense:\n\n{p}" for p in PARAGRAPHS
    ],
    "code edit": [
        f"Add a docstring to every function in this code and return the whole code:\n\n{c}"
        for c in CODE
    ],
    "summarize": [
        f"Summarize this text in two sentences, reusing its words:\n\n{p}" for p in PARAGRAPHS
    ],
    "open": [
        "Write a short poem about the sea.",
        "Tell me a story about a brave cat.",
        "What are three fun facts about space?",
        "Describe your ideal weekend.",
    ],
}


def load(path, dequantize, dtype="float32"):
    """The model and tokenizer: its 4-bit layers kept, or dequantized to ``dtype``."""
    loaded = common.real(path, quantized=not dequantize, dtype=dtype)
    return loaded.model, loaded.tokenizer


PREFILLED: dict = {}  # (what, prompts) -> a prefill done once, reused by every run


def prefilled(what, prompts, make, arrays):
    """``make()`` once per ``(what, prompts)``, its ``arrays(result)`` evaluated: every
    run of a kind starts from the same prefill (kvstate's records are immutable, so
    no run can change it; mlx-lm's caches are copied per run, ``_fork``). Decode
    time is what is timed; this keeps a CPU run's wall time small (a B = 8 prefill
    there takes tens of seconds)."""
    key = (what, tuple(map(tuple, prompts)))
    if key not in PREFILLED:
        PREFILLED[key] = out = make()
        mx.eval(arrays(out))
    return PREFILLED[key]


def _record_arrays(states):
    return [v for s in states for v in attrs.astuple(s, recurse=False) if isinstance(v, mx.array)]


def started(model, prompts, k, draft=None):
    """The rows prefilled and their first token sampled (``speculative.start``), with
    the draft model's records when ``draft`` is given: one target prefill per prompt
    set, shared by the plain loop and every speculative method."""
    spec = prefilled(
        "target",
        prompts,
        lambda: sp.start(model, prompts, num_draft=k),
        lambda s: [s.batch.tokens, s.batch.keys, *_record_arrays(s.states)],
    )
    if draft is None:
        return spec
    states = prefilled("draft", prompts, lambda: br.prefill(draft, prompts)[1], _record_arrays)
    return attrs.evolve(spec, draft_states=states)


def plain_run(model, prompts, T, k):
    """The plain greedy loop over one fixed batch, pipelined as mlx-lm's
    ``generate_step``: each step is handed to the device (``mx.async_eval``) before
    the step before it is read, so the host builds step n + 1 while the device runs
    step n (``plain_stream`` with every prompt in the batch: no row joins)."""
    return plain_stream(model, prompts, len(prompts), T, k)


WINDOWS: dict = {}  # method -> the Window it carries through the process
RULES: dict = {"lookup entry": {"hysteresis": True}}  # method -> its Window's options
FRESH = ("lookup fresh",)  # methods whose Window starts anew at each kind and batch size
TIMELINE: list = []  # per spec_run: [(drafted, seconds)] per loop iteration (--timeline)

FORWARD: list = [None]  # --compiled: the target's one Decoder (both loops; speculative.step's
# forward), else None (its default, the eager forward)


def _step(model, y, states):
    """A plain decode step: ``kvstate.mlx_lm.step``, or the compiled decoder."""
    dec = FORWARD[0]
    return br.step(model, y, states) if dec is None else dec(y, states)


def spec_run(model, prompts, T, drafter, k, window=None):
    draft = drafter.model if isinstance(drafter, DraftModel) else None
    batch = started(model, prompts, k, draft)  # prefills done before the clock, once
    if window is not None:  # a fresh batch carrying the method's rule
        batch = attrs.evolve(
            batch, window=WINDOWS.setdefault(window, sp.Window(**RULES.get(window, {})))
        )
    drafted = accepted = rounds = plain = 0
    made = [1] * len(prompts)  # tokens per row so far (the first came with the prefill)
    row_drafts, row_done = [0] * len(prompts), [0] * len(prompts)  # per row (--rows)
    t0, last = time.perf_counter(), None
    marks = []  # (drafted, seconds) per loop iteration (--timeline)
    while min(made) < T:
        # pipelined as plain_run: the round handed to the device, then the one before
        # it read (a plain round's tokens: a drafting round's are read inside step)
        t1 = time.perf_counter()
        batch, r = sp.step(model, batch, drafter=drafter, forward=FORWARD[0])
        mx.async_eval(batch.batch.tokens)
        if last is not None:
            _ = last.emitted  # the read
        marks.append((r.width > 1, time.perf_counter() - t1))
        for b, n in enumerate(made):  # per row: rounds it drafted in, rounds to T
            if n < T:
                row_drafts[b] += r.drafted[b] > 0
                row_done[b] += 1
        made = [n + 1 + a for n, a in zip(made, r.accepted)]  # a row emits 1 + accepted
        drafted, accepted, rounds = drafted + sum(r.drafted), accepted + sum(r.accepted), rounds + 1
        plain += r.width == 1
        last = r
    if last is not None:
        _ = last.emitted  # the read
    dt = time.perf_counter() - t0
    if window is not None:
        WINDOWS[window] = sp.recorded(batch)  # with its last plain round
    TIMELINE.append(marks)
    out = [list(c[len(p) : len(p) + T]) for c, p in zip(batch.context, prompts)]
    return dt, out, (drafted, accepted, rounds, plain, tuple(zip(row_drafts, row_done)))


def _finish(out, rows, made, T, ctx, queue):
    """Rows with ``T`` tokens leave: their tokens into ``out`` (by queue index);
    returns the rows that stay."""
    keep = []
    for i, (q, n) in enumerate(zip(rows, made)):
        if n >= T:
            p = queue[q]
            out[q] = list(ctx[i][len(p) : len(p) + T])
        else:
            keep.append(i)
    return keep


def plain_stream(model, queue, B, T, k):
    """Continuous batching, plain: ``B`` rows decode (pipelined as ``plain_run``);
    a row with ``T`` tokens leaves and the next prompt of ``queue`` joins (its
    prefill done before the clock, ``started``), until every prompt has ``T``
    tokens. Returns the seconds, each prompt's tokens and no stats."""
    firsts = [started(model, [p], k) for p in queue]
    rows, nxt = list(range(min(B, len(queue)))), min(B, len(queue))
    states = ops.merge_rows([list(firsts[q].states) for q in rows])
    y = mx.concatenate([firsts[q].batch.tokens for q in rows])
    ctx = [list(queue[q]) + firsts[q].batch.tokens.tolist() for q in rows]
    made, out = [1] * len(rows), {}
    t0, last = time.perf_counter(), None
    while rows:
        logits, states = _step(model, y, states)
        y = mx.argmax(logits, axis=-1)
        mx.async_eval(y)
        if last is not None:
            for c, t in zip(ctx, last.tolist()):
                c.append(t)
        last, made = y, [n + 1 for n in made]
        if min(made) < T:
            continue
        for c, t in zip(ctx, y.tolist()):
            c.append(t)
        last = None
        keep = _finish(out, rows, made, T, ctx, queue)
        new = list(range(nxt, min(nxt + len(rows) - len(keep), len(queue))))
        nxt += len(new)
        if keep:
            states, y = ops.filter_rows(states, keep), y[mx.array(keep)]
        parts = ([states] if keep else []) + [list(firsts[q].states) for q in new]
        if parts:
            states = ops.merge_rows(parts)
            y = mx.concatenate(([y] if keep else []) + [firsts[q].batch.tokens for q in new])
        rows = [rows[i] for i in keep] + new
        made = [made[i] for i in keep] + [1] * len(new)
        ctx = [ctx[i] for i in keep] + [
            list(queue[q]) + firsts[q].batch.tokens.tolist() for q in new
        ]
    return time.perf_counter() - t0, [out[q] for q in range(len(queue))], None


def spec_stream(model, queue, B, T, drafter, k, window=None):
    """Continuous batching, speculative (pipelined as ``spec_run``): rows with ``T``
    tokens leave (``speculative.leave``), the next prompts join (``speculative.join``)."""
    draft = drafter.model if isinstance(drafter, DraftModel) else None
    firsts = [started(model, [p], k, draft) for p in queue]
    rows, nxt = list(range(min(B, len(queue)))), min(B, len(queue))
    batch = firsts[rows[0]]
    if rows[1:]:
        batch = sp.join(batch, *(firsts[q] for q in rows[1:]))
    if window is not None:
        batch = attrs.evolve(
            batch, window=WINDOWS.setdefault(window, sp.Window(**RULES.get(window, {})))
        )
    drafted = accepted = rounds = plain = 0
    made, out = [1] * len(rows), {}
    t0, last = time.perf_counter(), None
    while rows:
        batch, r = sp.step(model, batch, drafter=drafter, forward=FORWARD[0])
        mx.async_eval(batch.batch.tokens)
        if last is not None:
            _ = last.emitted  # the read
        made = [n + 1 + a for n, a in zip(made, r.accepted)]
        drafted, accepted, rounds = drafted + sum(r.drafted), accepted + sum(r.accepted), rounds + 1
        plain += r.width == 1
        last = r
        if min(made) < T:
            continue
        last = None
        keep = _finish(out, rows, made, T, batch.context, queue)
        new = list(range(nxt, min(nxt + len(rows) - len(keep), len(queue))))
        nxt += len(new)
        if keep:  # the rule and its unrecorded rounds stay with the rows
            batch = sp.leave(batch, keep)
        else:  # the batch empties: the rule keeps its last rounds' costs
            rule, batch = sp.recorded(batch), None
            if window is not None:
                WINDOWS[window] = rule
        joining = [firsts[q] for q in new]  # one merge for all of them, as plain's
        if batch is None and joining:
            batch, joining = joining[0], joining[1:]
            if window is not None:
                batch = attrs.evolve(batch, window=WINDOWS[window])
        if joining:
            batch = sp.join(batch, *joining)
        rows = [rows[i] for i in keep] + new
        made = [made[i] for i in keep] + [1] * len(new)
    return (
        time.perf_counter() - t0,
        [out[q] for q in range(len(queue))],
        (
            drafted,
            accepted,
            rounds,
            plain,
        ),
    )


def _mlx_lm_prefill(model, prompt):
    """mlx-lm's caches for ``model`` holding ``prompt[:-1]`` (as its generators fill them)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    return cache


def _fork(cache):
    """A copy of an mlx-lm cache layer: its own array objects (its in-place slice
    writes then copy instead of writing into the shared prefill)."""
    out = copy.copy(cache)
    out.keys, out.values = mx.array(cache.keys), mx.array(cache.values)
    return out


def mlx_lm_run(model, prompt, T, draft=None, k=3):
    from mlx_lm.generate import generate_step, speculative_generate_step

    # mlx-lm prefills prompt[:-1] into its cache, then runs the last token: the
    # prefill is done once here and each run gets a copy of the caches.
    models = {"mlx-lm target": model, "mlx-lm draft": draft}
    cache = [
        _fork(c)
        for what, m in models.items()
        if m is not None
        for c in prefilled(
            what, [prompt], lambda m=m: _mlx_lm_prefill(m, prompt), lambda cs: [c.state for c in cs]
        )
    ]
    p = mx.array(prompt[-1:])
    gen = (
        generate_step(p, model, max_tokens=T, prompt_cache=cache)
        if draft is None
        else speculative_generate_step(
            p, model, draft, num_draft_tokens=k, max_tokens=T, prompt_cache=cache
        )
    )
    out, t0, from_draft = [], None, 0
    for item in gen:
        out.append(int(item[0]))
        if t0 is None:
            t0 = time.perf_counter()  # first token: prefill done
        elif draft is not None:
            from_draft += bool(item[2])
    dt = time.perf_counter() - t0
    if draft is None:
        return dt, out, None
    rounds = len(out) - 1 - from_draft  # each round ends with one target token
    return dt, out, (rounds * k, from_draft, rounds, 0)


def methods_for(model, draft, prompts, n, k, with_draft, fixed_draft, stream=0):
    """The timed runs, by name: each returns ``(seconds, tokens per row, stats)``.
    With ``stream``: also continuous batching over ``stream`` prompts (the batch's
    prompts cycled), ``B = len(prompts)`` rows at a time, as ``... stream``."""
    ms = {
        "plain": lambda: plain_run(model, prompts, n, k),
        "lookup": lambda: spec_run(model, prompts, n, Lookup(), k),
        "lookup cost": lambda: spec_run(model, prompts, n, Lookup(), k, "lookup cost"),
        "lookup entry": lambda: spec_run(model, prompts, n, Lookup(), k, "lookup entry"),
        "lookup fresh": lambda: spec_run(model, prompts, n, Lookup(), k, "lookup fresh"),
    }
    if with_draft:
        if fixed_draft:
            ms["draft"] = lambda: spec_run(model, prompts, n, DraftModel(draft), k)
        ms["draft cost"] = lambda: spec_run(model, prompts, n, DraftModel(draft), k, "draft cost")
    if stream and len(prompts) > 1:  # (one row at a time: the fixed batch, prompt by prompt)
        B, queue = len(prompts), [prompts[i % len(prompts)] for i in range(stream)]
        ms["plain stream"] = lambda: plain_stream(model, queue, B, n, k)
        ms["lookup stream"] = lambda: spec_stream(model, queue, B, n, Lookup(), k)
        ms["lookup cost stream"] = lambda: spec_stream(
            model, queue, B, n, Lookup(), k, "lookup cost"
        )
        if with_draft:
            ms["draft cost stream"] = lambda: spec_stream(
                model, queue, B, n, DraftModel(draft), k, "draft cost"
            )
    if with_draft and len(prompts) == 1:
        ms["mlx-lm plain"] = lambda: mlx_lm_run(model, prompts[0], n)
        ms["mlx-lm draft"] = lambda: mlx_lm_run(model, prompts[0], n, draft, k)
    return ms


def show_windows(kind, B, k):
    """What each method's window rule has measured at ``B`` so far on this device:
    a round's cost by width, in plain rounds of the same batch bucket, and the
    price the rule reads for every width (measured, stale or modelled)."""
    for name, w in WINDOWS.items():
        ratios = ", ".join(
            f"W={W}: {w.cost(B, W):.2f}" for W in range(2, k + 2) if w.measured(B, W) is not None
        )
        entering = ", ".join(  # under hysteresis: entering drafting, where measured
            f"W={W}: {w.cost(B, W, entry=True):.2f}"
            for W in range(2, k + 2)
            if w.hysteresis and w.measured(B, W, entry=True) is not None
        )
        ratios = "; entering ".join(x for x in (ratios or "none", entering) if x)
        base = w.measured(B, 1)
        priced = " ".join(f"{w.cost(B, W):.2f}" for W in range(2, k + 2))  # what choose reads
        print(
            f"  window after {kind} B={B}, {name}: plain round "
            f"{base * 1e3 if base else float('nan'):.1f} ms; measured cost in plain rounds: "
            f"{ratios if ratios != 'none' else 'no wider width measured'}; "
            f"priced W=2..{k + 1}: {priced}",
            flush=True,
        )


def show_rows(kind, B, T, plain_s, rows_seen):
    """Where a fixed batch's ratio comes from: ``x plain = (plain rounds / rounds) x
    (plain round / round)``. A run takes as many rounds as its slowest row needs;
    per row, the share of its rounds (until it has ``T`` tokens) in which it drafted
    and its tokens per round. Medians over the timed runs; the plain loop takes
    ``T - 1`` rounds (the first token comes with the prefill)."""
    for m, runs in rows_seen.items():
        rounds = [max(n for _, n in rows) for _, rows in runs]
        per_round = [s / n for (s, _), n in zip(runs, rounds)]
        plain_round = plain_s / (T - 1)
        tried = [sum(rows[b][0] for _, rows in runs) for b in range(B)]
        took = [max(1, sum(rows[b][1] for _, rows in runs)) for b in range(B)]
        drafted = [f"{d / n:.0%}" for d, n in zip(tried, took)]
        speed = [f"{(T - 1) * len(runs) / n:.2f}" for n in took]
        print(
            f"  rows {kind} B={B} {m}: rounds per run {statistics.median(rounds):.1f} "
            f"(plain {T - 1}): rounds saved x{(T - 1) / statistics.median(rounds):.2f}; "
            f"a round costs {statistics.median(per_round) / plain_round:.2f} plain rounds "
            f"({statistics.median(per_round) * 1e3:.1f} ms; plain {plain_round * 1e3:.1f} ms); "
            f"per row, rounds with a draft: {' '.join(drafted)}; tokens per round: "
            f"{' '.join(speed)}",
            flush=True,
        )


def show_timeline(kind, B, m, runs, plain_round):
    """Where a fixed batch's time goes, by a round's place in the run (``--timeline``):
    a loop iteration (build this round, hand it over, read the one before) by what
    it is and what came before it: ``P`` plain, ``D`` drafting; ``DP`` the plain
    round right after a drafting one, ``DPP`` the one after that. Per class: rounds
    per run, median ms, and the class's time over as many plain-loop rounds
    (``extra``, ms per run): what the transitions cost."""
    classes: dict = {}
    for marks in runs:
        prev = ""
        for drafted, dt in marks:
            name = "D" if drafted else "P"
            cls = (prev[-2:] if prev.endswith("DP") else prev[-1:]) + name
            cls = cls if cls in ("PP", "PD", "DD", "DP", "DPP") else name
            classes.setdefault(cls, []).append(dt)
            prev += name
    n = len(runs)
    parts = []
    for cls in ("PP", "DPP", "DP", "PD", "DD", "P", "D"):
        ts = classes.get(cls)
        if ts:
            extra = (sum(ts) - len(ts) * plain_round) / n
            parts.append(
                f"{cls} {len(ts) / n:.1f}/run {statistics.median(ts) * 1e3:.1f} ms "
                f"(extra {extra * 1e3:+.1f} ms)"
            )
    print(
        f"  timeline {kind} B={B} {m} (plain loop {plain_round * 1e3:.1f} ms a round): "
        + "; ".join(parts),
        flush=True,
    )


def dtype_option(ap):
    """``--dtype``: the dequantized weights' type (without ``--quantized``)."""
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="without --quantized: the dequantized weights' type",
    )


def spread(xs):
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a .gguf or mlx-lm directory (default: SmolLM2-135M)")
    ap.add_argument("--quantized", action="store_true", help="keep the GGUF's 4-bit layers")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--no-draft", action="store_true", help="prompt lookup only (no draft model)")
    ap.add_argument(
        "--fixed-draft", action="store_true", help="also the draft model without the window rule"
    )
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument(
        "--stream",
        type=int,
        default=0,
        help="also continuous batching over STREAM x B prompts, B > 1 rows at a time (0: off)",
    )
    ap.add_argument("--methods", nargs="*", help="run only these methods (default: all)")
    ap.add_argument(
        "--rows",
        action="store_true",
        help="per speculative method: rounds saved, a round's cost, and per row the share "
        "of rounds with a draft and tokens per round (fixed batch)",
    )
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="the target's steps and verify windows through one compiled Decoder (both loops)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="per speculative method (fixed batch): each loop iteration's time by its place "
        "(plain or drafting, after which), and what the transitions cost",
    )
    dtype_option(ap)
    args = ap.parse_args(argv)
    model, tok = load(args.model, not args.quantized, args.dtype)
    if args.compiled:
        from kvstate.bridge.decoder import Decoder

        FORWARD[0] = Decoder(model)
    draft = truncated(model, args.draft_layers)
    T, k = args.tokens, args.num_draft
    print(
        f"model {args.model} ({'quantized' if args.quantized else args.dtype}), "
        f"{T} new tokens per row, {args.rounds} paired rounds, num_draft {k}, draft = first "
        f"{args.draft_layers} layers; device {mx.default_device()}"
        f"{'; target through one compiled Decoder' if args.compiled else ''}"
    )
    head = (
        "kind",
        "B",
        "method",
        "tok/s",
        "x plain (median [min-max])",
        "acceptance",
        "tok/round",
        "plain rounds",
    )
    print(" | ".join(head))
    bad = 0
    for kind in args.kinds:
        texts = KINDS[kind]
        for B in args.batch:
            prompts = [
                tok.chat([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(B)
            ]
            Q = args.stream * B

            def chosen(n, prompts=prompts, Q=Q):
                ms = methods_for(
                    model, draft, prompts, n, k, not args.no_draft, args.fixed_draft, Q
                )
                return {m: f for m, f in ms.items() if not args.methods or m in args.methods}

            for m in FRESH:  # a new rule for this kind and batch size (warm-up included)
                WINDOWS.pop(m, None)
            for f in chosen(args.warmup_tokens).values():  # warm-up: a short run of each
                f()
            methods = chosen(T)
            times = {m: [] for m in methods}
            stats: dict = {}
            rows_seen: dict = {}  # method -> [(seconds, per-row stats)] of the timed runs
            timelines: dict = {}  # method -> [TIMELINE entry] of the timed runs
            refs: dict = {}  # "plain" / "plain stream" -> its tokens this round
            for r in range(args.rounds):
                names = list(methods) if r % 2 == 0 else list(methods)[::-1]
                for m in names:
                    TIMELINE.clear()
                    dt, out, st = methods[m]()
                    if TIMELINE and not m.endswith("stream"):
                        timelines.setdefault(m, []).append(TIMELINE[-1])
                    print(f"  {kind} B={B} round {r} {m}: {dt:.2f} s", file=sys.stderr, flush=True)
                    times[m].append(dt)
                    if st is not None:  # summed over the timed runs
                        stats[m] = tuple(a + b for a, b in zip(stats.get(m, (0,) * 4), st))
                        if len(st) > 4:  # per row: (rounds drafted in, rounds to T)
                            rows_seen.setdefault(m, []).append((dt, st[4]))
                    what = "plain stream" if m.endswith("stream") else "plain"
                    ref = refs.get(what)
                    if m == what:
                        refs[what] = out
                    elif not m.startswith("mlx-lm") and ref is not None and out != ref:
                        print(f"MISMATCH: {kind} B={B} {m} differs from {what}", file=sys.stderr)
                        bad += 1
                    elif m.startswith("mlx-lm") and ref is not None and out != ref[0]:
                        # reported, not fatal: a near-tie may flip across implementations
                        print(f"note: {kind} B={B} {m} tokens differ from plain", file=sys.stderr)
            for m, ts in times.items():
                base = "mlx-lm plain" if m == "mlx-lm draft" else "plain"
                base = "plain stream" if m.endswith("stream") else base
                if base not in times:
                    continue
                ratios = [b / t for b, t in zip(times[base], ts)]
                d, a, n, p = stats.get(m, (0, 0, 0, 0))
                rows = Q if m.endswith("stream") else B  # tokens counted: T per prompt
                acc = f"{a / d:.0%} ({a}/{d})" if d else "-"
                per_round = f"{rows * T * len(ts) / n:.2f}" if n else "-"
                plain_share = f"{p / n:.0%}" if n and not m.startswith("mlx-lm") else "-"
                print(
                    f"{kind} | {B} | {m} | {rows * T / statistics.median(ts):.1f} | "
                    f"{spread(ratios)} | {acc} | {per_round} | {plain_share}",
                    flush=True,
                )
            if args.rows and "plain" in times:
                show_rows(kind, B, T, statistics.median(times["plain"]), rows_seen)
            if args.timeline and "plain" in times:
                for m, runs in timelines.items():
                    show_timeline(kind, B, m, runs, statistics.median(times["plain"]) / (T - 1))
            show_windows(kind, B, k)  # printed as it goes: a cut run keeps what it had
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
