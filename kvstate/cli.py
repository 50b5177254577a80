"""The ``kvstate`` command: continuous batched generation on kvstate records.

``kvstate generate`` runs a real model (SmolLM2-135M-Instruct by default,
fetched and cached on first use) on real prompts: the built-in set, or
``--prompt`` (repeatable), or ``--prompts FILE``. Each prompt goes through
the model's chat template; requests are prefilled together, decode as one
batch, and leave as they finish (``kvstate.engine``). Each completion is
printed as it finishes (``--json``: one JSON object per line), then a table.

``--model tiny`` is the built-in tiny llama with random weights on random
token ids (no download, no tokenizer): the arrival-schedule workload of
``--requests``, ``--prompt-len``, ``--gen-len`` and ``--arrival-gap``.

``--compare`` runs the same requests on mlx-lm's own batch caches in the
same process and reports token parity and the speed ratio. Decisions are
in ``notes/cli.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from tqdm import tqdm

import kvstate as kv

from .models.load import fetch as fetch_model
from .models.load import has_tokenizer, tiny_llama
from .serving.budget import DEFAULT_PREFILL_BUDGET, bytes_per_token, default_kv_budget
from .serving.chat import Chat
from .serving.engine import (
    Completion,
    KVStateEngine,
    MlxLmEngine,
    Request,
    SpeculativeEngine,
    serve,
)
from .serving.prefix_cache import PrefixCache, model_identity
from .serving.prefix_cache import prefill as prefill_prompts

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for sleeping better.",
    "What is the boiling point of water in Fahrenheit?",
    "Explain what a cache is in one sentence.",
    "Name three primary colors.",
)

SYSTEM = (
    "You are a helpful assistant for a travel agency. Answer in one or two short "
    "sentences, plainly, without lists or headings."
)

# Chats of the built-in set: two requests sharing a system prompt, and a second
# turn whose history is the first chat (a prefix cache serves both from one prefill).
CHATS = (
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
    ),
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name a famous painting in the Louvre."},
    ),
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "How many people live there?"},
    ),
)


# --- requests ---------------------------------------------------------------------------


def make_requests(n, prompt_len, gen_len, gap, vocab, seed) -> list:
    """``n`` requests with random token prompts (the tiny model's workload): lengths
    uniform in the given ranges, arrival gaps uniform in ``[0, 2 * gap]`` steps."""
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    plen = cast(list, mx.random.randint(prompt_len[0], prompt_len[1] + 1, (n,), key=k1).tolist())
    glen = cast(list, mx.random.randint(gen_len[0], gen_len[1] + 1, (n,), key=k2).tolist())
    gaps = cast(list, mx.random.randint(0, 2 * gap + 1, (n,), key=k3).tolist())
    toks = cast(list, mx.random.randint(0, vocab, (n, max(plen)), key=k4).tolist())
    arrivals = [sum(gaps[:i]) for i in range(n)]
    return [
        Request(i, tuple(toks[i][:p]), g, arrival=a)
        for i, (a, p, g) in enumerate(zip(arrivals, plen, glen))
    ]


def read_prompts(path: Path) -> list:
    """Prompts from a file: one per line, or JSON lines.

    A JSON line is a string, a list of chat messages, or an object with
    ``"prompt"`` (text) or ``"messages"``, and optionally ``"max_tokens"``,
    ``"temperature"``, ``"top_p"``, ``"seed"``. Blank lines are skipped.
    Returns ``(prompt text or messages, overrides)`` pairs.
    """
    out: list = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line[0] not in '{["':
            out.append((line, {}))
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"kvstate generate: --prompts {path}:{n}: not JSON ({e})") from None
        if isinstance(item, dict):
            prompt = item.get("messages", item.get("prompt"))
            extra = {
                k: item[k] for k in ("max_tokens", "temperature", "top_p", "seed") if k in item
            }
        else:
            prompt, extra = item, {}
        if not isinstance(prompt, (str, list)) or not prompt:
            raise SystemExit(
                f"kvstate generate: --prompts {path}:{n}: expected a prompt "
                "string or a list of messages"
            )
        out.append((prompt, extra))
    if not out:
        raise SystemExit(f"kvstate generate: --prompts {path}: no prompts in the file")
    return out


def text_requests(args, tokenizer, prefix=None) -> list:
    """One ``Request`` per prompt (``--prompt``, ``--prompts`` or the built-in set:
    ``PROMPTS``, then the ``CHATS``), each asked ``--samples`` times (its own seed).
    With ``prefix`` (a cached document's tokens) each text prompt continues it."""
    items: list = [(p, {}) for p in args.prompt] if args.prompt else []
    if args.prompts:
        items += read_prompts(args.prompts)
    items = items or [(p, {}) for p in PROMPTS] + [(list(c), {}) for c in CHATS]
    items = [item for item in items for _ in range(args.samples)]
    reqs = []
    for i, (prompt, extra) in enumerate(items):
        text, ids = _prompt_ids(args, tokenizer, prompt, prefix)
        if not ids:
            raise SystemExit(f"kvstate generate: prompt {i} has no tokens")
        settings = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed + i,
            **extra,
        }
        reqs.append(
            Request(
                i,
                tuple(ids),
                int(settings["max_tokens"]),
                text,
                float(settings["temperature"]),
                float(settings["top_p"]),
                int(settings["seed"]),
                stop=tokenizer.eos_ids,
            )
        )
    return reqs


# --- the command ------------------------------------------------------------------------


def _prompt_ids(args, tokenizer, prompt, prefix=None) -> tuple:
    """``(text shown, token ids)`` of one prompt: a text or a list of messages."""
    if prefix is not None:
        if not isinstance(prompt, str):
            raise SystemExit(
                "kvstate generate: --prompt-cache-file continues the cached user turn: "
                "prompts must be text, not messages"
            )
        return prompt, [*prefix, *_continued(args, tokenizer, prompt)]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if args.system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": args.system_prompt}, *messages]
    if args.raw or not tokenizer.has_chat_template:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return text, tokenizer.encode(text)
    return messages[-1]["content"], tokenizer.chat(messages)


# the chat template rendered around this marks where a user turn's content goes
QUERY = "\x00kvstate-query\x00"


def _user_turn(args, tokenizer, content: str) -> str:
    """The template's text of a user turn holding ``content`` (after the system
    prompt, when there is one), the assistant's turn opened."""
    messages = [{"role": "user", "content": content}]
    if args.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    return tokenizer.render(messages)


def _without_bos(tokenizer, ids: list) -> list:
    return ids[1:] if tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id] else ids


