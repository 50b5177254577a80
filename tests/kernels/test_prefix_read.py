"""``kernels.ragged_attention(..., prefix=...)``: shared-prefix rows read in the
split-K launches (issue 13's decode read, issue 15's kernel).

Each row reads a view of one shared prefix record, then its own suffix
columns. The reference is ``kv.attend`` on ``kv.materialize(state)`` (the
same rows as a plain dense record, a per-row copy of the prefix). On the CPU
``ragged_attention`` takes its stock path (the prefix columns gathered in
front of each row, one masked SDPA), so these tests check that path and the
argument convention there; on MLX's CUDA backend the same tests check the
kernel (bf16 tolerance), and the CUDA-only ones check forced split counts,
threads and unrolls.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import kvstate as kv
from kvstate.kernels import cuda as kernels
from kvstate.kinds import shared

BF16_RTOL = 2e-2  # relative L2 error of a bf16 read against the float32 reference


def _rel(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want**2).sum())).item()


def _shared_rows(dtype, H, D, N, seed, trim=True):
    """A ``SharedState`` of 6 rows over a 2-row prefix record: rows 0-1 read their own
    prefix rows, rows 2-5 are forks of row 0 (one trimmed into the prefix), each with
    a ragged suffix of at least ``N`` tokens."""
    mx.random.seed(seed)
    Cp = 40
    pk = mx.random.normal((2, H, Cp, D)).astype(dtype)
    pv = mx.random.normal((2, H, Cp, D)).astype(dtype)
    base = kv.from_arrays(pk, pv, lengths=[37, 21], left_pad=[3, 19])
    state = kv.fork(base, 0, 4, step=16)
    for _ in range(3):
        k = mx.random.normal((6, H, N + 2, D)).astype(dtype)
        v = mx.random.normal((6, H, N + 2, D)).astype(dtype)
        state = kv.append(state, k, v)
    if trim:  # ragged suffixes; row 5 loses its suffix and 10 prefix tokens, then regrows
        state = kv.trim(state, [0, 3, 1, 2 * N, 0, 3 * (N + 2) + 10])
        k = mx.random.normal((6, H, N, D)).astype(dtype)
        state = kv.append(state, k, k * 0.5)
    return state


def _prefix_args(state):
    """``ragged_attention``'s arguments for a ``SharedState`` with one prefix record
    (the row map as ``kvstate.kinds.shared`` builds it for its own read)."""
    _, rows, starts, lens = shared.view_arrays(state)
    prefix = (*shared.prefix_planes(state), rows, starts, lens)
    sx = state.suffix
    lp, en = (mx.array(x, dtype=mx.int32) for x in (sx.left_pad, sx.ends))
    return sx.keys, sx.values, lp, en, prefix


def _reference(state, q, scale):
    f = mx.float32
    dense = kv.materialize(state)
    dense = kv.from_arrays(
        dense.keys.astype(f), dense.values.astype(f), lengths=dense.lengths, left_pad=dense.left_pad
    )
    return kv.attend(dense, q.astype(f), scale=scale)


@pytest.mark.parametrize(
    "gqa,D,N", [(1, 64, 1), (3, 64, 1), (4, 128, 1), (3, 64, 4), (8, 64, 8), (3, 64, 32)]
)
def test_prefix_read_equals_materialized_rows(gqa, D, N):
    """N = 32: a cached request's rest read over its prefix (``PREFIX_QUERIES``)."""
    dtype = mx.bfloat16 if kernels.kernel_available() else mx.float32
    H = 2
    state = _shared_rows(dtype, H, D, N, seed=gqa * 10 + N)
    assert state.shared[5] < state.prefixes[0].lengths[0]  # a row trimmed into its prefix
    q = mx.random.normal((6, H * gqa, N, D)).astype(dtype)
    k, v, lp, en, prefix = _prefix_args(state)
    got = kernels.ragged_attention(q, k, v, lp, en, scale=D**-0.5, prefix=prefix)
    assert got.shape == q.shape and got.dtype == dtype
    tol = BF16_RTOL if dtype == mx.bfloat16 else 1e-5
    assert _rel(got, _reference(state, q, D**-0.5)) < tol


def test_prefix_read_under_compile():
    """Traceable: the row map and lengths are arrays, one trace for two layouts."""
    dtype = mx.bfloat16 if kernels.kernel_available() else mx.float32
    traces = []

    def read(q, k, v, lp, en, *prefix):
        traces.append(1)
        return kernels.ragged_attention(q, k, v, lp, en, scale=0.125, prefix=prefix)

    fn = mx.compile(read)
    shapes = set()
    for seed, trim in ((1, False), (2, True)):
        state = _shared_rows(dtype, 2, 64, 1, seed=seed, trim=trim)
        k, v, lp, en, prefix = _prefix_args(state)
        shapes.add(k.shape)  # the same capacity both times (the trimmed rows regrew)
        q = mx.random.normal((6, 4, 1, 64)).astype(dtype)
        got = fn(q, k, v, lp, en, *prefix)
        tol = BF16_RTOL if dtype == mx.bfloat16 else 1e-5
        assert _rel(got, _reference(state, q, 0.125)) < tol
    assert len(shapes) == 1 and len(traces) == 1


def test_prefix_read_refuses_a_window():
    state = _shared_rows(mx.float32, 2, 64, 1, seed=3)
    k, v, lp, en, prefix = _prefix_args(state)
    q = mx.zeros((6, 2, 1, 64))
    with pytest.raises(kv.KVStateError, match="window"):
        kernels.ragged_attention(q, k, v, lp, en, scale=0.125, window=8, prefix=prefix)


cuda = pytest.mark.skipif(
    not kernels.kernel_available(),
    reason="needs MLX's CUDA backend (elsewhere the prefix read is the gathered masked SDPA)",
)


