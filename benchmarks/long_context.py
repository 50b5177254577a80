"""Long contexts in bounded memory: perplexity, needle retrieval, decode speed, cache bytes.

The real model (SmolLM2-135M-Instruct, trained context 8192) on a long real text, with
one cache per side, every side fed the same tokens in one process:

- ``full``: kvstate's dense records (``make_states(model, B)``), the whole context;
- ``ring 1/f``: mlx-lm's ``RotatingKVCache(max_size=budget, keep=4)`` per layer, driven
  by the model itself (``model(x, cache=...)``), as mlx-lm's ``max_kv_size`` makes it;
- ``<policy> 1/f``: kvstate's compressed records, ``make_states(model, B,
  kv_budget=budget, policy=...)`` for ``sinks``, ``snapkv`` and ``h2o``, through the
  same bridge calls (``forward``, ``step``) as the dense ones;

where ``budget`` = context // f, per row and layer, for each ``--fractions`` f.

**Feeding.** Every side takes its tokens in chunks of ``--chunk`` through its cache
(kvstate: ``forward``; mlx-lm: the model with ``cache=``), as a chunked prefill does,
so a bounded cache evicts while the context grows, chunk by chunk, and every query is
answered by what the cache holds at that point. ``--chunk 1`` is token-by-token decode
(exact, and slow). A chunk changes what a bounded cache shows:

- the compressed records evict before an append, so a chunk's queries see the budget
  plus the chunk (at ``--chunk 1``, ``sinks`` at budget n is the ring of n + 1: the
  tests check it);
- mlx-lm's ring holds ``max_size - 1 + chunk`` columns during a multi-token update and
  masks query i of a chunk to the last ``max_size`` positions, which leaves the
  ``keep`` sinks out for every query past a chunk's 4th: fed in chunks it is a plain
  sliding window, as in any mlx-lm prefill with ``max_kv_size``; ``--ring-chunk 1``
  feeds the rings as decode does (StreamingLLM with 4 sinks), at one forward a token.

Keep the chunk well under the smallest budget, and above ``snapkv``'s observation
window (``kv_window``, 16): it scores only blocks longer than that, so a chunk of 16
or less makes it ``sinks``.

**Perplexity** (``ppl``): teacher-forced over the first ``--ppl-tokens`` tokens of the
text, each length a separate run from an empty cache (budgets are fractions of it);
``ppl`` over every predicted position and ``tail`` over the second half, where every
bounded side has evicted.

**Needle** (``needle``): a pass key (a random 5-digit number, ``The pass key is 71432.
Remember it.``) inserted into filler text of ``--lengths`` tokens at ``--depths``
(fraction of the filler before it), wrapped in the chat template with an instruction
before and the question after, the assistant's turn opened with ``The pass key is``;
``--keys`` different keys a cell. All prompts of one length are equally long (digits
are single tokens), so a length's cells run as one aligned batch. Greedy decode of
``--answer-tokens``; a row scores when the first number in its answer is the key.
Budgets are fractions of the filler length.

**Decode** (``decode``): after ``--decode-context`` tokens of text, every side decodes
``--steps`` greedy tokens per round (each token evaluated, as a decode loop does), sides
alternating round by round (``_common.rounds``), over ``--rounds`` rounds; tokens/s and
the per-round ratio to full KV's time (``x`` above 1: faster than full KV; the ring
also against mlx-lm's ``KVCache``), and the cache's bytes (every plane the records or
caches hold: keys, values and any position or score planes).

**Target** (issue 35): at 1/4 of the memory, retrieval >= 90% of full KV's and above
the ring's; decode not slower than full KV. The last lines say, per policy, whether the
measured grid meets it.

Text: ``--text docs`` (default) is the checkout's own documentation, ``README.md``,
``docs/guides/*.md`` and ``notes/*.md`` but ``figures.md`` (sorted, joined by blank
lines): it travels with the repository, so the GPU machine reads the same text (a
figure holds for the commit it ran on); ``--text PATH`` reads a file instead.
Perplexity takes the text from its start; the filler starts ``--filler-offset`` tokens
in.

    python -m benchmarks long-context --quick                     # CPU: the harness
    python -m benchmarks long-context --full --model PATH.gguf    # GPU: the table

``--model`` takes the GGUF's path (the GPU machine reaches no network; default: the
cached download). Weights are dequantized to ``--dtype`` (float32 by default).
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from benchmarks import _common as c
from kvstate import mlx_lm as br
from kvstate.bridge.forward import _last_logits

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("sinks", "snapkv", "h2o")
KEEP = 4  # mlx-lm's RotatingKVCache keep (its default through max_kv_size)

PRESETS = {
    "quick": dict(
        ppl_tokens=[256],
        lengths=[128],
        depths=[0.0, 1.0],
        keys=3,
        fractions=[4],
        chunk=32,
        decode_context=128,
        steps=4,
        rounds=3,
    ),
    "full": dict(
        ppl_tokens=[4096, 8192],
        lengths=[1024, 2048, 4096],
        depths=[0.0, 0.25, 0.5, 0.75, 1.0],
        keys=3,
        fractions=[2, 4, 8],
        chunk=64,
        decode_context=4096,
        steps=16,
        rounds=5,
    ),
}

NEEDLE = " The pass key is {key}. Remember it. "
INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will ask you for the pass key.\n\n"
)
QUESTION = "\n\nWhat is the pass key?"
ANSWER = "The pass key is"


# --- sides -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One cache: ``kind`` ``"records"`` (kvstate, ``make`` = ``make_states``'
    keyword arguments), ``"ring"`` (mlx-lm ``RotatingKVCache(budget, keep=4)``) or
    ``"mlx-lm"`` (mlx-lm ``KVCache``)."""

    name: str
    kind: str
    budget: Optional[int] = None
    fraction: Optional[int] = None
    make: dict = field(default_factory=dict)
    chunk: Optional[int] = None  # its own feeding chunk (``--ring-chunk``)

    def new(self, model, B: int):
        if self.kind == "records":
            return br.make_states(model, B, **self.make)
        if self.kind == "ring":
            return [RotatingKVCache(self.budget, keep=KEEP) for _ in model.layers]
        return [KVCache() for _ in model.layers]

    def feed(self, model, state, tokens: mx.array, last: bool = False):
        """``(logits, state)`` after ``tokens`` ``[B, N]``: every position's logits
        ``[B, N, V]``, or the last's ``[B, 1, V]``."""
        if self.kind == "records":
            return br.forward(model, tokens, state, last=last)
        run = _last_logits if last else (lambda m, t, cache: m(t, cache=cache))
        return run(model, tokens, state), state  # mlx-lm caches update in place

    def step(self, model, state, tokens: mx.array):
        """One decode step, ``tokens`` ``[B]``: ``(logits [B, V], state)``."""
        if self.kind == "records":
            return br.step(model, tokens, state)
        return model(tokens[:, None], cache=state)[:, -1], state

    @staticmethod
    def nbytes(state) -> int:
        return sum(s.nbytes for s in state)

    @staticmethod
    def arrays(state) -> list:
        """What to evaluate with a step's output: the records' planes (mlx-lm's
        caches are evaluated through the output)."""
        return [s.planes for s in state if hasattr(s, "planes")]