def document_ids(args, tokenizer, text: str) -> list:
    """``kvstate cache-prompt``'s tokens: the template up to the end of ``text`` as
    the user's content (the turn left open, as ``mlx_lm.cache_prompt`` leaves it),
    or ``text`` as is with ``--raw``."""
    if args.raw or not tokenizer.has_chat_template:
        return tokenizer.encode(text)
    rendered = _user_turn(args, tokenizer, text + QUERY)
    return tokenizer.encode(rendered[: rendered.index(QUERY)])


def _continued(args, tokenizer, text: str) -> list:
    """A prompt's tokens after a cached document: the rest of the user turn (``text``,
    the turn's end, the assistant's turn opened), as ``mlx_lm.generate`` cuts it."""
    if args.raw or not tokenizer.has_chat_template:
        return _without_bos(tokenizer, tokenizer.encode(text))
    rendered = _user_turn(args, tokenizer, QUERY)
    rest = rendered[rendered.index(QUERY) :].replace(QUERY, text, 1)
    return _without_bos(tokenizer, tokenizer.encode(rest))


def _range(text: str):
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _int_flag(p, flag: str, default: int, what: str, **kwargs) -> None:
    """An int flag whose help ends with its default: ``what (default)``."""
    p.add_argument(flag, type=int, default=default, help=f"{what} ({default})", **kwargs)


def _budget_flag(p) -> None:
    """``--prefill-budget`` (``generate`` and ``serve``)."""
    _int_flag(
        p,
        "--prefill-budget",
        DEFAULT_PREFILL_BUDGET,
        "most prompt tokens run per round, so a long prompt does not stall the "
        "decoding rows; 0 prefills every admitted prompt whole",
        metavar="N",
    )


def _model_flags(p) -> None:
    """``--model`` and ``--float32`` (``generate`` and ``serve``: both load with ``load``)."""
    p.add_argument(
        "-m",
        "--model",
        help="a llama-family .gguf file, an mlx-lm model directory, or "
        "'tiny' (random weights and token ids); default: SmolLM2-135M-Instruct, "
        "fetched on first use",
    )
    p.add_argument(
        "--float32",
        action="store_true",
        help="dequantize a quantized model to float32 (parity tests use this)",
    )


def _parser():
    p = argparse.ArgumentParser(
        prog="kvstate",
        description="KV-cache state for MLX models: "
        "continuous batched generation on kvstate records.",
    )
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True)
    _tiny_flags(_generate_parser(sub))
    _serve_parser(sub)
    _cache_prompt_parser(sub)
    _chat_parser(sub)
    return p


def _generate_parser(sub):
    """``kvstate generate``'s flags (the random-token workload's apart)."""
    g = sub.add_parser(
        "generate",
        help="continuous batched generation on kvstate records",
        description=textwrap.fill(
            "Real prompts in, text out: requests are prefilled together, "
            "decode as one batch and leave as they finish. Prints each completion, "
            "then a table of requests, tokens, prompt and generation tokens/s, time to "
            "first token, peak memory and cache bytes per token held and reserved.",
            88,
        ),
        epilog="the table's columns:\n" + _legend(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_flags(g)
    g.add_argument(
        "-p",
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt (repeatable; '-' reads one from standard input); default: a built-in set",
    )
    g.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help="prompts, one per line, or JSON lines (text, messages, or objects "
        "with prompt/messages and max_tokens/temperature/top_p/seed)",
    )
    g.add_argument(
        "--raw",
        "--ignore-chat-template",
        dest="raw",
        action="store_true",
        help="no chat template: the prompt text as is",
    )
    g.add_argument(
        "--prompt-cache-file",
        type=Path,
        metavar="FILE",
        help="a document prefilled once by 'kvstate cache-prompt': each prompt continues "
        "it (the same user turn) and prefills only its own tokens",
    )
    g.add_argument(
        "--system-prompt",
        metavar="TEXT",
        help="a system message before each prompt given as text (chat template only)",
    )
    _int_flag(g, "--max-tokens", 48, "most tokens per completion")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0 = off)")
    _int_flag(g, "--seed", 0, "request i: SEED + i; tiny: weights too")
    _int_flag(g, "--batch-size", 8, "most rows decoded at once")
    _int_flag(g, "--prefill-step-size", 512, "most prompt tokens per prefill forward", metavar="N")
    _budget_flag(g)
    g.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per request on stdout (the table goes to stderr)",
    )
    g.add_argument(
        "--compare",
        action="store_true",
        help="also run mlx-lm's own batch caches; report token parity and speed",
    )
    g.add_argument("--compile", action="store_true", help="decode with a compiled step")
    _int_flag(
        g,
        "--samples",
        1,
        "completions per prompt, each with its own seed; with the prefix cache "
        "they share the prompt's keys and values",
    )
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt whole (default: reuse cached prompt prefixes, "
        "shared without copies; off with --compile for now)",
    )
    _int_flag(g, "--prefix-cache-mb", 1024, "byte budget of the prefix cache, MiB")
    _draft_flags(g)
    _kv_flags(g)
    _int_flag(g, "--repeat", 1, "runs per engine, alternating engines; the fastest is reported")
    g.add_argument(
        "--quiet", action="store_true", help="no progress bar, no legend under the table"
    )
    return g


