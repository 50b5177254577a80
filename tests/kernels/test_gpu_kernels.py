"""The mask-free split-K read (``kernels.ragged_attention``) and the compiled
step's cache writes, on MLX's CUDA backend (issue 15).

Every test here needs the CUDA kernel: elsewhere ``ragged_attention`` *is*
the masked SDPA it is compared with, so the comparison could not fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.compiled import boundary as compiled
from kvstate.core.masks import rows_mask
from kvstate.kernels import cuda as kernels
from kvstate.kinds import rotating as _ring

pytestmark = pytest.mark.skipif(
    not kernels.kernel_available(),
    reason="needs MLX's CUDA backend (elsewhere ragged_attention is the masked SDPA itself)",
)

BF16_RTOL = 2e-2  # relative L2 error of a bf16 read against a float32 reference


def _data(B, Hq, H, C, D, N, dtype, seed):
    mx.random.seed(seed)
    q = mx.random.normal((B, Hq, N, D)).astype(dtype)
    k = mx.random.normal((B, H, C, D)).astype(dtype)
    v = mx.random.normal((B, H, C, D)).astype(dtype)
    return q, k, v


def _masked(q, k, v, mask, scale):
    """The stock SDPA with a bool mask, in float32 (the reference)."""
    f = mx.float32
    return mx.fast.scaled_dot_product_attention(
        q.astype(f), k.astype(f), v.astype(f), scale=scale, mask=mask
    )


def _rel(got, want):
    got = got.astype(mx.float32)
    return (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want**2).sum())).item()


ROWS = {  # name -> (left_pad, ends) for B=4 rows in a capacity of 160
    "ragged": ([0, 0, 0, 0], [150, 97, 9, 160]),
    "padded": ([40, 0, 17, 100], [160, 160, 160, 160]),
    "spare": ([3, 0, 50, 0], [120, 64, 99, 8]),
}


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("N", [1, 2, 5, 8])
@pytest.mark.parametrize("window,splits", [(0, 0), (24, 0), (0, 4)])
def test_kernel_equals_masked_sdpa(gqa, D, N, window, splits):
    """Ragged, padded and spare-column rows; one launch (the split count these
    shapes get) and split + merge (4 splits)."""
    H, C = 2, 160
    q, k, v = _data(4, H * gqa, H, C, D, N, mx.bfloat16, seed=gqa * 100 + D + N)
    scale = D**-0.5
    for rows in sorted(ROWS):
        lp, en = ROWS[rows]
        lp_a, en_a = mx.array(lp, mx.int32), mx.array(en, mx.int32)
        got = kernels.ragged_attention(
            q, k, v, lp_a, en_a, scale=scale, window=window, splits=splits
        )
        want = _masked(q, k, v, rows_mask(N, lp, en, C, window=window or None), scale)
        assert got.shape == q.shape and got.dtype == mx.bfloat16, rows
        assert _rel(got, want) < BF16_RTOL, rows


@pytest.mark.parametrize(
    "splits,threads,unroll,prefetch",
    [
        (1, 128, 4, False),
        (3, 128, 2, False),
        (64, 128, 4, False),
        (1, 256, 8, False),
        (5, 256, 1, False),
        (1, 256, 2, True),
        (3, 128, 4, True),
        (64, 256, 1, True),
    ],
)
def test_kernel_in_float32_is_exact_for_any_split(splits, threads, unroll, prefetch):
    """Any split count (one split: the single-launch read), block size, unroll and
    prefetch."""
    lp, en = ROWS["ragged"]
    q, k, v = _data(4, 8, 2, 160, 64, 3, mx.float32, seed=splits)
    got = kernels.ragged_attention(
        q,
        k,
        v,
        mx.array(lp, mx.int32),
        mx.array(en, mx.int32),
        scale=0.125,
        splits=splits,
        threads=threads,
        unroll=unroll,
        prefetch=prefetch,
    )
    # the reference in float64 on the host (MLX CUDA's masked SDPA uses TF32 matmuls)
    qn, kn, vn = (np.array(x, dtype=np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, 4, axis=1), np.repeat(vn, 4, axis=1)
    s = np.einsum("bhnd,bhcd->bhnc", qn, kn) * 0.125
    s = np.where(np.array(rows_mask(3, lp, en, 160)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = mx.array(np.einsum("bhnc,bhcd->bhnd", p / p.sum(-1, keepdims=True), vn), mx.float32)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("splits,unroll", [(1, 2), (4, 1), (3, 4)])
def test_prefetch_reads_the_same_bits(dtype, splits, unroll):
    """Loading a step ahead changes when keys arrive, not which keys nor the sums:
    the read and the fused write give the same bits with and without it (rows
    shorter than one step, ragged, padded and spare-column rows, 3 new tokens)."""
    q, k, v = _data(4, 8, 2, 160, 64, 3, dtype, seed=7 + splits)
    kn, vn = (mx.random.normal((4, 2, 3, 64)).astype(dtype) for _ in range(2))
    for rows in sorted(ROWS):
        lp, en = (mx.array(x, mx.int32) for x in ROWS[rows])
        got = {}
        for pf in (False, True):
            kw = dict(scale=0.125, splits=splits, unroll=unroll, prefetch=pf)
            read = kernels.ragged_attention(q, k, v, lp, en, **kw)
            fused = kernels.write_and_read(q, k, v, kn, vn, lp, en, **kw)
            got[pf] = [np.array(x.astype(mx.float32)) for x in (read, *fused)]
        for a, b in zip(got[False], got[True]):
            assert a.tobytes() == b.tobytes(), rows


@pytest.mark.parametrize("gqa,D", [(1, 64), (4, 128), (8, 64)])
def test_kernel_reads_ring_rows(gqa, D):
    """Rings with capacity = max_size: below, at and past the window, with a kept prefix."""
    C, keep = 32, 2
    lengths = [5, 32, 33, 70]  # tokens seen, after the write
    held = [min(n, C) for n in lengths]
    q, k, v = _data(4, 2 * gqa, 2, C, D, 1, mx.bfloat16, seed=D + gqa)
    got = kernels.ragged_attention(
        q, k, v, mx.zeros((4,), mx.int32), mx.array(held, mx.int32), scale=D**-0.5
    )
    mask = _ring.ring_mask(1, lengths, held, keep=keep, capacity=C, width=C, window=C)
    assert _rel(got, _masked(q, k, v, mask, D**-0.5)) < BF16_RTOL


def _bytes(a):
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _compiled_write(state, k, v):
    """The planes a compiled step writes (``compiled.traced_update``) for ``k, v``."""
    flat, spec = compiled.flatten(state, room=k.shape[2])
    key = spec.key

    def write(planes, positions, k, v):
        view = compiled.Traced.of((planes, positions), key)
        out, _, _ = compiled.traced_update(view.proto, view, k, v, compiled.TraceContext())
        return list(out.planes)

    return mx.compile(write)(flat.planes, flat.positions, k, v)


@pytest.mark.parametrize("N", [1, 4])
def test_compiled_dense_writes_equal_eager_bytes(N):
    B, H, D, S = 3, 2, 64, 100
    q, k0, v0 = _data(B, H, H, S, D, 1, mx.bfloat16, seed=7)
    state = kv.from_arrays(k0, v0, lengths=[100, 60, 31], left_pad=[0, 40, 69], step=64)
    _, k, v = _data(B, H, H, N, D, 1, mx.bfloat16, seed=8)
    got = _compiled_write(state, k, v)
    want = kv.append(state, k, v)
    w = want.planes[0].shape[2]
    for g, e in zip(got, want.planes):
        assert _bytes(g[:, :, :w]) == _bytes(e)


def test_compiled_ring_writes_equal_eager_bytes():
    B, H, D = 2, 2, 64
    state = kv.rotating(B, max_size=16, keep=2)
    for i in range(20):  # past the window: the ring wraps
        _, k, v = _data(B, H, H, 1, D, 1, mx.bfloat16, seed=100 + i)
        state = kv.append(state, k, v)
    _, k, v = _data(B, H, H, 1, D, 1, mx.bfloat16, seed=99)
    got = _compiled_write(state, k, v)
    want = kv.append(state, k, v)
    for g, e in zip(got, want.planes):
        assert _bytes(g[:, :, : e.shape[2]]) == _bytes(e)


@pytest.mark.parametrize("N", [1, 4])
def test_kernel_decoder_equals_eager_steps(N):
    """Dense ragged rows, one token or a verify window of N, through the kernel."""
    model = tm.llama_model(layers=2)
    prompts = [tm.prompt(10 + i, n) for i, n in enumerate([5, 17, 9])]
    rows = []
    for p in prompts:
        s = br.make_states(model, 1)
        _, s = br.forward(model, mx.array([p]), s)
        rows.append(s)
    states = br.merge_rows(rows)
    decode = br.Decoder(model, attention="kernel")
    calls = []
    real, real_fused = kernels.ragged_attention, kernels.write_and_read

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    def spy_fused(*a, **kw):  # small planes: the write in the read's launch
        calls.append(a[0].shape)
        return real_fused(*a, **kw)

    kernels.ragged_attention, kernels.write_and_read = spy, spy_fused
    try:
        se = sc = states
        for t in range(3):
            tokens = mx.array([[(7 * b + t + i) % 50 + 1 for i in range(N)] for b in range(3)])
            if N == 1:
                le, se = br.step(model, tokens[:, 0], se)
            else:  # a verify window: the eager forward of N tokens per row
                le, se = br.forward(model, tokens, se)
            lc, sc = decode(tokens if N > 1 else tokens[:, 0], sc)
            assert mx.abs(le - lc).max().item() < 2e-3
    finally:
        kernels.ragged_attention, kernels.write_and_read = real, real_fused
    assert calls and all(shape[2] == N for shape in calls)


def test_kernel_decoder_reads_rings():
    model = tm.gemma3_model(layers=2, sliding_window=8)
    rows = []
    for i, n in enumerate([3, 12]):
        s = br.make_states(model, 1)
        _, s = br.forward(model, mx.array([tm.prompt(20 + i, n)]), s)
        rows.append(s)
    states = br.merge_rows(rows)
    decode = br.Decoder(model, attention="kernel")
    se = sc = states
    tok = mx.array([3, 4])
    for _ in range(10):  # both rows cross the window
        le, se = br.step(model, tok, se)
        lc, sc = decode(tok, sc)
        assert mx.abs(le - lc).max().item() < 2e-3
        tok = mx.argmax(le, axis=-1)


def test_decode_read_is_chosen_in_one_place():
    q = mx.zeros((1, 4, 1, 64), mx.bfloat16)
    k = mx.zeros((1, 2, 8, 64), mx.bfloat16)
    assert kernels.decode_read(1, q, k) == "kernel"
    assert kernels.decode_read(kernels.MAX_QUERIES) == "kernel"
    assert kernels.decode_read(kernels.MAX_QUERIES + 1) == "masked"
    assert kernels.decode_read(1, q, k.astype(mx.int8)) == "masked"
