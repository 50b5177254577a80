"""Row migration: ``send_rows``/``recv_rows`` of one long row, against the raw transfer.

One row of ``--tokens`` tokens in ``--layers`` dense records of the
Llama-3.2-1B shape (8 KV heads, head dim 64) moves from rank 0 to rank 1.
Each round first times kvstate's migration (handshake, offer, arrays,
rebuild and merge on the receiver), then the floor: the same arrays sent
with plain ``mx.distributed`` calls of the same transport (``send``/``recv``
for p2p, ``all_gather`` for the collective transport), no handshake. A
barrier (``all_sum``) starts every timed part on both ranks together; the
receiver's clock is reported. Prints per round and the median, min and max
of each side and of the per-round ratio kvstate / raw.

    mlx.launch -n 2 --backend ring --python python3 benchmarks/migration.py --dtype bfloat16
    # H200 x2 (NCCL: collectives only; one GPU per rank):
    NCCL_NVLS_ENABLE=0 mlx.launch --backend nccl -n 2 --nccl-port 12345 \\
        --python python3 benchmarks/migration.py --backend nccl --gpu-per-rank
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--transport", default="auto", choices=["auto", "p2p", "collective"])
    p.add_argument("--backend", default="any", help="mx.distributed.init backend")
    p.add_argument(
        "--timeout",
        default="60",
        help="handshake timeout in seconds, or 'none' (wait in the caller's thread)",
    )
    p.add_argument(
        "--gpu-per-rank",
        action="store_true",
        help="set CUDA_VISIBLE_DEVICES to this rank (MLX_RANK) before MLX starts",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.gpu_per_rank:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("MLX_RANK", "0")
    import mlx.core as mx

    import kvstate as kv
    from kvstate.distributed import links as _links
    from kvstate.distributed import rows as dist

    group = mx.distributed.init(backend=args.backend, strict=True)
    rank = group.rank()
    if group.size() != 2:
        sys.exit(f"run on 2 ranks (got {group.size()})")
    dtype = getattr(mx, args.dtype)
    timeout = None if args.timeout == "none" else float(args.timeout)
    link = _links._transport(group, 1 - rank, args.transport, speaks_first=rank == 1)
    transport = type(link).__name__.strip("_").lower()

    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    mx.random.seed(0)
    states = [
        kv.from_arrays(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        for _ in range(args.layers)
    ]
    mx.eval([s.planes for s in states])
    row_bytes = sum(s.nbytes for s in states)
    specs = [("", dtype, shape)] * (2 * args.layers)
    planes = [p for s in states for p in s.planes]

    def barrier():
        mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))

    def migrate():
        if rank == 0:
            dist.send_rows(states, [0], 1, group=group, transport=args.transport, timeout=timeout)
            return None
        got, _ = dist.recv_rows(None, 0, group=group, transport=args.transport, timeout=timeout)
        mx.eval([s.planes for s in got])
        return got

    def raw():
        return _links._move(link, planes if rank == 0 else None, specs)

    got = migrate()  # warm-up, and a check that the row arrived intact
    if rank == 1:
        for a, b in zip(got, states):
            assert a.lengths == b.lengths and mx.array_equal(a.keys, b.keys).item()
    raw()
    rounds = []
    for _ in range(args.rounds):
        barrier()
        t0 = time.perf_counter()
        migrate()
        t1 = time.perf_counter()
        barrier()
        t2 = time.perf_counter()
        raw()
        t3 = time.perf_counter()
        rounds.append((t1 - t0, t3 - t2))
    if rank != 1:
        return
    kvs = [a * 1e3 for a, _ in rounds]
    raws = [b * 1e3 for _, b in rounds]
    ratios = [a / b for a, b in rounds]
    for i, (a, b) in enumerate(zip(kvs, raws)):
        print(f"round {i}: kvstate {a:8.2f} ms   raw {b:8.2f} ms   ratio {a / b:.3f}")

    def spread(xs):
        return f"{statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"

    device = mx.default_device()
    print(
        f"\none row of {args.tokens} tokens, {args.layers} layers x {args.kv_heads} KV heads x "
        f"head dim {args.head_dim}, {args.dtype}: {row_bytes} bytes "
        f"({row_bytes / 2**20:.1f} MiB) on the wire; transport {transport}, device {device}"
    )
    print(f"kvstate send_rows/recv_rows ms: {spread(kvs)}")
    print(f"raw {transport} of the same arrays ms: {spread(raws)}")
    print(f"ratio kvstate / raw: {spread(ratios)}")
    gbs = row_bytes / statistics.median(kvs) / 1e6
    print(f"kvstate throughput: {gbs:.2f} GB/s (median)")
    print(
        json.dumps(
            {
                "bytes_per_row": row_bytes,
                "dtype": args.dtype,
                "tokens": args.tokens,
                "transport": transport,
                "device": str(device),
                "kvstate_ms": kvs,
                "raw_ms": raws,
            }
        )
    )


if __name__ == "__main__":
    main()