def _serve_parser(sub) -> None:
    """``kvstate serve``'s flags."""
    v = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server on kvstate records",
        description="POST /v1/chat/completions and /v1/completions (streaming or not), "
        "GET /v1/models and /health; every connection's rows decode in one continuous "
        "batch, prompts reuse cached prefixes, n samples share the prompt's rows.",
    )
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    _int_flag(v, "--port", 8080, "port")
    _model_flags(v)
    _int_flag(v, "--max-batch", 32, "most rows decoding at once")
    _int_flag(v, "--max-queue", 64, "most requests waiting; more are answered 429")
    v.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=None,
        help="byte budget of the prefix cache in MiB; 0 turns it off (256, or off where "
        "the records are rings: --max-kv-size, sliding-window layers)",
    )
    v.add_argument(
        "--prefix-cache-dir",
        type=Path,
        metavar="DIR",
        help="keep the prefix cache across restarts: loaded from DIR at start (a file per "
        "model), saved there on shutdown (Ctrl-C, SIGTERM)",
    )
    _budget_flag(v)
    v.add_argument(
        "--kv-budget-gb",
        type=float,
        default=None,
        help="most KV bytes (GB) the rows and prefix cache hold; rows past it are parked in "
        "host memory and resume exactly (default: 0.6 of the device's memory, or of the "
        "machine's RAM on the CPU, less the weights; 0: no budget)",
    )
    v.add_argument(
        "--context",
        type=int,
        default=None,
        help="longest prompt + max_tokens accepted (default: the model's)",
    )
    v.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take; past it, it ends with 504 (600)",
    )
    v.add_argument(
        "--allow-control-tokens",
        action="store_true",
        help="let message content carry special tokens such as <|im_start|> "
        "(default: content is encoded as text, so a user cannot forge a turn)",
    )
    _draft_flags(v)
    _kv_flags(v)
    v.add_argument(
        "--api-key",
        default=os.environ.get("KVSTATE_API_KEY"),
        metavar="KEY",
        help="every /v1 route needs 'Authorization: Bearer KEY' (default: $KVSTATE_API_KEY; "
        "unset: no key); /health and /metrics stay open",
    )
    v.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)


def _tiny_flags(g) -> None:
    """The random-token workload's flags (``--model tiny``)."""
    t = g.add_argument_group("random-token workload (a model without a tokenizer: --model tiny)")
    tiny: dict[str, Any] = dict(TINY)
    t.add_argument("--requests", type=int, help=f"number of requests ({tiny['requests']})")
    for flag, what in (("--prompt-len", "prompt lengths"), ("--gen-len", "tokens per request")):
        lo, hi = tiny[flag[2:].replace("-", "_")]
        t.add_argument(flag, type=_range, metavar="LO:HI", help=f"{what}, uniform ({lo}:{hi})")
    t.add_argument(
        "--arrival-gap",
        type=int,
        help=f"mean decode steps between arrivals ({tiny['arrival_gap']})",
    )


# the random-token workload's flags and defaults (pairs: module state stays immutable)
TINY = (("requests", 16), ("prompt_len", (16, 64)), ("gen_len", (8, 48)), ("arrival_gap", 2))


class Progress:
    """One engine's progress line (tqdm, on ``stream``): requests finished of all,
    then tokens, active rows, queued requests and tokens/s. Drawn only where
    ``stream`` is a terminal, so a redirected stderr gets no redraws."""

    def __init__(self, label: str, requests: int, stream) -> None:
        tty = getattr(stream, "isatty", lambda: False)()
        self.bar = tqdm(
            total=requests, desc=label, unit="req", file=stream, disable=not tty, mininterval=0.1
        )
        self.requests, self.start = requests, time.perf_counter()

    def __call__(self, tokens: int, active: int, queued: int) -> None:
        rate = tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{tokens} tok, {active} active, {queued} queued, {rate:,.1f} tok/s", refresh=False
        )
        self.bar.update(self.requests - active - queued - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def load(args, err):
    """``kvstate.models.Loaded`` for ``--model`` (``None`` tokenizer: random token ids)."""
    from .models import load as models

    if args.model == "tiny":
        return models.Loaded(tiny_llama(args.seed), None, "tiny llama (random weights, float32)")
    path = None if args.model is None else Path(args.model).expanduser()
    if path is not None and path.suffix != ".gguf" and not (path / "config.json").is_file():
        raise SystemExit(
            f"kvstate generate: --model {args.model}: no config.json there "
            "(expected a .gguf file, an mlx-lm model directory, or 'tiny')"
        )
    return models.load_model(path, dequantize=args.float32, log=err)


def _chat_parser(sub) -> None:
    """``kvstate chat`` (as ``mlx_lm.chat``)."""
    c = sub.add_parser(
        "chat",
        help="an interactive chat that keeps the conversation's cache",
        description="Each line you type is a user turn; the reply streams as it is sampled. "
        "Only the new turn is prefilled (the conversation's cache is kept). --save writes "
        "the session after every reply; --resume continues a saved one.",
    )
    _model_flags(c)
    c.add_argument("--system-prompt", metavar="TEXT", help="a system message first")
    _int_flag(c, "--max-tokens", 256, "most tokens per reply")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0 = off)")
    _int_flag(c, "--seed", 0, "the session's PRNG seed")
    c.add_argument("--save", type=Path, metavar="FILE", help="save the session after each reply")
    c.add_argument("--resume", type=Path, metavar="FILE", help="continue a saved session")


def _cache_prompt_parser(sub) -> None:
    """``kvstate cache-prompt`` (as ``mlx_lm.cache_prompt``)."""
    c = sub.add_parser(
        "cache-prompt",
        help="prefill a long prompt once and save its KV records to a file",
        description="The prompt (a document, usually) is prefilled once, as the start of a "
        "user turn, and its records saved with the model's identity; "
        "'kvstate generate --prompt-cache-file FILE -p QUESTION' then prefills only the "
        "question.",
    )
    _model_flags(c)
    c.add_argument("-p", "--prompt", required=True, metavar="TEXT", help="the text ('-': stdin)")
    c.add_argument("--prompt-cache-file", type=Path, required=True, metavar="FILE")
    c.add_argument("--raw", "--ignore-chat-template", dest="raw", action="store_true")
    c.add_argument("--system-prompt", metavar="TEXT", help="a system message before it")
    _int_flag(c, "--prefill-step-size", 512, "most prompt tokens per prefill forward")
    _kv_flags(c)
    c.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)


