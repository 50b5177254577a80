"""Grammar engines on the real vocabulary: compile time and the per-token mask at B rows.

Which engine ``kvstate.serving.grammar`` uses was chosen here (llguidance): xgrammar against
llguidance on SmolLM2-135M's vocabulary (49152 tokens, the tokenizer from
``kvstate.models``). Each of ``--batch`` rows holds its own matcher of one of
``SCHEMAS`` (row ``b`` takes schema ``b % len(SCHEMAS)``, compiled once per row:
every row's own grammar, as requests bring them) and walks the tokens of a valid
instance of it. Per token, timed over every row at once:

- ``fill``: the next-token bitmask of every row (each engine's parallel batch
  fill: ``xgrammar.BatchGrammarMatcher``, ``llguidance.numpy.fill_next_token_bitmask_par``);
- ``accept``: every row's matcher advanced by its token;
- ``apply``: the bitmask applied to ``[B, V]`` float32 logits in MLX
  (``kvstate.serving.grammar.apply_bitmask``, the same for both engines).

``compile``: one schema's grammar from its JSON text to a matcher's first mask
(xgrammar: ``compile_json_schema`` then the first fill; llguidance: the matcher's
construction then its first fill; its grammars compile lazily).

``decode``: a scheduler round of B rows decoding (SmolLM2-135M, greedy) with
every row under its own JSON-schema matcher against none: the cost per token of
structured output as served (the fill overlaps the forward; the mask is applied
in the sampling step).

``--speculative N``: structured output with lookup speculation against structured
output alone, side by side in one process: ``N`` rounds, each running the same B
JSON-schema requests (every row a grammar row, greedy) through the scheduler once
with ``Lookup()`` and once without, in alternating order; the tokens must be equal.
Prompts give a JSON list that the reply repeats (where lookup drafting helps).
Reports tokens per second of each and their ratio per round (median, spread).

xgrammar is not a kvstate dependency: its half runs where it is installed, and
is skipped with a message otherwise.

    python -m benchmarks grammar --batch 32 --repeats 5
    python -m benchmarks grammar --engines --decode 0 --batch 8 --speculative 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "ok": {"type": "boolean"},
        },
        "required": ["city", "tags", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
                    "required": ["id", "label"],
                },
            },
        },
        "required": ["kind", "score", "items"],
    },
]
INSTANCES = [
    {"name": "Ada Lovelace", "age": 36},
    {"city": "Paris", "tags": ["river", "museum", "bridge"], "ok": True},
    {"kind": "green", "score": 2.5, "items": [{"id": 1, "label": "one"}, {"id": 2, "label": "b"}]},
]


def _median(xs) -> str:
    return f"{statistics.median(xs) * 1e3:.3f} ms [{min(xs) * 1e3:.3f}-{max(xs) * 1e3:.3f}]"


def _xgrammar_info(xgr, tok, V: int):
    """xgrammar's ``TokenizerInfo`` of a ``kvstate.models.Tokenizer`` (its vocabulary
    type read from the ``tokenizers`` decoder)."""
    backend = tok.backend
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    kind = (
        xgr.VocabType.BYTE_LEVEL
        if "ByteLevel" in decoder
        else xgr.VocabType.BYTE_FALLBACK
        if "ByteFallback" in decoder
        else xgr.VocabType.RAW
    )
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(V, max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    return xgr.TokenizerInfo(encoded, kind, vocab_size=V, stop_token_ids=list(tok.eos_ids))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, V: int, threads: int):
        import numpy as np
        import xgrammar as xgr

        self.xgr, self.np = xgr, np
        self.info = _xgrammar_info(xgr, tok, V)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads)
        self.V = V

    def matcher(self, schema: dict):
        cg = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        m = self.xgr.GrammarMatcher(cg)
        m.fill_next_token_bitmask(self.np.full((1, (self.V + 31) // 32), -1, self.np.int32))
        return m

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, tokens) -> None:
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t), "a valid instance's token refused"


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, V: int, threads: int):
        import llguidance as llg
        import llguidance.numpy as llnp
        import numpy as np

        self.llg, self.llnp, self.np = llg, llnp, np
        backend = tok.backend
        self.tok = llg.LLTokenizer(backend.to_str(), n_vocab=V, eos_token=tok.eos_ids[0])
        self.executor = llg.LLExecutor(threads)
        self.V = V

    def matcher(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
        )
        m = self.llg.LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        self.llnp.fill_next_token_bitmask(m, self.np.full((1, (self.V + 31) // 32), -1, "int32"))
        return m

    def fill(self, matchers, bitmask) -> None:
        self.llnp.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matchers, tokens) -> None:
        for m, t in zip(matchers, tokens):
            assert m.consume_token(t), m.get_error()


def _walk(engine, B: int, paths: list, V: int) -> dict:
    """One pass: fresh matchers, every row through its instance's tokens."""
    import mlx.core as mx
    import numpy as np

    from kvstate.serving.grammar import apply_bitmask

    matchers = [engine.matcher(SCHEMAS[b % len(SCHEMAS)]) for b in range(B)]
    bitmask = np.full((B, (V + 31) // 32), -1, np.int32)
    logits = mx.random.normal((B, V))
    mx.eval(logits)
    out: dict = {"fill": [], "accept": [], "apply": []}
    for i in range(min(map(len, paths))):
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        mx.eval(apply_bitmask(logits, mx.array(bitmask)))
        t2 = time.perf_counter()
        engine.accept(matchers, [paths[b % len(paths)][i] for b in range(B)])
        t3 = time.perf_counter()
        out["fill"].append(t1 - t0)
        out["apply"].append(t2 - t1)
        out["accept"].append(t3 - t2)
    return out


# A schema no row finishes within the timed rounds: every round masks all B rows.
LONG = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["items"],
}


def decode_rounds(loaded, B: int, rounds: int, grammar: bool) -> list:
    """Seconds per scheduler round of ``B`` decoding rows (all admitted first), each
    row with its own ``LONG`` matcher or none (kvstate's engine: llguidance)."""
    from kvstate.serving.grammar import Grammar, Grammars
    from kvstate.serving.scheduler import Job, Scheduler

    tok = loaded.tokenizer
    compiled = Grammars(tok, int(loaded.model.args.vocab_size))
    sched = Scheduler(loaded.model, tok.eos_ids, max_batch=B, prefill_budget=None)
    prompt = tok.chat([{"role": "user", "content": "A list of words as JSON:"}])
    for _ in range(B):
        g = compiled.compile(Grammar("json_schema", LONG)) if grammar else None
        sched.submit(Job(prompt=prompt, max_tokens=rounds + 4, temperature=0.0, grammar=g))
    sched.step()  # admission: every row prefilled and joined
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sched.step()
        out.append(time.perf_counter() - t0)
    return out


RECORDS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "city": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "city", "age"],
        "additionalProperties": False,
    },
    "minItems": 3,
    "maxItems": 3,
}
PEOPLE = [
    [("Ann", "Oslo", 31), ("Bob", "Rome", 45), ("Cyd", "Lima", 27)],
    [("Dan", "Kyiv", 52), ("Eve", "Cork", 38), ("Fay", "Bern", 19)],
]


