"""The CUDA launches of ``kvstate.kernels.cuda``, recorded on any backend.

CUDA caps a launch's grid at 65535 blocks along y and z and 2^31 - 1 along x
(MLX's ``cuda_kernel`` takes the grid in threads, as int32s); a launch past a cap
fails as ``cudaGraphAddKernelNode ... invalid argument``. A stand-in for
``mx.fast.cuda_kernel`` records every launch (its outputs are zeros, never
evaluated), so the grids of thousands of rows are checked on the CPU. That the
kernels index their blocks as these grids lay them out is checked on the H200
(``tests/kernels/test_gpu_kernels.py`` and the other kernel tests).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvstate.errors import KVStateError
from kvstate.kernels import cuda as kernels

LIMITS = (2**31 - 1, 65535, 65535)  # blocks along x, y, z


@pytest.fixture
def launches(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, name, **_):
            self.name = name

        def __call__(self, *, grid, threadgroup, output_shapes, output_dtypes, **_):
            assert all(g < 2**31 for g in grid)  # MLX's int32 grid, in threads
            blocks = tuple(-(-g // t) for g, t in zip(grid, threadgroup))
            seen.append((self.name, blocks))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(mx.fast, "cuda_kernel", Recorder)
    monkeypatch.setattr(kernels, "_kernels", {})
    monkeypatch.setattr(kernels, "kernel_available", lambda dtype=None: True)
    return seen


def _rows(B, H, rep, N, C=64, D=16):
    # lazy zeros: never evaluated (the recorder hands back zeros of its own)
    q = mx.zeros((B, H * rep, N, D))
    k = mx.zeros((B, H, C, D))
    ends = mx.full((B,), C, mx.int32)
    return q, k, mx.zeros((B,), mx.int32), ends


def _read(q, k, lp, ends, splits):
    return kernels.ragged_attention(q, k, k, lp, ends, scale=1.0, splits=splits)


def _fused(q, k, lp, ends, splits):
    new = mx.zeros((k.shape[0], k.shape[1], q.shape[2], k.shape[3]))
    return kernels.write_and_read(q, k, k, new, new, lp, ends, scale=1.0, splits=splits)


def _prefix(q, k, lp, ends, splits):
    B, H, _, D = k.shape
    pk = mx.zeros((2, H, 32, D))
    rows, starts, lens = mx.zeros((B,), mx.int32), mx.zeros((B,), mx.int32), mx.full((B,), 32)
    prefix = (pk, pk, rows, starts, lens.astype(mx.int32))
    return kernels.ragged_attention(q, k, k, lp, ends, scale=1.0, splits=splits, prefix=prefix)


def _quantized(q, k, lp, ends, splits):
    B, H, C, D = k.shape
    packed = mx.zeros((B, H, C, D * 8 // 32), mx.uint32)
    triple = (packed, mx.zeros((B, H, C, 1)), mx.zeros((B, H, C, 1)))
    return kernels.quantized_attention(
        q, triple, triple, lp, ends, scale=1.0, group_size=16, bits=8, splits=splits
    )


# (B, KV heads H, query heads per KV head, queries N, splits): the 3000 rows x 2 query
# heads of test_speculative's sampled loop; B x H past 65535 (8192 x 8, a batch the
# old grid's y could not take); merges of more than 65535 (row, head, query) rows.
SHAPES = [(3000, 1, 2, 1, 0), (8192, 8, 4, 1, 0), (65536, 1, 1, 1, 0), (4096, 8, 4, 8, 2)]


@pytest.mark.parametrize("call", [_read, _fused, _prefix, _quantized])
@pytest.mark.parametrize("B,H,rep,N,splits", SHAPES)
def test_launch_grids_stay_inside_cuda_limits_at_any_batch(launches, call, B, H, rep, N, splits):
    call(*_rows(B, H, rep, N), splits)
    assert launches
    S = splits or 1
    copies = kernels.copies_for(64, 16, 4) if call is _fused else 0  # _rows' C, D, float32
    for name, blocks in launches:
        assert all(1 <= b <= most for b, most in zip(blocks, LIMITS)), (name, blocks)
        if "merge" in name:  # one block per (row, query head, query)
            assert blocks == (B * H * rep * N, 1, 1)
        else:  # each (row, KV head)'s splits (and copy blocks) along x, the queries along z
            assert blocks == ((S + copies) * B * H, 1, N), (name, blocks)
    assert len(launches) == (1 if S == 1 else 2)


@pytest.mark.parametrize("call", [_read, _fused, _prefix, _quantized])
def test_no_rows_launch_nothing(launches, call):
    # an empty grid is an invalid launch: zero rows take the stock path (empty results)
    out = call(*_rows(0, 2, 2, 1), 0)
    out = out[0] if isinstance(out, tuple) else out
    mx.eval(out)
    assert not launches and out.shape == (0, 4, 1, 16)


def test_a_grid_past_int32_threads_is_refused_on_the_host(launches):
    B = 2**31 // kernels.THREADS  # B x 1 head x 256 threads = 2^31: one past the cap
    with pytest.raises(KVStateError, match="rows x heads"):
        _read(*_rows(B, 1, 1, 1, C=16), 1)
    assert not launches


def test_splits_fill_the_gpu_at_any_batch(monkeypatch):
    """``splits_for``'s rule (host arithmetic: runs everywhere; the counts were
    chosen from H200 measurements, ``notes/kernels.md``)."""
    assert kernels.splits_for(1, 8, 8448) == 32  # one long row spread over many blocks
    assert kernels.splits_for(1, 8, 33024) == kernels.MAX_SPLITS == 32  # (whole steps)
    assert kernels.splits_for(1, 8, 2304) == 1  # a short one: one launch (measured)
    assert kernels.splits_for(32, 8, 8192) == 1  # B x H blocks fill the GPU (measured)
    assert kernels.splits_for(8, 2, 33024) == 32  # TARGET_BLOCKS
    assert kernels.splits_for(8, 8, 8448) == 8  # TARGET_BLOCKS
    monkeypatch.setattr(kernels, "SINGLE_SPAN", 0)
    assert kernels.splits_for(1, 1, 1000) == 15  # never a split under MIN_SPLIT columns
