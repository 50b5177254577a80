"""The main job end to end: kvstate's engine against mlx-lm's ``BatchGenerator``.

Every side serves the same requests on the SAME model object, greedy to EOS or
``--max-tokens``: mlx-lm's ``BatchGenerator`` (``MlxLmEngine``, what ``kvstate
generate --compare`` measures against), kvstate's scheduler eager
(``KVStateEngine``), compiled, and with lookup speculation
(``SpeculativeEngine(Lookup())``, the cost-measured window). Each round runs every
side once, the order turning round by round (``_common.rounds``' rule), after one
warm-up run of each. Per batch size ``B`` (``--batch``; ``--waves`` x ``B``
requests, all arriving at once) it prints, per side: output tokens/s of the whole
``serve`` call (median [min-max] over rounds), its paired per-round ratio to
mlx-lm's, time to first token (the median over requests of one round, then the
median [min-max] over rounds), and the requests whose tokens equal mlx-lm's.

    python -m benchmarks e2e                                   # SmolLM2 4-bit, B = 1 8 32
    python -m benchmarks e2e --model llama-3.2-1b --dtype bfloat16   # the GPU shape

The real model's prompts are chat prompts (a shared system prompt, one question
each, ``serve_load.QUESTIONS``); a random-weights model's are seeded token ids of
``--prompt-len`` tokens (no EOS: every request runs ``--max-tokens``). The server
half of the comparison is ``python -m benchmarks serve-load``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from . import _common
from .serve_load import QUESTIONS, SYSTEM

SIDES = ("mlx-lm", "kvstate", "compiled", "lookup", "serial")


def requests(loaded, n: int, max_tokens: int, prompt_len: int, vocab: int) -> list:
    """``n`` greedy requests: chat prompts with the tokenizer, else seeded token ids."""
    from kvstate.serving.engine import Request

    tok = loaded.tokenizer if loaded is not None else None
    out = []
    for i in range(n):
        if tok is not None:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
            ]
            ids = tok.encode(tok.render(messages))
            out.append(Request(i, tuple(ids), max_tokens, stop=tuple(tok.eos_ids)))
        else:
            ids = mx.random.randint(0, vocab, (prompt_len,), key=mx.random.key(i)).tolist()
            out.append(Request(i, tuple(ids), max_tokens))
    return out


def engines(model, sides, num_draft: int) -> dict:
    from kvstate.serving.engine import KVStateEngine, MlxLmEngine, SpeculativeEngine
    from kvstate.speculative.drafts import Lookup
    from kvstate.speculative.rounds import Window

    make = {
        "mlx-lm": lambda: MlxLmEngine(model),
        "kvstate": lambda: KVStateEngine(model),
        "compiled": lambda: KVStateEngine(model, compiled=True),
        "lookup": lambda: SpeculativeEngine(model, Lookup(), num_draft, window=Window()),
        "serial": lambda: _serial(KVStateEngine(model)),
    }
    return {s: make[s]() for s in sides}


def _serial(engine):
    """``engine`` with every round read as it ends (``Scheduler(pipelined=False)``):
    the scheduler before rounds were pipelined, for a before/after in one run."""
    make = engine.scheduler

    def scheduler(batch_size, jobs):
        sched = make(batch_size, jobs)
        sched.pipelined = False
        return sched

    engine.scheduler = scheduler
    engine.name = "kvstate (serial rounds)"
    return engine


def run_one(engine, reqs, B: int) -> dict:
    from kvstate.serving.engine import serve

    t = time.perf_counter()
    done, _ = serve(engine, reqs, B)
    seconds = time.perf_counter() - t
    toks = sum(len(c.tokens) for c in done)
    return dict(
        seconds=seconds,
        tokens=toks,
        tps=toks / seconds,
        ttft=statistics.median(c.ttft for c in done),
        out=[c.tokens for c in done],
    )


def measure(model, reqs, B: int, sides: dict, n: int) -> dict:
    """Every side's runs: one warm-up each, then ``n`` rounds, the order turning.
    Each run's time goes to stderr as it ends (a long run shows where it stands)."""
    names = list(sides)

    def run(name: str, label: str) -> dict:
        got = run_one(sides[name], reqs, B)
        print(
            f"  B={B} {label} {name}: {got['seconds']:.2f} s, {got['tps']:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
        return got

    for name in names:
        run(name, "warm-up")
    got: dict = {name: [] for name in names}
    for r in range(n):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            got[name].append(run(name, f"round {r + 1}"))
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="real", help="real (SmolLM2 GGUF) or a _common.MODELS name")
    p.add_argument("--dtype", default="float32", help="a random model's dtype")
    p.add_argument("--dequantize", action="store_true", help="the real model in --dtype")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--waves", type=int, default=2, help="requests per row of the batch (2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="a random model's prompt tokens")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument(
        "--sides",
        nargs="+",
        default=list(SIDES[:4]),
        choices=SIDES,
        help="mlx-lm kvstate compiled lookup (default), serial: the scheduler unpipelined",
    )
    args = _common.output_args(p).parse_args(argv)
    if "mlx-lm" not in args.sides:
        p.error("--sides: mlx-lm is the reference every ratio is to")

    loaded = None
    if args.model == "real":
        loaded = _common.real(quantized=not args.dequantize, dtype=args.dtype)
        model, vocab = loaded.model, 0
    else:
        model = _common.llama(args.model, args.dtype)
        vocab = _common.MODELS[args.model]["vocab_size"]
    sides = engines(model, args.sides, args.num_draft)
    print(
        f"model {args.model} ({'4-bit' if loaded and not args.dequantize else args.dtype}), "
        f"device {mx.default_device()}, {args.rounds} rounds, max_tokens {args.max_tokens}"
    )
    print("| B | side | output tok/s | ratio to mlx-lm | TTFT median (s) | tokens equal |")
    print("|---|---|---|---|---|---|")
    rows = []
    for B in args.batch:
        reqs = requests(loaded, args.waves * B, args.max_tokens, args.prompt_len, vocab)
        got = measure(model, reqs, B, sides, args.rounds)
        ref = got["mlx-lm"]
        for name, runs in got.items():
            tps = [x["tps"] for x in runs]
            ttft = [x["ttft"] for x in runs]
            ratios = [x["tps"] / y["tps"] for x, y in zip(runs, ref)]
            equal = sum(a == b for x, y in zip(runs, ref) for a, b in zip(x["out"], y["out"]))
            total = sum(len(x["out"]) for x in runs)
            print(
                f"| {B} | {name} | {_common.spread(tps, 1, '', 1)} "
                f"| {_common.spread(ratios, 1, '', 2)} | {_common.spread(ttft, 1, '', 3)} "
                f"| {equal}/{total} |",
                flush=True,
            )
            rows.append(
                dict(
                    B=B,
                    side=name,
                    requests=len(reqs),
                    tokens=runs[0]["tokens"],
                    tps=_common.summary(tps, 1),
                    ratio=_common.summary(ratios, 1),
                    ttft_s=_common.summary(ttft, 1),
                    equal=equal,
                    total=total,
                )
            )
    _common.write(args, "e2e", rows, model=args.model, rounds=args.rounds)


if __name__ == "__main__":
    main()
