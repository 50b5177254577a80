"""Conversion between kvstate records and mlx-lm's cache objects.

``from_prompt_cache`` copies what mlx-lm caches hold into records (a copy,
because mlx-lm writes into its buffers in place); ``to_prompt_cache`` builds
mlx-lm caches over fresh array objects, so mlx-lm's in-place writes never
reach a record. Re-exported as ``kvstate.mlx_lm.from_prompt_cache`` /
``to_prompt_cache``. Which cache maps to which record: ``notes/bridge.md``.
"""

from __future__ import annotations

from typing import Sequence, cast

import attrs
import mlx.core as mx
from mlx_lm.models import cache as lm_cache

from ..core import ops
from ..core.args import as_int
from ..core.records import (
    CacheState,
    ChunkedState,
    CompositeState,
    QuantizedState,
    RecurrentState,
    RotatingState,
    share_row_ids,
)
from ..errors import bad, check
from ..kinds.chunked import chunked_state
from ..kinds.dense import empty, from_arrays
from ..kinds.quantized import quantized
from ..kinds.recurrent import recurrent_state
from ..kinds.rotating import from_temporal, rotating

__all__ = ["from_prompt_cache", "to_prompt_cache", "CACHE_CLASSES"]

# The mlx-lm cache classes ``from_prompt_cache`` converts (subclasses too), by
# name: what an mlx-lm prompt-cache file may name (mlx-lm's own reader builds
# whatever global of its cache module a file names).
_CONVERTED = (
    lm_cache.KVCache,
    lm_cache.QuantizedKVCache,
    lm_cache.RotatingKVCache,
    lm_cache.BatchKVCache,
    lm_cache.BatchRotatingKVCache,
    lm_cache.ArraysCache,
    lm_cache.ChunkedKVCache,
    lm_cache.CacheList,
)
CACHE_CLASSES = tuple(
    sorted(
        name
        for name, c in vars(lm_cache).items()
        if isinstance(c, type) and issubclass(c, _CONVERTED)
    )
)


def _own(x):
    """A compact, evaluated copy: the record never shares a buffer mlx-lm writes in place."""
    x = mx.contiguous(x)
    mx.eval(x)
    return x


def _stored(name, c, keys) -> int:
    """The cache's ``offset``: an int in ``[0, stored columns]`` (a slice
    with a negative or larger offset would read the wrong columns)."""
    n = as_int(c.offset, f"{name}.offset")
    check(0 <= n <= keys.shape[2], f"{name}.offset", f"in [0, {keys.shape[2]}] (stored columns)", n)
    return n


def _planes_of(name, c, triple: bool):
    """``c.keys``/``c.values`` as mlx-lm holds them: arrays, or quantized triples."""
    for field in ("keys", "values"):
        x = getattr(c, field)
        ok = (
            (
                isinstance(x, (tuple, list))
                and len(x) == 3
                and all(isinstance(p, mx.array) and p.ndim == 4 for p in x)
            )
            if triple
            else (isinstance(x, mx.array) and x.ndim == 4)
        )
        if not ok:
            raise bad(
                f"{name}.{field}",
                "(packed, scales, biases) arrays [B, H, S, *]"
                if triple
                else "an mx.array [B, H, S, D]",
                type(x).__name__,
            )


def _per_row(name, c, field, B=None) -> list:
    """An integer ``mx.array`` ``[B]`` field of a batched cache, as ints."""
    x = getattr(c, field)
    if (
        not isinstance(x, mx.array)
        or x.ndim != 1
        or not mx.issubdtype(x.dtype, mx.integer)
        or (B is not None and x.shape[0] != B)
    ):
        raise bad(
            f"{name}.{field}",
            f"an integer mx.array [{'B' if B is None else B}]",
            f"{type(x).__name__} {getattr(x, 'shape', '')}",
        )
    return cast(list, x.tolist())  # a 1-D array (checked above)


