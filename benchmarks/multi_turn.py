"""A 10-turn conversation through the scheduler: time to first token per turn, with and
without finished requests' completions in the prefix cache.

The real model (SmolLM2-135M-Instruct, float32) and its own chat template: each turn's
prompt is the whole conversation so far (the system prompt, every user message, every
earlier reply as the text a client got back), rendered by the template, as an agent
sends it. Greedy, ``--max-tokens`` per reply. Two sides, each a fresh ``Scheduler``
with a prefix cache: ``completions`` (a finished row's prompt and completion join the
cache, the default) and ``prompts`` (``cache_completions=False``: only prompts do).
Every round runs both sides once, the order alternating. Reported per turn and side:
time to first token (median [min-max] over rounds), the prompt tokens the cache served
(``cached``), and ``cached`` over the previous turn's prompt + completion tokens. The
two sides must give the same replies (checked).

    python -m benchmarks multi-turn --rounds 3
"""

from __future__ import annotations

import argparse
import time

from benchmarks._common import output_args, real, spread, write
from kvstate.serving.prefix_cache import PrefixCache
from kvstate.serving.scheduler import Job, Scheduler

SYSTEM = "You are a helpful assistant. Answer in two or three sentences."
USERS = (
    "I am planning a trip to Italy. Which cities should I visit?",
    "What is the best season to go there?",
    "Which food should I try in Rome?",
    "And in Florence?",
    "How do I get from Rome to Florence?",
    "Is it expensive?",
    "What should I pack?",
    "Do I need to speak Italian?",
    "Give me three useful Italian phrases.",
    "Thank you. Summarize my trip plan.",
)


def turn(s: Scheduler, prompt: list, max_tokens: int) -> tuple:
    """One request run to its end: ``(tokens, seconds to the first token, cached)``."""
    tokens: list = []
    first: list = []

    def emit(kind, i, value):
        if kind == "token":
            if not tokens:
                first.append(time.perf_counter())
            tokens.append(value)

    job = Job(prompt=prompt, max_tokens=max_tokens, emit=emit)
    start = time.perf_counter()
    s.submit(job)
    while s.step():
        pass
    return tokens, first[0] - start, job.cached


def conversation(loaded, turns: int, max_tokens: int, completions: bool, mb: int) -> list:
    """Per turn: ``dict(prompt, completion, ttft, cached, replies)`` on a fresh scheduler."""
    tok = loaded.tokenizer
    s = Scheduler(
        loaded.model,
        tok.eos_ids,
        prefix_cache=PrefixCache(mb << 20),
        cache_completions=completions,
    )
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": USERS[t % len(USERS)]})
        prompt = tok.chat(messages)
        tokens, ttft, cached = turn(s, prompt, max_tokens)
        reply = tok.decode(tokens)  # what a client gets back, and sends in the next turn
        messages.append({"role": "assistant", "content": reply})
        out.append(dict(prompt=len(prompt), completion=len(tokens), ttft=ttft, cached=cached))
        out[-1]["reply"] = reply
    return out


def main(argv=None) -> None:
    p = output_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefix-cache-mb", type=int, default=256)
    args = p.parse_args(argv)
    loaded = real()
    conversation(loaded, 2, 4, True, args.prefix_cache_mb)  # warm-up
    sides = {"completions": True, "prompts": False}
    runs: dict = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            runs[name].append(
                conversation(loaded, args.turns, args.max_tokens, sides[name], args.prefix_cache_mb)
            )
            print(f"round {r + 1}: {name} done", flush=True)
    replies = {name: [[t["reply"] for t in run] for run in rs] for name, rs in runs.items()}
    same = all(a == replies["completions"][0] for rs in replies.values() for a in rs)
    rows = report(runs, args.turns)
    print(f"replies equal on both sides and every round: {same}")
    write(args, "multi_turn", rows, rounds=args.rounds, max_tokens=args.max_tokens, same=same)


def report(runs: dict, turns: int) -> list:
    """Print one line per turn; the rows written as JSON."""
    rows = []
    first = runs["completions"][0]
    print(
        f"{'turn':>4} {'prompt':>6} {'compl':>5}  {'TTFT completions':>24}  "
        f"{'TTFT prompts only':>24}  {'cached':>6} {'of prev':>7}  {'cached (prompts)':>16}"
    )
    for t in range(turns):
        row = dict(turn=t + 1, prompt=first[t]["prompt"], completion=first[t]["completion"])
        for name, rs in runs.items():
            row[f"ttft_{name}"] = [r[t]["ttft"] for r in rs]
            row[f"cached_{name}"] = [r[t]["cached"] for r in rs]
        prev = first[t - 1]["prompt"] + first[t - 1]["completion"] if t else 0
        row["previous"] = prev
        cached = row["cached_completions"][0]
        frac = f"{cached / prev:.3f}" if prev else "-"
        print(
            f"{t + 1:>4} {row['prompt']:>6} {row['completion']:>5}  "
            f"{spread(row['ttft_completions']):>24}  {spread(row['ttft_prompts']):>24}  "
            f"{cached:>6} {frac:>7}  {row['cached_prompts'][0]:>16}"
        )
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
