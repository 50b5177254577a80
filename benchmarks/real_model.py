"""The real model (SmolLM2-135M-Instruct): prefill speed, weight format, KV quality.

Three measurements, each in one process on the same model object:

``prefill``: time to first token and prefill tokens/s of a batch of prompts.
Sides, interleaved in a rotating order every round: kvstate's batched
prefill (``kvstate.mlx_lm.prefill``: right-padded, chunked, trimmed, then
the last tokens as one step), kvstate one prompt at a time (``prefill`` of
each prompt alone, then ``merge_rows``: the previous behaviour), and
mlx-lm's ``BatchGenerator`` (insert the prompts with ``max_tokens=1``, call
``next_generated`` until every prompt has its first token). Each side's
time runs from the call to the evaluated first tokens (and records).

``weights``: the same batched prefill and decode steps with the 4-bit GGUF
weights (``quantized_matmul``) and with the weights dequantized to float32.

``quality``: perplexity of the model over a fixed slice of
``pydoc_data/topics.py`` (in every CPython install), fed in chunks through
``kvstate.mlx_lm.forward`` on dense, 8-bit and 4-bit KV records
(group 64), the share of positions whose greedy (argmax) token differs
from the dense run's, and free-running greedy generations from the CLI's
built-in chat prompts: how many differ from the dense run, and where.

    python -m benchmarks real-model prefill --rounds 5
    python -m benchmarks real-model weights --rounds 5
    python -m benchmarks real-model quality --tokens 512
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import mlx.core as mx

from benchmarks import _common as c
from kvstate import mlx_lm as br
from kvstate.cli import PROMPTS


def chat_prompts(tok, n):
    return [tok.chat([{"role": "user", "content": p}]) for p in (PROMPTS * n)[:n]]


def text_prompts(tok, n, length):
    """``n`` ragged prompts of about ``length`` tokens cut from topics.py."""
    ids = topics_tokens(tok, n * 2 * length)
    out, at = [], 0
    for i in range(n):
        size = max(2, length - length // 2 + (length * i) // max(n - 1, 1))  # 0.5x .. 1.5x
        out.append(ids[at : at + size])
        at += size
    return out


def topics_tokens(tok, n, start=20000):
    """``n`` tokens of ``pydoc_data.topics`` text, from character ``start``."""
    from pydoc_data import topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok.encode(text[start : start + 8 * n])
    if len(ids) < n:
        raise SystemExit(f"topics.py slice gave {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def kvstate_batched(model, prompts, step_size):
    logits, states = br.prefill(model, prompts, prefill_step_size=step_size)
    first = mx.argmax(logits, axis=-1)
    mx.eval(first, [s.planes for s in states])
    return first.tolist()


def kvstate_alone(model, prompts, step_size):
    rows = [br.prefill(model, [p], prefill_step_size=step_size) for p in prompts]
    logits = mx.concatenate([r[0] for r in rows])
    states = br.merge_rows([r[1] for r in rows])
    first = mx.argmax(logits, axis=-1)
    mx.eval(first, [s.planes for s in states])
    return first.tolist()


def mlx_lm_batch_generator(model, prompts, step_size):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=1,
        prefill_batch_size=len(prompts),
        completion_batch_size=len(prompts),
        prefill_step_size=step_size,
    )
    uids = gen.insert(prompts, max_tokens=[1] * len(prompts))
    first = {}
    while len(first) < len(uids):
        for r in gen.next_generated():
            first[r.uid] = int(r.token)
    gen.close()
    return [first[u] for u in uids]


def prefill_bench(args, loaded):
    model, tok = loaded.model, loaded.tokenizer
    prompts = (
        chat_prompts(tok, args.batch)
        if args.prompts == "chat"
        else text_prompts(tok, args.batch, args.length)
    )
    n_tok = sum(len(p) for p in prompts)
    sides = {
        "kvstate batched": kvstate_batched,
        "kvstate one at a time": kvstate_alone,
        "mlx-lm BatchGenerator": mlx_lm_batch_generator,
    }
    print(
        f"prefill: {len(prompts)} prompts ({args.prompts}), lengths "
        f"{[len(p) for p in prompts]}, {n_tok} tokens, prefill_step_size {args.step}, "
        f"weights {'float32' if args.float32 else '4-bit GGUF'}"
    )
    names = list(sides)
    ref = None
    for name in names:  # warm-up, and the sides agree on every first token
        got = sides[name](model, prompts, args.step)
        ref = got if ref is None else ref
        assert got == ref, f"{name}: first tokens {got} differ from {ref}"
    run = {n: lambda f=f: f(model, prompts, args.step) for n, f in sides.items()}
    times = c.rounds(run, args.rounds)
    base = times["mlx-lm BatchGenerator"]
    print(
        f"{'side':<24}{'median s':>10}{'min s':>8}{'max s':>8}{'prefill tok/s':>15}"
        f"{'ratio':>8}{'ratio range':>16}"
    )
    for n in names:
        ts = times[n]
        ratios = [b / t for b, t in zip(base, ts)]  # per round: mlx-lm time / this side's
        print(
            f"{n:<24}{statistics.median(ts):>10.2f}{min(ts):>8.2f}{max(ts):>8.2f}"
            f"{n_tok / statistics.median(ts):>15.1f}{statistics.median(ratios):>8.2f}"
            f"{f'{min(ratios):.2f}..{max(ratios):.2f}':>16}"
        )
    print(
        "ratio: mlx-lm BatchGenerator time / this side's time, per round (median, range);"
        " above 1 = faster than mlx-lm"
    )


def weights_bench(args):
    q = c.real(quantized=True)
    f = c.real()
    prompts = chat_prompts(q.tokenizer, args.batch)
    sides = {"4-bit GGUF": q.model, "float32": f.model}

    def run(model):
        t = time.perf_counter()
        logits, states = br.prefill(model, prompts, prefill_step_size=args.step)
        nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.steps):
            logits, states = br.step(model, nxt, states)
            nxt = mx.argmax(logits, axis=-1)
            mx.eval(nxt)
        return t_prefill, (time.perf_counter() - t) / args.steps

    for m in sides.values():
        run(m)
    got = {n: [] for n in sides}
    names = list(sides)
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            got[n].append(run(sides[n]))
        print(
            f"  round {r}: "
            + ", ".join(
                f"{n} prefill {got[n][-1][0]:.2f} s, decode {1000 * got[n][-1][1]:.0f} ms/step"
                for n in names
            ),
            flush=True,
        )
    print(
        f"weights: B={len(prompts)} chat prompts, {sum(map(len, prompts))} prompt tokens, "
        f"{args.steps} decode steps"
    )
    for n in names:
        pre = [g[0] for g in got[n]]
        dec = [g[1] for g in got[n]]
        print(
            f"{n:<12} prefill median {statistics.median(pre):.2f} s "
            f"[{min(pre):.2f}..{max(pre):.2f}], decode median "
            f"{1000 * statistics.median(dec):.0f} ms/step [{1000 * min(dec):.0f}.."
            f"{1000 * max(dec):.0f}]"
        )
    ratio_p = [a[0] / b[0] for a, b in zip(got[names[0]], got[names[1]])]
    ratio_d = [a[1] / b[1] for a, b in zip(got[names[0]], got[names[1]])]
    print(
        f"4-bit time / float32 time per round: prefill median {statistics.median(ratio_p):.2f}"
        f" [{min(ratio_p):.2f}..{max(ratio_p):.2f}], decode median "
        f"{statistics.median(ratio_d):.2f} [{min(ratio_d):.2f}..{max(ratio_d):.2f}]"
    )


def nll(model, ids, chunk, **make):
    """Per-position negative log-likelihood and argmax over ``ids`` through kvstate."""
    states = br.make_states(model, 1, **make)
    losses, argmax = [], []
    for start in range(0, len(ids) - 1, chunk):
        x = ids[start : min(start + chunk, len(ids) - 1)]
        y = mx.array(ids[start + 1 : start + 1 + len(x)])
        logits, states = br.forward(model, mx.array([x]), states)
        logp = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)
        loss = -mx.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
        top = mx.argmax(logits[0], axis=-1)
        mx.eval(loss, top, [s.planes for s in states])
        losses += loss.tolist()
        argmax += top.tolist()
    return losses, argmax


def greedy(model, prompts, n, **make):
    logits, states = br.prefill(model, prompts, **make)
    out = []
    for _ in range(n):
        nxt = mx.argmax(logits, axis=-1)
        out.append(nxt.tolist())
        logits, states = br.step(model, nxt, states)
    return [list(r) for r in zip(*out)]


def quality_bench(args):
    loaded = c.real(quantized=not args.float32)
    model, tok = loaded.model, loaded.tokenizer
    ids = topics_tokens(tok, args.tokens)
    kinds = {
        "dense": {},
        "8-bit KV": {"kv_bits": 8, "kv_group_size": 64},
        "4-bit KV": {"kv_bits": 4, "kv_group_size": 64},
    }
    print(
        f"quality: {len(ids)} tokens of pydoc_data/topics.py (sorted topics joined by "
        f"newlines, characters from 20000), chunks of {args.chunk}, weights "
        f"{'float32' if args.float32 else '4-bit GGUF'}"
    )
    prompts = chat_prompts(tok, len(PROMPTS))
    dense = None
    for name, make in kinds.items():
        t = time.perf_counter()
        losses, top = nll(model, ids, args.chunk, **make)
        gens = greedy(model, prompts, args.gen, **make)
        ppl = math.exp(sum(losses) / len(losses))
        if dense is None:
            dense = (top, gens)
            print(f"{name:<10} perplexity {ppl:.3f}  ({time.perf_counter() - t:.0f} s)")
            continue
        flips = sum(a != b for a, b in zip(top, dense[0]))
        firsts = [
            next((i for i, (a, b) in enumerate(zip(g, d)) if a != b), None)
            for g, d in zip(gens, dense[1])
        ]
        differ = [f for f in firsts if f is not None]
        print(
            f"{name:<10} perplexity {ppl:.3f}  argmax differs from dense at {flips}/"
            f"{len(top)} positions ({100 * flips / len(top):.2f}%); greedy generations "
            f"({args.gen} tokens, {len(prompts)} chat prompts): {len(differ)} differ, first "
            f"difference at tokens {differ}  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("prefill")
    a.add_argument(
        "--prompts",
        choices=["chat", "text"],
        default="chat",
        help="the CLI's chat prompts, or ragged topics.py slices",
    )
    a.add_argument("--batch", type=int, default=6)
    a.add_argument("--length", type=int, default=128, help="mean length of text prompts")
    a.add_argument("--step", type=int, default=512, help="prefill_step_size")
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--float32", action="store_true")
    w = sub.add_parser("weights")
    w.add_argument("--batch", type=int, default=4)
    w.add_argument("--steps", type=int, default=8)
    w.add_argument("--step", type=int, default=512)
    w.add_argument("--rounds", type=int, default=5)
    q = sub.add_parser("quality")
    q.add_argument("--tokens", type=int, default=512)
    q.add_argument("--chunk", type=int, default=64)
    q.add_argument("--gen", type=int, default=32, help="greedy tokens per chat prompt")
    q.add_argument("--float32", action="store_true")
    args = p.parse_args(argv)
    if args.what == "prefill":
        prefill_bench(args, c.real(quantized=not args.float32))
    elif args.what == "weights":
        weights_bench(args)
    else:
        quality_bench(args)


if __name__ == "__main__":
    main()
