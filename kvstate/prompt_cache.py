"""Conversion between kvstate records and mlx-lm's cache objects.

``from_prompt_cache`` copies what mlx-lm caches hold into records (a copy,
because mlx-lm writes into its buffers in place); ``to_prompt_cache`` builds
mlx-lm caches over fresh array objects, so mlx-lm's in-place writes never
reach a record. Re-exported as ``kvstate.mlx_lm.from_prompt_cache`` /
``to_prompt_cache``. Which cache maps to which record: ``notes/bridge.md``.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import cache as lm_cache

from . import ops
from .dense import empty, from_arrays
from .errors import bad, check
from .quantized import quantized
from .records import CacheState, QuantizedState, RotatingState
from .rotating import from_temporal, rotating

__all__ = ["from_prompt_cache", "to_prompt_cache"]


def _own(x):
    """A compact, evaluated copy: the record never shares a buffer mlx-lm writes in place."""
    x = mx.contiguous(x)
    mx.eval(x)
    return x


def _from_cache(i, c):
    name = f"caches[{i}]"
    if isinstance(c, lm_cache.QuantizedKVCache):
        if c.keys is None:
            return quantized(1, group_size=c.group_size, bits=c.bits)
        n, B = c.offset, c.keys[0].shape[0]
        keys = tuple(_own(x[:, :, :n]) for x in c.keys)
        values = tuple(_own(x[:, :, :n]) for x in c.values)
        return QuantizedState((n,) * B, (0,) * B, keys=keys, values=values,
                              group_size=c.group_size, bits=c.bits)
    if isinstance(c, lm_cache.KVCache):
        if c.keys is None:
            return empty(1)
        n = c.offset
        return from_arrays(_own(c.keys[:, :, :n]), _own(c.values[:, :, :n]))
    if isinstance(c, lm_cache.BatchKVCache):
        pending = getattr(c, "_right_padding", None)  # absent after load_prompt_cache
        check(pending is None, f"{name}", "a finalized BatchKVCache (call finalize())",
              "one with pending right padding")
        lp = [int(p) for p in c.left_padding.tolist()]
        if c.keys is None:
            check(all(p == 0 for p in lp), f"{name}.left_padding", "zeros for an empty cache", lp)
            return empty(len(lp))
        w = c._idx
        return from_arrays(_own(c.keys[:, :, :w]), _own(c.values[:, :, :w]),
                              lengths=[w - p for p in lp], left_pad=lp)
    if isinstance(c, lm_cache.RotatingKVCache):
        if c.keys is None:
            return rotating(1, max_size=c.max_size, keep=c.keep)
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)  # new arrays
        n = min(c.offset, k.shape[2])
        return from_temporal(_own(k[:, :, :n]), _own(v[:, :, :n]), lengths=c.offset,
                             max_size=c.max_size, keep=c.keep)
    if isinstance(c, lm_cache.BatchRotatingKVCache):
        B = c.offset.shape[0]
        if c.keys is None:
            return rotating(B, max_size=c.max_size)
        pending = getattr(c, "_lengths", None)  # absent after load_prompt_cache
        check(pending is None, name, "a finalized BatchRotatingKVCache (call finalize())",
              "one with pending right padding")
        # mlx-lm's own extract gives each row as a RotatingKVCache (keep = 0).
        return ops.merge_rows([_from_cache(i, c.extract(b)) for b in range(B)])
    raise bad(name, "KVCache, QuantizedKVCache, RotatingKVCache, BatchKVCache or "
              "BatchRotatingKVCache", type(c).__name__)


def from_prompt_cache(caches: Sequence) -> list:
    """Records holding what the mlx-lm cache objects ``caches`` hold (copied)."""
    return [_from_cache(i, c) for i, c in enumerate(caches)]


def _to_cache(i, s):
    name = f"states[{i}]"
    if isinstance(s, QuantizedState):
        check(s.batch_size == 1, f"{name} batch size",
              "1 (mlx-lm has no batched quantized cache)", s.batch_size)
        c = lm_cache.QuantizedKVCache(group_size=s.group_size, bits=s.bits)
        if s.keys is not None:
            a, n = s.left_pad[0], s.lengths[0]
            c.keys = tuple(x[:, :, a:a + n] for x in s.keys)
            c.values = tuple(x[:, :, a:a + n] for x in s.values)
            c.offset = n
        return c
    if isinstance(s, CacheState):
        if s.batch_size == 1:
            c = lm_cache.KVCache()
            if s.keys is not None:
                a, n = s.left_pad[0], s.lengths[0]
                c.keys, c.values, c.offset = s.keys[:, :, a:a + n], s.values[:, :, a:a + n], n
            return c
        if s.keys is None:
            return lm_cache.BatchKVCache([0] * s.batch_size)
        if any(e != s.width for e in s.ends):
            # BatchKVCache has one shared end: right-align the rows first.
            s = ops.merge_rows([ops.extract_row(s, b) for b in range(s.batch_size)])
        c = lm_cache.BatchKVCache(list(s.left_pad))
        w = s.width
        c.keys, c.values = s.keys[:, :, :w], s.values[:, :, :w]
        c.offset = mx.array(s.lengths)
        c._idx = w
        return c
    if isinstance(s, RotatingState):
        if s.batch_size == 1:
            c = lm_cache.RotatingKVCache(s.max_size, s.keep)
            if s.keys is not None:
                # The state mlx-lm's concatenating path leaves: temporal order, _idx = held.
                c.keys, c.values = ops.fetch(s)
                c.offset, c._idx = s.lengths[0], s.held[0]
            return c
        check(s.keep == 0, f"{name}.keep", "0 (mlx-lm's BatchRotatingKVCache drops keep)",
              s.keep)
        if s.keys is None:
            return lm_cache.BatchRotatingKVCache(s.max_size, [0] * s.batch_size)
        rows = [_to_cache(i, ops.extract_row(s, b)) for b in range(s.batch_size)]
        return lm_cache.BatchRotatingKVCache.merge(rows)
    raise bad(name, "a CacheState, QuantizedState or RotatingState", type(s).__name__)


def to_prompt_cache(states: Sequence) -> list:
    """mlx-lm cache objects holding what ``states`` hold.

    One-row records become ``KVCache``/``QuantizedKVCache``/``RotatingKVCache``;
    batched dense records a ``BatchKVCache`` (rows whose ends differ are
    right-aligned), batched rings with ``keep == 0`` a ``BatchRotatingKVCache``
    (mlx-lm's own ``merge`` of the rows). Batched quantized records and
    batched rings with ``keep > 0`` have no mlx-lm form and are refused.
    The caches get their own array objects, so mlx-lm's in-place writes
    never reach the records.
    """
    return [_to_cache(i, s) for i, s in enumerate(states)]