def _from_cache(i, c):
    """One mlx-lm cache object as a record (copied), by its class."""
    name = f"caches[{i}]"
    if isinstance(c, lm_cache.QuantizedKVCache):
        return _from_quantized_cache(name, c)
    if isinstance(c, lm_cache.KVCache):
        return _from_kv_cache(name, c)
    if isinstance(c, lm_cache.BatchKVCache):
        return _from_batch_kv_cache(name, c)
    if isinstance(c, lm_cache.RotatingKVCache):
        return _from_rotating_cache(name, c)
    if isinstance(c, lm_cache.BatchRotatingKVCache):
        return _from_batch_rotating_cache(i, name, c)
    if isinstance(c, lm_cache.ArraysCache):
        return _from_arrays_cache(name, c)
    if isinstance(c, lm_cache.ChunkedKVCache):
        return _from_chunked_cache(c)
    if isinstance(c, lm_cache.CacheList):
        return CompositeState(tuple(_from_cache(f"{i}.{j}", p) for j, p in enumerate(c.caches)))
    raise bad(
        name,
        "KVCache, QuantizedKVCache, RotatingKVCache, BatchKVCache, "
        "BatchRotatingKVCache, ArraysCache, ChunkedKVCache or CacheList",
        type(c).__name__,
    )


def _from_quantized_cache(name, c):
    """A ``QuantizedKVCache`` as a ``QuantizedState``: its stored columns of each plane."""
    if c.keys is None:
        return quantized(1, group_size=c.group_size, bits=c.bits)
    _planes_of(name, c, True)
    n, B = _stored(name, c, c.keys[0]), c.keys[0].shape[0]
    keys = tuple(_own(x[:, :, :n]) for x in c.keys)
    values = tuple(_own(x[:, :, :n]) for x in c.values)
    return QuantizedState(
        (n,) * B, (0,) * B, keys=keys, values=values, group_size=c.group_size, bits=c.bits
    )


def _from_kv_cache(name, c):
    """A ``KVCache`` as a ``CacheState``: its stored columns."""
    if c.keys is None:
        return empty(1)
    _planes_of(name, c, False)
    n = _stored(name, c, c.keys)
    return from_arrays(_own(c.keys[:, :, :n]), _own(c.values[:, :, :n]))


def _from_batch_kv_cache(name, c):
    """A finalized ``BatchKVCache`` as a ``CacheState``: its columns up to ``_idx``, each row
    left-padded as the cache pads it."""
    pending = getattr(c, "_right_padding", None)  # absent after load_prompt_cache
    check(
        pending is None,
        f"{name}",
        "a finalized BatchKVCache (call finalize())",
        "one with pending right padding",
    )
    lp = _per_row(name, c, "left_padding")
    if c.keys is None:
        check(all(p == 0 for p in lp), f"{name}.left_padding", "zeros for an empty cache", lp)
        return empty(len(lp))
    _planes_of(name, c, False)
    w = as_int(c._idx, f"{name}._idx")
    check(0 <= w <= c.keys.shape[2], f"{name}._idx", f"in [0, {c.keys.shape[2]}]", w)
    check(all(0 <= p <= w for p in lp), f"{name}.left_padding", f"each in [0, {w}] (_idx)", lp)
    return from_arrays(
        _own(c.keys[:, :, :w]),
        _own(c.values[:, :, :w]),
        lengths=[w - p for p in lp],
        left_pad=lp,
    )


def _from_rotating_cache(name, c):
    """A ``RotatingKVCache`` as a ``RotatingState``: its entries in temporal order."""
    if c.keys is None:
        return rotating(1, max_size=c.max_size, keep=c.keep)
    _planes_of(name, c, False)
    offset = as_int(c.offset, f"{name}.offset")
    check(offset >= 0, f"{name}.offset", ">= 0", offset)
    idx = as_int(c._idx, f"{name}._idx")
    check(0 <= idx <= c.keys.shape[2], f"{name}._idx", f"in [0, {c.keys.shape[2]}]", idx)
    k, v = c._temporal_order(c.keys), c._temporal_order(c.values)  # new arrays
    n = min(offset, k.shape[2])
    return from_temporal(
        _own(k[:, :, :n]), _own(v[:, :, :n]), lengths=c.offset, max_size=c.max_size, keep=c.keep
    )