def compressed_available() -> bool:
    """Whether ``make_states`` takes ``kv_budget`` (the compressed records)."""
    return "kv_budget" in inspect.signature(br.make_states).parameters


def sides_for(
    context: int,
    fractions: Sequence[int],
    policies: Sequence[str],
    extra: Optional[dict] = None,
    compressed: Optional[bool] = None,
    ring_chunk: Optional[int] = None,
) -> list:
    """Full KV, then per fraction the ring (fed in chunks of ``ring_chunk`` when given)
    and each policy at ``context // f`` (policies left out when ``make_states`` has no
    ``kv_budget``)."""
    compressed = compressed_available() if compressed is None else compressed
    out = [Side("full", "records")]
    for f in fractions:
        n = context // f
        out.append(Side(f"ring 1/{f}", "ring", n, f, chunk=ring_chunk))
        if compressed:
            for p in policies:
                make = dict(kv_budget=n, policy=p, **(extra or {}))
                out.append(Side(f"{p} 1/{f}", "records", n, f, make))
    return out


# --- text ------------------------------------------------------------------------------


def corpus(source: str = "docs") -> str:
    """The text: ``docs`` (the checkout's README, guides and notes but figures.md,
    sorted, joined by blank lines) or a file's path."""
    if source != "docs":
        return Path(source).read_text(encoding="utf-8")
    files = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
    files += [p for p in sorted((ROOT / "notes").glob("*.md")) if p.name != "figures.md"]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files)


