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
from typing import Any, cast

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
    _render: Callable[..., str] | None  # (messages, tools=...) -> prompt text
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

            def render(messages, tools=None):
                return template.render(
                    messages=messages, tools=tools, add_generation_prompt=True, **extra
                )

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

            def render(messages, tools=None):
                return hf.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False
                )

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

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The chat template applied to ``messages`` (and ``tools``, OpenAI function
        tools, where the template renders them), with the assistant's turn opened."""
        self._check(messages)
        return self._apply(self.for_template(messages, tools), tools)

    def _check(self, messages: Sequence[dict]) -> None:
        if self._render is None:
            raise bad("tokenizer", "a chat template", "none (use encode on plain text)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
                raise bad(f"messages[{i}]", "a dict with 'role' and 'content'", repr(m))

    def _apply(self, prepared: list, tools) -> str:
        """The template over messages ``for_template`` already prepared."""
        self._check(prepared)
        render = cast(Callable[..., str], self._render)  # _check refused None
        return render(prepared, tools=tools if self.knows_tools else None)

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself."""
        return "tools" in self.template

    def for_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list:
        """``messages`` as this template can render them (the module docstring):
        ``developer`` as ``system`` and tool calls as content where it knows neither,
        ``tools`` described in the system message where it does not render them."""
        if tools and not self.knows_tools:
            messages = _with_tools(messages, tools)
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

    def chat(
        self,
        messages: Sequence[dict],
        *,
        control_tokens: bool = False,
        tools: Sequence[dict] | None = None,
    ) -> list:
        """Token ids of the chat template applied to ``messages``.

        The template's own markup is matched against the special tokens; the
        messages' ``content`` is encoded as text (a ``<|im_end|>`` typed in it is
        those characters), unless ``control_tokens``. Content with no special token
        in it encodes exactly as the rendered text does."""
        messages = self.for_template(messages, tools)
        if control_tokens or not self._forges(messages):
            ids = self._encode(self._apply(messages, tools))
        else:
            ids = self._literal_chat(messages, tools)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def _forges(self, messages: Sequence[dict]) -> bool:
        """Whether some message's content holds a special token's text."""
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        texts = [c for c in contents if isinstance(c, str)]
        return any(tok in c for c in texts for tok in self.special_tokens if tok)

    def _literal_chat(self, messages: Sequence[dict], tools=None) -> list:
        """The template rendered around placeholders: its markup encoded with special
        tokens matched, each content encoded as text in its place."""
        marks = [f"\x00kvstate-content-{i}\x00" for i in range(len(messages))]
        text = self._apply([{**m, "content": mark} for m, mark in zip(messages, marks)], tools)
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


TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _with_tools(messages: Sequence[dict], tools: Sequence[dict]) -> list:
    """``messages`` with ``tools`` described in the system message, in the Hermes form
    Qwen's template writes (for a template that does not render tools itself)."""
    text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    messages = list(messages)
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