def _draft_flags(g) -> None:
    """``--draft``, ``--draft-model``, ``--num-draft``, ``--draft-window`` (``generate``
    and ``serve``)."""
    g.add_argument(
        "--draft",
        choices=["ngram"],
        help="speculate with prompt lookup: drafts copied from each row's own context",
    )
    g.add_argument(
        "--draft-model",
        metavar="PATH",
        help="speculate with a draft model (.gguf or mlx-lm directory, the target's vocabulary)",
    )
    g.add_argument(
        "--num-draft",
        "--num-draft-tokens",
        dest="num_draft",
        type=int,
        default=4,
        help="most draft tokens per row and round (4)",
    )
    g.add_argument(
        "--draft-window",
        choices=["cost", "fixed"],
        default="cost",
        help="cost: each round only as wide as its measured cost pays (rows with poor "
        "acceptance take plain steps); fixed: every row drafts up to --num-draft (cost)",
    )


def _kv_flags(g) -> None:
    """``--kv-bits``, ``--kv-group-size``, ``--max-kv-size`` (``generate`` and ``serve``;
    mlx-lm's names): the rows' records, as ``kv_options`` reads them."""
    g.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        help="quantized KV records: keys and values in 4 or 8 bits, per group "
        "(default: full precision)",
    )
    g.add_argument(
        "--kv-group-size",
        type=int,
        choices=(32, 64, 128),
        help="values per quantization group, with --kv-bits (64)",
    )
    g.add_argument(
        "--max-kv-size",
        type=int,
        metavar="N",
        help="ring records: each row keeps its first 4 and its last N - 4 tokens, in every "
        "full-attention layer (sliding-window layers keep their own window)",
    )
    g.add_argument(
        "--kv-budget",
        type=int,
        metavar="N",
        help="compressed records: each row keeps at most N tokens (columns) in every "
        "full-attention layer, chosen by --kv-policy (not --kv-budget-gb, a byte budget "
        "over all rows)",
    )
    g.add_argument(
        "--kv-policy",
        choices=("sinks", "snapkv", "h2o"),
        help="which tokens --kv-budget keeps: sinks (the first 4 and the newest), snapkv "
        "(the prompt's tokens its last 16 attend to most), h2o (the most attended so far) "
        "(default: sinks)",
    )


def _compressed_options(args, command: str) -> dict:
    """``--kv-budget``/``--kv-policy``: compressed records, alone."""
    if args.kv_budget is None:
        raise SystemExit(f"{command}: --kv-policy needs --kv-budget")
    if args.kv_budget < 20:
        raise SystemExit(
            f"{command}: --kv-budget must be >= 20 (4 sink tokens and a window of 16), "
            f"got {args.kv_budget}"
        )
    for flag, value in (("--max-kv-size", args.max_kv_size), ("--kv-bits", args.kv_bits)):
        if value is not None:
            raise SystemExit(
                f"{command}: --kv-budget and {flag}: compressed records are neither rings "
                "nor quantized; pass one"
            )
    return {"kv_budget": args.kv_budget, "policy": args.kv_policy or "sinks"}


def kv_options(args) -> dict:
    """``make_states`` options of ``--kv-bits``/``--kv-group-size``/``--max-kv-size``;
    a combination that cannot work exits with a message naming the flags."""
    command = f"kvstate {args.command}"
    if args.kv_group_size is not None and args.kv_bits is None:
        raise SystemExit(f"{command}: --kv-group-size needs --kv-bits")
    if args.kv_budget is not None or args.kv_policy is not None:
        return _compressed_options(args, command)
    if args.max_kv_size is not None:
        if args.max_kv_size < 5:
            raise SystemExit(f"{command}: --max-kv-size must be >= 5 (4 kept tokens and a window)")
        if args.kv_bits is not None:
            raise SystemExit(f"{command}: --kv-bits and --max-kv-size: rings are not quantized")
        return {"max_kv_size": args.max_kv_size, "ring_full_layers": True}
    if args.kv_bits is not None:
        return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size or 64}
    return {}


def _window(args):
    """``--draft-window``: a fresh ``kvstate.speculative.Window`` for ``cost``, else ``None``."""
    from .speculative.rounds import Window

    return Window() if args.draft_window == "cost" else None


def _drafter(args, err):
    """``--draft ngram`` / ``--draft-model PATH`` as a ``kvstate.drafts`` drafter (or ``None``)."""
    from .speculative.drafts import DraftModel, Lookup

    command = f"kvstate {getattr(args, 'command', 'generate')}"
    if args.num_draft < 1:
        raise SystemExit(f"{command}: --num-draft must be >= 1")
    if args.draft and args.draft_model:
        raise SystemExit(f"{command}: give --draft ngram or --draft-model, not both")
    if args.draft == "ngram":
        return Lookup()
    if args.draft_model is None:
        return None
    from .models import load as models

    draft = models.load_model(Path(args.draft_model).expanduser(), dequantize=args.float32, log=err)
    return DraftModel(draft.model)


