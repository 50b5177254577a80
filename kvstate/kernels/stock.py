"""The stock reads and writes: what every backend runs where no kernel fits.

``column_writer`` writes new tokens at each row's end (one ``slice_update``
or a per-row scatter); ``quantized_sdpa`` is attention on quantized planes
with mlx-lm's arithmetic. The kinds use them directly; the CUDA kernels
(``kernels.cuda``) route to them where a kernel does not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import mlx.core as mx

__all__ = ["column_writer", "quantized_sdpa", "scatter_writer"]

Writer = Callable[[mx.array, mx.array], mx.array]  # write(plane, new) -> the written plane


_GPU = mx.DeviceType.gpu


def column_writer(ends: Any, N: int, *, slice_write: Optional[bool] = None) -> Writer:
    """How ``N`` new tokens ``[B, H, N, D]`` are written at the rows' ``ends``:
    a function ``write(plane, new)`` returning the written plane.

    ``ends``: host ints (eager appends) or an int32 ``[B]`` array (a
    compiled step, where it is traced). One shared end is a single
    ``slice_update``; differing ends a per-row scatter at column indices
    ``[B, 1, N, 1]`` (it broadcasts over heads and head dim), built once and
    shared by every plane. Both write in place when nothing else holds the
    plane. ``slice_write``: for host ends, default ``True`` off the GPU; for
    array ends, whether every row is known to end at ``ends[0]``.

    On a GPU host writes are scatters: MLX 0.32's CUDA backend copies the
    whole plane for a dynamic-start ``slice_update`` (the step grows with the
    capacity), while its scatter writes in place (``notes/kernels.md``).
    MLX does not bounds-check either write: the host guarantees
    ``ends + N <= C`` before the call.
    """
    if isinstance(ends, mx.array):
        if slice_write:
            start = ends[:1]
            return lambda plane, new: mx.slice_update(plane, new, start, (2,))
        index = ends[:, None, None, None] + mx.arange(N, dtype=mx.int32)[None, None, :, None]
    else:
        if slice_write is None:
            slice_write = mx.default_device().type != _GPU
        if slice_write and ends and ends.count(ends[0]) == len(ends):
            start = mx.array([ends[0]], dtype=mx.int32)
            return lambda plane, new: mx.slice_update(plane, new, start, (2,))
        flat = [e + i for e in ends for i in range(N)]  # (one list: cheaper than nested)
        index = mx.array(flat, dtype=mx.int32).reshape(len(ends), 1, N, 1)
    return scatter_writer(index)


def scatter_writer(index: mx.array) -> Writer:
    """``write(plane, new)`` putting ``new`` ``[B, H, N, D]`` at the columns
    ``index`` ``[B, 1, N, 1]`` (broadcast over heads and head dim)."""
    return lambda plane, new: mx.put_along_axis(
        plane, mx.broadcast_to(index, new.shape), new, axis=2
    )


def quantized_sdpa(
    q: mx.array,
    keys: tuple,
    values: tuple,
    *,
    scale: float,
    mask: Any,
    group_size: int,
    bits: int,
) -> mx.array:
    """Attention of ``q`` ``[B, Hq, N, D]`` on quantized planes ``[B, H, W, *]``.

    The arithmetic of mlx-lm's ``quantized_scaled_dot_product_attention``
    (scale, ``quantized_matmul``, ``finfo.min`` where masked, precise
    softmax, ``quantized_matmul``) with two differences: ``q`` is never
    scaled in place, and the ``rep = Hq // H`` query heads sharing a KV head
    are folded into the matmul's rows (``[B, H, rep*N, D]`` against the
    planes as stored) instead of a broadcast batch of ``rep`` matmuls, so
    each KV plane is read once per KV head, not ``rep`` times. Every output
    element is the same dot product either way; on this CPU the results are
    bit-identical to mlx-lm's (tested) and decode is about 20% faster.
    """
    B, Hq, N, D = q.shape
    if B == 0:  # quantized_matmul of an empty batch faults (MLX 0.32)
        return mx.zeros((0, Hq, N, values[0].shape[-1] * 32 // bits), q.dtype)
    H = keys[0].shape[1]
    rep = Hq // H
    q = (q * scale).reshape(B, H, rep * N, D)
    scores = mx.quantized_matmul(
        q, keys[0], keys[1], keys[2], transpose=True, group_size=group_size, bits=bits
    )
    W = scores.shape[-1]
    scores = scores.reshape(B, H, rep, N, W)
    if mask is not None:
        if isinstance(mask, str):  # "causal", bottom-right aligned
            mask = mx.arange(W - N, W)[:, None] >= mx.arange(W)[None]
        if mask.ndim == 4:  # [B or 1, 1, N, W]: broadcast over the rep axis
            mask = mx.expand_dims(mask, -3)
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    scores = mx.softmax(scores, axis=-1, precise=True).reshape(B, H, rep * N, W)
    out = mx.quantized_matmul(
        scores, values[0], values[1], values[2], transpose=False, group_size=group_size, bits=bits
    )
    return out.reshape(B, Hq, N, out.shape[-1])
