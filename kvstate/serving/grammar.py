"""Structured output: a grammar per row, its matcher row state.

A request may constrain its reply to a grammar: a JSON schema, any JSON object,
a regular expression, a Lark (or GBNF) grammar or a choice of strings
(``Grammar``, built from the request's ``response_format`` or vLLM's
``structured_outputs`` / ``guided_*`` by ``kvstate.serving.request``). The
grammar is compiled once per request, on the HTTP side (``Grammars.compile``,
llguidance); each of the request's rows then holds its own matcher (a copy),
which the scheduler advances with every token the row emits (``accept``). Each
round the matchers of the rows that have one fill one bitmask for the whole
batch (``fill``, llguidance's parallel fill on its own threads), one word row
per position of the round's verify window (a drafting row's matcher steps over
its drafts and back), and every token a row's matcher forbids at a position is
set to ``-inf`` after the row's logits processors and before its
log-probabilities, filters and temperature (``kvstate.sampling.apply_bitmask``)::

    round t:   forward([y d1..dk]) ──▶ logits [B, N, V] ──▶ apply_bitmask ──▶ verify ──▶ tokens
                                                              ▲                           │
               matchers ── fill [B, N, ceil(V/32)] ───────────┘              accept ◀─────┘
               (consume d1..dk, fill each position, roll back)    (the emitted tokens only)

A row without a grammar gets an all-ones mask word row (nothing forbidden);
a batch without any grammar builds no mask at all. A row whose matcher has
stopped (it accepted an end-of-sequence token its grammar allowed) ends
with ``finish_reason: "stop"``. Why llguidance and not xgrammar, and the
measured costs: ``notes/serving.md``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any, Optional, cast

import attrs
import mlx.core as mx
import numpy as np

from ..errors import KVStateError, bad
from ..models.tokenizer import Tokenizer
from ..sampling import apply_bitmask

__all__ = [
    "KINDS",
    "Grammar",
    "Grammars",
    "accept",
    "apply_bitmask",
    "fill",
    "matcher",
    "tokenizer_info",
]

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "lark")
# JSON without optional whitespace: a small model cannot pad forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@attrs.frozen
class Grammar:
    """What a request constrains its reply to.

    Attributes:
        kind: one of ``KINDS``.
        source: the JSON schema (a dict) for ``json_schema``; the pattern for
            ``regex``; the EBNF text for ``grammar``; the strings for ``choice``
            (a tuple); ``None`` for ``json_object``; llguidance's Lark text, taken as
            it is, for ``lark`` (what ``tools.tool_grammar`` writes).
        arg: the request field it came from (named in errors).
    """

    kind: str
    source: Any = None
    arg: str = "response_format"

    def __attrs_post_init__(self):
        if self.kind not in KINDS:
            raise bad(f"{self.arg} kind", f"one of {list(KINDS)}", repr(self.kind))


def tokenizer_info(tok: Tokenizer, vocab_size: int) -> Any:
    """llguidance's ``LLTokenizer`` of a ``kvstate.models.Tokenizer``, for a model of
    ``vocab_size`` logits (ids past the tokenizer's vocabulary are never allowed); its
    end-of-sequence tokens are the tokenizer's ``eos_ids``."""
    import llguidance as llg

    backend = tok.backend
    if backend is None:
        raise KVStateError("structured output needs a fast (tokenizers) tokenizer; this has none")
    return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(tok.eos_ids))