def _vocab(model):
    """The model's vocabulary size: ``model.args.vocab_size``, or its text
    config's (multimodal configs such as llama4 nest it in ``text_config``)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        text = getattr(args, "text_config", None)
        size = (
            text.get("vocab_size") if isinstance(text, dict) else getattr(text, "vocab_size", None)
        )
    if size is None:
        raise SystemExit("kvstate generate: cannot tell this model's vocab_size from model.args")
    return size


def show_completion(c: Completion, tokenizer, out, as_json: bool):
    r = c.request
    if as_json:
        text = tokenizer.decode(c.tokens) if tokenizer else None
        print(
            json.dumps(
                {
                    "id": r.id,
                    "prompt": r.text,
                    "completion": text,
                    "token_ids": list(c.tokens),
                    "prompt_tokens": len(r.prompt),
                    "generated_tokens": len(c.tokens),
                    "finish_reason": c.finish,
                    **({"error": c.error} if c.error is not None else {}),
                    "ttft_s": round(c.ttft, 4),
                    "seconds": round(c.seconds, 4),
                }
            ),
            file=out,
            flush=True,
        )
        return
    text = tokenizer.decode(c.tokens) if tokenizer else " ".join(map(str, c.tokens))
    print(
        f"[{r.id}] {r.text if r.text is not None else f'{len(r.prompt)} random tokens'}\n"
        f"    {text.strip()}\n    ({len(c.tokens)} tokens, {c.finish}"
        f"{f': {c.error}' if c.error is not None else ''}, "
        f"first token after {c.ttft:.2f} s)",
        file=out,
        flush=True,
    )


def run(engine, requests, args, err, on_finish=None, best=None):
    """Serve every request once (after a short warm-up); keeps the faster of this
    run and ``best`` (a previous run's figures, whose tokens must match)."""
    warm = Request(-1, requests[0].prompt[:4], 2)
    serve(engine, [warm], 1)
    if hasattr(engine, "reset"):
        engine.reset()  # counters, and an empty prefix cache: every run starts cold
    show = None if args.quiet else Progress(engine.name.split()[0], len(requests), err)
    mx.reset_peak_memory()
    try:
        completions, stats = serve(
            engine, requests, args.batch_size, on_finish=on_finish, progress=show
        )
        if show:
            show(sum(len(c.tokens) for c in completions), 0, 0)
    finally:
        if show:
            show.close()
    stats["peak"] = mx.get_peak_memory()
    stats["completions"] = completions
    stats["prefilled"] = getattr(engine, "prefilled", sum(len(r.prompt) for r in requests))
    stats["peak_kv"] = getattr(engine, "peak_bytes", 0)
    stats["held"] = bytes_per_token(engine.model, getattr(engine, "make", None))
    if best is not None:
        if [c.tokens for c in best["completions"]] != [c.tokens for c in completions]:
            raise SystemExit(f"kvstate generate: {engine.name} gave different tokens on a repeat")
        stats = min(best, stats, key=lambda s: s["seconds"])
    return stats


# The table's columns and what each means (``generate --help``'s epilog, the legend
# under the table). The phases are timed as mlx-lm's BatchGenerator times its own.
COLUMNS = (
    ("engine", "the records the rows decode on (kvstate's, or mlx-lm's BatchGenerator)"),
    ("requests", "requests served"),
    ("prompt tok", "prompt tokens asked for"),
    ("gen tok", "tokens generated"),
    ("time s", "wall time of the run, first arrival to last token"),
    (
        "prompt tok/s",
        "prompt tokens run through the model / seconds in prefill calls (their "
        "first tokens sampled); as mlx_lm.generate's 'Prompt: ... tokens-per-sec'",
    ),
    (
        "gen tok/s",
        "tokens from decode rounds / seconds in those rounds; with continuous "
        "batching prefill and decode interleave and each call is timed on its own",
    ),
    ("ttft s", "mean time from a request's arrival to its first token"),
    ("peak MB", "the process's peak memory in the run (mx.get_peak_memory)"),
    ("held B/tok", "KV bytes one held token occupies (every layer's keys and values)"),
    (
        "reserved B/tok",
        "KV bytes resident / tokens held, averaged over rounds: padding and spare "
        "capacity included, and the prefix cache's entries",
    ),
    ("prefilled", "prompt tokens run through the model"),
    ("saved", "prompt tokens read from the prefix cache instead"),
    ("peak KV MB", "the most KV bytes resident at once (rows and prefix cache)"),
)


def _legend(width: int = 0) -> str:
    """One line per column: its name, then what it means."""
    width = width or max(len(name) for name, _ in COLUMNS)
    return "\n".join(
        textwrap.fill(
            what,
            88,
            initial_indent=f"  {name:<{width}}  ",
            subsequent_indent=" " * (width + 4),
            break_on_hyphens=False,
        )
        for name, what in COLUMNS
    )


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.1f}" if seconds > 0 else "-"