def text_ids(tok, text: str, n: int, offset: int = 0) -> list:
    """``n`` token ids of ``text`` from token ``offset`` (no BOS)."""
    ids = _plain(tok, text)
    if len(ids) < offset + n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {offset} + {n}")
    return ids[offset : offset + n]


def _plain(tok, text: str) -> list:
    """``text``'s ids without the tokenizer's BOS."""
    ids = tok.encode(text)
    bos = getattr(tok, "bos_id", None)
    return ids[1:] if bos is not None and ids and ids[0] == bos else ids


# --- perplexity --------------------------------------------------------------------------


def perplexity(model, side: Side, ids: Sequence[int], chunk: int) -> dict:
    """Teacher-forced perplexity of ``ids`` through ``side``'s cache, fed in chunks of
    ``chunk``: ``ppl`` over every predicted position, ``tail`` over the second half,
    ``nll`` per position."""
    state = side.new(model, 1)
    nll: list = []
    chunk = side.chunk or chunk
    for start in range(0, len(ids) - 1, chunk):
        x = ids[start : min(start + chunk, len(ids) - 1)]
        y = mx.array(ids[start + 1 : start + 1 + len(x)])
        logits, state = side.feed(model, state, mx.array([x]))
        logits = logits[0].astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        loss = lse - mx.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        mx.eval(loss, side.arrays(state))
        nll += loss.tolist()
    half = nll[len(nll) // 2 :]
    return dict(
        ppl=math.exp(sum(nll) / len(nll)),
        tail=math.exp(sum(half) / len(half)),
        nll=nll,
        bytes=side.nbytes(state),
    )


# --- needle ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    ids: list
    key: int
    depth: float
    at: int  # index of the needle's first token in ids


def chat_frame(tok) -> tuple:
    """``(head, tail)`` ids around the user content: the chat template (when the
    tokenizer has one) with ``INSTRUCTION`` before, ``QUESTION`` after and the
    assistant's turn opened with ``ANSWER``."""
    mark = "\x00haystack\x00"
    if getattr(tok, "has_chat_template", False):
        text = tok.render([{"role": "user", "content": INSTRUCTION + mark + QUESTION}])
    else:
        text = INSTRUCTION + mark + QUESTION + "\n"
    head, _, tail = text.partition(mark)
    return tok.encode(head), _plain(tok, tail + ANSWER)


def needle_prompts(
    tok, filler: Sequence[int], length: int, depths: Sequence[float], keys: Sequence[int]
) -> list:
    """One prompt per (depth, key): ``length`` filler tokens with the needle inserted
    after ``round(depth * length)`` of them, in the chat frame. Every prompt has the
    same length (the keys' needles must tokenize to one length)."""
    if len(filler) < length:
        raise SystemExit(f"filler has {len(filler)} tokens, fewer than {length}")
    head, tail = chat_frame(tok)
    out = []
    for depth in depths:
        cut = round(depth * length)
        for key in keys:
            needle = _plain(tok, NEEDLE.format(key=key))
            ids = head + list(filler[:cut]) + needle + list(filler[cut:length]) + tail
            out.append(Prompt(ids, key, depth, len(head) + cut))
    sizes = {len(p.ids) for p in out}
    if len(sizes) != 1:
        raise SystemExit(f"needle prompts of one length differ in tokens: {sorted(sizes)}")
    return out


def pass_keys(rng: np.random.Generator, n: int) -> list:
    """``n`` distinct random 5-digit keys."""
    return [int(k) for k in rng.choice(np.arange(10000, 100000), size=n, replace=False)]


def answer_key(text: str) -> Optional[int]:
    """The first number written in ``text`` (None: none)."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def scored(text: str, key: int) -> bool:
    """Exact match: the answer's first number is ``key``."""
    return answer_key(text) == key


def greedy_answers(
    model, side: Side, prompts: Sequence[Sequence[int]], chunk: int, n: int
) -> tuple:
    """``(tokens, nbytes)``: ``n`` greedy tokens per prompt (equal lengths, one aligned
    batch) after feeding the prompts through ``side``'s cache in chunks of ``chunk``,
    and the cache's bytes after the prompts."""
    x = mx.array([list(p) for p in prompts])
    state = side.new(model, x.shape[0])
    logits = None
    chunk = side.chunk or chunk
    for start in range(0, x.shape[1], chunk):
        logits, state = side.feed(model, state, x[:, start : start + chunk], last=True)
        mx.eval(logits, side.arrays(state))
    nbytes = side.nbytes(state)
    assert logits is not None
    nxt = mx.argmax(logits[:, -1], axis=-1)
    out = [nxt]
    for _ in range(n - 1):
        logits, state = side.step(model, state, nxt)
        nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt, side.arrays(state))
        out.append(nxt)
    return mx.stack(out, axis=1).tolist(), nbytes


