"""Chunked prefill: running streams' inter-token latency while a long prompt arrives.

``--streams`` rows decode in one ``Scheduler``; after ``--steady`` rounds a prompt of
``--long`` tokens arrives. Measured per side, in one process, sides alternating
round by round (``_common.rounds``' order):

- the streams' steady inter-token latency (median gap over the rounds before the
  long prompt arrives) and their p99 and largest gap from its arrival until its
  first token, each over the steady median;
- the long prompt's time to first token, over that of the same prompt prefilled
  alone (an empty scheduler, whole-prompt prefill) in the same round.

Sides: ``before`` (``prefill_budget=None``: the whole prompt prefilled before the
next round) and one per ``--budgets`` value. The model is a seeded random llama
(``--model``, a ``_common.MODELS`` preset; ``tiny`` by default: SmolLM2 and the
``small`` preset take minutes to prefill 4K tokens on a 2-core CPU).

    python -m benchmarks chunked-prefill --long 4096 --budgets 4 16 64 --rounds 3
    python -m benchmarks chunked-prefill --model llama-3.2-1b --dtype bfloat16 \
        --budgets 128 256 512 1024 --rounds 5   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import _common
from kvstate.serving.scheduler import Job, Scheduler


def _prompt(seed: int, n: int, vocab: int) -> list:
    return [(seed * 7919 + 31 * i) % (vocab - 1) + 1 for i in range(n)]


def _first_token_after(sched: Scheduler, prompt: list) -> float:
    """Seconds from ``prompt``'s submission to its first token, stepping ``sched``."""
    first: list = []
    t0 = time.perf_counter()
    sched.submit(Job(prompt, 1, emit=lambda k, i, v: first.append(time.perf_counter())))
    while not first:
        sched.step()
    return first[0] - t0


def alone(model, prompt: list, step_size: int) -> float:
    """The long prompt's time to first token in an empty scheduler (whole prefill)."""
    sched = Scheduler(model, (), prefill_budget=None, prefill_step_size=step_size)
    return _first_token_after(sched, prompt)


def loaded(model, args, prompt: list, budget) -> dict:
    """``args.streams`` rows decoding, then ``prompt`` arrives: the streams' gaps and
    its time to first token."""
    vocab = model.args.vocab_size
    sched = Scheduler(
        model,
        (),
        max_batch=args.streams + 1,
        prefill_budget=None,  # the streams start alike on every side
        prefill_step_size=args.step_size,
    )
    stamps: dict = {s: [] for s in range(args.streams)}
    for s in range(args.streams):
        sched.submit(
            Job(
                _prompt(s, 32, vocab),
                10**6,
                emit=lambda k, i, v, s=s: (
                    stamps[s].append(time.perf_counter()) if k == "token" else None
                ),
            )
        )
    for _ in range(args.steady):
        sched.step()
    sched.prefill_budget = budget
    arrived = time.perf_counter()
    ttft = _first_token_after(sched, prompt)
    for _ in range(2):  # the round that joins it, and one after
        sched.step()
    steady, during = [], []
    for ts in stamps.values():
        gaps = [(b - a, b) for a, b in zip(ts, ts[1:])]
        steady += [g for g, t in gaps if t < arrived][-(args.steady - 1) :]
        during += [g for g, t in gaps if t >= arrived]
    base = statistics.median(steady)
    p99 = sorted(during)[max(int(0.99 * len(during)) - 1, 0)]
    return dict(steady=base, p99=p99, worst=max(during), ttft=ttft)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks chunked-prefill")
    p.add_argument("--model", default="tiny", help="a _common.MODELS preset (tiny)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long", type=int, default=4096, help="tokens of the arriving prompt")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    p.add_argument("--step-size", type=int, default=512, help="prefill_step_size")
    p.add_argument("--steady", type=int, default=20, help="rounds before the prompt arrives")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="the weights' dtype (bfloat16 on a GPU)")
    args = _common.output_args(p).parse_args(argv)
    model = _common.llama(args.model, dtype=args.dtype)
    prompt = _prompt(99, args.long, model.args.vocab_size)
    sides = {"before": None, **{f"budget {b}": b for b in args.budgets}}
    got: dict = {name: [] for name in ["alone", *sides]}
    names = list(got)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            if name == "alone":
                got[name].append(alone(model, prompt, args.step_size))
            else:
                got[name].append(loaded(model, args, prompt, sides[name]))
            print(f"round {r} {name}: {got[name][-1]}", flush=True)
    rows = []
    for name in sides:
        runs = got[name]
        row = dict(
            side=name,
            steady_ms=[1e3 * x["steady"] for x in runs],
            p99_over_steady=[x["p99"] / x["steady"] for x in runs],
            worst_over_steady=[x["worst"] / x["steady"] for x in runs],
            ttft_s=[x["ttft"] for x in runs],
            ttft_over_alone=[x["ttft"] / a for x, a in zip(runs, got["alone"])],
        )
        rows.append(row)
        print(
            f"{name:>12}: steady ITL {_common.spread(row['steady_ms'], 1)}; "
            f"p99/steady {_common.spread(row['p99_over_steady'], 1, '')}; "
            f"worst/steady {_common.spread(row['worst_over_steady'], 1, '')}; "
            f"TTFT {_common.spread(row['ttft_s'], 1, 's')}, "
            f"/alone {_common.spread(row['ttft_over_alone'], 1, '')}"
        )
    print(f"{'alone':>12}: TTFT {_common.spread(got['alone'], 1, 's')}")
    _common.write(args, "chunked_prefill", rows, alone_s=got["alone"], **vars(args))


if __name__ == "__main__":
    main()