def _table(results, requests, out, legend: bool = True):
    """The engines' figures, one row each, and (``legend``) what each column means."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    rows = []
    for name, s in results:
        cs = s["completions"]
        gen = sum(len(c.tokens) for c in cs)
        rows.append(
            (
                name,
                len(requests),
                prompt_tokens,
                gen,
                f"{s['seconds']:.3f}",
                _rate(s.get("prompt_tokens_run", 0), s.get("prefill_s", 0.0)),
                _rate(s.get("generated", 0), s.get("decode_s", 0.0)),
                f"{sum(c.ttft for c in cs) / len(cs):.3f}",
                f"{s['peak'] / 2**20:,.1f}",
                f"{s.get('held', 0):,}",
                f"{s['bytes_per_token']:,.0f}",
                s["prefilled"],
                prompt_tokens - s["prefilled"],
                f"{s['peak_kv'] / 2**20:,.2f}",
            )
        )
    head = [name for name, _ in COLUMNS]
    widths = [max(len(str(v)) for v in col) for col in zip(head, *rows)]
    for row in [head, *rows]:
        cells = [
            f"{v!s:<{w}}" if i == 0 else f"{v!s:>{w}}" for i, (v, w) in enumerate(zip(row, widths))
        ]
        print("  ".join(cells), file=out)
    if legend:
        print(_legend(), file=out)


def generate(args, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    _check_generate(args)
    if not args.quiet and getattr(err, "isatty", lambda: False)():
        print(f"kvstate: loading {args.model or 'SmolLM2-135M-Instruct'}", file=err, flush=True)
    loaded = load(args, err)
    model, tokenizer = loaded.model, loaded.tokenizer
    start = _start_cache(args, err)
    requests = _generate_requests(args, loaded, start)
    engines = _engines(args, model, err, start)
    table_out = err if args.json else out
    print(
        f"model: {loaded.name}; {len(requests)} requests, batch size {args.batch_size}",
        file=table_out,
        flush=True,
    )

    def printer(c):
        with tqdm.external_write_mode(file=out):  # the progress line cleared, then redrawn
            show_completion(c, tokenizer, out, args.json)

    best: list = [None] * len(engines)
    for k in range(args.repeat):
        best = [
            run(e, requests, args, err, printer if (k == 0 and i == 0) else None, b)
            for i, (e, b) in enumerate(zip(engines, best))
        ]
    results = [(e.name, s) for e, s in zip(engines, best)]
    _table(results, requests, table_out, legend=not args.quiet)
    if isinstance(engines[0], SpeculativeEngine):
        e = engines[0]
        rate = f"{e.accepted / e.drafted:.0%}" if e.drafted else "-"
        print(
            f"speculation: {e.accepted}/{e.drafted} draft tokens accepted ({rate}), "
            "in the last run",
            file=table_out,
        )
    return _parity(results, len(requests), table_out) if args.compare else 0


def _check_generate(args, stdin=None) -> None:
    """Every flag, before the model loads (a wrong one costs no load); reads the
    ``--prompt -`` text from ``stdin``."""
    for name in ("batch_size", "repeat", "max_tokens", "prefill_step_size", "samples"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvstate generate: --{name.replace('_', '-')} must be >= 1")
    if args.prefill_budget < 0:
        raise SystemExit("kvstate generate: --prefill-budget must be >= 0 (0: off)")
    if args.prefix_cache_mb < 1:
        raise SystemExit("kvstate generate: --prefix-cache-mb must be >= 1")
    if not (args.temperature >= 0 and 0 < args.top_p <= 1):
        raise SystemExit("kvstate generate: expected --temperature >= 0 and 0 < --top-p <= 1")
    if not 0 <= args.seed < 2**64:
        raise SystemExit(f"kvstate generate: --seed must be in [0, 2**64), got {args.seed}")
    if args.compare and kv_options(args):
        raise SystemExit(
            "kvstate generate: --compare runs mlx-lm's BatchGenerator, which makes neither "
            "quantized nor (for a model with its own make_cache) ring caches: drop --kv-bits "
            "and --max-kv-size"
        )
    _check_prompts(args, stdin if stdin is not None else sys.stdin)
    _check_workload(args)
    _check_prompt_cache(args)


def _check_prompt_cache(args) -> None:
    """``--prompt-cache-file``: a file, prompts given, and the plain engine with the
    prefix cache (the engine that reads it)."""
    if args.prompt_cache_file is None:
        return
    if not args.prompt_cache_file.is_file():
        raise SystemExit(
            f"kvstate generate: --prompt-cache-file {args.prompt_cache_file}: no such file "
            "(write one with 'kvstate cache-prompt')"
        )
    if not (args.prompt or args.prompts):
        raise SystemExit("kvstate generate: --prompt-cache-file needs --prompt or --prompts")
    clash = [
        flag
        for flag, on in (
            ("--no-prefix-cache", args.no_prefix_cache),
            ("--compile", args.compile),
            ("--draft", args.draft is not None),
            ("--draft-model", args.draft_model is not None),
        )
        if on
    ]
    if clash:
        raise SystemExit(
            f"kvstate generate: --prompt-cache-file is read through the prefix cache of the "
            f"plain engine; drop {', '.join(clash)}"
        )


def _start_cache(args, err):
    """The prefix cache of ``--prompt-cache-file`` (``None`` without it): refused
    when it was written for another model or is not ``kvstate cache-prompt``'s."""
    if args.prompt_cache_file is None:
        return None
    path = args.prompt_cache_file
    room = (args.prefix_cache_mb << 20) + path.stat().st_size  # the document stays
    cache = PrefixCache.load(path, room, identity=_identity(args, err))
    if len(cache) != 1:
        raise SystemExit(
            f"kvstate generate: --prompt-cache-file {path}: {len(cache)} entries, expected "
            "the one 'kvstate cache-prompt' writes"
        )
    return cache


def chat(args, stdin=None, out=None, err=None) -> int:
    """``kvstate chat``: read a turn a line, stream each reply, save after each."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    _check_chat(args)
    loaded = load(args, err)
    session = _chat_session(args, loaded, err)
    tty = getattr(stdin, "isatty", lambda: False)()
    while True:
        if tty:
            print(">> ", end="", file=out, flush=True)
        line = stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        session, _ = session.say(
            loaded.model,
            loaded.tokenizer,
            line.rstrip("\n"),
            max_tokens=args.max_tokens,
            on_text=lambda text: print(text, end="", file=out, flush=True),
        )
        print(file=out, flush=True)
        if args.save is not None:
            session.save(args.save, {"model": _identity(args, err)})


def _check_chat(args) -> None:
    """``kvstate chat``'s flags, before the model loads."""
    if args.max_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit(
            "kvstate chat: expected --max-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1"
        )
    if not 0 <= args.seed < 2**64:
        raise SystemExit(f"kvstate chat: --seed must be in [0, 2**64), got {args.seed}")
    if args.resume is not None and not args.resume.is_file():
        raise SystemExit(f"kvstate chat: --resume {args.resume}: no such file")
    if args.resume is not None and args.system_prompt is not None:
        raise SystemExit("kvstate chat: --system-prompt starts a session; --resume has one")


def _chat_session(args, loaded, err) -> Chat:
    """The session ``kvstate chat`` starts with: resumed, or new."""
    if loaded.tokenizer is None or not loaded.tokenizer.has_chat_template:
        raise SystemExit(f"kvstate chat: {loaded.name} has no chat template")
    if args.resume is not None:
        session, _ = Chat.resume(args.resume, loaded.model)
        print(f"kvstate chat: {len(session.messages)} messages resumed", file=err)
        return session
    sampling = kv.Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return Chat.start(system=args.system_prompt, sampling=sampling)


