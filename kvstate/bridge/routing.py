"""Routing mlx-lm's attention reads: the model's own SDPA global swapped, while
a forward runs, for a dispatcher that sends each layer's read where its
record reads best (the CUDA kernels, the stock quantized read, the model's
own SDPA). Used by the eager forward (``bridge.forward``) and the compiled
decoder (``bridge.decoder``).
"""

from __future__ import annotations

import sys
import threading
import weakref

import attrs
import mlx.core as mx

from ..compiled import boundary as compiled
from ..core.records import CacheState, QuantizedState, RotatingState
from ..kernels import cuda as kernels
from ..kinds import quantized as _quantized
from . import shells as _shells

_MODS: dict = {}  # id(model) -> its attention modules; an entry leaves with its model


def _attention_modules(model):
    """The modules whose ``scaled_dot_product_attention`` global the model calls
    (found once per model: a walk of its modules costs milliseconds, and the
    eager bridge asks every forward over shared rows)."""
    mods = _MODS.get(id(model))
    if mods is None:
        mods = _MODS[id(model)] = frozenset(_find_attention_modules(model))
        weakref.finalize(model, _MODS.pop, id(model), None)
    return mods


def _find_attention_modules(model):
    from mlx_lm.models import base

    mods = set()
    named = getattr(model, "named_modules", None)  # (as mlx_lm.vocab_size: duck-typed models)
    for _, m in named() if callable(named) else ():
        mod = sys.modules.get(type(m).__module__)
        if (
            mod is not None
            and getattr(mod, "scaled_dot_product_attention", None)
            is base.scaled_dot_product_attention
        ):
            mods.add(mod)
    return mods


_ROUTE_LOCK = threading.Lock()  # one routed call at a time (the globals are shared)


class routed_attention:
    """While entered, mlx-lm's attention reads of ``mods`` go through ``read``.

    mlx-lm's attention calls ``scaled_dot_product_attention(q, k, v, cache=...,
    scale=..., mask=...)``, a global of the model's module (found by
    ``_attention_modules``). While entered, that global is a dispatcher that
    calls ``read(queries, keys, values, cache, scale, sinks, mask)`` and, where it
    answers ``None``, mlx-lm's own function unchanged; it is restored on
    exit. A lock serialises routed calls, since every model of a class shares
    the global. Used by the compiled decoder (entered inside the traced step,
    so once per trace) and by ``forward`` for shared-prefix rows.
    """

    def __init__(self, mods, read):
        self.mods, self.read = mods, read

    def __enter__(self):
        from mlx_lm.models import base

        original, read = base.scaled_dot_product_attention, self.read
        self.original = original

        def dispatch(queries, keys, values, cache, scale, mask, sinks=None):
            out = read(queries, keys, values, cache, scale, sinks, mask)
            if out is None:
                out = original(
                    queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
                )
            return out

        _ROUTE_LOCK.acquire()
        for mod in self.mods:
            mod.scaled_dot_product_attention = dispatch
        return self

    def __exit__(self, *exc):
        try:
            for mod in self.mods:
                mod.scaled_dot_product_attention = self.original
        finally:
            _ROUTE_LOCK.release()
        return False


def routes_reads() -> bool:
    """Whether eager forwards route their attention reads through ``routed_read``
    (a compiled step does with ``attention="kernel"``): where kvstate's kernels
    run (``kernels.kernel_available``: MLX's CUDA backend). Elsewhere the
    model's own reads are the same reads, cheaper to call. Tests force it to
    run the wiring on the CPU, where the kernels answer by their stock paths."""
    return kernels.kernel_available()


