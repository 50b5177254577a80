"""Llama-family ``.gguf`` files as mlx-lm models: weights, tokenizer, chat template.

mlx-lm cannot run a GGUF file; MLX can read one (``mx.load(path,
return_metadata=True)``). This module maps what MLX reads onto mlx-lm's own
``llama.Model`` (the real class, so ``kvstate.mlx_lm`` and mlx-lm run it
alike) and builds the tokenizer and chat template from the metadata.

What MLX hands over, per GGUF tensor type (``mlx/io/gguf.cpp``):

=====================  ===============================================
``Q4_0``, ``Q4_1``,     4-bit, group 32: ``(weight uint32, scales,
``Q4_K``                biases)``, exactly ``mx.quantize``'s layout
``Q8_0``                8-bit, group 32, same layout
``F32``, ``F16``        as they are
other k-quants          dequantized to float16 by MLX on load
=====================  ===============================================

Every quantized layer becomes an ``nn.QuantizedLinear`` /
``nn.QuantizedEmbedding`` with the bits its planes show (a file may mix
them: SmolLM2's Q4_1 file keeps its embedding in Q8_0), or, with
``dequantize=True``, a float layer (float32 by default: on a CPU
``quantized_matmul`` is slow and parity tests run in float32).

GGUF stores the query and key projections of llama models permuted for
interleaved ("traditional") RoPE, so the model is built with
``rope_traditional=True``; with the default it produces fluent nonsense.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import attrs
import mlx.core as mx
import numpy as np
from mlx import nn

from ..errors import KVStateError, bad
from .tokenizer import Tokenizer

GROUP_SIZE = 32  # every GGUF block type MLX reads quantized has 32 weights a block

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer names this module builds (``tokenizer.ggml.pre``).
_PRE_TOKENIZERS = ("smollm", "gpt2")


@attrs.frozen
class Loaded:
    """A model ready to run: the mlx-lm model, its tokenizer, where it came from."""

    model: nn.Module
    tokenizer: Tokenizer | None
    name: str


def read(path) -> tuple:
    """``(weights, metadata)`` of a GGUF file, as MLX reads it (lazily)."""
    path = Path(path)
    if not path.is_file():
        raise bad("path", "an existing .gguf file", str(path))
    try:
        return cast(tuple, mx.load(str(path), return_metadata=True))  # (weights, metadata)
    except (RuntimeError, ValueError) as e:
        raise bad("path", "a GGUF file MLX can read", f"{path} ({e})") from None


def _scalar(meta: dict, key: str):
    if key not in meta:
        raise bad("GGUF metadata", f"a value for {key!r}", "none")
    v = meta[key]
    return v.item() if isinstance(v, mx.array) else v


def llama_args(meta: dict, *, tied: bool):
    """``mlx_lm.models.llama.ModelArgs`` from a llama GGUF's metadata."""
    from mlx_lm.models import llama

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise bad("general.architecture", "'llama' (a llama-family GGUF)", repr(arch))

    def get(k):
        return _scalar(meta, f"llama.{k}")

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(
        meta["llama.rope.dimension_count"].item()
        if "llama.rope.dimension_count" in meta
        else hidden // heads
    )
    vocab = meta.get("llama.vocab_size")
    vocab = int(vocab.item()) if vocab is not None else len(meta["tokenizer.ggml.tokens"])
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=vocab,
        rope_theta=float(
            meta["llama.rope.freq_base"].item() if "llama.rope.freq_base" in meta else 10000.0
        ),
        max_position_embeddings=int(get("context_length")),
        rope_traditional=True,
        tie_word_embeddings=tied,
    )


