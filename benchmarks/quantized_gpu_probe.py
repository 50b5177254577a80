"""Which KV-cache-shaped ``mx.quantized_matmul`` calls run on this device.

Quantized attention (mlx-lm's ``quantized_scaled_dot_product_attention`` and
kvstate's ``quantized_sdpa``) needs ``quantized_matmul(transpose=True)`` of
queries ``[B,H,M,D]`` against quantized keys ``[B,H,N,D]`` (the scores), and
``transpose=False`` of probabilities ``[B,H,M,N]`` against quantized values
(the output). This tries both for a grid of shapes and prints ``ok`` with
the max error against dequantize-then-matmul, or ``FAIL`` with the error.

    python benchmarks/quantized_gpu_probe.py          # on the H200: see notes/kinds.md

Slow where kernels fail to compile (each failure is a JIT attempt).
"""

import itertools

import mlx.core as mx

for dt, bits, tr, M, N, bh in itertools.product(
    (mx.bfloat16, mx.float32),
    (4, 8),
    (True, False),
    (1, 4, 16),
    (64, 256, 609, 640, 1024),
    ((1, 1), (8, 8)),
):
    B, H = bh
    D = 64
    w = mx.random.normal((B, H, N, D)).astype(dt)
    x = mx.random.normal((B, H, M, D if tr else N)).astype(dt)
    p = mx.quantize(w, group_size=64, bits=bits)
    try:
        o = mx.quantized_matmul(x, *p, transpose=tr, group_size=64, bits=bits)
        mx.eval(o)
        deq = mx.dequantize(*p, group_size=64, bits=bits)
        ref = x @ (deq.swapaxes(-1, -2) if tr else deq)
        err = mx.abs(o.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        r = f"ok err={err:.3g}"
    except Exception as e:  # noqa: BLE001 - report whatever the backend raises
        r = "FAIL " + str(e)[:60]
    print(dt, bits, "T" if tr else "N", f"M={M} N={N} BH={bh}", r, flush=True)