def _lark_choice(choices: tuple) -> str:
    """A Lark grammar whose sentences are exactly ``choices`` (JSON string literals)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class Grammars:
    """Compiles ``Grammar``s for one tokenizer (llguidance; its grammars build lazily,
    so a compile is a matcher's construction, checked for errors).

    Args:
        tok: a ``kvstate.models.Tokenizer`` with a ``backend``.
        vocab_size: the model's logits per position.
        threads: the executor's threads for the batch fill.
    """

    def __init__(self, tok: Tokenizer, vocab_size: int, threads: int = 2) -> None:
        self.tokenizer = tokenizer_info(tok, vocab_size)
        self.threads = threads

    def compile(self, grammar: Grammar) -> Any:
        """A matcher at the grammar's start (each row takes a ``matcher`` copy of it);
        ``KVStateError`` naming ``grammar.arg`` when it does not compile."""
        import llguidance as llg

        try:
            m = llg.LLMatcher(self.tokenizer, _source(grammar), log_level=0)
        except Exception as exc:  # a schema that is not JSON, an API misuse
            raise bad(
                grammar.arg, f"a {grammar.kind} llguidance compiles", _first_line(exc)
            ) from None
        if m.is_error():
            raise bad(
                grammar.arg, f"a {grammar.kind} llguidance compiles", _first_line(m.get_error())
            )
        return m


def _source(grammar: Grammar) -> str:
    """llguidance's grammar text of ``grammar`` (``ValueError`` for a schema it cannot
    read)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = grammar.kind
    if kind in ("json_schema", "json_object"):
        schema = grammar.source if kind == "json_schema" else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, JSON_OPTIONS))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.source)
    if kind == "grammar":  # Lark, or GBNF / xgrammar's EBNF (``::=``) converted
        return LLMatcher.grammar_from_lark(any_to_lark(grammar.source))
    if kind == "lark":
        return LLMatcher.grammar_from_lark(grammar.source)
    return LLMatcher.grammar_from_lark(_lark_choice(grammar.source))


def matcher(compiled: Any) -> Any:
    """A fresh matcher of a compiled grammar (``Grammars.compile``): one per row."""
    return compiled.deep_copy()


def accept(m: Any, token: int) -> bool:
    """``m`` advanced by ``token``; whether its grammar has ended (the reply is
    complete). A token the grammar refuses is a ``KVStateError``."""
    if not m.consume_token(token):
        raise KVStateError(f"the grammar refused token {token}: {m.get_error()}")
    return m.is_stopped()


@functools.cache
def _executor(threads: int):
    import llguidance as llg

    return llg.LLExecutor(threads)


def fill(
    matchers: Sequence, vocab_size: int, drafts: Optional[Sequence] = None, threads: int = 2
) -> Optional[mx.array]:
    """The batch bitmask ``[B, N, ceil(V/32)]`` int32, one word row per position of the
    round's window, of rows whose matcher is ``matchers[b]`` (``None``: the row is
    free, every bit set), or ``None`` when no row has one.

    Position 0 is each matcher's own state; position ``i`` is its state after
    ``drafts[b][:i]`` (``N = 1 + len(drafts[b])``; ``drafts=None``: ``N = 1``). A
    draft the grammar refuses ends the row's masks there: later positions keep
    every bit (their logits are never used: that draft is rejected by the mask
    before it). The matchers are left as they were: each consumes its drafts
    (``try_consume_tokens``, which refuses without entering llguidance's error
    state) and rolls them back (``rollback``), so a round that is retried or
    dropped changes no matcher; the tokens a round emits are fed afterwards
    (``accept``). Each position is one parallel fill (llguidance's, on
    ``threads`` threads) over the rows still inside their grammar.
    """
    from llguidance.numpy import fill_next_token_bitmask_par

    rows = [b for b, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    N = 1 + max((len(drafts[b]) for b in rows), default=0) if drafts is not None else 1
    B, words = len(matchers), (vocab_size + 31) // 32
    bitmask = np.full((B * N, words), -1, np.int32)
    consumed = dict.fromkeys(rows, 0)
    live = rows
    try:
        for i in range(N):
            pairs = [(matchers[b], b * N + i) for b in live]
            fill_next_token_bitmask_par(_executor(threads), pairs, bitmask)
            if i + 1 == N or drafts is None:
                break
            nxt = []
            for b in live:
                draft = drafts[b]
                if i < len(draft) and matchers[b].try_consume_tokens([int(draft[i])]) == 1:
                    consumed[b] += 1
                    nxt.append(b)
            live = nxt
            if not live:
                break
    finally:
        for b, n in consumed.items():
            if n:
                matchers[b].rollback(n)
    return mx.array(bitmask.reshape(B, N, words))


def _first_line(exc: object) -> str:
    """The engine's reason, less its ``[time] file:line:`` prefix."""
    lines = str(exc).strip().splitlines() if str(exc).strip() else []
    return repr(re.sub(r"^\[[^\]]*\] \S+: ", "", lines[0]) if lines else type(exc).__name__)
