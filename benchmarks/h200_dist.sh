#!/usr/bin/env bash
# Issue 16's H200 x2 figures, from the repository root of a machine set up as
# /work/shared/tools/GPU.md says (two GPUs: kind nvidia-h200-x2):
#   1. sharded decode tokens/s: the model whole on GPU 0, then sharded over
#      both GPUs with NCCL (mlx-lm's Model.shard()), B=1 and B=32 at ctx 2048;
#   2. row migration of a 2K-token Llama-3.2-1B-shape row (bf16) over NCCL
#      (all_gather: NCCL has no send/recv in MLX 0.32), then over the ring
#      backend (send/recv over TCP) on the same host.
# Each rank sees only its own GPU (--gpu-per-rank sets CUDA_VISIBLE_DEVICES
# from MLX_RANK before MLX starts). About 2-4 minutes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}
launch() { python3 -c 'import sys; from mlx._distributed_utils.launch import main; sys.exit(main())' "$@"; }
set -x
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/sharded_decode.py --json "$OUT/sharded_one.json"
launch --backend nccl -n 2 --nccl-port 12345 --python python3 benchmarks/sharded_decode.py \
    --backend nccl --gpu-per-rank --baseline "$OUT/sharded_one.json" --json "$OUT/sharded_two.json"
launch --backend nccl -n 2 --nccl-port 12346 --python python3 benchmarks/migration.py \
    --backend nccl --gpu-per-rank --dtype bfloat16 \
  || launch --backend nccl -n 2 --nccl-port 12347 --python python3 benchmarks/migration.py \
    --backend nccl --gpu-per-rank --dtype bfloat16 --timeout none
launch --backend ring -n 2 --python python3 benchmarks/migration.py \
    --backend ring --gpu-per-rank --dtype bfloat16 --transport p2p