def needle_cell_scores(rows: Sequence[dict]) -> dict:
    """``(length, depth) -> hits / keys`` over rows of one side."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["length"], r["depth"]), []).append(r["hit"])
    return {k: sum(v) / len(v) for k, v in cells.items()}


# --- decode speed ------------------------------------------------------------------------


def decoder(model, side: Side, context: Sequence[int], chunk: int, steps: int) -> tuple:
    """``(run, holder)``: ``run()`` decodes ``steps`` greedy tokens from where the
    last call left (each token evaluated); ``holder`` has the state after ``context``."""
    state = side.new(model, 1)
    x = mx.array([list(context)])
    logits = None
    chunk = side.chunk or chunk
    for start in range(0, x.shape[1], chunk):
        logits, state = side.feed(model, state, x[:, start : start + chunk], last=True)
        mx.eval(logits, side.arrays(state))
    assert logits is not None
    holder = {"state": state, "next": mx.argmax(logits[:, -1], axis=-1)}
    del state

    def run():
        st, nxt = holder.pop("state"), holder.pop("next")  # no old record held
        for _ in range(steps):
            logits, st = side.step(model, st, nxt)
            nxt = mx.argmax(logits, axis=-1)
            mx.eval(nxt, side.arrays(st))
        holder.update(state=st, next=nxt)
        return nxt

    return run, holder


# --- the run -----------------------------------------------------------------------------


def run_ppl(model, tok, text, a, log: Callable) -> list:
    rows = []
    for n in a.ppl_tokens:
        ids = text_ids(tok, text, n)
        for side in sides_for(n, a.fractions, a.policies, a.extra, ring_chunk=a.ring_chunk):
            t = time.perf_counter()
            got = perplexity(model, side, ids, a.chunk)
            rows.append(
                dict(
                    section="ppl",
                    side=side.name,
                    budget=side.budget,
                    fraction=side.fraction,
                    tokens=n,
                    ppl=got["ppl"],
                    tail=got["tail"],
                    bytes=got["bytes"],
                    seconds=time.perf_counter() - t,
                )
            )
            log(
                f"ppl {n:>5} {side.name:<12} budget {str(side.budget):>5}  ppl "
                f"{got['ppl']:8.3f}  second half {got['tail']:8.3f}  "
                f"({rows[-1]['seconds']:.1f} s)"
            )
    return rows


def run_needle(model, tok, text, a, log: Callable) -> list:
    rng = np.random.default_rng(a.seed)
    filler = text_ids(tok, text, max(a.lengths), a.filler_offset)
    rows = []
    for length in a.lengths:
        keys = pass_keys(rng, a.keys)
        prompts = needle_prompts(tok, filler, length, a.depths, keys)
        for side in sides_for(length, a.fractions, a.policies, a.extra, ring_chunk=a.ring_chunk):
            t = time.perf_counter()
            answers: list = []
            nbytes = 0
            for i in range(0, len(prompts), a.batch):
                group = prompts[i : i + a.batch]
                toks, b = greedy_answers(
                    model, side, [p.ids for p in group], a.chunk, a.answer_tokens
                )
                answers += toks
                nbytes = max(nbytes, b)
            for p, ans in zip(prompts, answers):
                text_out = tok.decode(ans)
                rows.append(
                    dict(
                        section="needle",
                        side=side.name,
                        budget=side.budget,
                        fraction=side.fraction,
                        length=length,
                        tokens=len(p.ids),
                        depth=p.depth,
                        key=p.key,
                        answer=text_out,
                        hit=scored(text_out, p.key),
                    )
                )
            mine = [r for r in rows if r["side"] == side.name and r["length"] == length]
            cells = needle_cell_scores(mine)
            log(
                f"needle {length:>5} {side.name:<12} budget {str(side.budget):>5}  "
                + " ".join(f"{d:.2f}:{cells[(length, d)]:.2f}" for d in a.depths)
                + f"  mean {sum(r['hit'] for r in mine) / len(mine):.2f}  "
                f"({time.perf_counter() - t:.1f} s, {nbytes / 2**20:.1f} MiB)"
            )
    return rows


def run_decode(model, tok, text, a, log: Callable) -> list:
    ids = text_ids(tok, text, a.decode_context)
    sides = sides_for(a.decode_context, a.fractions, a.policies, a.extra, ring_chunk=a.ring_chunk)
    sides.insert(1, Side("full (mlx-lm)", "mlx-lm"))
    runs, holders = {}, {}
    log(f"decode: prefilling {len(sides)} sides with {len(ids)} tokens")
    for side in sides:
        runs[side.name], holders[side.name] = decoder(model, side, ids, a.chunk, a.steps)
    times = c.rounds(runs, a.rounds, warmup=1)
    base, base_lm = times["full"], times["full (mlx-lm)"]
    rows = []
    full_bytes = Side.nbytes(holders["full"]["state"])
    for side in sides:
        ts = times[side.name]
        x = [b / t for b, t in zip(base, ts)]
        x_lm = [b / t for b, t in zip(base_lm, ts)]
        nbytes = side.nbytes(holders[side.name]["state"])
        rows.append(
            dict(
                section="decode",
                side=side.name,
                budget=side.budget,
                fraction=side.fraction,
                context=a.decode_context,
                steps=a.steps,
                tok_s=c.summary([a.steps / t for t in ts], 1),
                x_full=c.summary(x, 1),
                x_mlx_lm=c.summary(x_lm, 1),
                bytes=nbytes,
                bytes_of_full=nbytes / full_bytes,
            )
        )
        log(
            f"decode {a.decode_context:>5} {side.name:<13} budget {str(side.budget):>5}  "
            f"{c.spread([a.steps / t for t in ts], 1, 'tok/s', 1)}  x full "
            f"{c.spread(x, 1, '', 3).strip()}  x mlx-lm KVCache {c.spread(x_lm, 1, '', 3).strip()}"
            f"  cache {nbytes / 2**20:.2f} MiB ({nbytes / full_bytes:.3f} of full KV's)"
        )
    return rows


def verdict(rows: Sequence[dict], policies: Sequence[str], fraction: int = 4) -> list:
    """The issue's target at ``1/fraction``, per policy: lines saying what was measured
    and whether it is met (retrieval >= 0.9 of full's and above the ring's; decode
    median x full >= 1)."""

    def mean_hit(side):
        hits = [r["hit"] for r in rows if r["section"] == "needle" and r["side"] == side]
        return sum(hits) / len(hits) if hits else None

    def x_full(side):
        got = [r["x_full"] for r in rows if r["section"] == "decode" and r["side"] == side]
        return got[0] if got else None

    full, ring = mean_hit("full"), mean_hit(f"ring 1/{fraction}")
    out = [f"target at 1/{fraction}: full KV retrieval {_fmt(full)}, ring {_fmt(ring)}"]
    for p in policies:
        name = f"{p} 1/{fraction}"
        hit, dec = mean_hit(name), x_full(name)
        if hit is None or full is None or ring is None:
            out.append(f"  {name}: not measured")
            continue
        ok_r = hit >= 0.9 * full and hit > ring
        ok_d = dec is not None and dec["median"] >= 1.0
        dec_s = "not measured" if dec is None else f"x{dec['median']:.3f} of full KV's speed"
        out.append(
            f"  {name}: retrieval {hit:.2f} ({'met' if ok_r else 'NOT met'}: >= "
            f"{0.9 * full:.2f} and > {ring:.2f}); decode {dec_s} "
            f"({'met' if ok_d else 'NOT met'})"
        )
    return out


def _fmt(x) -> str:
    return "not measured" if x is None else f"{x:.2f}"


def _extra(pairs: Sequence[str]) -> dict:
    out: dict[str, Any] = {}
    for pair in pairs:
        k, _, v = pair.partition("=")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small grid (CPU)")
    size.add_argument("--full", action="store_true", help="the issue's grid (default; GPU)")
    p.add_argument("--model", help="the GGUF file or mlx-lm directory (default: the cached one)")
    p.add_argument("--dtype", default="float32", help="the dequantized weights' dtype")
    p.add_argument("--text", default="docs", help="'docs' or a text file's path")
    p.add_argument("--only", nargs="+", choices=["ppl", "needle", "decode"])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--ppl-tokens", type=int, nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", help="needle filler lengths (tokens)")
    p.add_argument("--depths", type=float, nargs="+")
    p.add_argument("--keys", type=int, help="pass keys per needle cell")
    p.add_argument("--fractions", type=int, nargs="+", help="budget = context // f")
    p.add_argument("--chunk", type=int, help="tokens a forward feeds")
    p.add_argument(
        "--ring-chunk", type=int, help="the ring's own chunk (1: fed as decode; default --chunk)"
    )
    p.add_argument("--decode-context", type=int)
    p.add_argument("--steps", type=int, help="decode steps a round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--batch", type=int, default=16, help="needle prompts a forward")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--filler-offset", type=int, default=9000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--make",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="more make_states arguments for the compressed sides",
    )
    a = c.output_args(p).parse_args(argv)
    preset = PRESETS["quick" if a.quick else "full"]
    for k, v in preset.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.extra = _extra(a.make)
    if "snapkv" in a.policies and a.chunk <= a.extra.get("kv_window", 16):
        print(f"warning: chunk {a.chunk} <= snapkv's window: it scores nothing (as sinks)")
    return a


def main(argv=None):
    a = parse(argv)
    t0 = time.perf_counter()

    def log(line):
        print(f"[{time.perf_counter() - t0:6.1f} s] {line}", flush=True)

    loaded = c.real(a.model, dtype=a.dtype)
    model, tok = loaded.model, loaded.tokenizer
    text = corpus(a.text)
    compressed = compressed_available()
    log(
        f"model {loaded.name} ({a.dtype}), text {a.text} ({len(text)} characters), chunk "
        f"{a.chunk}, fractions {a.fractions}, policies "
        + (", ".join(a.policies) if compressed else "NOT MEASURED (make_states has no kv_budget)")
        + f"; {mx.default_device()}"
    )
    rows: list = []
    only = a.only or ["ppl", "needle", "decode"]
    if "ppl" in only:
        rows += run_ppl(model, tok, text, a, log)
    if "needle" in only:
        rows += run_needle(model, tok, text, a, log)
    if "decode" in only:
        rows += run_decode(model, tok, text, a, log)
    if 4 in a.fractions:
        for line in verdict(rows, a.policies if compressed else [], 4):
            log(line)
    if not compressed:
        log("compressed rows: not measured (make_states has no kv_budget on this checkout)")
    c.write(
        a,
        "long-context",
        rows,
        model=loaded.name,
        text=a.text,
        chunk=a.chunk,
        ring_chunk=a.ring_chunk,
        compressed=compressed,
        seconds=time.perf_counter() - t0,
    )


if __name__ == "__main__":
    main()
