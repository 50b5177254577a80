"""The cache write fused into the decode read (``kernels.write_and_read``, issue 15).

``write_and_read`` writes a step's new tokens and reads the rows in one launch on
MLX's CUDA backend; elsewhere it is the compiled step's scatter write followed by
``ragged_attention``. The first test runs everywhere (on the CPU it checks the
fallback, on CUDA the kernel) against ``kv.append``'s record and the masked stock
SDPA; the Decoder's wiring runs everywhere; the routing test needs the kernel.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny_models as tm

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.core.masks import rows_mask
from kvstate.kernels import cuda as kernels

cuda_only = pytest.mark.skipif(
    not kernels.kernel_available(),
    reason="needs MLX's CUDA backend (elsewhere decode_read never fuses the write)",
)


def _bytes(a):
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _rel(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want**2).sum())).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("gqa,D", [(1, 64), (4, 128), (4, 64)])
@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("splits", [0, 4])
def test_write_and_read_is_append_then_read(dtype, gqa, D, N, splits):
    """Ragged and left-padded rows: the planes equal ``kv.append``'s byte for byte
    (every column of the capacity, spare ones included), the read equals the
    masked stock SDPA over them."""
    B, H, C = 3, 2, 96
    mx.random.seed(gqa * 10 + D + N + splits)
    k0 = mx.random.normal((B, H, C, D)).astype(dtype)
    v0 = mx.random.normal((B, H, C, D)).astype(dtype)
    state = kv.from_arrays(k0, v0, lengths=[70, 33, 5], left_pad=[0, 20, 60], step=32)
    kn = mx.random.normal((B, H, N, D)).astype(dtype)
    vn = mx.random.normal((B, H, N, D)).astype(dtype)
    q = mx.random.normal((B, H * gqa, N, D)).astype(dtype)
    want_state = kv.append(state, kn, vn)
    Cw = want_state.planes[0].shape[2]
    pad = [(0, 0), (0, 0), (0, Cw - state.keys.shape[2]), (0, 0)]
    k1, v1 = (mx.pad(p, pad) for p in (state.keys, state.values))  # (hidden columns cleared)
    lp = mx.array(want_state.left_pad, mx.int32)
    ends = mx.array(want_state.ends, mx.int32)
    out, keys, values = kernels.write_and_read(
        q, k1, v1, kn, vn, lp, ends, scale=D**-0.5, splits=splits
    )
    assert _bytes(keys) == _bytes(want_state.keys)
    assert _bytes(values) == _bytes(want_state.values)
    # the reference in float64 on the host (MLX CUDA's masked SDPA runs TF32 matmuls)
    qn, kn64, vn64 = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, keys, values))
    kn64, vn64 = np.repeat(kn64, gqa, axis=1), np.repeat(vn64, gqa, axis=1)
    s = np.einsum("bhnd,bhcd->bhnc", qn, kn64) * D**-0.5
    s = np.where(np.array(rows_mask(N, want_state.left_pad, want_state.ends, Cw)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = mx.array(np.einsum("bhnc,bhcd->bhnd", p / p.sum(-1, keepdims=True), vn64), mx.float32)
    assert out.shape == q.shape and out.dtype == dtype
    assert _rel(out, ref) < (1e-5 if dtype == mx.float32 else 2e-2)


@cuda_only
def test_decode_read_fuses_small_planes_only(monkeypatch):
    q = mx.zeros((1, 4, 1, 64), mx.bfloat16)
    k = mx.zeros((1, 2, 256, 64), mx.bfloat16)
    assert kernels.decode_read(1, q, k, written=True) == "fused"
    assert kernels.decode_read(1, q, k) == "kernel"  # no write at hand: a read alone
    monkeypatch.setattr(kernels, "FUSED_BYTES", 2 * k.nbytes - 1)
    assert kernels.decode_read(1, q, k, written=True) == "kernel"


ROUNDING = 2e-3  # float32 rounding differences, as amplified by TF32 matmuls on CUDA


def _decode(model, states, steps, N):
    decode = br.Decoder(model, attention="kernel")
    logits = []
    for t in range(steps):
        tokens = mx.array([[(5 * b + t + i) % 50 + 1 for i in range(N)] for b in range(3)])
        lg, states = decode(tokens if N > 1 else tokens[:, 0], states)
        logits.append(lg)
    return logits, states


@pytest.mark.parametrize("N", [1, 4])
def test_decoder_fused_write_equals_scatter_write(monkeypatch, N):
    """The compiled Decoder with the write fused into the read gives the logits and
    the records of the same Decoder writing by scatter. Off
    CUDA ``decode_read`` is made to answer ``"fused"`` (``write_and_read`` is
    then its stock path), so the wiring runs everywhere; on CUDA it is the kernel."""
    if not kernels.kernel_available():
        real_route = kernels.decode_read

        def route(N, q=None, k=None, **kw):
            return "fused" if kw.get("written") else real_route(N, q, k, **kw)

        monkeypatch.setattr(kernels, "decode_read", route)
    model = tm.llama_model(layers=2)
    states = tm.ragged_states(model, [5, 17, 9], seed=30)
    calls = []
    real = kernels.write_and_read

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(kernels, "write_and_read", spy)
    fused_logits, fused = _decode(model, states, 3, N)
    assert calls and all(shape[2] == N for shape in calls)
    monkeypatch.undo()  # the scatter write, the same read
    monkeypatch.setattr(kernels, "FUSED_BYTES", 0)
    monkeypatch.setattr(kernels, "write_and_read", spy)
    calls.clear()
    plain_logits, plain = _decode(model, states, 3, N)
    assert not calls
    # the first layer's planes hold only what the tokens give: byte for byte; later
    # layers' new columns come from an attention read whose sums the fused launch
    # orders differently (the new columns last), so they agree to float rounding, which
    # on CUDA the model's TF32 matmuls of N > 1 rows amplify (measured: 5.9e-4 at N=4;
    # a wrong or missing column moves them by 1e-1 and more)
    for a, b in zip(fused_logits, plain_logits):
        assert mx.abs(a - b).max().item() < ROUNDING
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert a.lengths == b.lengths and a.left_pad == b.left_pad
        for pa, pb in zip(a.planes, b.planes):
            assert pa.shape == pb.shape and pa.dtype == pb.dtype
            if i == 0:
                assert _bytes(pa) == _bytes(pb)
            else:
                assert mx.abs(pa - pb).max().item() < ROUNDING


def test_one_kernel_build_serves_every_capacity(monkeypatch):
    """The capacity (and a fused write's copy blocks, which follow it) and the
    queries per row reach the kernel at run time, not as template constants: a
    new capacity bucket or verify width reuses the kernel MLX built (an NVRTC
    build costs ~1.3 s on the H200). Checked on what ``_launch`` hands
    ``mx.fast.cuda_kernel``, so it runs everywhere."""
    calls = []

    def record(prefix, direct, quant=False, fused=False, prefetch=False):
        def kernel(**kw):
            calls.append((kw["template"], kw["grid"]))
            return [mx.zeros(s, t) for s, t in zip(kw["output_shapes"], kw["output_dtypes"])]

        return kernel

    monkeypatch.setattr(kernels, "_split_kernel", record)
    monkeypatch.setattr(kernels, "kernel_available", lambda dtype=None: True)  # the routes too
    for C, N in ((256, 1), (512, 3), (4096, 8)):
        q = mx.zeros((2, 8, N, 64), mx.bfloat16)
        k = mx.zeros((2, 2, C, 64), mx.bfloat16)
        lp, en = mx.zeros((2,), mx.int32), mx.array([C - 1] * 2, mx.int32)
        kernels.ragged_attention(q, k, k, lp, en, scale=0.125, splits=1)
        kernels.write_and_read(q, k, k, k[:, :, :N], k[:, :, :N], lp, en, scale=0.125, splits=1)
    plain = {str(t) for t, _ in calls[0::2]}
    fused = {str(t) for t, _ in calls[1::2]}
    assert len(plain) == 1 and len(fused) == 1  # one build each, whatever the capacity
    assert len({g for _, g in calls[1::2]}) == 3  # the grid still follows them