@cuda
@pytest.mark.parametrize("splits,threads,unroll", [(1, 128, 4), (3, 256, 2), (64, 128, 8)])
def test_prefix_kernel_in_float32_for_any_launch(splits, threads, unroll):
    state = _shared_rows(mx.float32, 2, 64, 3, seed=splits)
    q = mx.random.normal((6, 8, 3, 64))
    k, v, lp, en, prefix = _prefix_args(state)
    got = kernels.ragged_attention(
        q, k, v, lp, en, scale=0.125, prefix=prefix, splits=splits, threads=threads, unroll=unroll
    )
    # MLX CUDA's masked SDPA (the reference) runs TF32 matmuls: 1e-3, not 1e-5
    assert _rel(got, _reference(state, q, 0.125)) < 1e-3


@cuda
def test_prefix_rows_without_a_view_read_only_their_suffix():
    state = _shared_rows(mx.bfloat16, 2, 64, 1, seed=5)
    k, v, lp, en, (pk, pv, rows, starts, lens) = _prefix_args(state)
    q = mx.random.normal((6, 2, 1, 64)).astype(mx.bfloat16)
    none = mx.zeros_like(lens)
    got = kernels.ragged_attention(
        q, k, v, lp, en, scale=0.125, prefix=(pk, pv, rows, starts, none)
    )
    want = kernels.ragged_attention(q, k, v, lp, en, scale=0.125)
    assert _rel(got, want) < 1e-2


@cuda
@pytest.mark.parametrize("N,dtype", [(129, mx.bfloat16), (256, mx.bfloat16), (512, mx.bfloat16)])
def test_prefix_kernel_reads_rests_past_128_queries(monkeypatch, N, dtype):
    """A cached request's rest of up to 512 queries per row read over its prefix
    in the kernel (``PREFIX_QUERIES`` raised to ``N`` where it is lower: where
    the limit may go; the H200 measured the kernel faster than the cascade at
    every width to 512, notes/kernels.md), against the same rows stored unshared."""
    monkeypatch.setattr(kernels, "PREFIX_QUERIES", max(kernels.PREFIX_QUERIES, N))
    H, gqa, D = 2, 3, 64
    state = _shared_rows(dtype, H, D, N, seed=N)
    q = mx.random.normal((6, H * gqa, N, D)).astype(dtype)
    k, v, lp, en, prefix = _prefix_args(state)
    assert kernels.decode_read(N, q, k, prefix=True) == "kernel"
    got = kernels.ragged_attention(q, k, v, lp, en, scale=D**-0.5, prefix=prefix)
    assert got.shape == q.shape and got.dtype == dtype
    assert _rel(got, _reference(state, q, D**-0.5)) < BF16_RTOL
    # and the shared read itself (shared.prefix_read: the route it takes for this width)
    out, _ = shared.prefix_read(
        q, (k, v), lp, en, [prefix[:2]], shared.view_arrays(state), scale=D**-0.5
    )
    assert _rel(out, got) < 1e-2


def _bytes(a):
    import numpy as np

    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("gqa,D,N", [(3, 64, 1), (4, 128, 1), (3, 64, 4)])
@pytest.mark.parametrize("splits", [0, 3])
def test_write_and_read_with_a_prefix_is_append_then_read(dtype, gqa, D, N, splits):
    """The shared step's fused write (``write_and_read(..., prefix=...)``): the suffix
    planes equal ``kv.append``'s byte for byte (every column, spare ones included),
    the read equals the same rows stored unshared (``kv.attend`` on ``materialize``,
    float32). On the CPU the stock path (scatter, then the gathered read); on CUDA
    the kernel: a prefix source and a fused write in one launch."""
    H = 2
    state = _shared_rows(dtype, H, D, N, seed=gqa * 7 + N + splits)
    kn = mx.random.normal((6, H, N, D)).astype(dtype)
    vn = mx.random.normal((6, H, N, D)).astype(dtype)
    q = mx.random.normal((6, H * gqa, N, D)).astype(dtype)
    want = kv.append(state, kn, vn)
    k, v, lp, en, prefix = _prefix_args(want)
    before = state.suffix
    pad = [(0, 0), (0, 0), (0, k.shape[2] - before.keys.shape[2]), (0, 0)]
    k0, v0 = (mx.pad(p, pad) for p in (before.keys, before.values))  # (grown columns: zeros)
    out, keys, values = kernels.write_and_read(
        q, k0, v0, kn, vn, lp, en, scale=D**-0.5, prefix=prefix, splits=splits
    )
    assert _bytes(keys) == _bytes(k) and _bytes(values) == _bytes(v)
    assert out.shape == q.shape and out.dtype == dtype
    # float32: 1e-5 on the CPU; MLX CUDA's masked SDPA reference runs TF32 matmuls
    tol = BF16_RTOL if dtype == mx.bfloat16 else (1e-3 if kernels.kernel_available() else 1e-5)
    assert _rel(out, _reference(want, q, D**-0.5)) < tol
    # and the read of the written planes without the fused write (the kernel's own read)
    alone = kernels.ragged_attention(q, keys, values, lp, en, scale=D**-0.5, prefix=prefix)
    assert _rel(out, alone) < (1e-2 if dtype == mx.bfloat16 else 1e-5)


def test_write_and_read_with_a_prefix_refuses_a_window():
    state = _shared_rows(mx.float32, 2, 64, 1, seed=4)
    k, v, lp, en, prefix = _prefix_args(state)
    q = mx.zeros((6, 2, 1, 64))
    with pytest.raises(kv.KVStateError, match="window"):
        kernels.write_and_read(q, k, v, q, q, lp, en, scale=0.125, window=8, prefix=prefix)
