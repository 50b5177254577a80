"""Tiny real mlx-lm models of the hybrid and recurrent families, seeded
random float32 weights (no downloads): lfm2 (short conv + attention),
qwen3_next (gated delta net + attention), mamba2 (SSM only), falcon_h1 (a
mamba mixer and attention in every layer: ``CacheList``) and llama4
(chunked local attention + global attention). ``vocab``: the vocabulary size
(a real tokenizer's, for the server tests)."""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import falcon_h1, lfm2, llama4, mamba2, qwen3_next

VOCAB = 128


def _built(module, args, seed):
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    model.config = args  # (for model_dir)
    return model


def lfm2_model(seed=10, vocab=VOCAB):
    return _built(
        lfm2,
        dict(
            model_type="lfm2",
            vocab_size=vocab,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
        ),
        seed,
    )


def qwen3_next_model(seed=11, vocab=VOCAB):
    return _built(
        qwen3_next,
        dict(
            model_type="qwen3_next",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[],
            moe_intermediate_size=32,
            rms_norm_eps=1e-6,
            vocab_size=vocab,
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            max_position_embeddings=512,
            full_attention_interval=2,
        ),
        seed,
    )


def mamba2_model(seed=12, vocab=VOCAB):
    return _built(
        mamba2,
        dict(
            model_type="mamba2",
            num_heads=4,
            head_dim=16,
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            state_size=16,
            num_hidden_layers=2,
            layer_norm_epsilon=1e-5,
            conv_kernel=4,
            n_groups=1,
            use_bias=False,
            use_conv_bias=True,
            tie_word_embeddings=True,
            time_step_limit=(0.0, float("inf")),
            time_step_rank="auto",
        ),
        seed,
    )


def falcon_h1_model(seed=13, vocab=VOCAB):
    return _built(
        falcon_h1,
        dict(
            model_type="falcon_h1",
            hidden_size=64,
            head_dim=16,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=vocab,
            mamba_d_conv=4,
            mamba_d_head=16,
            mamba_d_ssm=64,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_n_heads=4,
            mamba_chunk_size=16,
            rope_theta=10000.0,
        ),
        seed,
    )


def llama4_model(seed=14, chunk=8, vocab=VOCAB):
    text = dict(
        model_type="llama4_text",
        attention_bias=False,
        attention_chunk_size=chunk,
        head_dim=16,
        hidden_size=64,
        interleave_moe_layer_step=2,
        intermediate_size=64,
        intermediate_size_mlp=128,
        max_position_embeddings=512,
        num_attention_heads=4,
        num_experts_per_tok=1,
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_local_experts=2,
        rms_norm_eps=1e-5,
        rope_scaling=None,
        rope_theta=10000.0,
        use_qk_norm=True,
        vocab_size=vocab,
    )
    return _built(llama4, dict(model_type="llama4", text_config=text), seed)


MODELS = {
    "lfm2": lfm2_model,
    "qwen3_next": qwen3_next_model,
    "mamba2": mamba2_model,
    "falcon_h1": falcon_h1_model,
    "llama4": llama4_model,
}


def prompt(seed, n):
    """``n`` token ids in [1, VOCAB), deterministic per seed."""
    return mx.random.randint(1, VOCAB, (n,), key=mx.random.key(seed)).tolist()


def model_dir(name: str, path) -> Path:
    """A local mlx-lm model directory of tiny model ``name`` (``config.json`` and
    ``model.safetensors``), as ``mlx_lm.utils.load_model`` reads one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = MODELS[name]()
    (path / "config.json").write_text(json.dumps(model.config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path
