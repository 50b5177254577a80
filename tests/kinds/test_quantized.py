"""QuantizedState: appends quantize only new tokens; moving rows and columns
moves packed bytes (never requantizes); attention on the quantized planes.

Dims stay tiny (head dim 32/64, a few tokens): ``quantized_matmul`` is slow
on this CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from _quant import (
    GEOMETRIES,
    QuantizeCounter,
    assert_same_bytes,
    dequant_attend,
    dequant_sdpa,
    fetched,
    mlx_qsdpa,
    np_of,
    quantize_np,
    rand,
    row_planes,
)
from _rows import append_peak, np_rows_mask
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvstate as kv
from kvstate import KVStateError, to_quantized
from kvstate.kernels import cuda as kernels
from kvstate.kinds import quantized as _quantized

H = 2
SCALE = 0.125


def solo(rng, chunks, *, D=64, group_size=32, bits=4, step=8):
    """A one-row state built by appending ``chunks`` (token counts) in turn."""
    s = kv.quantized(1, group_size=group_size, bits=bits, step=step)
    for n in chunks:
        s = kv.append(s, rand(rng, 1, H, n, D), rand(rng, 1, H, n, D))
    return s


def ragged(rng, lengths, **kw):
    """Solo rows of the given lengths (two chunks each) and their merge."""
    rows = [solo(rng, [n // 2, n - n // 2] if n > 1 else [n], **kw) for n in lengths]
    return rows, kv.merge_rows(rows)


# --- appends --------------------------------------------------------------------


@pytest.mark.parametrize("ragged_rows", [False, True])
def test_append_quantizes_only_new_tokens(monkeypatch, ragged_rows):
    rng = np.random.default_rng(0)
    gs, bits, D = 32, 4, 64
    if ragged_rows:
        _, s = ragged(rng, [5, 2, 7], D=D, group_size=gs, bits=bits)
    else:
        s = kv.append(
            kv.quantized(3, group_size=gs, bits=bits, step=8),
            rand(rng, 3, H, 6, D),
            rand(rng, 3, H, 6, D),
        )
    before = [row_planes(s, b) for b in range(s.batch_size)]
    all_before = tuple(np_of(p) for p in s.planes)
    counter = QuantizeCounter(monkeypatch)
    k, v = rand(rng, 3, H, 3, D), rand(rng, 3, H, 3, D)  # crosses capacity 8
    s2 = kv.append(s, k, v)
    # Exactly two quantize calls, each of the new tokens only; no dequantize.
    assert counter.quantized == [(3, H, 3, D), (3, H, 3, D)]
    assert counter.dequantized == []
    assert s2.capacity == 16 and s2.lengths == tuple(n + 3 for n in s.lengths)
    new_k, new_v = quantize_np(k, gs, bits), quantize_np(v, gs, bits)
    for b in range(3):
        got = row_planes(s2, b)
        n = s.lengths[b]
        # Old columns: the same bytes as before the append.
        assert_same_bytes([p[:, :n] for p in got], before[b], f"row {b} old columns")
        # New columns: exactly mx.quantize of just the new tokens.
        want = [p[b] for p in (*new_k, *new_v)]
        assert_same_bytes([p[:, n:] for p in got], want, f"row {b} new columns")
    # The input record still holds what it held (no in-place write leaked into it).
    assert_same_bytes([np_of(p) for p in s.planes], all_before, "input record")


def test_stored_planes_have_mlx_quantize_layout():
    rng = np.random.default_rng(1)
    for bits, gs, D in [(4, 32, 64), (8, 64, 64), (3, 32, 32), (6, 32, 64)]:
        x = rand(rng, 1, H, 3, D)
        s = kv.append(kv.quantized(1, group_size=gs, bits=bits), x, x)
        keys, values = kv.fetch(s)
        want = mx.quantize(x, group_size=gs, bits=bits)
        for got, w in zip((*keys, *values), (*want, *want)):
            assert got.shape == w.shape and got.dtype == w.dtype
        assert keys[0].dtype == mx.uint32 and keys[0].shape[-1] == D * bits // 32
        assert keys[1].shape[-1] == D // gs


def test_bfloat16_tokens_keep_bfloat16_scales():
    rng = np.random.default_rng(2)
    x = rand(rng, 2, H, 3, 64).astype(mx.bfloat16)
    s = kv.append(kv.quantized(2, group_size=64, bits=8), x, x)
    keys, _ = kv.fetch(s)
    assert keys[1].dtype == mx.bfloat16 and keys[2].dtype == mx.bfloat16
    with pytest.raises(KVStateError, match="k dtype"):
        kv.append(s, x.astype(mx.float32), x.astype(mx.float32))


def _append_peak(state, steps, keep_old):
    return append_peak(state, mx.ones((state.batch_size, H, 1, 64)), steps, keep_old)


@pytest.mark.parametrize("ragged_ends", [False, True], ids=["slice_update", "scatter"])
def test_append_is_in_place_when_the_old_record_is_dropped(ragged_ends):
    rng = np.random.default_rng(11)
    C = 8192
    rows = [
        kv.append(
            kv.quantized(1, group_size=64, bits=8), rand(rng, 1, H, n, 64), rand(rng, 1, H, n, 64)
        )
        for n in ([C - 64, C - 70] if ragged_ends else [C - 64] * 2)
    ]
    s = (
        kv.merge_rows(rows)
        if ragged_ends
        else kv.append(
            kv.quantized(2, group_size=64, bits=8),
            rand(rng, 2, H, C - 64, 64),
            rand(rng, 2, H, C - 64, 64),
        )
    )
    del rows
    mx.eval(*s.planes)
    assert s.capacity == C
    plane = s.keys[0].nbytes  # the packed keys: 1 MiB
    grew, after = _append_peak(s, 16, keep_old=False)
    assert after.lengths == tuple(n + 17 for n in s.lengths)
    # O(new tokens): far less than one packed plane (a copy is all six planes)
    assert grew < plane // 8, (grew, plane)
    # control: holding the old records forces a copy per append
    grew_held, _ = _append_peak(s, 2, keep_old=True)
    assert grew_held >= plane, (grew_held, plane)


# --- moving rows and columns never requantizes --------------------------------------------


def test_moves_never_quantize_or_dequantize(monkeypatch):
    rng = np.random.default_rng(3)
    rows, s = ragged(rng, [4, 7, 2])
    counter = QuantizeCounter(monkeypatch)
    cp = kv.checkpoint(s)
    moved = [
        kv.merge_rows(rows),
        kv.extend(rows[0], rows[1]),
        kv.filter_rows(s, [2, 0]),
        kv.extract_row(s, 1),
        kv.trim(s, [1, 2, 0]),
        kv.rollback(s, cp, 0),
    ]
    for m in moved:
        kv.fetch(m)
        mx.eval(*m.planes)
    assert counter.quantized == [] and counter.dequantized == []


@st.composite
def quantized_rows(draw, max_rows=4):
    bits, gs, D = draw(st.sampled_from([(b, g, d) for b, g, d in GEOMETRIES if d == 64]))
    step = draw(st.sampled_from([4, 16]))
    rows = draw(
        st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=max_rows)
    )
    seed = draw(st.integers(0, 2**16))
    return bits, gs, D, step, rows, seed


def build_rows(spec):
    bits, gs, D, step, rows, seed = spec
    rng = np.random.default_rng(seed)
    return [solo(rng, chunks, D=D, group_size=gs, bits=bits, step=step) for chunks in rows]


@given(quantized_rows())
def test_extract_after_merge_is_byte_exact(spec):
    rows = build_rows(spec)
    merged = kv.merge_rows(rows)
    assert merged.lengths == tuple(r.lengths[0] for r in rows)
    for i, r in enumerate(rows):
        assert_same_bytes(row_planes(merged, i), row_planes(r, 0), f"merged row {i}")
        e = kv.extract_row(merged, i)
        assert (e.lengths, e.left_pad) == (r.lengths, (0,))
        assert e.capacity == r.lengths[0]  # a compact copy, not a view of the batch
        assert (e.bits, e.group_size) == (r.bits, r.group_size)
        assert_same_bytes(fetched(e), fetched(r), f"extract_row(merge_rows(rows), {i})")


@given(quantized_rows(), st.data())
def test_filter_is_byte_exact(spec, data):
    rows = build_rows(spec)
    merged = kv.merge_rows(rows)
    keep = data.draw(
        st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=len(rows), unique=True)
    )
    f = kv.filter_rows(merged, keep)
    assert f.lengths == tuple(rows[r].lengths[0] for r in keep)
    assert min(f.left_pad) == 0  # padding every survivor shared is gone
    assert f.width == max(rows[r].lengths[0] for r in keep)
    for j, r in enumerate(keep):
        assert_same_bytes(row_planes(f, j), row_planes(rows[r], 0), f"filtered row {j}")


@given(quantized_rows(max_rows=3), st.data())
def test_rollback_and_trim_then_append_equal_appending_the_accepted(spec, data):
    bits, gs, D, step, rows, seed = spec
    rng = np.random.default_rng(seed + 1)
    batch = kv.merge_rows(build_rows(spec))
    B = batch.batch_size
    draft_n = data.draw(st.integers(1, 4))
    keep = data.draw(st.lists(st.integers(0, draft_n), min_size=B, max_size=B))
    dk, dv = rand(rng, B, H, draft_n, D), rand(rng, B, H, draft_n, D)
    nk, nv = rand(rng, B, H, 2, D), rand(rng, B, H, 2, D)
    cp = kv.checkpoint(batch)
    drafted = kv.append(batch, dk, dv)
    rolled = kv.rollback(drafted, cp, keep)
    trimmed = kv.trim(drafted, [draft_n - k for k in keep])
    for got in (rolled, trimmed):
        assert got.lengths == tuple(n + k for n, k in zip(batch.lengths, keep))
        after = kv.append(got, nk, nv)
        for b in range(B):
            ref = kv.extract_row(batch, b)
            ref = (
                kv.append(ref, dk[b : b + 1, :, : keep[b]], dv[b : b + 1, :, : keep[b]])
                if keep[b]
                else ref
            )
            ref = kv.append(ref, nk[b : b + 1], nv[b : b + 1])
            assert_same_bytes(row_planes(after, b), row_planes(ref, 0), f"row {b}")


@given(quantized_rows())
def test_to_quantized_equals_appending_to_quantized_rows(spec):
    """Float rows quantized once (mlx-lm's ``to_quantized`` path) hold the
    same bytes as the same tokens appended to quantized rows, chunk by
    chunk; the float record is unchanged, and appends continue from it."""
    bits, gs, D, step, rows, seed = spec
    rng = np.random.default_rng(seed)
    dense_rows, quant_rows = [], []
    for chunks in rows:
        d = kv.empty(1, step=step)
        q = kv.quantized(1, group_size=gs, bits=bits, step=step)
        for n in chunks:
            k, v = rand(rng, 1, H, n, D), rand(rng, 1, H, n, D)
            d, q = kv.append(d, k, v), kv.append(q, k, v)
        dense_rows.append(d)
        quant_rows.append(q)
    batch = kv.merge_rows(dense_rows)
    before = [np_of(p) for p in batch.planes]
    got = to_quantized(batch, group_size=gs, bits=bits)
    want = kv.merge_rows(quant_rows)
    assert (got.lengths, got.left_pad, got.step) == (want.lengths, want.left_pad, want.step)
    assert (got.bits, got.group_size) == (bits, gs)
    for b in range(batch.batch_size):
        assert_same_bytes(row_planes(got, b), row_planes(want, b), f"row {b}")
    assert_same_bytes([np_of(p) for p in batch.planes], before, "the float record")
    k, v = rand(rng, batch.batch_size, H, 2, D), rand(rng, batch.batch_size, H, 2, D)
    got, want = kv.append(got, k, v), kv.append(want, k, v)
    for b in range(batch.batch_size):
        assert_same_bytes(row_planes(got, b), row_planes(want, b), f"row {b} after an append")


def test_to_quantized_bad_input():
    rng = np.random.default_rng(12)
    assert to_quantized(kv.empty(3, step=8), bits=4).lengths == (0, 0, 0)
    s = kv.append(kv.empty(1), rand(rng, 1, H, 2, 32), rand(rng, 1, H, 2, 32))
    with pytest.raises(
        KVStateError,
        match=r"state keys head dim \(shape\[3\]\): expected a "
        r"multiple of group_size=64, got 32",
    ):
        to_quantized(s)
    with pytest.raises(KVStateError, match="bits: expected one of"):
        to_quantized(s, group_size=32, bits=7)
    with pytest.raises(KVStateError, match="state: expected a CacheState, got QuantizedState"):
        to_quantized(to_quantized(s, group_size=32))


def test_merge_refuses_other_bits_or_group_size():
    rng = np.random.default_rng(4)
    a = solo(rng, [2], bits=4, group_size=32)
    for other in (solo(rng, [2], bits=8, group_size=32), solo(rng, [2], bits=4, group_size=64)):
        with pytest.raises(KVStateError, match=r"states\[1\]\.(bits|group_size)"):
            kv.merge_rows([a, other])
    with pytest.raises(KVStateError, match="QuantizedState"):
        kv.merge_rows([a, kv.append(kv.empty(1), rand(rng, 1, H, 2, 64), rand(rng, 1, H, 2, 64))])


# --- attention --------------------------------------------------------------------


def check_attend(s, q, window=None, tol=2e-4):
    """kv.attend equals mlx-lm's quantized SDPA on the same planes under the
    contract's mask (bit for bit; where the backend has that read: not MLX
    0.32.4's CUDA), and dequantize -> float attention (within ``tol``); ``q``
    is not modified."""
    q_before = np_of(q)
    got = kv.attend(s, q, scale=SCALE, window=window)
    keys, values = kv.fetch(s)
    n = q.shape[2]
    if s.aligned and window is None:
        mask = None if n == 1 else "causal"  # what mlx-lm's make_mask answers
    else:
        mask = mx.array(np_rows_mask(n, s.left_pad, s.ends, s.width, window))
    if _quantized.stock_read_runs():  # mlx-lm's read, where this backend has it (tests/_quant.py)
        want = mlx_qsdpa(
            q, keys, values, scale=SCALE, mask=mask, group_size=s.group_size, bits=s.bits
        )
        np.testing.assert_array_equal(np_of(got), np_of(want))
    ref = dequant_attend(s, q, scale=SCALE, window=window)
    np.testing.assert_allclose(np_of(got), np_of(ref), atol=tol, rtol=tol)
    np.testing.assert_array_equal(np_of(q), q_before)
    assert got.shape == (q.shape[0], q.shape[1], n, 64)
    return got


@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 3])
def test_attend_aligned_gqa(rep, n):
    rng = np.random.default_rng(5 + rep + n)
    s = kv.append(
        kv.quantized(2, group_size=32, bits=8, step=8),
        rand(rng, 2, H, 6, 64),
        rand(rng, 2, H, 6, 64),
    )
    check_attend(s, rand(rng, 2, H * rep, n, 64))


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (3, 32)])
@pytest.mark.parametrize("n", [1, 2])
def test_attend_ragged_rows_gqa(bits, gs, n):
    rng = np.random.default_rng(6 + bits + n)
    _, s = ragged(rng, [3, 9, 5], group_size=gs, bits=bits)
    for _ in range(2):  # rows advance independently: per-row ends
        s = kv.append(s, rand(rng, 3, H, n, 64), rand(rng, 3, H, n, 64))
        check_attend(s, rand(rng, 3, 2 * H, n, 64), tol=2e-4 if bits == 8 else 2e-3)


@pytest.mark.parametrize("aligned", [True, False])
def test_attend_window(aligned):
    rng = np.random.default_rng(7)
    if aligned:
        s = kv.append(
            kv.quantized(2, group_size=32, bits=8), rand(rng, 2, H, 9, 64), rand(rng, 2, H, 9, 64)
        )
    else:
        _, s = ragged(rng, [9, 4], group_size=32, bits=8)
    for n, w in [(1, 3), (3, 2), (2, 20)]:
        check_attend(s, rand(rng, 2, 2 * H, n, 64), window=w)


@pytest.mark.parametrize("n", [2, kernels.MAX_QUERIES + 1])
def test_attend_with_memo_matches_without(n):
    """A memo builds the rows' mask once for two reads and holds none after
    them; a read that takes no mask (the kernel route: decode and verify
    widths on MLX's CUDA backend) builds none. The wider read takes a mask
    on every backend (on CUDA the dequantized route)."""
    rng = np.random.default_rng(8)
    _, s = ragged(rng, [10, 14], group_size=32, bits=4)
    q = rand(rng, 2, H, n, 64)
    masked = _quantized.read_route(q, kv.fetch(s)[0], 32, 4) != "kernel"
    memo = kv.MaskMemo()
    a = kv.attend(s, q, scale=SCALE, memo=memo)
    b = kv.attend(s, q, scale=SCALE, memo=memo)
    c = kv.attend(s, q, scale=SCALE)
    assert memo.builds == int(masked) and memo.live == 0
    np.testing.assert_array_equal(np_of(a), np_of(c))
    np.testing.assert_array_equal(np_of(b), np_of(c))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2, 0, 64), (0, 2, 3, 64), (0, 2, 0, 128)])
def test_empty_tokens_quantize_to_the_planes_mx_quantize_gives(shape, dtype):
    """``_quantized.quantize`` of an empty array (a row or batch with no tokens)
    gives the planes ``mx.quantize`` gives, by shape, without calling it: MLX
    0.32.4's CUDA ``mx.quantize`` of an empty array kills the process (SIGFPE).
    The comparison runs where ``mx.quantize`` takes empty arrays (the CPU)."""
    x = mx.zeros(shape, dtype)
    for bits, gs in [(2, 32), (3, 32), (4, 64), (5, 32), (6, 64), (8, 32)]:
        got = _quantized.quantize(x, gs, bits)
        assert [(p.shape, p.dtype) for p in got] == [
            ((*shape[:-1], shape[-1] * bits // 32), mx.uint32),
            ((*shape[:-1], shape[-1] // gs), dtype),
            ((*shape[:-1], shape[-1] // gs), dtype),
        ]
        if not kernels.kernel_available():  # (not on MLX's CUDA backend, where it dies)
            want = mx.quantize(x, group_size=gs, bits=bits)
            assert [(p.shape, p.dtype) for p in got] == [(p.shape, p.dtype) for p in want]


def test_five_and_six_bits_at_head_dim_128():
    # mlx-lm's QuantizedKVCache mis-sizes these (dim // (32 // bits) words);
    # kvstate takes the planes' shape from mx.quantize itself.
    rng = np.random.default_rng(9)
    for bits in (5, 6):
        s = kv.quantized(1, group_size=64, bits=bits, step=4)
        for n in (3, 1, 2):
            s = kv.append(s, rand(rng, 1, H, n, 128), rand(rng, 1, H, n, 128))
        keys, _ = kv.fetch(s)
        assert keys[0].shape == (1, H, 6, 128 * bits // 32)
        q = rand(rng, 1, H, 1, 128)
        got = kv.attend(s, q, scale=SCALE)
        ref = dequant_attend(s, q, scale=SCALE)
        np.testing.assert_allclose(np_of(got), np_of(ref), atol=2e-4, rtol=2e-4)


# --- bad input -------------------------------------------------------------------


def test_bad_input_names_the_argument_and_changes_nothing():
    rng = np.random.default_rng(10)
    with pytest.raises(KVStateError, match="bits: expected one of"):
        kv.quantized(1, bits=7)
    with pytest.raises(KVStateError, match="group_size: expected one of"):
        kv.quantized(1, group_size=16)
    with pytest.raises(KVStateError, match="bits: expected an int"):
        kv.quantized(1, bits=4.0)
    s = solo(rng, [3], D=64, group_size=64, bits=4)
    before = fetched(s)
    x = rand(rng, 1, H, 2, 32)
    with pytest.raises(KVStateError, match=r"k head dim \(shape\[3\]\): expected 64"):
        kv.append(s, x, x)
    with pytest.raises(
        KVStateError,
        match=r"k head dim \(shape\[3\]\): expected a multiple of "
        r"group_size=64, got 32",
    ):
        kv.append(kv.quantized(1, group_size=64), x, x)
    with pytest.raises(KVStateError, match="q dtype"):
        kv.attend(s, rand(rng, 1, H, 1, 64).astype(mx.bfloat16), scale=SCALE)
    with pytest.raises(KVStateError, match="q heads"):
        kv.attend(s, rand(rng, 1, 3, 1, 64), scale=SCALE)
    with pytest.raises(KVStateError, match="state: expected a state holding keys"):
        kv.fetch(kv.quantized(1))
    with pytest.raises(KVStateError, match="n for row 0"):
        kv.trim(s, 4)
    assert_same_bytes(fetched(s), before, "state after failed calls")
    assert s.lengths == (3,)


# --- model-based: a numpy model of the rows' quantized bytes ----------------------------


class QuantizedRows(RuleBasedStateMachine):
    """Every rule applies one kvstate function and the obvious edit to a model
    that holds, per row, the six planes ``[H, L, *]`` as numpy: appended
    tokens are ``mx.quantize``'d once, on their own, and then only ever
    concatenated or sliced. After every rule the record's row bytes equal the
    model's, and ``kv.attend`` equals mlx-lm's quantized SDPA on each model
    row alone (where the backend has that read; else the dequantized float
    read of the model row)."""

    D = 32

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)
        self.state, self.rows = None, []

    def quantize(self, x):
        return quantize_np(x, self.gs, self.bits)

    def fresh(self, lengths):
        singles, rows = [], []
        for n in lengths:
            s = kv.quantized(1, group_size=self.gs, bits=self.bits, step=4)
            k, v = rand(self.rng, 1, H, n, self.D), rand(self.rng, 1, H, n, self.D)
            if n:
                s = kv.append(s, k, v)
            singles.append(s)
            rows.append(tuple(p[0] for p in (*self.quantize(k), *self.quantize(v))))
        return kv.merge_rows(singles), rows

    def show(self, what):
        s = self.state
        note(f"{what} -> lengths={s.lengths} left_pad={s.left_pad} capacity={s.capacity}")

    @initialize(
        lengths=st.lists(st.integers(0, 5), min_size=1, max_size=3),
        geometry=st.sampled_from([(4, 32), (8, 32), (3, 32), (2, 32)]),
    )
    def start(self, lengths, geometry):
        self.bits, self.gs = geometry
        self.state, self.rows = self.fresh(lengths)
        self.show(f"start {lengths} bits={self.bits}")

    @rule(n=st.integers(1, 3), seed=st.integers(0, 2**16))
    def append(self, n, seed):
        rng = np.random.default_rng(seed)
        B = self.state.batch_size
        k, v = rand(rng, B, H, n, self.D), rand(rng, B, H, n, self.D)
        self.state = kv.append(self.state, k, v)
        new = (*self.quantize(k), *self.quantize(v))
        self.rows = [
            tuple(np.concatenate([r, p[b]], axis=1) for r, p in zip(row, new))
            for b, row in enumerate(self.rows)
        ]
        self.show(f"append {n}")

    @rule(data=st.data())
    def trim(self, data):
        n = [
            data.draw(st.integers(0, m), label=f"n[{b}]") for b, m in enumerate(self.state.lengths)
        ]
        self.state = kv.trim(self.state, n)
        self.rows = [tuple(p[:, : p.shape[1] - t] for p in row) for row, t in zip(self.rows, n)]
        self.show(f"trim {n}")

    @rule(data=st.data(), n=st.integers(1, 3), seed=st.integers(0, 2**16))
    def speculate(self, data, n, seed):
        rng = np.random.default_rng(seed)
        B = self.state.batch_size
        keep = data.draw(st.lists(st.integers(0, n), min_size=B, max_size=B), label="keep")
        k, v = rand(rng, B, H, n, self.D), rand(rng, B, H, n, self.D)
        cp = kv.checkpoint(self.state)
        self.state = kv.rollback(kv.append(self.state, k, v), cp, keep)
        new = (*self.quantize(k), *self.quantize(v))
        self.rows = [
            tuple(np.concatenate([r, p[b][:, : keep[b]]], axis=1) for r, p in zip(row, new))
            for b, row in enumerate(self.rows)
        ]
        self.show(f"draft {n} keep {keep}")

    @precondition(lambda self: self.state.batch_size < 5)
    @rule(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=2), first=st.booleans())
    def merge(self, lengths, first):
        other, rows = self.fresh(lengths)
        if first:
            self.state, self.rows = kv.merge_rows([other, self.state]), rows + self.rows
        else:
            self.state, self.rows = kv.extend(self.state, other), self.rows + rows
        self.show(f"merge {lengths}")

    @rule(data=st.data())
    def filter(self, data):
        B = self.state.batch_size
        keep = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=B), label="keep")
        self.state = kv.filter_rows(self.state, keep)
        self.rows = [self.rows[r] for r in keep]
        self.show(f"filter {keep}")

    @rule(data=st.data())
    def extract(self, data):
        i = data.draw(st.integers(0, self.state.batch_size - 1), label="row")
        row = kv.extract_row(self.state, i)
        if row.keys is not None:
            assert_same_bytes(row_planes(row, 0), self.rows[i], "extracted row")
        if data.draw(st.booleans(), label="continue with the row alone"):
            self.state, self.rows = row, [self.rows[i]]
        self.show(f"extract {i}")

    @invariant()
    def bytes_match(self):
        s = self.state
        if s is None:
            return
        assert s.lengths == tuple(r[0].shape[1] for r in self.rows)
        if s.keys is None:
            return
        for b, row in enumerate(self.rows):
            assert_same_bytes(row_planes(s, b), row, f"row {b}")

    @invariant()
    def attention_matches(self):
        s = self.state
        if s is None or s.keys is None or min(s.lengths) == 0:
            return
        n = min(2, min(s.lengths))
        q = rand(self.rng, s.batch_size, 2 * H, n, self.D)
        got = np_of(kv.attend(s, q, scale=SCALE))
        # mlx-lm's read where this backend has it, else the dequantized float
        # read (MLX 0.32.4's CUDA lacks quantized_matmul for these shapes)
        stock = _quantized.stock_read_runs()
        reference, tol = (mlx_qsdpa, 1e-5) if stock else (dequant_sdpa, 2e-4)
        for b, row in enumerate(self.rows):
            keys = tuple(mx.array(p[None]) for p in row[:3])
            values = tuple(mx.array(p[None]) for p in row[3:])
            want = reference(
                q[b : b + 1],
                keys,
                values,
                scale=SCALE,
                mask=None if n == 1 else "causal",
                group_size=self.gs,
                bits=self.bits,
            )
            np.testing.assert_allclose(
                got[b : b + 1], np_of(want), atol=tol, rtol=tol, err_msg=f"row {b}"
            )


QuantizedRows.TestCase.settings = settings(stateful_step_count=12)
TestQuantizedRows = QuantizedRows.TestCase
