"""The compiled decode step for mlx-lm models (the bridge side of ``kvstate.compiled``).

``Decoder(model)(tokens, states) -> (logits, states)``: the records cross
the boundary (``compiled.flatten``), the whole model forward runs on
``compiled.Traced`` views through the same shells ``kvstate.mlx_lm.forward``
uses (``kvstate._shells``), and the results come back as records
(``compiled.unflatten`` with the host lengths advanced). Decisions and
measurements: ``notes/compile.md``.
"""

from __future__ import annotations

import sys
import threading

import mlx.core as mx

from . import _shells, compiled, kernels
from .errors import bad, check
from .records import CacheState


def _attention_modules(model):
    """The modules whose ``scaled_dot_product_attention`` global the model calls."""
    from mlx_lm.models import base

    mods = set()
    for _, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is \
                base.scaled_dot_product_attention:
            mods.add(mod)
    return mods


_ROUTE_LOCK = threading.Lock()  # one routed call at a time (the globals are shared)


class routed_attention:
    """While entered, mlx-lm's attention reads of ``mods`` go through ``read``.

    mlx-lm's attention calls ``scaled_dot_product_attention(q, k, v, cache=...,
    scale=..., mask=...)``, a global of the model's module (found by
    ``_attention_modules``). While entered, that global is a dispatcher that
    calls ``read(queries, keys, values, cache, scale, sinks)`` and, where it
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
            out = read(queries, keys, values, cache, scale, sinks)
            if out is None:
                out = original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                               sinks=sinks)
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


def _kernel_read(queries, keys, values, cache, scale, sinks):
    """A one-token read of dense rows in a compiled step: ``ragged_attention``
    (mask-free); ``None`` for anything else."""
    content = getattr(cache, "content", None)
    if (sinks is None and queries.shape[2] == 1 and isinstance(content, compiled.Traced)
            and type(content.proto) is CacheState):
        ends, left_pad = content.positions  # after the write
        return kernels.ragged_attention(queries, keys, values, left_pad, ends, scale=scale)
    return None


ATTENTION = ("mask", "kernel", "auto")


class Decoder:
    """A compiled decode step for an mlx-lm model over kvstate records.

    ``decoder(tokens, states) -> (logits, states)``: ``tokens`` ``[B]`` (one
    per row) or ``[B, N]``; ``logits`` ``[B, V]`` for one token per row, else
    ``[B, N, V]``. The whole forward and every state update run in one
    compiled function per static key (the layers' ``Spec.key``s, ``N`` and
    the attention mode); capacity buckets are shapes, so at most one trace
    per bucket. Input records are unchanged; drop them before evaluating the
    result so the writes happen in place.

    Args:
        model: an mlx-lm model whose layers read their caches through the
            protocol (llama, qwen3, gemma3's full layers, ...).
        attention: ``"mask"``: the model's own SDPA with a per-row bool mask
            over the fixed capacity (any backend, any model). ``"kernel"``:
            dense full-attention decode reads go to ``ragged_attention`` (a
            mask-free split-K CUDA kernel; the masked SDPA elsewhere).
            ``"auto"``: ``"kernel"`` on MLX's CUDA backend, else ``"mask"``.
        write: how dense rows take their new tokens: ``"scatter"`` (one
            ``put_along_axis`` per plane, per-row ends) or ``"slice"`` (a
            dynamic-start ``slice_update`` when every row ends at one column).
            Both write in place when the old buffer is free; which is faster
            depends on the backend (``notes/compile.md``).
        wait: before dispatching a step, wait until the previous step has
            finished. A buffer that an in-flight read still holds cannot be
            written in place, so without the wait a pipelined loop may copy
            every plane each step on a GPU (``notes/compile.md``).
    """

    def __init__(self, model, *, attention: str = "auto", write: str = "scatter",
                 wait: bool = False):
        if attention not in ATTENTION:
            raise bad("attention", f"one of {ATTENTION}", repr(attention))
        if write not in ("scatter", "slice"):
            raise bad("write", "'scatter' or 'slice'", repr(write))
        self.write = write
        if attention == "auto":
            attention = "kernel" if kernels.kernel_available() else "mask"
        self.model = model
        self.attention = attention
        self.wait = bool(wait)
        self.traces = 0
        self._fns = {}
        self._mods = None
        self._pending = None
        self._layers = None

    def _compiled(self, key):
        fn = self._fns.get(key)
        if fn is None:
            keys, squeeze = key
            if self.attention == "kernel" and self._mods is None:
                self._mods = _attention_modules(self.model)
            routed = (routed_attention(self._mods, _kernel_read)
                      if self.attention == "kernel" else None)

            def step(tokens, flats):
                self.traces += 1  # Python runs only while tracing
                ctx = _shells.Tracing(self.attention, self.write == "slice")
                shells = [_shells.shell(compiled.Traced.of(f, k), ctx)
                          for f, k in zip(flats, keys)]
                if routed is None:
                    logits = self.model(tokens, cache=shells)
                else:
                    with routed:
                        logits = self.model(tokens, cache=shells)
                if squeeze:
                    logits = logits[:, -1, :]
                return logits, [sh.content.planes for sh in shells]

            fn = self._fns[key] = mx.compile(step)
        return fn

    def __call__(self, tokens, states):
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens)
        squeeze = tokens.ndim == 1
        if squeeze:
            tokens = tokens[:, None]
        check(tokens.ndim == 2, "tokens rank", "1 ([B]) or 2 ([B, N])", tokens.ndim)
        N = tokens.shape[1]
        check(N >= 1, "tokens length", ">= 1", N)
        states = list(states)
        if self._layers is None:
            from .mlx_lm import layer_count

            self._layers = layer_count(self.model)
        if len(states) != self._layers:
            raise bad("states", f"{self._layers} records (one per layer of the model)",
                      len(states))
        B = tokens.shape[0]
        flats, specs, prepared, layouts = [], [], [], {}
        for i, s in enumerate(states):
            if not _shells.is_record(s):
                raise bad(f"states[{i}]", "a kvstate record", type(s).__name__)
            check(s.batch_size == B, f"states[{i}] batch size", f"{B} (tokens rows)",
                  s.batch_size)
            s = compiled.prepare(s, N)
            lay = compiled.host_positions(s)
            if lay not in layouts:
                layouts[lay] = compiled.position_arrays(s)
            flat, spec = compiled.flatten(s, room=N, positions=layouts[lay])
            flats.append(flat)
            specs.append(spec)
            prepared.append(s)
        fn = self._compiled((tuple(sp.key for sp in specs), squeeze))
        if self._pending is not None:
            mx.eval(self._pending)  # the previous step's reads are done: its buffers are free
            self._pending = None
        logits, out = fn(tokens, flats)
        del flats, states
        if self.wait:
            self._pending = logits
        new = [compiled.unflatten(sp.replace(**compiled.advanced(s, N)), f)
               for f, sp, s in zip(out, specs, prepared)]
        return logits, new


def compiled_decoder(model, *, attention: str = "auto") -> Decoder:
    """A ``Decoder`` for ``model``: ``decode(tokens, states) -> (logits, states)``."""
    return Decoder(model, attention=attention)


def make_step(model, *, attention: str = "auto"):
    """``step(model, tokens, states) -> (logits [B, V], states)``, compiled.

    Same signature as ``kvstate.mlx_lm.step`` (what ``kvstate generate
    --compile`` calls); one ``Decoder`` per ``make_step`` call.
    """
    decoder = Decoder(model, attention=attention)

    def step(model_, tokens, states):
        if model_ is not model:
            raise bad("model", "the model this step was compiled for", type(model_).__name__)
        return decoder(tokens, states)

    step.decoder = decoder
    return step


__all__ = ["Decoder", "compiled_decoder", "make_step", "ATTENTION"]