def _from_batch_rotating_cache(i, name, c):
    """A finalized ``BatchRotatingKVCache`` as a ``RotatingState``: its rows (mlx-lm's own
    ``extract``) merged."""
    B = len(_per_row(name, c, "offset"))
    if c.keys is None:
        return rotating(B, max_size=c.max_size)
    pending = getattr(c, "_lengths", None)  # absent after load_prompt_cache
    check(
        pending is None,
        name,
        "a finalized BatchRotatingKVCache (call finalize())",
        "one with pending right padding",
    )
    _planes_of(name, c, False)
    _per_row(name, c, "left_padding", B)  # (negative once rotated: extract clips it)
    idx = as_int(c._idx, f"{name}._idx")
    check(0 <= idx <= c.keys.shape[2], f"{name}._idx", f"in [0, {c.keys.shape[2]}]", idx)
    # mlx-lm's own extract gives each row as a RotatingKVCache (keep = 0).
    return ops.merge_rows([_from_cache(i, c.extract(b)) for b in range(B)])


def _ints(x):
    return None if x is None else [int(v) for v in mx.array(x).reshape(-1).tolist()]


def _from_arrays_cache(name, c):
    """An ``ArraysCache`` as a ``RecurrentState``: the slots (copied), its
    pending ``left_padding`` and ``lengths`` (``until``). mlx-lm does not count
    a recurrent layer's tokens: ``lengths`` are 0 here, and ``from_prompt_cache``
    takes them from the model's other layers when it has any."""
    B = c.batch_size
    arrays = tuple(None if a is None else _own(a) for a in c.cache)
    check(
        all(a is None or a.shape[0] == B for a in arrays),
        f"{name} slots",
        f"arrays of batch size {B}",
        [None if a is None else list(a.shape) for a in arrays],
    )
    state = recurrent_state(B, slots=max(len(arrays), 1), left_padding=_ints(c.left_padding))
    return attrs.evolve(state, arrays=arrays or (None,), until=_ints(c.lengths))


def _from_chunked_cache(c):
    if c.keys is None:
        return chunked_state(1, chunk_size=c.chunk_size)
    k, v = c.keys_and_values()
    B, held = k.shape[0], k.shape[2]
    return ChunkedState(
        (held,) * B,
        (0,) * B,
        start=(c.start_position,) * B,
        chunk_size=c.chunk_size,
        keys=_own(k),
        values=_own(v),
    )


def _counted(records: list) -> list:
    """Recurrent records (never counted by mlx-lm) take the token counts of
    the first record that has them, when its rows match."""
    counts = [t for t in map(_tokens, records) if t is not None]
    if not counts:
        return records
    return [_with_tokens(r, counts) for r in records]


def _tokens(r):
    if isinstance(r, RecurrentState):
        return None
    if isinstance(r, CompositeState):
        return next((t for t in map(_tokens, r.parts) if t is not None), None)
    return r.offsets if isinstance(r, ChunkedState) else r.lengths


def _with_tokens(r, counts):
    if isinstance(r, RecurrentState):
        same = next((t for t in counts if len(t) == r.batch_size), None)
        return r if same is None else attrs.evolve(r, lengths=same)
    if isinstance(r, CompositeState):
        return CompositeState(tuple(_with_tokens(p, counts) for p in r.parts))
    return r


def from_prompt_cache(caches: Sequence) -> list:
    """Records holding what the mlx-lm cache objects ``caches`` hold (copied).

    Every number the caches hold (offsets, write indices, padding,
    ``bits``/``group_size``) is checked before it is used, and the records
    are validated (``KVStateError`` otherwise). The caches are one model's
    layers, so records of one batch size share their row ids (one
    ``kv.checkpoint`` of any layer fits every layer).
    """
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
        raise bad("caches", "a list of mlx-lm cache objects", type(caches).__name__)
    return share_row_ids(_counted([_from_cache(i, c) for i, c in enumerate(caches)]))