def cache_prompt(args, err=None) -> int:
    """``kvstate cache-prompt``: the prompt prefilled once (``document_ids``), its
    records saved to ``--prompt-cache-file`` with the model's identity."""
    err = err or sys.stderr
    if args.system_prompt is not None and args.raw:
        raise SystemExit("kvstate cache-prompt: --system-prompt needs the chat template")
    if args.prefill_step_size < 1:
        raise SystemExit("kvstate cache-prompt: --prefill-step-size must be >= 1")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text.strip():
        raise SystemExit("kvstate cache-prompt: the prompt is empty")
    loaded = load(args, err)
    if loaded.tokenizer is None:
        raise SystemExit(f"kvstate cache-prompt: {loaded.name} has no tokenizer")
    ids = document_ids(args, loaded.tokenizer, text)
    cache = PrefixCache(1 << 62, identity=_identity(args, err))
    mx.reset_peak_memory()
    start = time.perf_counter()
    logits, _, leases, _ = prefill_prompts(
        loaded.model, [ids], cache, prefill_step_size=args.prefill_step_size, **kv_options(args)
    )
    mx.eval(logits, [p for s in cache.records() for p in s.planes])
    seconds = time.perf_counter() - start
    for lease in leases:
        if lease is not None:
            lease.release()
    cache.save(args.prompt_cache_file)
    print(
        f"kvstate cache-prompt: {len(ids)} tokens prefilled in {seconds:.2f} s "
        f"({len(ids) / seconds:,.1f} tok/s), peak memory {mx.get_peak_memory() / 1e9:.3f} GB; "
        f"saved to {args.prompt_cache_file}",
        file=err,
    )
    return 0


def _check_prompts(args, stdin) -> None:
    """``--system-prompt`` needs the chat template; ``--prompt -`` is read once."""
    if args.system_prompt is not None and args.raw:
        raise SystemExit(
            "kvstate generate: --system-prompt goes through the chat template; "
            "drop it or --raw/--ignore-chat-template"
        )
    if args.prompt.count("-") > 1:
        raise SystemExit("kvstate generate: --prompt - (standard input) given more than once")
    if "-" in args.prompt:
        text = stdin.read().strip()
        if not text:
            raise SystemExit("kvstate generate: --prompt -: standard input is empty")
        args.prompt = [text if p == "-" else p for p in args.prompt]


def _takes_text(args) -> bool:
    """Whether ``--model`` comes with a tokenizer, known before it loads."""
    if args.model in (None, "tiny"):
        return args.model is None
    path = Path(args.model).expanduser()
    return path.suffix == ".gguf" or has_tokenizer(path)


def _check_workload(args) -> None:
    """The random-token workload flags: only for a model without a tokenizer
    (``--model tiny``, a directory without tokenizer files), where the prompt
    flags cannot work; defaults filled in."""
    given = [f"--{k.replace('_', '-')}" for k, _ in TINY if getattr(args, k) is not None]
    if _takes_text(args):
        if given:
            raise SystemExit(
                f"kvstate generate: {', '.join(given)} shape the workload of a model "
                "without a tokenizer; this one takes --prompt, --prompts and --max-tokens"
            )
        return
    if args.prompt or args.prompts or args.system_prompt is not None:
        raise SystemExit(
            f"kvstate generate: --model {args.model} has no tokenizer: --prompt, --prompts "
            "and --system-prompt need a model with one"
        )
    for key, default in TINY:
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.requests < 1:
        raise SystemExit("kvstate generate: --requests must be >= 1")


def _generate_requests(args, loaded, start=None) -> list:
    """The requests: the prompts' text through the tokenizer (continuing the cached
    document of ``start``, a ``--prompt-cache-file``), or random token ids for a
    model without a tokenizer."""
    if loaded.tokenizer is not None:
        prefix = None if start is None else max(start.keys(), key=len)
        return text_requests(args, loaded.tokenizer, prefix)
    return make_requests(
        args.requests,
        args.prompt_len,
        args.gen_len,
        max(args.arrival_gap, 0),
        _vocab(loaded.model),
        args.seed,
    )


def _engines(args, model, err, start=None) -> list:
    """kvstate's engine (plain or speculative), and mlx-lm's with ``--compare``;
    ``start``: the prefix cache every run starts from (``--prompt-cache-file``)."""
    drafter = _drafter(args, err)
    if drafter is not None:
        engines: list = [
            SpeculativeEngine(
                model,
                drafter,
                args.num_draft,
                args.prefill_step_size,
                compiled=args.compile,
                window=_window(args),
                make=kv_options(args),
            )
        ]
    else:
        cache = start or (None if args.no_prefix_cache else PrefixCache(args.prefix_cache_mb << 20))
        engines = [
            KVStateEngine(
                model,
                compiled=args.compile,
                prefill_step_size=args.prefill_step_size,
                prefix_cache=cache,
                make=kv_options(args),
                prefill_budget=args.prefill_budget or None,
            )
        ]
    if args.compare:
        engines.append(MlxLmEngine(model, prefill_step_size=args.prefill_step_size))
    return engines


def _parity(results, n: int, out) -> int:
    """``--compare``'s verdict: requests with identical tokens, and the speed ratio."""
    (_, ours), (_, theirs) = results
    same = sum(a.tokens == b.tokens for a, b in zip(ours["completions"], theirs["completions"]))
    print(
        f"token parity: {same}/{n} requests identical{'' if same == n else ' (MISMATCH)'}",
        file=out,
    )
    print(
        f"speed ratio (mlx-lm time / kvstate time): {theirs['seconds'] / ours['seconds']:.2f}",
        file=out,
    )
    return 0 if same == n else 1


def _kv_budget(args, model):
    """``--kv-budget-gb`` in bytes (``None``: 0, no budget; default: ``default_kv_budget``)."""
    if args.kv_budget_gb is None:
        return default_kv_budget(model) or None
    return int(args.kv_budget_gb * 1e9) or None


