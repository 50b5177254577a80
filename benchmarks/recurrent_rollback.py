"""What rolling back recurrent rows costs, against a plain decode step.

A hybrid model (mlx-lm's qwen3_next: gated-delta linear attention and full
attention layers, or lfm2: short convolutions and attention; seeded random
float32 weights, CPU) holds B rows after a ragged prefill. Each round, from
the same rows, times (each to its evaluated result):

* ``step``: one kvstate decode step (``kvstate.mlx_lm.step``);
* ``mlx-lm step``: one mlx-lm decode step of the same B rows (aligned
  prompts, mlx-lm's own caches: it cannot hold ragged recurrent rows);
* ``verify``: one forward of K+1 tokens per row (a speculative verify);
* ``rollback all/none``: ``kv.rollback`` where every row keeps all or none
  of the block (no model call: recurrent rows take the checkpoint's slots);
* ``rollback partial``: ``kvstate.mlx_lm.rollback`` where rows keep
  1..K tokens (every layer back to the checkpoint, then one forward of the
  accepted tokens, right-padded, recurrent rows masked).

Prints, per side, the median over rounds and the min-max spread, and each
side's median ratio to the kvstate step of the same round.

    python -m benchmarks recurrent-rollback --family qwen3_next
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models import lfm2, qwen3_next
from mlx_lm.models.cache import make_prompt_cache

import kvstate as kv
from benchmarks import _common as c
from kvstate import mlx_lm as br


def build(family: str, hidden: int, layers: int, vocab: int):
    mx.random.seed(0)
    if family == "qwen3_next":
        args = qwen3_next.ModelArgs(
            model_type="qwen3_next",
            hidden_size=hidden,
            num_hidden_layers=layers,
            intermediate_size=2 * hidden,
            num_attention_heads=hidden // 64,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_value_heads=hidden // 64,
            linear_num_key_heads=hidden // 128,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=0,
            num_experts_per_tok=0,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=0,
            mlp_only_layers=list(range(layers)),
            moe_intermediate_size=0,
            rms_norm_eps=1e-6,
            vocab_size=vocab,
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            max_position_embeddings=4096,
            full_attention_interval=4,
        )
        model = qwen3_next.Model(args)
    else:
        types = ["conv", "conv", "conv", "full_attention"] * (layers // 4)
        model = lfm2.Model(
            lfm2.ModelArgs(
                model_type="lfm2",
                vocab_size=vocab,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=hidden // 64,
                num_key_value_heads=2,
                max_position_embeddings=4096,
                norm_eps=1e-5,
                conv_bias=False,
                conv_L_cache=3,
                block_dim=hidden,
                block_ff_dim=2 * hidden,
                block_multiple_of=64,
                block_ffn_dim_multiplier=1.0,
                block_auto_adjust_ff_dim=False,
                layer_types=types,
            )
        )
    mx.eval(model.parameters())
    return model


def arrays(out) -> list:
    """Every array in ``out``: logits, records' planes, nested lists and tuples."""
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (list, tuple)):
        return [a for x in out for a in arrays(x)]
    return list(out.planes)  # a record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("qwen3_next", "lfm2"), default="qwen3_next")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128, help="prompt length (rows differ by 8)")
    p.add_argument("--draft", type=int, default=4, help="K: draft tokens per verify")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    args = c.output_args(p).parse_args(argv)

    model = build(args.family, args.hidden, args.layers, args.vocab)
    B, K = args.batch, args.draft
    prompts = [
        mx.random.randint(1, args.vocab, (args.length + 8 * b,), key=mx.random.key(b)).tolist()
        for b in range(B)
    ]
    _, states = br.prefill(model, prompts)
    mx.eval([s.planes for s in states])
    lm_cache = make_prompt_cache(model)
    lm_prompt = mx.array([prompts[0]] * B)
    mx.eval(model(lm_prompt, cache=lm_cache))
    lm_saved = [c.state for c in lm_cache]
    tok = mx.array([1] * B)
    block = mx.random.randint(1, args.vocab, (B, K + 1), key=mx.random.key(99))
    partial = [1 + b % K for b in range(B)]  # each row keeps 1..K of K+1
    cp = kv.checkpoint(states)
    _, verified = br.forward(model, block, states)
    mx.eval([s.planes for s in verified])

    def lm_step():
        for cache, st in zip(lm_cache, lm_saved):
            cache.state = st  # the same rows every round (the state setter, no copy)
        return model(tok[:, None], cache=lm_cache)

    sides = {
        "step": lambda: br.step(model, tok, states),
        "mlx-lm step": lm_step,
        "verify (K+1 tokens)": lambda: br.forward(model, block, states),
        "rollback all/none": lambda: kv.rollback(verified, cp, [0, K + 1] * (B // 2)),
        "rollback partial": lambda: br.rollback(model, verified, cp, partial, block),
    }
    times = c.rounds({k: lambda f=f: arrays(f()) for k, f in sides.items()}, args.rounds, warmup=1)
    base = times["step"]
    print(
        f"{args.family}: B={B}, prompts {args.length}..{args.length + 8 * (B - 1)}, K={K}, "
        f"hidden {args.hidden}, {args.layers} layers, {args.rounds} rounds, "
        f"{mx.default_device()}"
    )
    print("side: ms median [min-max] over rounds; x step: the per-round ratio")
    for k, ts in times.items():
        print(f"  {k:24s} {c.spread(ts, digits=2)}  x step {c.ratio(ts, base, 2)}")
    c.write(
        args,
        f"recurrent-rollback-{args.family}",
        [dict(side=k, **c.summary(t)) for k, t in times.items()],
    )


if __name__ == "__main__":
    main()