def _to_cache(i, s):
    """One record as an mlx-lm cache object, by its class."""
    name = f"states[{i}]"
    if isinstance(s, QuantizedState):
        return _to_quantized_cache(name, s)
    if isinstance(s, CacheState):
        return _to_kv_cache(s)
    if isinstance(s, RotatingState):
        return _to_rotating_cache(i, name, s)
    if isinstance(s, RecurrentState):
        return _to_arrays_cache(s)
    if isinstance(s, ChunkedState):
        return _to_chunked_cache(name, s)
    if isinstance(s, CompositeState):
        return lm_cache.CacheList(*(_to_cache(f"{i}.{j}", p) for j, p in enumerate(s.parts)))
    raise bad(
        name,
        "a CacheState, QuantizedState, RotatingState, RecurrentState, "
        "ChunkedState or CompositeState",
        type(s).__name__,
    )


def _to_quantized_cache(name, s):
    """A one-row ``QuantizedState`` as a ``QuantizedKVCache``."""
    check(
        s.batch_size == 1,
        f"{name} batch size",
        "1 (mlx-lm has no batched quantized cache)",
        s.batch_size,
    )
    c = lm_cache.QuantizedKVCache(group_size=s.group_size, bits=s.bits)
    if s.keys is not None:
        a, n = s.left_pad[0], s.lengths[0]
        c.keys = tuple(x[:, :, a : a + n] for x in s.keys)
        c.values = tuple(x[:, :, a : a + n] for x in s.values)
        c.offset = n
    return c


def _to_kv_cache(s):
    """A ``CacheState`` as a ``KVCache`` (one row) or a ``BatchKVCache`` (rows right-aligned)."""
    if s.batch_size == 1:
        c = lm_cache.KVCache()
        if s.keys is not None:
            a, n = s.left_pad[0], s.lengths[0]
            c.keys, c.values, c.offset = s.keys[:, :, a : a + n], s.values[:, :, a : a + n], n
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


def _to_rotating_cache(i, name, s):
    """A ``RotatingState`` as a ``RotatingKVCache`` (one row) or a ``BatchRotatingKVCache``
    (``keep == 0``: mlx-lm's own ``merge`` of the rows)."""
    if s.batch_size == 1:
        c = lm_cache.RotatingKVCache(s.max_size, s.keep)
        if s.keys is not None:
            # The state mlx-lm's concatenating path leaves: temporal order, _idx = held.
            c.keys, c.values = ops.fetch(s)
            c.offset, c._idx = s.lengths[0], s.held[0]
        return c
    check(s.keep == 0, f"{name}.keep", "0 (mlx-lm's BatchRotatingKVCache drops keep)", s.keep)
    if s.keys is None:
        return lm_cache.BatchRotatingKVCache(s.max_size, [0] * s.batch_size)
    rows = [_to_cache(i, ops.extract_row(s, b)) for b in range(s.batch_size)]
    return lm_cache.BatchRotatingKVCache.merge(rows)


def _to_arrays_cache(s):
    """A ``RecurrentState`` as an ``ArraysCache``: its slots, padding and ``lengths``."""
    c = lm_cache.ArraysCache(
        len(s.arrays), left_padding=list(s.left_padding) if any(s.left_padding) else None
    )
    c.cache = list(s.arrays)
    c.lengths = None if s.until is None else mx.array(s.until)
    return c


def _to_chunked_cache(name, s):
    c = lm_cache.ChunkedKVCache(s.chunk_size)
    if s.keys is None:
        return c
    check(
        len(set(s.offsets)) == 1 and len(set(s.start)) == 1,
        f"{name} rows",
        "rows at one position (mlx-lm's ChunkedKVCache has one offset)",
        f"offsets {s.offsets}, start {s.start}",
    )
    if not s.aligned:
        s = ops.merge_rows([ops.extract_row(s, b) for b in range(s.batch_size)])
    c.keys, c.values = ops.fetch(s)
    c.offset, c.start_position = s.offsets[0], s.start[0]
    return c


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