def speculative_rounds(loaded, B: int, max_tokens: int, window: str, drafted: bool) -> tuple:
    """``(tokens per row, seconds)``: ``B`` JSON-schema requests (each a list of the
    prompt's records to repeat) run through the scheduler to their end, with
    ``Lookup()`` drafting (``window``: ``fixed``, every row up to 4 drafts; ``cost``:
    ``Window()``) or plain."""
    from kvstate.serving.grammar import Grammar, Grammars
    from kvstate.serving.scheduler import Job, Scheduler
    from kvstate.speculative import Window
    from kvstate.speculative.drafts import Lookup

    tok = loaded.tokenizer
    compiled = Grammars(tok, int(loaded.model.args.vocab_size)).compile(
        Grammar("json_schema", RECORDS)
    )
    options: dict = {}
    if drafted:
        options = dict(drafter=Lookup(), num_draft=4)
        options["window"] = Window() if window == "cost" else None
    sched = Scheduler(loaded.model, tok.eos_ids, max_batch=B, prefill_budget=None, **options)
    out: list = [[] for _ in range(B)]
    for b in range(B):
        people = [dict(name=n, city=c, age=a) for n, c, a in PEOPLE[b % len(PEOPLE)]]
        text = json.dumps(people, separators=(",", ":"))
        q = f"People as JSON: {text}\nWrite the same list as JSON again."
        job = Job(
            prompt=tok.chat([{"role": "user", "content": q}]),
            max_tokens=max_tokens,
            grammar=compiled,
        )
        job.emit = lambda kind, _c, v, b=b: out[b].append(v) if kind == "token" else None
        sched.submit(job)
    t0 = time.perf_counter()
    while sched.step():
        pass
    return out, time.perf_counter() - t0


