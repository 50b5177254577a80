"""Structured output: a grammar per row, its matcher row state.

A request may constrain its reply to a grammar: a JSON schema, any JSON object,
a regular expression or an EBNF grammar (``Grammar``, built from the request's
``response_format`` or vLLM's ``structured_outputs`` by ``kvstate.serving.http``).
The grammar is compiled once per request, on the HTTP side (``Grammars.compile``,
xgrammar); each of the request's rows then holds its own matcher, which the
scheduler advances with every token the row emits. Each round the matchers of
the rows that have one fill one bitmask for the whole batch (``Grammars.fill``,
xgrammar's batch fill on its own threads) and the sampler sets every token a
row's matcher forbids to ``-inf`` before its filters and temperature
(``kvstate.sampling.apply_bitmask``)::

    round t:   forward(rows) ──▶ logits [B, V] ──▶ apply_bitmask ──▶ sample ──▶ tokens
                                                      ▲                          │
               matchers ── fill [B, ceil(V/32)] ──────┘        accept_token ◀────┘

A row without a grammar gets an all-ones mask word row (nothing forbidden);
a batch without any grammar builds no mask at all. A row whose matcher has
terminated (it accepted an end-of-sequence token its grammar allowed) ends
with ``finish_reason: "stop"``. Why xgrammar and not llguidance, and the
measured costs: ``notes/serving.md``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any, Optional

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
    "apply_bitmask",
    "fill",
    "matcher",
    "tokenizer_info",
]

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
SEPARATORS = (",", ":")  # JSON without optional whitespace: a small model cannot pad forever


@attrs.frozen
class Grammar:
    """What a request constrains its reply to.

    Attributes:
        kind: one of ``KINDS``.
        source: the JSON schema (a dict) for ``json_schema``; the pattern for
            ``regex``; the EBNF text for ``grammar``; the strings for ``choice``
            (a tuple); ``None`` for ``json_object``.
        arg: the request field it came from (named in errors).
    """

    kind: str
    source: Any = None
    arg: str = "response_format"

    def __attrs_post_init__(self):
        if self.kind not in KINDS:
            raise bad(f"{self.arg} kind", f"one of {list(KINDS)}", repr(self.kind))


def _vocab_type(backend):
    """xgrammar's ``VocabType`` of a ``tokenizers.Tokenizer``, read from its decoder."""
    import xgrammar as xgr

    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if "ByteLevel" in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def tokenizer_info(tok: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's ``TokenizerInfo`` of a ``kvstate.models.Tokenizer``, for a model of
    ``vocab_size`` logits (ids past the tokenizer's vocabulary are never allowed)."""
    import xgrammar as xgr

    backend = tok.backend
    if backend is None:
        raise KVStateError("structured output needs a fast (tokenizers) tokenizer; this has none")
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    return xgr.TokenizerInfo(
        encoded, _vocab_type(backend), vocab_size=vocab_size, stop_token_ids=list(tok.eos_ids)
    )


def _ebnf_choice(choices: tuple) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class Grammars:
    """Compiles ``Grammar``s for one tokenizer (xgrammar's compiler, which caches them).

    Args:
        tok: a ``kvstate.models.Tokenizer`` with a ``backend``.
        vocab_size: the model's logits per position.
        threads: the compiler's threads.
    """

    def __init__(self, tok: Tokenizer, vocab_size: int, threads: int = 2) -> None:
        import xgrammar as xgr

        self.compiler = xgr.GrammarCompiler(tokenizer_info(tok, vocab_size), max_threads=threads)

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar (xgrammar's ``CompiledGrammar``, shareable across rows);
        ``KVStateError`` naming ``grammar.arg`` when it does not compile."""
        c, kind = self.compiler, grammar.kind
        try:
            if kind == "json_schema":
                return c.compile_json_schema(
                    json.dumps(grammar.source), any_whitespace=False, separators=SEPARATORS
                )
            if kind == "json_object":
                return c.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=False,
                    separators=SEPARATORS,
                    strict_mode=False,
                )
            if kind == "regex":
                return c.compile_regex(grammar.source)
            if kind == "grammar":
                return c.compile_grammar(grammar.source)
            return c.compile_grammar(_ebnf_choice(grammar.source))
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its reason
            raise bad(
                grammar.arg, f"a {kind} the grammar engine compiles", _first_line(exc)
            ) from None


def matcher(compiled: Any) -> Any:
    """A fresh matcher of a compiled grammar (``Grammars.compile``): one per row."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


@functools.cache
def _batch(threads: int):
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(threads)


def fill(matchers: Sequence, vocab_size: int, threads: int = 2) -> Optional[mx.array]:
    """The batch bitmask ``[B, ceil(V/32)]`` int32 of rows whose matcher is
    ``matchers[b]`` (``None``: the row is free, every bit set), or ``None`` when no
    row has one. The matchers are read, not changed (xgrammar's batch fill, on
    ``threads`` threads)."""
    rows = [b for b, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = np.full((len(matchers), (vocab_size + 31) // 32), -1, np.int32)
    _batch(threads).batch_fill_next_token_bitmask([matchers[b] for b in rows], bitmask, rows)
    return mx.array(bitmask)


def _first_line(exc: BaseException) -> str:
    """The engine's reason, less its ``[time] file:line:`` prefix."""
    lines = str(exc).strip().splitlines()
    return repr(re.sub(r"^\[[^\]]*\] \S+: ", "", lines[0]) if lines else type(exc).__name__)