def serve_command(args, err=None) -> int:
    """``kvstate serve``: load the model, then serve until interrupted (SIGINT or
    SIGTERM: in-flight requests finish first)."""
    from .serving import http as server

    err = err or sys.stderr
    make = kv_options(args)
    api_key = _api_key(args)
    server.check_port(args.host, args.port)  # before the model loads: fail fast
    loaded = load(args, err)
    drafter = _drafter(args, err)
    cache, on_stop = _serve_cache_dir(args, _serve_prefix_cache(args, loaded.model, make), err)
    _serve_log(err)
    print(
        f"kvstate serve: {loaded.name} on http://{args.host}:{args.port}/v1"
        f"{_records_note(make, cache)}{'; API key required' if api_key else ''}",
        file=err,
        flush=True,
    )
    server.run(
        loaded,
        host=args.host,
        port=args.port,
        log=err,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prefill_budget=args.prefill_budget or None,
        kv_budget=_kv_budget(args, loaded.model),
        context=args.context,
        timeout=args.request_timeout,
        control_tokens=args.allow_control_tokens,
        prefix_cache=cache,
        drafter=drafter,
        num_draft=args.num_draft,
        window=_window(args),
        make=make,
        api_key=api_key,
        on_stop=on_stop,
    )
    return 0


def _api_key(args):
    """``--api-key`` (or ``$KVSTATE_API_KEY``): a key, or ``None`` for an open server;
    an empty one is refused (it would look set and let everyone in)."""
    if args.api_key is None:
        return None
    if not args.api_key.strip():
        raise SystemExit("kvstate serve: --api-key (or $KVSTATE_API_KEY) is set but empty")
    return args.api_key


def _serve_prefix_cache(args, model, make):
    """``--prefix-cache-mb``: the cache, or ``None``; asked for where the records are
    rings (which share no prefix), it is refused rather than dropped."""
    from .serving.scheduler import shares_prefixes

    mb, shares = args.prefix_cache_mb, shares_prefixes(model, make)
    if mb is None:
        mb = 256 if shares else 0
    if mb < 0:
        raise SystemExit("kvstate serve: --prefix-cache-mb must be >= 0")
    if mb and not shares:
        raise SystemExit(
            f"kvstate serve: --prefix-cache-mb {mb}: this model's records are rings or "
            "compressed (--max-kv-size, --kv-budget, or sliding-window layers), which the "
            "prefix cache cannot share; pass --prefix-cache-mb 0"
        )
    return PrefixCache(mb << 20) if mb else None


def _records_note(make: dict, cache) -> str:
    """The startup line's account of the records and the prefix cache."""
    kind = (
        f"; {make['kv_bits']}-bit KV records (groups of {make['kv_group_size']})"
        if "kv_bits" in make
        else f"; ring KV records of {make['max_kv_size']} tokens"
        if "max_kv_size" in make
        else f"; compressed KV records of {make['kv_budget']} tokens ({make['policy']})"
        if "kv_budget" in make
        else ""
    )
    mb = "off" if cache is None else f"{cache.max_bytes >> 20} MiB"
    return f"{kind}; prefix cache {mb}"


def _serve_log(err) -> None:
    """The ``kvstate.serve`` logger (one line per request) to ``err``, once."""
    log = logging.getLogger("kvstate.serve")
    if not log.handlers:
        handler = logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _serve_cache_dir(args, cache, err) -> tuple:
    """The prefix cache ``cache`` with ``--prefix-cache-dir``, and what saves it at
    shutdown: ``(cache, on_stop)``. The file of this model (named by its identity) is
    loaded when there is one; a file that is not this model's (or not a cache) is
    refused with a message and the server starts with an empty cache."""
    if args.prefix_cache_dir is None:
        return cache, None
    if cache is None:
        raise SystemExit(
            "kvstate serve: --prefix-cache-dir needs the prefix cache on (--prefix-cache-mb > 0)"
        )
    mb = cache.max_bytes >> 20
    identity = _identity(args, err)
    path = prefix_cache_file(args.prefix_cache_dir, identity)
    cache = PrefixCache(mb << 20, identity=identity)
    if path.is_file():
        try:
            cache = PrefixCache.load(path, mb << 20, identity=identity)
            print(f"kvstate serve: {len(cache)} prefix cache entries from {path}", file=err)
        except kv.KVStateError as e:
            print(
                f"kvstate serve: --prefix-cache-dir: {path} not loaded ({e}); "
                "starting with an empty prefix cache",
                file=err,
            )

    def save(scheduler) -> None:
        if scheduler.prefix_cache is not None and len(scheduler.prefix_cache):
            path.parent.mkdir(parents=True, exist_ok=True)
            scheduler.prefix_cache.save(path)
            n = len(scheduler.prefix_cache)
            print(f"kvstate serve: {n} prefix cache entries saved to {path}", file=err, flush=True)

    return cache, save


def prefix_cache_file(directory: Path, identity: str) -> Path:
    """The prefix cache file of one model identity in ``directory``."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Path(directory) / f"prefix-cache-{digest}.safetensors"


def _identity(args, err) -> str:
    """What a saved prefix cache is bound to: the weights' digest and how they were
    loaded (``--float32`` changes the keys and values a prompt gives)."""
    if args.model == "tiny":
        return f"tiny llama seed {args.seed}"
    path = fetch_model(log=err) if args.model is None else Path(args.model).expanduser()
    return f"{model_identity(path)}; {'float32' if args.float32 else 'as shipped'}"


def version_line() -> str:
    """``kvstate --version``: this package's version and the MLX it runs on."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        lm = version("mlx-lm")
    except PackageNotFoundError:
        lm = "not installed"
    return f"kvstate {kv.__version__} (mlx {version('mlx')}, mlx-lm {lm})"


def parse(argv=None) -> argparse.Namespace:
    """The arguments; an unknown flag is reported with its command's usage (not the
    top-level one, as argparse does when a subcommand leaves arguments over)."""
    p = _parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv=None) -> int:
    """The exit code: 0 done, 1 a ``--compare`` mismatch, 2 a user error (one line
    on stderr, no traceback), 130 interrupted (Ctrl-C: what finished is printed)."""
    try:
        args = parse(argv)
    except SystemExit as e:  # argparse: usage and message printed, or --help/--version
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "serve":
            return serve_command(args)
        if args.command == "chat":
            return chat(args)
        return cache_prompt(args) if args.command == "cache-prompt" else generate(args)
    except kv.KVStateError as e:
        print(f"kvstate {args.command}: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            raise
        print(e.code, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nkvstate {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
