"""Quantized rows: ``QuantizedState``, the dense layout with packed planes.

Appends quantize only the new tokens (``mx.quantize`` along the head dim, so
every token's groups are its own); everything that moves rows or columns is
the row code in ``kvstate.kinds.rows`` working on the six planes, so merge,
filter, extract, trim and rollback move packed bytes and never requantize.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..core import ops
from ..core.args import as_int
from ..core.invariants import check_float, check_int, check_plane, clear_hidden, validate
from ..core.records import CacheState, QuantizedState, derived
from ..errors import bad, check
from ..kernels import cuda as kernels
from ..kernels.stock import quantized_sdpa
from . import dense as _dense
from . import rows as _rows

GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 5, 6, 8)


def quantized(
    batch_size: int = 1, *, group_size: int = 64, bits: int = 8, step: int = 256
) -> QuantizedState:
    """An empty ``QuantizedState`` of ``batch_size`` rows."""
    group_size, bits = as_int(group_size, "group_size"), as_int(bits, "bits")
    check(group_size in GROUP_SIZES, "group_size", f"one of {GROUP_SIZES}", group_size)
    check(bits in BITS, "bits", f"one of {BITS}", bits)
    base = _dense.empty(batch_size, step=step)
    return QuantizedState(base.lengths, base.left_pad, base.step, group_size=group_size, bits=bits)


def to_quantized(state: CacheState, *, group_size: int = 64, bits: int = 8) -> QuantizedState:
    """A ``QuantizedState`` holding ``state``'s rows, quantized once.

    mlx-lm's ``KVCache.to_quantized`` for kvstate records (what mlx-lm's
    ``generate`` does after ``quantized_kv_start`` tokens: prefill in float,
    then decode on quantized rows). Columns ``[0, width)`` are quantized, so
    the rows, their padding and their lengths carry over; the result's
    capacity is ``width`` (the next append grows it in ``step`` multiples).
    Because ``mx.quantize`` works token by token, the bytes equal appending
    the same tokens to a ``kv.quantized`` record. ``state`` is unchanged.
    """
    if not isinstance(state, CacheState):
        raise bad("state", "a CacheState", type(state).__name__)
    empty = quantized(state.batch_size, group_size=group_size, bits=bits, step=state.step)
    if state.keys is None:
        return empty
    planes: Any = (state.keys, state.values)
    for arg, x in zip(("state keys", "state values"), planes):
        check(
            x.shape[3] % group_size == 0,
            f"{arg} head dim (shape[3])",
            f"a multiple of group_size={group_size}",
            x.shape[3],
        )
    planes = _rows.to_planes(empty, *_rows.columns(state.planes, state.width))
    out = _rows.with_planes(
        empty, planes, lengths=state.lengths, left_pad=state.left_pad, row_ids=state.row_ids
    )
    return clear_hidden(out)  # (mx.quantize of a zero column gives a nonzero scale)


@_rows.geometry.register
def geometry_quantized(state: QuantizedState):
    if state.keys is None:
        return None
    keys: Any = state.keys
    values: Any = state.values
    kp, ks, _ = keys
    vp, vs, _ = values
    # The head dim is recoverable from the scales: one scale per group.
    return (kp.shape[1], ks.shape[3] * state.group_size, vs.shape[3] * state.group_size, ks.dtype)


@_rows.to_planes.register
def to_planes_quantized(state: QuantizedState, k, v):
    for arg, x in (("k", k), ("v", v)):
        check(
            x.shape[3] % state.group_size == 0,
            f"{arg} head dim (shape[3])",
            f"a multiple of group_size={state.group_size}",
            x.shape[3],
        )
    qk = quantize(k, state.group_size, state.bits)
    qv = quantize(v, state.group_size, state.bits)
    return (*qk, *qv)


def quantize(x, group_size: int, bits: int) -> tuple:
    """``mx.quantize`` of ``x`` ``[..., D]``: ``(packed uint32 [..., D * bits // 32],
    scales, biases [..., D // group_size])``, scales and biases in ``x``'s dtype.
    An empty ``x`` (no rows or no tokens) gets its empty planes from these
    shapes: MLX 0.32.4's CUDA ``mx.quantize`` of an empty array kills the
    process (SIGFPE, on the H200)."""
    if x.size == 0:
        lead, D = x.shape[:-1], x.shape[-1]
        return (
            mx.zeros((*lead, D * bits // 32), mx.uint32),
            mx.zeros((*lead, D // group_size), x.dtype),
            mx.zeros((*lead, D // group_size), x.dtype),
        )
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


@_rows.with_planes.register
def with_planes_quantized(state: QuantizedState, planes, **changes):
    keys, values = (tuple(planes[:3]), tuple(planes[3:])) if planes else (None, None)
    return derived(state, keys=keys, values=values, **changes)


@validate.register
def validate_quantized(state: QuantizedState):
    """The dense checks, plus ``bits``/``group_size`` and ``(packed, scales,
    biases)`` planes that agree with them: packed ``uint32`` ``[B, H, C,
    D * bits / 32]``, scales and biases ``[B, H, C, D / group_size]`` of one
    float dtype."""
    B, ends = _rows.validate_rows(state)
    _check_format(state)
    if ends is None:
        return state
    H, C, dtype = _check_triple(state, "keys", B, None, None, None)
    _check_triple(state, "values", B, C, H, dtype)
    _rows.check_ends(state, C)
    return state


def _check_format(state: QuantizedState) -> None:
    """Check ``bits`` and ``group_size``: ints among the supported values."""
    check_int(state.bits, "state.bits", 1)
    check_int(state.group_size, "state.group_size", 1)
    if state.bits not in BITS:
        raise bad("state.bits", f"one of {BITS}", state.bits)
    if state.group_size not in GROUP_SIZES:
        raise bad("state.group_size", f"one of {GROUP_SIZES}", state.group_size)


def _check_triple(state: QuantizedState, name: str, B: int, C, H, dtype):
    """Check one ``(packed, scales, biases)`` triple (``state.keys`` or ``state.values``).

    Args:
        state: The state whose triple is checked.
        name: ``"keys"`` or ``"values"``.
        B: The rows.
        C: The columns the triple must have, or ``None`` (the first triple sets them).
        H: The heads the triple must have, or ``None`` (the first triple sets them).
        dtype: The scales' dtype the triple must have, or ``None`` (the first sets it).

    Returns:
        ``(H, C, dtype)`` of this triple.
    """
    planes = getattr(state, name)
    if type(planes) is not tuple or len(planes) != 3:
        raise bad(
            f"state.{name}",
            "a (packed, scales, biases) tuple of 3 arrays",
            f"{type(planes).__name__} of {len(planes) if type(planes) is tuple else '?'}",
        )
    packed, scales, biases = planes
    _, H, C, width = check_plane(f"state.{name}[0] (packed)", packed, B, C, H)
    groups = check_plane(f"state.{name}[1] (scales)", scales, B, C, H)[3]
    check_plane(f"state.{name}[2] (biases)", biases, B, C, H)
    if biases.shape != scales.shape:
        raise bad(
            f"state.{name}[2] (biases) shape",
            f"{list(scales.shape)} as scales",
            list(biases.shape),
        )
    if packed.dtype != mx.uint32:
        raise bad(f"state.{name}[0] (packed) dtype", "uint32", packed.dtype)
    dtype = scales.dtype if dtype is None else dtype
    for j, x in ((1, scales), (2, biases)):
        if x.dtype != dtype:
            raise bad(f"state.{name}[{j}] dtype", f"{dtype} as keys[1] (scales)", x.dtype)
    check_float(f"state.{name}[1] (scales)", dtype)
    D = groups * state.group_size
    if width * 32 != D * state.bits:
        raise bad(
            f"state.{name}[0] (packed) width (shape[3])",
            f"{D * state.bits // 32} ({groups} groups of {state.group_size} at {state.bits} bits)",
            width,
        )
    return H, C, dtype


@ops.fetch.register
def fetch_quantized(state: QuantizedState):
    """The two ``(packed, scales, biases)`` triples over columns ``[0, width)``."""
    check(state.keys is not None, "state", "a state holding keys (append first)", "an empty state")
    planes = _rows.columns(state.planes, state.width)
    return tuple(planes[:3]), tuple(planes[3:])


def stock_read_runs() -> bool:
    """Whether the stock quantized read (``quantized_sdpa``: ``quantized_matmul``)
    runs here: everywhere but MLX's CUDA backend, whose ``quantized_matmul``
    fails for most KV shapes in MLX 0.32.4 (the backend where
    ``kernels.kernel_available``)."""
    return not kernels.kernel_available()


def read_route(q, keys, group_size: int, bits: int) -> str:
    """THE choice of a quantized attention read, in one place (``kv.attend``, the
    eager bridge and the compiled decoder ask it):

    - ``"kernel"``: ``kernels.quantized_attention`` reads the packed planes,
      each row over its own columns, no mask (where ``kernels.decode_read``
      picks the kernel: decode and verify widths on MLX's CUDA backend);
    - ``"dequantized"``: where the stock read cannot run and the kernel does
      not cover the read (prefill, ``N > kernels.MAX_QUERIES``, or bits the
      kernel lacks, on CUDA): the read's columns dequantized once, then MLX's
      fused SDPA under the same mask;
    - ``"stock"``: ``quantized_sdpa`` (``quantized_matmul`` under the mask;
      the CPU and Metal).

    ``q`` ``[B, Hq, N, D]``; ``keys`` the ``(packed, scales, biases)`` triple.
    """
    if kernels.decode_read(q.shape[2], q, keys, group_size=group_size, bits=bits) == "kernel":
        return "kernel"
    return "stock" if stock_read_runs() else "dequantized"


def dequantized_read(q, keys, values, *, scale: float, mask, group_size: int, bits: int):
    """The ``"dequantized"`` read: ``keys``/``values`` triples dequantized once, then
    MLX's fused SDPA under ``mask`` (``None``, ``"causal"`` or a bool array)."""
    k, v = (
        mx.dequantize(w, scales=s, biases=b, group_size=group_size, bits=bits)
        for w, s, b in (keys, values)
    )
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def reader(
    record, q, keys, values, *, scale: float, rows, window: int = 0, planes: tuple = ()
) -> tuple:
    """``(route, read)``: ``read_route``'s choice for ``record``'s quantized
    ``keys``/``values`` triples ``[B, H, W, *]`` (``record``: a
    ``QuantizedState`` or a compiled step's proto: its ``group_size`` and
    ``bits``), and ``read(mask)``, the attention read of ``q`` it names:

    - ``"kernel"``: ``kernels.quantized_attention`` over the rows given by
      ``rows()`` (``(left_pad, ends)`` int32 ``[B]`` arrays after the write,
      called only there), the last ``window`` columns only (0: all); the
      mask is not read; it reads ``planes`` (the ``(keys, values)`` triples
      over the record's whole capacity) when given: the kernel compiles once
      per capacity, not once per width;
    - ``"dequantized"``: ``keys``/``values`` dequantized once, MLX's fused
      SDPA under ``mask`` (``None``, ``"causal"`` or a bool array over ``W``);
    - ``"stock"``: ``quantized_sdpa`` under ``mask``.
    """
    gs, bits = record.group_size, record.bits
    route = read_route(q, keys, gs, bits)

    def read(mask):
        if route == "kernel":
            left_pad, ends = rows()
            k, v = planes or (keys, values)
            return kernels.quantized_attention(
                q,
                k,
                v,
                left_pad,
                ends,
                scale=scale,
                group_size=gs,
                bits=bits,
                window=window,
            )
        if route == "dequantized":
            return dequantized_read(
                q, keys, values, scale=scale, mask=mask, group_size=gs, bits=bits
            )
        return quantized_sdpa(q, keys, values, scale=scale, mask=mask, group_size=gs, bits=bits)

    return route, read


@ops.attend.register
def attend_quantized(state: QuantizedState, q, *, scale: float, memo=None, window=None):
    """``attend_rows`` through ``read_route``'s read: on MLX's CUDA backend the
    kernel for decode and verify widths, the dequantized columns for wider
    reads; elsewhere the stock quantized read under the rows' mask."""
    n = _rows.validate_queries(state, q, scale=scale, window=window, memo=memo)
    keys, values = ops.fetch(state)
    route, read = reader(
        state,
        q,
        keys,
        values,
        scale=scale,
        window=window or 0,
        rows=lambda: (mx.array(state.left_pad, mx.int32), mx.array(state.ends, mx.int32)),
        planes=(state.keys, state.values),
    )
    if route == "kernel":  # (no mask to build)
        return read(None)
    return _rows.under_mask(_rows.read_mask(state, n, memo, window), read)
