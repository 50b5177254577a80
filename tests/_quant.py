"""Test support for quantized rows: byte views, references, a quantize counter.

A quantized row is what a model sees through ``kv.fetch``: two
``(packed, scales, biases)`` triples over the row's columns
``[left_pad[b], ends[b])``. Byte-exact comparisons go through numpy copies
(``tobytes``), so "equal" means the same bytes, not merely close values.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _rows import np_rows_mask
from mlx_lm.models.base import quantized_scaled_dot_product_attention as _mlx_qsdpa

import kvstate as kv
from kvstate.kinds import quantized as _quantized

# A test whose reference is mlx-lm's own quantized attention (QuantizedKVCache
# through a model, quantized_scaled_dot_product_attention, or kvstate's stock
# read forced): that read is mx.quantized_matmul, which MLX 0.32.4's CUDA
# backend lacks for KV shapes ("No implementation for problem shape", the
# H200), so there is no reference to compare with there.
# kvstate's own quantized reads on CUDA: tests/bridge/test_bridge_cuda.py,
# tests/kernels/test_quantized_read.py.
needs_stock_quantized_read = pytest.mark.skipif(
    not _quantized.stock_read_runs(),
    reason="the reference is mlx-lm's quantized read (mx.quantized_matmul), "
    "which this backend (MLX 0.32.4 CUDA) lacks for KV shapes",
)

# (bits, group_size, head dim) that mx.quantize, quantized_matmul and mlx-lm's
# QuantizedKVCache all accept on this CPU. mlx-lm sizes its packed buffer as
# dim // (32 // bits), which is wrong for 5 and 6 bits at head dim 128
# (it allocates 21/25 words where mx.quantize packs 20/24), so those combos
# stay at head dim 64 here; test_quantized checks kvstate alone handles them.
GEOMETRIES = [(b, g, 64) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64)] + [
    (b, 128, 128) for b in (2, 3, 4, 8)
]


def rand(rng: np.random.Generator, *shape) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def np_of(x) -> np.ndarray:
    return np.array(x, copy=True)


def row_planes(state, b: int) -> tuple:
    """Row ``b``'s six planes over its own columns, as numpy ``[H, L, *]``."""
    p, e = state.left_pad[b], state.ends[b]
    keys, values = kv.fetch(state)
    return tuple(np_of(x[b, :, p:e, :]) for x in (*keys, *values))


def fetched(state) -> tuple:
    """The six fetched planes (columns ``[0, width)``) as numpy."""
    keys, values = kv.fetch(state)
    return tuple(np_of(x) for x in (*keys, *values))


def assert_same_bytes(got, want, what=""):
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what} plane {i}: shape {a.shape} vs {b.shape}"
        assert a.dtype == b.dtype, f"{what} plane {i}: dtype {a.dtype} vs {b.dtype}"
        assert a.tobytes() == b.tobytes(), f"{what} plane {i}: bytes differ"


def quantize_np(x: mx.array, group_size: int, bits: int) -> tuple:
    """``mx.quantize`` of ``x`` as numpy planes (the reference for new columns;
    through ``_quantized.quantize``, which gives an empty ``x`` its empty planes
    without calling ``mx.quantize``: that killed the process on MLX's CUDA)."""
    return tuple(np_of(p) for p in _quantized.quantize(x, group_size, bits))


def mlx_qsdpa(q, keys, values, *, scale, mask, group_size, bits):
    """mlx-lm's quantized SDPA. It scales ``q`` in place (``queries *= scale``),
    so it gets a copy: the caller's ``q`` must stay usable for kvstate."""
    return _mlx_qsdpa(
        mx.array(q), keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits
    )


def dequant_attend(state, q, *, scale, window=None) -> mx.array:
    """Reference: dequantize the fetched planes, then float attention (fused
    SDPA, GQA by repeating heads) under the contract's mask."""
    keys, values = kv.fetch(state)
    mask = mx.array(np_rows_mask(q.shape[2], state.left_pad, state.ends, state.width, window))
    return dequant_sdpa(
        q, keys, values, scale=scale, mask=mask, group_size=state.group_size, bits=state.bits
    )


def dequant_sdpa(q, keys, values, *, scale, mask, group_size, bits) -> mx.array:
    """Float attention of ``q`` on the dequantized ``(packed, scales, biases)``
    triples (fused SDPA, GQA by repeating heads) under ``mask``."""
    k = mx.dequantize(*keys, group_size=group_size, bits=bits)
    v = mx.dequantize(*values, group_size=group_size, bits=bits)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class QuantizeCounter:
    """Records the shape of every ``mx.quantize`` / ``mx.dequantize`` call."""

    def __init__(self, monkeypatch):
        self.quantized, self.dequantized = [], []
        q, dq = mx.quantize, mx.dequantize

        def quantize(x, *a, **k):
            self.quantized.append(tuple(x.shape))
            return q(x, *a, **k)

        def dequantize(x, *a, **k):
            self.dequantized.append(tuple(x.shape))
            return dq(x, *a, **k)

        monkeypatch.setattr(mx, "quantize", quantize)
        monkeypatch.setattr(mx, "dequantize", dequantize)

    def reset(self):
        self.quantized.clear()
        self.dequantized.clear()