def mlx_lm_names(weights: dict) -> dict:
    """GGUF tensor names -> mlx-lm llama parameter names (``.scales``/``.biases`` too)."""
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
            out[f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"] = w
        elif len(parts) == 2 and parts[0] in _TOP_NAMES:
            out[f"{_TOP_NAMES[parts[0]]}.{parts[1]}"] = w
        else:
            raise bad(
                "GGUF tensor",
                "a llama tensor (blk.N.attn_*/ffn_*, token_embd, output_norm, output)",
                repr(name),
            )
    return out


def _bits(weights: dict, prefix: str) -> int:
    """Bits per weight of a quantized layer, from its planes' shapes."""
    packed, scales = weights[prefix + ".weight"], weights[prefix + ".scales"]
    return packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


def build_model(
    weights: dict, meta: dict, *, dequantize: bool = False, dtype=mx.float32
) -> nn.Module:
    """An ``mlx_lm.models.llama.Model`` holding ``weights`` (GGUF names).

    Args:
        weights: what ``read`` returned.
        meta: the GGUF metadata.
        dequantize: float layers (``dtype``) instead of quantized ones.
        dtype: the float type of dequantized weights; norms stay float32.
    """
    from mlx_lm.models import llama

    named = mlx_lm_names(weights)
    model = llama.Model(llama_args(meta, tied="lm_head.weight" not in named))
    quantized = {k[: -len(".scales")] for k in named if k.endswith(".scales")}
    if dequantize:
        planes = {}
        for k, w in named.items():
            prefix = k.rsplit(".", 1)[0]
            if prefix in quantized:
                if not k.endswith(".weight"):
                    continue
                w = mx.dequantize(
                    w,
                    named[prefix + ".scales"],
                    named[prefix + ".biases"],
                    group_size=GROUP_SIZE,
                    bits=_bits(named, prefix),
                )
            planes[k] = w.astype(dtype) if w.ndim > 1 or w.dtype != mx.float32 else w
        named = planes
    else:

        def quantize(path, module):
            if path not in quantized:
                return False
            return {"group_size": GROUP_SIZE, "bits": _bits(named, path)}

        nn.quantize(model, class_predicate=quantize)
    try:
        model.load_weights(list(named.items()), strict=True)
    except ValueError as e:
        raise KVStateError(f"GGUF weights: expected the tensors of a llama model, {e}") from None
    mx.eval(model.parameters())
    return model


def tokenizer(meta: dict) -> Tokenizer:
    """The byte-level BPE tokenizer and chat template a GGUF file carries.

    Tokens of type 3 (control) are special: ``encode`` matches them in text
    (``<|im_start|>``) and ``decode`` leaves them out.
    """
    backend, special = tokenizer_backend(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    eos = int(_scalar(meta, "tokenizer.ggml.eos_token_id"))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = (
        bool(meta["tokenizer.ggml.add_bos_token"].item())
        if "tokenizer.ggml.add_bos_token" in meta
        else False
    )
    return Tokenizer.from_backend(
        backend,
        eos_ids=(eos,),
        bos_id=int(bos.item()) if add_bos and bos is not None else None,
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens={tokens[i]: i for i in special},
    )


def tokenizer_backend(meta: dict) -> tuple:
    """``(tokenizers.Tokenizer, special token ids)`` from a GGUF's metadata."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise bad("tokenizer.ggml.model", "'gpt2' (a byte-level BPE)", repr(kind))
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise bad("tokenizer.ggml.pre", f"one of {_PRE_TOKENIZERS}", repr(pre))
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's smollm: every digit alone, then GPT-2's split
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    types = (
        np.array(meta["tokenizer.ggml.token_type"])
        if "tokenizer.ggml.token_type" in meta
        else np.ones(len(tokens), np.int32)
    )
    special = [int(i) for i in np.nonzero(types == 3)[0]]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special]
    )
    return backend, special


def export_mlx_lm(path, out, *, dtype=mx.float32) -> Path:
    """Write a llama ``.gguf`` file as an mlx-lm model directory (``out``), float layers.

    mlx-lm cannot read GGUF files; this gives it the same model, so that
    mlx-lm's own tools (``mlx_lm.server``, ``mlx_lm.generate``) run it:
    ``config.json``, ``model.safetensors`` (dequantized to ``dtype``),
    ``tokenizer.json`` and ``tokenizer_config.json`` (the chat template).
    """
    import dataclasses
    import json

    weights, meta = read(path)
    model = build_model(weights, meta, dequantize=True, dtype=dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.save_weights(str(out / "model.safetensors"))
    backend, special = tokenizer_backend(meta)
    backend.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    eos = tokens[int(_scalar(meta, "tokenizer.ggml.eos_token_id"))]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": meta.get("tokenizer.chat_template"),
                "eos_token": eos,
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": config.get("max_position_embeddings", 8192),
            },
            indent=2,
        )
    )
    return out


def load(path, *, dequantize: bool = False, dtype=mx.float32) -> Loaded:
    """A llama-family ``.gguf`` file as ``Loaded(model, tokenizer, name)``.

    Args:
        path: the file.
        dequantize: float layers (``dtype``) instead of MLX's quantized ones.
        dtype: float type of dequantized weights (float32 by default).
    """
    weights, meta = read(path)
    model = build_model(weights, meta, dequantize=dequantize, dtype=dtype)
    return Loaded(model, tokenizer(meta), Path(path).name)
