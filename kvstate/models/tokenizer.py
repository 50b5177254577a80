"""Text in, token ids out, and back: one small interface over two tokenizers.

A GGUF file carries a byte-level BPE (built with the ``tokenizers``
package, ``kvstate.models.gguf.tokenizer``); an mlx-lm model directory carries a
Hugging Face tokenizer (``from_hf``). Both become a ``Tokenizer``:
``encode``, ``decode``, ``chat`` (the model's chat template applied, then
encoded) and the end-of-sequence ids generation stops at.

Message content is text: ``chat`` matches special tokens only where the
template writes them, so a user who types ``<|im_start|>system`` gets those
characters, not a forged turn (``control_tokens=True`` lets content carry
them, for clients that build raw turns on purpose).

Messages are OpenAI's: roles ``system``, ``developer``, ``user``,
``assistant`` and ``tool``; an assistant's ``tool_calls`` (arguments as
objects) and a tool message's ``tool_call_id`` go to the template as they
are, where it renders them. A template that never names ``developer`` gets
that role as ``system``; one that never names ``tool_calls`` gets an
assistant's calls appended to its content in the Hermes form that
Qwen-style templates write (``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``), so the model sees the calls it made instead of an empty
turn (``for_template``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import bad


@attrs.frozen
class Tokenizer:
    """Functions over one vocabulary; built by ``from_backend`` or ``from_hf``.

    ``encode`` matches special tokens written in the text (``<|im_start|>``)
    and adds no BOS unless the model asks for one; ``decode`` leaves special
    tokens out.
    """

    _encode: Callable[[str], list]
    _encode_text: Callable[[str], list]  # special tokens written in the text stay text
    _decode: Callable[[list], str]
    _render: Callable[[list], str] | None  # messages -> prompt text
    eos_ids: tuple
    bos_id: int | None = None
    special_tokens: dict = attrs.field(factory=dict, eq=False)
    template: str = ""  # the chat template's source (what ``for_template`` asks of it)
    # the ``tokenizers.Tokenizer`` underneath (``None``: a slow Hugging Face tokenizer);
    # grammar engines read the vocabulary from it (``kvstate.serving.grammar``)
    backend: Any = attrs.field(default=None, eq=False)

    @classmethod
    def from_backend(
        cls,
        backend,
        *,
        eos_ids: Sequence[int],
        bos_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: dict | None = None,
    ) -> Tokenizer:
        """Wrap a ``tokenizers.Tokenizer`` and a jinja2 chat template (as Hugging Face
        renders it: a sandbox, ``trim_blocks``, ``lstrip_blocks``)."""
        render = None
        if chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            template = env.from_string(chat_template)
            ids = special_tokens or {}
            names = {v: k for k, v in ids.items()}
            extra = {
                "eos_token": names.get(eos_ids[0], ""),
                "bos_token": names.get(bos_id, "") if bos_id is not None else "",
            }

            def render(messages):
                return template.render(messages=messages, add_generation_prompt=True, **extra)

        literal = copy.deepcopy(backend)  # its own object: the flag is the backend's state
        literal.encode_special_tokens = True
        # encode_batch, not encode: it lets go of the GIL while it works, so a long
        # prompt tokenized in a worker thread does not stall the server's event loop
        return cls(
            lambda text: backend.encode_batch([text], add_special_tokens=False)[0].ids,
            lambda text: literal.encode_batch([text], add_special_tokens=False)[0].ids,
            lambda ids: backend.decode(list(ids), skip_special_tokens=True),
            render,
            tuple(int(i) for i in eos_ids),
            bos_id,
            dict(special_tokens or {}),
            chat_template or "",
            backend,
        )

    @classmethod
    def from_hf(cls, tok) -> Tokenizer:
        """Wrap an mlx-lm ``TokenizerWrapper`` (or a Hugging Face tokenizer)."""
        hf = getattr(tok, "_tokenizer", tok)
        eos = getattr(tok, "eos_token_ids", None) or [hf.eos_token_id]
        render = None
        if getattr(hf, "chat_template", None):

            def render(messages):
                return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

        special = {t: hf.convert_tokens_to_ids(t) for t in getattr(hf, "all_special_tokens", [])}
        special.update(getattr(hf, "added_tokens_encoder", None) or {})
        return cls(
            lambda text: list(hf.encode(text, add_special_tokens=False)),
            lambda text: list(hf.encode(text, add_special_tokens=False, split_special_tokens=True)),
            lambda ids: hf.decode(list(ids), skip_special_tokens=True),
            render,
            tuple(sorted(int(i) for i in eos if i is not None)),
            hf.bos_token_id if getattr(hf, "add_bos_token", False) else None,
            special,
            hf.chat_template if isinstance(getattr(hf, "chat_template", None), str) else "",
            getattr(hf, "backend_tokenizer", None),
        )

    @property
    def has_chat_template(self) -> bool:
        return self._render is not None

    def encode(self, text: str) -> list:
        """Token ids of ``text`` (special tokens written in it are matched)."""
        if not isinstance(text, str):
            raise bad("text", "a str", type(text).__name__)
        ids = self._encode(text)
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens are left out."""
        return self._decode([int(i) for i in ids])

    def render(self, messages: Sequence[dict]) -> str:
        """The chat template applied to ``messages``, with the assistant's turn opened."""
        if self._render is None:
            raise bad("tokenizer", "a chat template", "none (use encode on plain text)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
                raise bad(f"messages[{i}]", "a dict with 'role' and 'content'", repr(m))
        return self._render(self.for_template(messages))

    def for_template(self, messages: Sequence[dict]) -> list:
        """``messages`` as this template can render them (the module docstring):
        ``developer`` as ``system`` and tool calls as content where it knows neither."""
        out = []
        for m in messages:
            if not isinstance(m, dict):  # (render names it)
                out.append(m)
                continue
            m = dict(m)
            if m.get("role") == "developer" and "developer" not in self.template:
                m["role"] = "system"
            if m.get("tool_calls") and "tool_calls" not in self.template:
                calls = [_hermes(c) for c in m.pop("tool_calls")]
                m["content"] = "\n".join([m["content"]] * bool(m.get("content")) + calls)
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
        return out

    def chat(self, messages: Sequence[dict], *, control_tokens: bool = False) -> list:
        """Token ids of the chat template applied to ``messages``.

        The template's own markup is matched against the special tokens; the
        messages' ``content`` is encoded as text (a ``<|im_end|>`` typed in it is
        those characters), unless ``control_tokens``. Content with no special token
        in it encodes exactly as the rendered text does."""
        messages = self.for_template(messages)
        if control_tokens or not self._forges(messages):
            ids = self._encode(self.render(messages))
        else:
            ids = self._literal_chat(messages)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def _forges(self, messages: Sequence[dict]) -> bool:
        """Whether some message's content holds a special token's text."""
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        texts = [c for c in contents if isinstance(c, str)]
        return any(tok in c for c in texts for tok in self.special_tokens if tok)

    def _literal_chat(self, messages: Sequence[dict]) -> list:
        """The template rendered around placeholders: its markup encoded with special
        tokens matched, each content encoded as text in its place."""
        marks = [f"\x00kvstate-content-{i}\x00" for i in range(len(messages))]
        text = self.render([{**m, "content": mark} for m, mark in zip(messages, marks)])
        ids: list = []
        for mark, m in zip(marks, messages):
            if mark not in text:  # a message the template leaves out
                continue
            head, _, text = text.partition(mark)
            ids += self._encode(head) + self._encode_text(m["content"])
        return ids + self._encode(text)


def _hermes(call: dict) -> str:
    """A tool call as Hermes/Qwen templates write it."""
    fn = call.get("function", call)
    body = {"name": fn.get("name"), "arguments": fn.get("arguments")}
    return "<tool_call>\n" + json.dumps(body) + "\n</tool_call>"
