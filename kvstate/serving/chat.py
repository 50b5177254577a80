"""A chat session as a value: messages in, text out, the conversation's cache kept.

``Chat`` holds the messages, the token ids its cache holds and a one-row
``kv.Batch`` (the cache, the reply's last sampled token pending, the row's
sampling settings and PRNG key). ``say`` renders the whole conversation with
the chat template, finds how much of it the cache already holds (the longest
common prefix with the tokens it holds), trims the rest away if the template
renders an earlier turn differently, and prefills only the new tokens: the
template slicing is done here, not by the caller. A ``Chat`` is never changed:
``say`` returns a new one, so an old one is a free snapshot to go back to.
``save``/``resume`` write and read one file: the records (``kv.save``: only
the tokens held) and, as JSON, the messages, the tokens and any JSON metadata.
A resumed session continues exactly as the uninterrupted one would, sampled
replies included (the PRNG key is saved with the row).

Decisions: ``notes/serving.md`` ("Chat sessions").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs
import mlx.core as mx

from .. import mlx_lm as bridge
from ..batch import Batch
from ..core import ops
from ..errors import bad, check
from ..persist import load as load_records
from ..persist import save as save_records
from ..sampling import Sampling
from .prefix_cache import common_prefix

__all__ = ["Chat"]

SESSION_KEY = "chat.session"  # the file's metadata key holding the session as JSON


@attrs.frozen
class Chat:
    """A conversation: ``messages`` (dicts with ``role`` and ``content``),
    ``tokens`` (the ids its cache holds), ``batch`` (``None`` before the first
    turn) and ``sampling`` (every reply's). Make one with ``Chat.start``."""

    messages: tuple
    tokens: tuple
    batch: Optional[Batch]
    sampling: Sampling

    @classmethod
    def start(cls, *, system: Optional[str] = None, sampling: Optional[Sampling] = None) -> Chat:
        """An empty conversation, with a system message when ``system`` is given."""
        messages = () if system is None else ({"role": "system", "content": system},)
        if system is not None:
            check(isinstance(system, str), "system", "a str", type(system).__name__)
        return cls(messages, (), None, sampling or Sampling())

    def say(
        self,
        model: Any,
        tokenizer: Any,
        content: str,
        *,
        max_tokens: int = 256,
        on_text: Optional[Callable[[str], None]] = None,
    ) -> tuple:
        """The user's ``content`` and the model's reply: ``(chat, reply text)``.

        Only the tokens the cache does not hold yet are prefilled; the reply
        ends at an end-of-sequence token or ``max_tokens``; ``on_text`` is called
        with each piece of the reply's text as it is decoded (streaming)."""
        check(isinstance(content, str), "content", "a str", type(content).__name__)
        check(isinstance(max_tokens, int) and max_tokens >= 1, "max_tokens", ">= 1", max_tokens)
        messages = (*self.messages, {"role": "user", "content": content})
        ids = list(tokenizer.chat(list(messages)))
        held, batch = self._continue(model, ids)
        reply, batch, ended = _reply(model, tokenizer, batch, max_tokens, on_text)
        text = tokenizer.decode(reply)
        # every reply token is in the cache but the pending one: the end-of-sequence
        # token, or at max_tokens the reply's last
        held = (*held, *(reply if ended else reply[:-1]))
        chat = Chat((*messages, {"role": "assistant", "content": text}), held, batch, self.sampling)
        return chat, text

    def _continue(self, model: Any, ids: list) -> tuple:
        """The batch with ``ids`` in its cache but the last, which is sampled after:
        ``(tokens held, batch)`` with the first reply token pending."""
        if self.batch is None:
            batch = bridge.admit(model, [ids], sampling=self.sampling)
            return tuple(ids), batch
        same = min(common_prefix(self.tokens, ids), len(ids) - 1)
        states = list(self.batch.states)
        if same < len(self.tokens):  # the template renders an earlier turn otherwise
            states = [ops.trim(s, len(self.tokens) - same) for s in states]
        first = mx.array([ids[same]], mx.uint32)
        batch = attrs.evolve(self.batch, states=states, tokens=first)
        return tuple(ids), bridge.feed(model, batch, [ids[same + 1 :]])

    def save(self, path: str | os.PathLike, metadata: Any = None) -> None:
        """One file: the cache (``kv.save``) and the session, ``metadata`` any JSON value."""
        if self.batch is None:
            raise bad("chat", "a chat with a turn", "an empty chat")
        session = {
            "messages": list(self.messages),
            "tokens": list(self.tokens),
            "metadata": metadata,
        }
        try:
            text = json.dumps(session)
        except (TypeError, ValueError) as e:
            raise bad("metadata", "a JSON value", f"{type(metadata).__name__} ({e})") from None
        save_records(path, self.batch, {SESSION_KEY: text})

    @classmethod
    def resume(cls, path: str | os.PathLike, model: Any) -> tuple:
        """``(chat, metadata)`` from ``save``'s file (refused for another model's
        geometry, or a file that is not a chat session)."""
        batch, meta = load_records(path, model=model)
        check(SESSION_KEY in meta, "path", "a file written by Chat.save", "no chat session in it")
        check(isinstance(batch, Batch), "path", "a saved chat's batch", type(batch).__name__)
        session = json.loads(meta[SESSION_KEY])
        chat = cls(tuple(session["messages"]), tuple(session["tokens"]), batch, batch.sampling[0])
        return chat, session["metadata"]


def _reply(model: Any, tokenizer: Any, batch: Batch, max_tokens: int, on_text) -> tuple:
    """Tokens sampled until an end-of-sequence token (pending, not in the reply) or
    ``max_tokens`` (the last one pending in the batch): ``(reply ids, batch, whether
    it ended at an end-of-sequence token)``."""
    reply: list = []
    shown = ""
    while len(reply) < max_tokens:
        token = batch.tokens.item()
        if token in tokenizer.eos_ids:
            return reply, batch, True
        reply.append(token)
        shown = _stream(tokenizer, reply, shown, on_text)
        if len(reply) < max_tokens:
            batch = bridge.advance(model, batch)
    return reply, batch, False


def _stream(tokenizer: Any, reply: Sequence[int], shown: str, on_text) -> str:
    """Hand ``on_text`` the text decoded since ``shown`` (held back while the
    last token ends inside a character)."""
    if on_text is None:
        return shown
    text = tokenizer.decode(reply)
    if text.endswith("\ufffd") or not text.startswith(shown):
        return shown
    if len(text) > len(shown):
        on_text(text[len(shown) :])
    return text
