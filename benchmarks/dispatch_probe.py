"""What one custom-kernel launch costs the host in a compiled replay (issue 15's B=1 bound).

Each case is one ``mx.compile``'d function of ``--ops`` chained calls on one
input, timed two ways per call, median over ``--rounds`` rounds: ``host``, the
seconds until ``mx.async_eval(fn(x))`` returns (MLX's replay, encoding and
launches on this thread; the device runs behind), and ``waited``,
``mx.eval(fn(x))`` (host and device, no overlap). "per op" divides by the
chain length after taking off the one-op case of the same kind.

Cases (one output the size of B=1's query, 32 x 64 floats, per op):

    builtin add      ``x + 1``, MLX's own elementwise kernel; ``mx.compile`` fuses
                     the chain into one kernel, so its per-op figure is no launch
    builtin sdpa     ``mx.fast.scaled_dot_product_attention`` over the same B=1
                     planes as the kvstate read, no mask: a builtin launch that
                     does not fuse (the stock read a compiled forward without a
                     cache makes)
    custom, short    ``mx.fast.cuda_kernel`` doing ``x + 1``, a short source
    custom, long     the same kernel with ``--long-kb`` KiB of comment in its
                     source: MLX 0.32's CUDA ``CustomKernel::eval_gpu`` hashes
                     the whole source string on every call
                     (``std::hash<std::string>{}(source_)``), so a long source
                     may cost the host per launch
    kvstate read     ``kernels.ragged_attention`` at B=1, 2K columns of a
                     Llama-3.2-1B layer (32/8 heads of 64, bf16), each call its
                     own planes: one split (one launch) and ``--splits``
                     (split pass + merge pass)
    kvstate fused    ``kernels.write_and_read`` (the decode step's default
                     route: the write in the read's launch)

Without MLX's CUDA backend it prints why and exits 0.

    python3 benchmarks/dispatch_probe.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.kernels import cuda as kernels  # noqa: E402

_ADD = r"""
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n[0]) out[i] = x[i] + 1.0f;
"""


def add_kernel(name: str, pad_kb: int):
    pad = "".join(f"// padding line {i:06d} {'.' * 40}\n" for i in range(pad_kb * 1024 // 64))
    src = pad + _ADD
    k = mx.fast.cuda_kernel(name=name, input_names=["x", "n"], output_names=["out"], source=src)
    return k, len(src)


def chain(op, L: int):
    def f(x, *extra):
        for i in range(L):
            x = op(x, i, extra)
        return x

    return mx.compile(f)


def timed(f, args, reps: int) -> tuple[float, float]:
    """Seconds per call: until ``async_eval`` returns, and waited for."""
    host = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        y = f(*args)
        mx.async_eval(y)
        host += time.perf_counter() - t
    mx.eval(y)
    t = time.perf_counter()
    for _ in range(max(1, reps // 2)):
        mx.eval(f(*args))
    return host / reps, (time.perf_counter() - t) / max(1, reps // 2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--long-kb", type=int, default=64, help="KiB of comment in the long source")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--splits", type=int, default=4)
    args = p.parse_args(argv)
    if not kernels.kernel_available():
        print(f"dispatch_probe: skipped: no MLX CUDA backend here (mlx {mx.__version__})")
        return
    L = args.ops
    print(f"mlx {mx.__version__} on {mx.default_device()}; {L} chained ops, {args.rounds} rounds")
    own = {
        "read, 1 split": kernels._split_source(False, True, False, False, False),
        "fused, 1 split": kernels._split_source(False, True, False, True, False),
    }
    print("kvstate's kernel sources: " + ", ".join(f"{k} {len(v)} chars" for k, v in own.items()))
    x = mx.zeros((1, 32, 1, 64), mx.float32)
    n = mx.array([x.size], mx.int32)
    short, short_len = add_kernel("kvstate_probe_add_short", 0)
    long_, long_len = add_kernel("kvstate_probe_add_long", args.long_kb)

    def custom(k):
        def op(x, i, extra):
            return k(
                inputs=[x, n],
                output_shapes=[x.shape],
                output_dtypes=[x.dtype],
                grid=(x.size, 1, 1),
                threadgroup=(256, 1, 1),
            )[0]

        return op

    # B=1, 2K columns, Llama-3.2-1B attention: q [1, 32, 1, 64], planes [1, 8, C, 64] bf16
    ctx, dt = args.context, mx.bfloat16
    C = -(-(ctx + 1) // 256) * 256
    planes = [
        mx.random.normal((1, 8, C, 64), key=mx.random.key(i)).astype(dt) for i in range(2 * L)
    ]
    new = [
        mx.random.normal((1, 8, 1, 64), key=mx.random.key(1000 + i)).astype(dt) for i in range(2)
    ]
    lp, en = mx.array([0], mx.int32), mx.array([ctx], mx.int32)
    q = mx.random.normal((1, 32, 1, 64)).astype(dt)
    mx.eval(planes, new, lp, en, q)
    s = 64**-0.5

    def read(S):
        def op(q, i, kv):
            return kernels.ragged_attention(q, kv[2 * i], kv[2 * i + 1], lp, en, scale=s, splits=S)

        return op

    def sdpa(q, i, kv):
        return mx.fast.scaled_dot_product_attention(q, kv[2 * i], kv[2 * i + 1], scale=s)

    def fused(q, i, kv):
        nk, nv = new
        return kernels.write_and_read(q, kv[2 * i], kv[2 * i + 1], nk, nv, lp, en, scale=s)[0]

    kinds = {
        "builtin add": (lambda x, i, e: x + 1, (x,)),
        "builtin sdpa (no mask)": (sdpa, (q, *planes)),
        f"custom, short source ({short_len} chars)": (custom(short), (x,)),
        f"custom, long source ({long_len} chars)": (custom(long_), (x,)),
        "kvstate read, 1 split": (read(1), (q, *planes)),
        f"kvstate read, {args.splits} splits (+ merge)": (read(args.splits), (q, *planes)),
        "kvstate fused write + read (default)": (fused, (q, *planes)),
    }
    cases = {}
    for name, (op, a) in kinds.items():
        for length in (1, L):
            f = chain(op, length)
            mx.eval(f(*a))  # trace and build the kernels
            cases[(name, length)] = (f, a, [], [])
    for _ in range(args.rounds):
        for f, a, host, waited in cases.values():
            h, w = timed(f, a, args.reps)
            host.append(h * 1e6)
            waited.append(w * 1e6)
    print(f"us per call, median [min-max] of {args.rounds}; per op = (L={L} - L=1) / {L - 1}")
    print(f"  {'case':<44} {'L':>3} {'host':>22} {'waited':>22}")
    med = {}
    for (name, length), (_, _, host, waited) in cases.items():
        med[(name, length)] = (statistics.median(host), statistics.median(waited))
        print(
            f"  {name:<44} {length:>3} "
            f"{med[(name, length)][0]:9.1f} [{min(host):.1f}-{max(host):.1f}]"
            f" {med[(name, length)][1]:9.1f} [{min(waited):.1f}-{max(waited):.1f}]"
        )
    print("  per op (host / waited):")
    for name in kinds:
        (h1, w1), (hl, wl) = med[(name, 1)], med[(name, L)]
        print(f"    {name:<44} {(hl - h1) / (L - 1):7.2f} / {(wl - w1) / (L - 1):7.2f} us")


if __name__ == "__main__":
    main()
