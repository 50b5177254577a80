"""Quantized rows read packed: ``kernels.quantized_attention`` and ``kv.attend``
on a ``QuantizedState`` (issue 15's quantized rows).

The reference is the float32 masked SDPA over the dequantized planes (what
the packed rows stand for). On the CPU ``quantized_attention`` is the stock
quantized read (``quantized_matmul`` under a per-row mask), so these tests
check that path and the row convention; on MLX's CUDA backend, where the
stock read fails for most KV shapes (MLX 0.32.4), they check the kernel that
reads the packed planes (bf16 tolerance).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
import tiny_models as tm

import kvstate as kv
from kvstate import mlx_lm as br
from kvstate.core.masks import rows_mask
from kvstate.kernels import cuda as kernels

CUDA = kernels.kernel_available()
DTYPE = mx.bfloat16 if CUDA else mx.float32
TOL = 2e-2 if CUDA else 1e-4  # relative L2 error against the dequantized float32 read


def _rel(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want**2).sum())).item()


def _rows(H, D, group_size, bits, seed):
    """Ragged, left-padded quantized rows (4 rows, capacity 96)."""
    mx.random.seed(seed)
    k = mx.random.normal((4, H, 96, D)).astype(DTYPE)
    v = mx.random.normal((4, H, 96, D)).astype(DTYPE)
    dense = kv.from_arrays(k, v, lengths=[90, 41, 96, 12], left_pad=[6, 0, 0, 30])
    return kv.to_quantized(dense, group_size=group_size, bits=bits)


def _reference(state, q, scale):
    f = mx.float32
    deq = [
        mx.dequantize(*p, group_size=state.group_size, bits=state.bits).astype(f)
        for p in (state.keys, state.values)
    ]
    C, N = deq[0].shape[2], q.shape[2]
    mask = rows_mask(N, state.left_pad, state.ends, C)
    return mx.fast.scaled_dot_product_attention(q.astype(f), *deq, scale=scale, mask=mask)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 32), (8, 64)])
@pytest.mark.parametrize("D,gqa", [(64, 1), (64, 4), (128, 4)])
@pytest.mark.parametrize("N", [1, 4])
def test_quantized_read_equals_dequantized_rows(bits, group_size, D, gqa, N):
    H = 2
    state = _rows(H, D, group_size, bits, seed=bits + D + N)
    q = mx.random.normal((4, H * gqa, N, D)).astype(DTYPE)
    want = _reference(state, q, D**-0.5)
    lp, en = (mx.array(x, dtype=mx.int32) for x in (state.left_pad, state.ends))
    got = kernels.quantized_attention(
        q,
        state.keys,
        state.values,
        lp,
        en,
        scale=D**-0.5,
        group_size=group_size,
        bits=bits,
    )
    assert got.shape == q.shape and got.dtype == DTYPE
    assert _rel(got, want) < TOL
    assert _rel(kv.attend(state, q, scale=D**-0.5), want) < TOL  # the record's own read


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend (forced launches of the kernel)")
@pytest.mark.parametrize("splits,threads", [(1, 256), (3, 128), (16, 256)])
def test_quantized_kernel_for_any_launch(splits, threads):
    state = _rows(2, 64, 32, 4, seed=splits)
    q = mx.random.normal((4, 8, 2, 64)).astype(DTYPE)
    lp, en = (mx.array(x, dtype=mx.int32) for x in (state.left_pad, state.ends))
    got = kernels.quantized_attention(
        q, state.keys, state.values, lp, en, scale=0.125, group_size=32, bits=4,
        splits=splits, threads=threads,
    )  # fmt: skip
    assert _rel(got, _reference(state, q, 0.125)) < TOL


@pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend (the compiled step's kernel read)")
def test_kernel_decoder_reads_quantized_rows():
    """The compiled step over quantized rows on CUDA (its stock quantized read fails
    there): logits equal the eager bridge's steps computed on the CPU stream."""
    model = tm.llama_model(layers=2)
    rows = []
    for i, n in enumerate([5, 17, 9]):
        s = br.make_states(model, 1)
        _, s = br.forward(model, mx.array([tm.prompt(10 + i, n)]), s)
        rows.append(s)
    dense = br.merge_rows(rows)
    states = [kv.to_quantized(s, group_size=32, bits=8) for s in dense]
    decode = br.Decoder(model, attention="kernel")
    se = sc = states
    tok = mx.array([3, 4, 5])
    for _ in range(3):
        with mx.stream(mx.cpu):
            le, se = br.step(model, tok, se)
            mx.eval(le)
        lc, sc = decode(tok, sc)
        assert isinstance(sc[0], kv.QuantizedState)
        assert mx.abs(le - lc).max().item() < 2e-2 * max(1.0, mx.abs(le).max().item())
        tok = mx.argmax(le, axis=-1)