def speculative(loaded, B: int, rounds: int, max_tokens: int, window: str) -> None:
    """Structured output with lookup speculation against without, side by side."""
    speculative_rounds(loaded, 2, 4, window, True)  # warm-up: grammar view, first shapes
    ratios, rates = [], {False: [], True: []}
    for r in range(rounds):
        got = {}
        for drafted in (r % 2 == 1, r % 2 == 0):  # alternating order
            tokens, seconds = speculative_rounds(loaded, B, max_tokens, window, drafted)
            got[drafted] = tokens
            rates[drafted].append(sum(map(len, tokens)) / seconds)
        assert got[True] == got[False], "speculation changed the tokens"
        ratios.append(rates[True][-1] / rates[False][-1])
        print(
            f"round {r}: {rates[True][-1]:.2f} tok/s with lookup ({window}), "
            f"{rates[False][-1]:.2f} without: {ratios[-1]:.3f}x"
        )
    n = sum(map(len, got[True]))
    print(
        f"B={B} structured + lookup ({window}) / structured alone: "
        f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}] "
        f"over {rounds} rounds ({n} tokens a run)"
    )


def _engines(names: list, tok, V: int, threads: int) -> list:
    """The engines asked for that are installed (xgrammar is not a kvstate dependency)."""
    kinds = {"xgrammar": Xgrammar, "llguidance": Llguidance}
    out = []
    for name in names:
        try:
            __import__(name)
        except ImportError:
            print(f"{name} is not installed: its half of the comparison is skipped")
            continue
        t0 = time.perf_counter()
        engine = kinds[name](tok, V, threads)
        out.append((engine, time.perf_counter() - t0))
    return out


def compare(engine, setup: float, B: int, repeats: int, paths: list, V: int) -> None:
    """Compile, fill, accept and apply times of one engine."""
    compile_s = {i: [] for i in range(len(SCHEMAS))}  # type: dict
    for _ in range(repeats):
        for i, s in enumerate(SCHEMAS):
            t0 = time.perf_counter()
            engine.matcher(s)
            compile_s[i].append(time.perf_counter() - t0)
    times: dict = {"fill": [], "accept": [], "apply": []}
    for _ in range(repeats):
        for k, v in _walk(engine, B, paths, V).items():
            times[k] += v
    print(f"{engine.name}: tokenizer setup {setup * 1e3:.0f} ms")
    for i in compile_s:
        print(f"  compile schema {i}: {_median(compile_s[i])}")
    for k, v in times.items():
        print(f"  {k} (B={B}, per token): {_median(v)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="passes over the instances (5)")
    ap.add_argument("--threads", type=int, default=2, help="engine threads (2: this CPU's cores)")
    ap.add_argument("--engines", nargs="*", default=["xgrammar", "llguidance"])
    ap.add_argument(
        "--speculative",
        type=int,
        default=0,
        help="rounds of structured output with and without lookup speculation (0: skip)",
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="per row, --speculative (64)")
    ap.add_argument("--draft-window", choices=["fixed", "cost"], default="fixed")
    ap.add_argument(
        "--decode", type=int, default=12, help="scheduler rounds timed with and without (0: skip)"
    )
    args = ap.parse_args(argv)
    from kvstate.models import load as models

    loaded = models.load_model(None, dequantize=True)
    tok, V = loaded.tokenizer, int(loaded.model.args.vocab_size)
    paths = [tok.encode(json.dumps(x, separators=(",", ":"))) for x in INSTANCES]
    print(f"V={V} B={args.batch} tokens per row: {[len(p) for p in paths]}")
    for engine, setup in _engines(args.engines, tok, V, args.threads):
        compare(engine, setup, args.batch, args.repeats, paths, V)
    if args.decode:
        for grammar in (False, True):
            t = decode_rounds(loaded, args.batch, args.decode, grammar)
            print(f"decode round, B={args.batch}, grammar rows {grammar}: {_median(t)}")
    if args.speculative:
        speculative(loaded, args.batch, args.speculative, args.max_tokens, args.draft_window)


if __name__ == "__main__":
    main()
