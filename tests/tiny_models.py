"""Tiny real mlx-lm models with seeded random float32 weights (no downloads)."""

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama, qwen3

VOCAB = 128


def llama_model(seed=0, layers=3, sliding_window=None, vocab=VOCAB):
    mx.random.seed(seed)
    types = None
    if sliding_window is not None:
        types = ["sliding_attention", "full_attention"] * ((layers + 1) // 2)
        types = types[:layers]
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
        layer_types=types,
        sliding_window=sliding_window,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def qwen3_model(seed=1, layers=3, vocab=VOCAB):
    mx.random.seed(seed)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def gemma3_model(seed=2, layers=4, sliding_window=8, vocab=VOCAB):
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=vocab,
        sliding_window=sliding_window,
        sliding_window_pattern=2,
        query_pre_attn_scalar=32,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


def prompt(seed, n):
    """``n`` token ids in [1, VOCAB), deterministic per seed."""
    return mx.random.randint(1, VOCAB, (n,), key=mx.random.key(seed)).tolist()


def ragged_states(model, lens, seed=10):
    """Ragged rows: prompts of ``lens`` tokens, each prefilled alone through the
    bridge, merged into one batch of records (one per layer)."""
    from kvstate import mlx_lm as br

    rows = []
    for i, n in enumerate(lens):
        s = br.make_states(model, 1)
        _, s = br.forward(model, mx.array([prompt(seed + i, n)]), s)
        rows.append(s)
    return br.merge_rows(rows)


def greedy(decode, model, first, states, steps):
    """Greedy decode from ``first`` tokens through ``decode(model, tokens, states)`` (the
    eager ``step`` or a compiled decoder): (logits per step, tokens, states)."""
    seen, toks, tok = [], [], mx.array(first)
    for _ in range(steps):
        logits, states = decode(model, tok, states)
        tok = mx.argmax(logits, axis=-1)
        seen.append(logits)
        toks.append(tok.tolist())
    return seen, toks, states