def routed_read(queries, keys, values, cache, scale, sinks, mask):
    """THE routed attention read of one layer, eager (``kvstate.mlx_lm.forward``
    where ``routes_reads``) or traced (``Decoder(attention="kernel")``); ``None``
    leaves the read to the model's own SDPA under its ``mask``.

    - Quantized rows: ``_quantized.read_route`` (the read ``kv.attend`` takes):
      the kernel over the packed planes for decode and verify widths, the
      dequantized columns under ``mask`` where the stock quantized read fails
      (MLX's CUDA backend), else the model's own read.
    - Dense rows whose read needs a mask array (ragged rows, or a compiled
      step's fixed capacity), 1 to ``kernels.MAX_QUERIES`` queries: one
      ``ragged_attention`` over each row's columns ``[left_pad, end)``
      (mask-free on CUDA; off CUDA it is the masked SDPA). Aligned eager
      rows need no mask (their read is cut to the exact width): the stock
      unmasked read stays, as mlx-lm reads them.
    - Ring rows: one query, a ring whose capacity is at most its
      ``max_size`` (it fills columns in order, and once it evicts it holds
      ``max_size`` = every column), read over columns ``[0, held)``; a wider
      ring (grown for a multi-token append) stays masked.

    Not routed: sinks; dense and quantized reads of a model call that asked
    for a windowed mask (the kernel would need the window, which only the
    mask carries); shapes the kernel does not cover (``kernels.kernel_fits``).

    In a compiled step, dense rows whose planes are small
    (``kernels.decode_read(..., written=True)`` answers ``"fused"``):
    ``kernels.write_and_read`` writes the new tokens in the read's launch, and
    the layer's shell takes its planes in place of the scatter's (which the
    compiled graph then drops).
    """
    if sinks is not None or not isinstance(cache, _shells.Shell):
        return None
    proto, N = cache.proto, queries.shape[2]
    kind = type(proto)
    if kind is RotatingState:
        if (
            N == 1
            and isinstance(mask, mx.array)
            and cache.content.capacity <= proto.max_size
            and kernels.kernel_fits(queries, keys)
        ):
            _, held = cache.positions()  # after the write
            keys, values = _whole(cache, keys, values)
            return kernels.ragged_attention(
                queries, keys, values, mx.zeros_like(held), held, scale=scale
            )
        return None
    if cache.windowed:
        return _masked_quantized(cache, queries, keys, values, scale, mask)
    if kind is QuantizedState:
        route, read = _quantized.reader(
            proto,
            queries,
            keys,
            values,
            scale=scale,
            rows=lambda: cache.positions()[::-1],  # (ends, left_pad) -> (left_pad, ends)
            planes=_whole(cache, keys, values),
        )
        return None if route == "stock" else read(mask)
    if kind is not CacheState:
        return _masked_quantized(cache, queries, keys, values, scale, mask)
    if kind is CacheState and isinstance(mask, mx.array) and kernels.kernel_fits(queries, keys):
        ends, left_pad = cache.positions()  # after the write
        content = cache.content
        if isinstance(content, compiled.Traced) and content.written:
            if kernels.decode_read(queries.shape[2], queries, keys, written=True) == "fused":
                (k0, v0), (kn, vn) = content.written
                out, keys, values = kernels.write_and_read(
                    queries, k0, v0, kn, vn, left_pad, ends, scale=scale
                )
                cache.content = attrs.evolve(content, planes=(keys, values), written=())
                return out
        keys, values = _whole(cache, keys, values)
        return kernels.ragged_attention(queries, keys, values, left_pad, ends, scale=scale)
    return None


def _masked_quantized(cache, queries, keys, values, scale, mask):
    """Quantized columns no kernel route takes (shared rows, read materialized;
    any read of a windowed call), under the model's ``mask``: where the stock
    quantized read cannot run (MLX's CUDA backend), dequantized once and read
    by the fused SDPA (``_quantized.dequantized_read``); elsewhere, and for
    dense columns, ``None`` (the model's own read)."""
    if type(keys) is not tuple or _quantized.stock_read_runs():
        return None
    return _quantized.dequantized_read(
        queries, keys, values, scale=scale, mask=mask, group_size=cache.group_size, bits=cache.bits
    )


def _whole(cache, keys, values) -> tuple:
    """The planes a kernel reads for ``cache``'s layer: an eager record's whole
    capacity, not the columns its read was cut to (each row reads only its
    ``[left_pad, end)``; a kernel is compiled per capacity, which grows by the
    record's ``step``, where the cut width changes every step: one compile per
    width on MLX's CUDA backend); a traced step's views are their capacity."""
    content = cache.content
    if isinstance(content, compiled.Traced):
        return keys, values
    return content.keys, content.values
