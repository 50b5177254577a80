"""Ragged batched decode: kvstate ``forward`` versus mlx-lm's ``BatchKVCache``.

B rows of different prompt lengths (around 512 tokens) are prefilled alone,
merged (left-padded) and decoded greedily as one batch, float32 on the CPU,
through the same mlx-lm llama model in the same process. Each round starts
every side from the same prefilled rows and rotates the order of their
decode steps, timing each step to its evaluated logits. Prints the median
step time of each side, their ratio (mlx-lm time / kvstate time; above 1.0
means kvstate is faster) and, because the machine may be shared, the
median of the per-step ratios of back-to-back steps. A third side runs
kvstate with ``start_early=False`` (no early device start of the first
layer; the default starts early on the CPU only), so the share of the
ratio that the early start brings is measured in the same run.

    python benchmarks/ragged_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache

from kvstate import mlx_lm as br


def build_model(args):
    mx.random.seed(0)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=2 * args.hidden,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.kv_heads,
            head_dim=64,
            rms_norm_eps=1e-5,
            vocab_size=args.vocab,
            tie_word_embeddings=False,
        )
    )
    mx.eval(model.parameters())
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512, help="mean prompt length")
    p.add_argument("--spread", type=int, default=96, help="prompt lengths length +- spread")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    model = build_model(args)
    B = args.batch
    lengths = [args.length - args.spread + (2 * args.spread * i) // max(B - 1, 1) for i in range(B)]
    prompts = [
        mx.random.randint(1, args.vocab, (n,), key=mx.random.key(i)).tolist()
        for i, n in enumerate(lengths)
    ]

    # Prefill each row alone on both sides (untimed).
    solo_caches, solo_last = [], []
    for pr in prompts:
        c = [KVCache() for _ in model.layers]
        solo_last.append(model(mx.array([pr]), cache=c)[:, -1])
        mx.eval(solo_last[-1], [x.state for x in c])
        solo_caches.append(c)
    first_lm = mx.argmax(mx.concatenate(solo_last, axis=0), axis=-1)
    kv_logits, kv_prefilled = br.prefill(model, prompts)
    first_kv = mx.argmax(kv_logits, axis=-1)
    mx.eval(first_lm, first_kv, [s.planes for s in kv_prefilled])

    times = {"kv": [], "late": [], "lm": []}
    paired, paired_late, mismatched = [], [], 0
    for r in range(args.rounds):
        lm_cache = [
            BatchKVCache.merge([c[i] for c in solo_caches]) for i in range(len(model.layers))
        ]
        mx.eval([c.state for c in lm_cache])
        states = {"kv": kv_prefilled, "late": kv_prefilled}
        tok = {"kv": first_kv, "late": first_kv, "lm": first_lm}
        for s in range(args.steps):
            order = ["kv", "late", "lm"]
            k = (r + s) % 3
            order = order[k:] + order[:k]
            if (r + s) % 2:
                order.reverse()
            for side in order:
                t0 = time.perf_counter()
                if side == "lm":
                    logits = model(tok["lm"][:, None], cache=lm_cache)[:, -1]
                else:
                    logits, states[side] = br.step(
                        model, tok[side], states[side], start_early=None if side == "kv" else False
                    )
                tok[side] = mx.argmax(logits, axis=-1)
                mx.eval(tok[side])
                times[side].append(time.perf_counter() - t0)
            # same step, same context, back to back
            paired.append(times["lm"][-1] / times["kv"][-1])
            paired_late.append(times["lm"][-1] / times["late"][-1])
            mismatched += int((tok["kv"] != tok["lm"]).sum().item())
            mismatched += int((tok["late"] != tok["lm"]).sum().item())
        del states

    t_kv, t_late, t_lm = times["kv"], times["late"], times["lm"]
    mk, mt, ml = (statistics.median(t) for t in (t_kv, t_late, t_lm))
    print(
        f"model: llama {args.layers} layers, hidden {args.hidden}, kv heads {args.kv_heads}, "
        f"head_dim 64, vocab {args.vocab}, float32, {mx.default_device()}"
    )
    print(f"rows: B={B}, prompt lengths {lengths}")
    print(f"steps timed per side: {len(t_kv)} ({args.rounds} rounds x {args.steps})")
    print(
        f"median step  kvstate {mk * 1e3:.3f} ms   kvstate start_early=False {mt * 1e3:.3f} ms"
        f"   mlx-lm BatchKVCache {ml * 1e3:.3f} ms"
    )
    print(f"token mismatches with mlx-lm (both kvstate sides): {mismatched}")
    for name, pr, m in (("kvstate", paired, mk), ("kvstate start_early=False", paired_late, mt)):
        q = statistics.quantiles(pr, n=4)
        print(
            f"{name}: paired per-step ratio median {statistics.median(pr):.3f} "
            f"(quartiles {q[0]:.3f} .. {q[2]:.3f}); ratio of medians {ml / m:.3f}"
        )
    print(f"ratio (mlx-lm / kvstate, medians): {ml / mk:.3f}")


if __name__ == "__main__":
    main()
