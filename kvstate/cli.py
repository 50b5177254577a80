"""The ``kvstate`` command: continuous batched generation on kvstate records.

``kvstate generate`` serves a stream of requests that arrive and finish at
different times. One scheduler drives an *engine*; each step it admits the
requests that have arrived (prefilled alone, then joined to the batch with
``extend``), decodes one token for every active row, and drops finished
rows with ``filter_rows``::

    step:      0   1   2   3   4   5   6   7   8
    req 0:     P   d   d   d   d   x                 P prefill + join
    req 1:         P   d   d   d   d   d   x         d one decode step
    req 2:                 P   d   d   x             x finished, filtered out

``--compare`` runs the same schedule on mlx-lm's own batch caches
(``BatchKVCache`` merge/extend/filter) in the same process, and reports
whether every request got the same tokens, and the speed ratio.
Decisions are in ``notes/cli.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import attrs
import mlx.core as mx

import kvstate as kv
from .models import tiny_llama as tiny_llama


# --- requests and the scheduler ----------------------------------------------------


@attrs.define
class Request:
    arrival: int          # the decode step at which it arrives
    prompt: list          # token ids
    max_new: int          # tokens to generate
    out: list = attrs.Factory(list)


def make_requests(n, prompt_len, gen_len, gap, vocab, seed) -> list:
    """``n`` requests with random prompts, lengths uniform in the given ranges."""
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    plen = mx.random.randint(prompt_len[0], prompt_len[1] + 1, (n,), key=k1).tolist()
    glen = mx.random.randint(gen_len[0], gen_len[1] + 1, (n,), key=k2).tolist()
    gaps = mx.random.randint(0, 2 * gap + 1, (n,), key=k3).tolist()
    toks = mx.random.randint(0, vocab, (n, max(plen)), key=k4).tolist()
    arrivals = [sum(gaps[:i]) for i in range(n)]
    return [Request(a, toks[i][:p], g) for i, (a, p, g) in enumerate(zip(arrivals, plen, glen))]


def serve(engine, requests, batch_size, progress=None) -> dict:
    """Run every request to completion; returns timing and cache figures."""
    pending = sorted(requests, key=lambda r: r.arrival)
    for r in pending:
        r.out = []
    active, batch, t, bytes_per_tok = [], None, 0, []
    start = time.perf_counter()
    while pending or active:
        while pending and pending[0].arrival <= t and len(active) < batch_size:
            r = pending.pop(0)
            logits, row = engine.prefill(r.prompt)
            r.out.append(mx.argmax(logits, axis=-1).item())
            if len(r.out) >= r.max_new:
                continue
            batch = row if batch is None else engine.join(batch, row)
            active.append(r)
        if not active:  # idle until the next arrival
            t = max(t + 1, pending[0].arrival) if pending else t
            continue
        tokens = mx.array([r.out[-1] for r in active], dtype=mx.int32)
        logits, batch = engine.step(batch, tokens)
        for r, tok in zip(active, mx.argmax(logits, axis=-1).tolist()):
            r.out.append(tok)
        held = sum(len(r.prompt) + len(r.out) - 1 for r in active)
        bytes_per_tok.append(engine.nbytes(batch) / held)
        keep = [i for i, r in enumerate(active) if len(r.out) < r.max_new]
        if len(keep) < len(active):
            active = [active[i] for i in keep]
            batch = engine.leave(batch, keep) if keep else None
        t += 1
        if progress:
            progress(sum(len(r.out) for r in requests), len(active), len(pending))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": t,
            "bytes_per_token": sum(bytes_per_tok) / max(len(bytes_per_tok), 1)}


# --- engines: kvstate records, and mlx-lm's own caches --------------------------------


class KVStateEngine:
    """Rows are kvstate records, driven through ``kvstate.mlx_lm``."""

    name = "kvstate"

    def __init__(self, model, compiled=False):
        from . import mlx_lm as bridge

        self.model, self.bridge = model, bridge
        self._step = bridge.step
        if compiled:
            try:
                from .compiled import make_step
            except ImportError:
                raise SystemExit("kvstate generate: --compile needs kvstate.compiled.make_step, "
                                 "which this install does not have yet") from None
            self._step = make_step(model)  # step(model, tokens, states) -> (logits, states)
            self.name = "kvstate (compiled)"

    def prefill(self, prompt):
        states = self.bridge.make_states(self.model, 1)
        logits, states = self.bridge.forward(self.model, mx.array([prompt]), states)
        return logits[:, -1, :], states

    def join(self, batch, row):
        return self.bridge.extend(batch, row)

    def step(self, batch, tokens):
        return self._step(self.model, tokens, batch)

    def leave(self, batch, keep):
        return self.bridge.filter_rows(batch, keep)

    def nbytes(self, batch):
        return sum(s.nbytes for s in batch)


class MlxLmEngine:
    """Rows are mlx-lm caches: ``KVCache`` per prompt, ``BatchKVCache`` for the batch."""

    name = "mlx-lm"

    def __init__(self, model):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.make = model, make_prompt_cache

    def prefill(self, prompt):
        caches = self.make(self.model)
        logits = self.model(mx.array([prompt]), cache=caches)
        return logits[:, -1, :], [type(c).merge([c]) for c in caches]

    def join(self, batch, row):
        for b, r in zip(batch, row):
            b.extend(r)  # in place, as mlx-lm's BatchGenerator does
        return batch

    def step(self, batch, tokens):
        return self.model(tokens[:, None], cache=batch)[:, -1, :], batch

    def leave(self, batch, keep):
        for b in batch:
            b.filter(mx.array(keep))
        return batch

    def nbytes(self, batch):
        return sum(c.nbytes for c in batch)


# --- the command -----------------------------------------------------------------------


def _range(text: str):
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _parser():
    p = argparse.ArgumentParser(prog="kvstate", description="KV-cache state for MLX models: "
                                "continuous batched generation on kvstate records.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continuous batched generation on kvstate records",
                       description="Requests arrive and finish at different times; rows join "
                       "the batch with extend and leave with filter_rows. Prints a table of "
                       "requests, tokens, tokens/s, peak memory and cache bytes per token.")
    g.add_argument("--model", type=Path, help="a local mlx-lm model directory "
                   "(default: a built-in tiny llama with seeded random weights)")
    g.add_argument("--requests", type=int, default=16, help="number of requests (16)")
    g.add_argument("--prompt-len", type=_range, default=(16, 64), metavar="LO:HI",
                   help="prompt lengths, uniform (16:64)")
    g.add_argument("--gen-len", type=_range, default=(8, 48), metavar="LO:HI",
                   help="tokens generated per request, uniform (8:48)")
    g.add_argument("--batch-size", type=int, default=8, help="most rows decoded at once (8)")
    g.add_argument("--arrival-gap", type=int, default=2,
                   help="mean decode steps between arrivals (2)")
    g.add_argument("--seed", type=int, default=0, help="seed for weights and requests (0)")
    g.add_argument("--repeat", type=int, default=1,
                   help="runs per engine, alternating engines; the fastest is reported (1)")
    g.add_argument("--compare", action="store_true",
                   help="also run mlx-lm's own batch caches; report token parity and speed")
    g.add_argument("--compile", action="store_true", help="decode with a compiled step")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _progress(label, total, stream):
    last = [0.0]
    start = time.perf_counter()

    def show(tokens, active, queued, final=False):
        now = time.perf_counter()
        if not final and now - last[0] < 0.1:
            return
        last[0] = now
        filled = int(30 * tokens / max(total, 1))
        rate = tokens / max(now - start, 1e-9)
        stream.write(f"\r{label:<8} [{'#' * filled}{'.' * (30 - filled)}] {tokens}/{total} tok"
                     f"  {active} active  {queued} queued  {rate:,.0f} tok/s ")
        stream.write("\n" if final else "")
        stream.flush()

    return show


def _load_model(args):
    if args.model is None:
        return tiny_llama(args.seed), "tiny llama (random weights, float32)"
    from mlx_lm.utils import load_model

    args.model = args.model.expanduser()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"kvstate generate: --model {args.model}: no config.json there "
                         "(expected a local mlx-lm model directory)")
    model, _ = load_model(args.model)
    return model, str(args.model)


def _vocab(model):
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if size is None:
        raise SystemExit("kvstate generate: cannot tell this model's vocab_size from model.args")
    return size


def run(engine, requests, args, stream, best=None):
    """Serve every request once (after a short warm-up); keeps the faster of this
    run and ``best`` (a previous run's figures, whose tokens must match)."""
    serve(engine, [Request(0, requests[0].prompt[:4], 2)], 1)
    show = None if args.quiet else _progress(engine.name.split()[0],
                                             sum(r.max_new for r in requests), stream)
    mx.reset_peak_memory()
    stats = serve(engine, requests, args.batch_size, show)
    if show:
        show(sum(len(r.out) for r in requests), 0, 0, final=True)
    stats["peak"] = mx.get_peak_memory()
    stats["outputs"] = [list(r.out) for r in requests]
    if best is not None:
        if best["outputs"] != stats["outputs"]:
            raise SystemExit(f"kvstate generate: {engine.name} gave different tokens on a repeat")
        stats = min(best, stats, key=lambda s: s["seconds"])
    return stats


def generate(args, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    for name in ("requests", "batch_size", "repeat"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvstate generate: --{name.replace('_', '-')} must be >= 1")
    model, label = _load_model(args)
    requests = make_requests(args.requests, args.prompt_len, args.gen_len,
                             max(args.arrival_gap, 0), _vocab(model), args.seed)
    engines = [KVStateEngine(model, compiled=args.compile)]
    if args.compare:
        engines.append(MlxLmEngine(model))
    best = [None] * len(engines)
    for _ in range(args.repeat):
        best = [run(e, requests, args, err, b) for e, b in zip(engines, best)]
    results = [(e.name, s) for e, s in zip(engines, best)]

    prompt_tokens = sum(len(r.prompt) for r in requests)
    print(f"model: {label}; {args.requests} requests, batch size {args.batch_size}", file=out)
    head = ("engine", "requests", "prompt tok", "gen tok", "time s", "tok/s", "peak MB",
            "cache B/tok")
    print("".join(f"{h:>12}" if i else f"{h:<20}" for i, h in enumerate(head)), file=out)
    for name, s in results:
        gen = sum(len(o) for o in s["outputs"])
        row = (name, len(requests), prompt_tokens, gen, f"{s['seconds']:.3f}",
               f"{gen / s['seconds']:,.1f}", f"{s['peak'] / 2**20:,.1f}",
               f"{s['bytes_per_token']:,.0f}")
        print("".join(f"{v:>12}" if i else f"{v:<20}" for i, v in enumerate(row)), file=out)
    if not args.compare:
        return 0
    (_, ours), (_, theirs) = results
    same = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"]))
    print(f"token parity: {same}/{len(requests)} requests identical"
          f"{'' if same == len(requests) else ' (MISMATCH)'}", file=out)
    print(f"speed ratio (mlx-lm time / kvstate time): "
          f"{theirs['seconds'] / ours['seconds']:.2f}", file=out)
    return 0 if same == len(requests) else 1


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return generate(args)
    except kv.KVStateError as e:
        print(f"kvstate {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
