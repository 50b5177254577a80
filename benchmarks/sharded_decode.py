"""Decode tokens/s of a tensor-parallel model: kvstate and mlx-lm side by side.

Run alone, the model is whole on one device; under ``mlx.launch -n 2`` it is
sharded with mlx-lm's own ``Model.shard()`` and each rank holds half the KV
heads. Each case (B rows at context ``--context``, aligned or ragged) times
mlx-lm's caches (``KVCache``; ``BatchKVCache`` when ragged) and kvstate's
compiled decoder over the same random KV, interleaved round by round
(``suite.time_interleaved``). Rank 0 prints ms/step and tokens/s per side;
``--json`` writes them, and ``--baseline`` (a ``--json`` of the one-device
run) adds the ratio sharded / one device. Needs MLX's GPU (or any device
for a smoke run with ``--model tiny``).

    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/sharded_decode.py --json one.json
    NCCL_NVLS_ENABLE=0 mlx.launch --backend nccl -n 2 --nccl-port 12345 --python python3 \\
        benchmarks/sharded_decode.py --backend nccl --gpu-per-rank --baseline one.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a model of benchmarks._common.MODELS")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--cases", default="1:aligned,32:aligned,32:ragged", help="B:layout,...")
    p.add_argument("--steps", type=int, default=16, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--backend", default="any", help="mx.distributed.init backend")
    p.add_argument(
        "--gpu-per-rank",
        action="store_true",
        help="set CUDA_VISIBLE_DEVICES to this rank (MLX_RANK) before MLX starts",
    )
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--baseline", help="a --json file of the one-device run, for the ratio")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.gpu_per_rank:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("MLX_RANK", "0")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mlx.core as mx

    from benchmarks import _common as c
    from benchmarks import suite
    from kvstate import mlx_lm as br

    group = mx.distributed.init(backend=args.backend)
    N, rank = group.size(), group.rank()
    dtype = getattr(mx, args.dtype)
    model = c.llama(args.model, dtype)
    if N > 1:
        model.shard(group)
    # Each rank's records hold its share of the KV heads.
    local = dataclasses.replace(model.args, num_key_value_heads=model.args.num_key_value_heads // N)
    shim = type("Shim", (), {"args": local})()
    decoders = {"compiled": br.Decoder(model, attention="auto")}
    results = []
    for case in args.cases.split(","):
        B, layout = case.split(":")
        B, ctx = int(B), args.context
        lengths = suite.row_lengths(B, ctx, layout)
        cap = suite.round_up(ctx + args.warmup + args.steps * args.rounds + 8, 256)
        kvs = suite.random_kv(shim, B, cap, dtype, seed=rank + 1)
        runs = {
            "mlx-lm": [
                suite.impl_step("mlx-lm", model, decoders),
                mx.zeros((B,), mx.int32),
                suite.mlx_lm_caches(kvs, lengths, ctx),
            ],
            "kvstate": [
                decoders["compiled"],
                mx.zeros((B,), mx.int32),
                suite.kv_states(kvs, lengths, ctx),
            ],
        }
        del kvs
        med = suite.time_interleaved(runs, args.warmup, args.steps, args.rounds)
        del runs
        for side, sec in med.items():
            results.append(
                {
                    "B": B,
                    "layout": layout,
                    "side": side,
                    "ranks": N,
                    "ms": sec * 1e3,
                    "tokens_per_s": B / sec,
                }
            )
    if rank != 0:
        return
    base = {}
    if args.baseline:
        with open(args.baseline) as f:
            base = {(r["B"], r["layout"], r["side"]): r for r in json.load(f)["results"]}
    print(
        f"model {args.model} {args.dtype}, context {args.context}, {N} rank(s), "
        f"device {mx.default_device()}, KV heads per rank {local.num_key_value_heads}"
    )
    for r in results:
        line = (
            f"B={r['B']:3d} {r['layout']:8s} {r['side']:8s} {r['ms']:8.3f} ms/step "
            f"{r['tokens_per_s']:9.1f} tokens/s"
        )
        b = base.get((r["B"], r["layout"], r["side"]))
        if b:
            line += (
                f"   vs {b['ranks']} rank(s): {b['tokens_per_s']:9.1f} tokens/s, "
                f"ratio {r['tokens_per_s'] / b['tokens_per_s']:.3f}"
            )
        print(line)
    pairs = {}
    for r in results:
        pairs.setdefault((r["B"], r["layout"]), {})[r["side"]] = r["ms"]
    for (B, layout), sides in pairs.items():
        print(
            f"B={B} {layout}: mlx-lm / kvstate step time {sides['mlx-lm'] / sides['kvstate']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "results": results,
                    "median_of": f"{args.rounds} rounds x {args.steps} steps",
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
