"""The eager forward: an mlx-lm model run on kvstate records through cache shells.

``forward(model, tokens, states)`` hands the model one shell per layer
(``bridge.shells``) that answers mlx-lm's cache protocol from a record and
swaps in the appended record as the model writes; it returns the logits and
the new records, the inputs unchanged. Also here: ``make_states`` (one empty
record per layer, as ``make_prompt_cache``), the shells and cascade read of
shared-prefix rows, and the token-id checks. The public face is
``kvstate.mlx_lm``; the compiled decoder (``bridge.decoder``) uses
``forward`` for what it does not compile.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache

from ..core.args import as_int, row_count
from ..core.masks import MaskMemo, check_memo
from ..core.records import CompressedState, QuantizedState, share_row_ids
from ..errors import bad, check
from ..kinds import rows as _rows
from ..kinds.compressed import attend_and_score, compressed
from ..kinds.dense import empty
from ..kinds.quantized import quantized
from ..kinds.rotating import rotating
from ..kinds.shared import (
    Layouts as SharedLayouts,
)
from ..kinds.shared import (
    PerLayout,
    SharedState,
)
from ..kinds.shared import (
    read as shared_read,
)
from ..kinds.shared import (
    update_suffix as shared_update_suffix,
)
from . import hybrid as _hybrid
from . import routing
from . import shells as _shells
from .prompt_cache import from_prompt_cache as from_prompt_cache
from .prompt_cache import to_prompt_cache as to_prompt_cache
from .shells import Model

# --- shared-prefix rows (kvstate.kinds.shared): shells and the cascade read ---------------------


class _SharedReads:
    """What a ``SharedState`` shell reports of its record: the suffix rows' arrays."""

    __slots__ = ()
    record: Any  # (the Shell's)

    @property
    def keys(self):
        return self.record.suffix.keys

    @property
    def values(self):
        return self.record.suffix.values

    def empty(self) -> bool:
        return _rows.geometry(self.record) is None


class SharedShell(_SharedReads, _shells.Shell):
    """A ``SharedState`` layer of dense rows.

    Read by the cascade (``_cascade``: each shared prefix read once for all
    its rows) when the forward routes the model's attention; otherwise the
    model reads the rows materialized (each row's prefix view, then its
    suffix: ``kvstate.kinds.shared.materialize``), with the mask laid out over
    those columns.
    """

    __slots__ = ()

    @property
    def offset(self):
        off = self._offset
        if off is None:
            route = self._ctx.route
            record = self.content
            off = self._offset = self._ctx.offset(record) if route is None else route.offset(record)
        return off

    def update_and_fetch(self, keys, values):
        ctx = self._ctx
        route = ctx.route
        if route is None:
            return super().update_and_fetch(keys, values)
        if not ctx.started:
            ctx.start(keys, values)
        self.content, sk, sv = shared_update_suffix(self.record, keys, values, ctx.plans)
        self._offset = None
        route.pending[id(self)] = (sk, sv)  # the cascade reads the suffix columns
        return sk, sv

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if self._ctx.route is not None and window_size is None and not return_array:
            return None  # the cascade builds its own suffix mask
        return super().make_mask(N, window_size, return_array)


class SharedQuantizedShell(_SharedReads, _shells.QuantizedShell):
    """Quantized shared rows (``bits``/``group_size`` from the suffix record):
    always read materialized, through mlx-lm's quantized attention."""

    __slots__ = ()

    @property
    def bits(self) -> int:
        return self.record.suffix.bits

    @property
    def group_size(self) -> int:
        return self.record.suffix.group_size


@_shells.shell_class.register
def shell_class_shared(record: SharedState) -> type:
    return SharedQuantizedShell if type(record.suffix) is QuantizedState else SharedShell


class _cascade:
    """While the model runs, its attention reads of shared dense rows take the
    cascade (``kvstate.kinds.shared.read``: each shared prefix read once for all the
    rows reading it) instead of materialized columns; where
    ``routing.routes_reads``, every other read goes to
    ``routing.routed_read`` (the routed read the compiled decoder uses too: kernels for
    ragged and quantized rows on CUDA).

    mlx-lm's attention calls its module's ``scaled_dot_product_attention(q, k,
    v, cache=..., scale=..., mask=...)``; for the duration of the call that
    global is a dispatcher sending a ``SharedShell`` to the cascade and every
    other call to ``routed_read`` (where routed), else, unchanged, to
    mlx-lm's function. A shell's
    ``update_and_fetch`` hands the model only its suffix columns, so every
    one must be read by the dispatcher: one that is not (a model whose
    attention does not read through that global) raises ``KVStateError``
    after the forward instead of giving a wrong result.
    """

    def __init__(self, model, ctx):
        self.mods, self.ctx = routing._attention_modules(model), ctx
        self.kernel = routing.routes_reads()
        self.pending = {}
        self.layouts = SharedLayouts(ctx.positions)  # row maps, positions: once per forward
        self.offsets = PerLayout()  # a shared layer's offset: once per layout
        self.compressed = 0  # compressed layers in this forward: each must be read once

    def offset(self, state: SharedState):
        """``ctx.offset`` of shared rows, once per forward's layout (``PerLayout``):
        the rows' lengths are not rebuilt and hashed per layer (unshared rows'
        offsets are matched by identity alike)."""
        return self.offsets.get(state, self.ctx.offset)

    def _read(self, queries, keys, values, cache, scale, sinks, mask):
        if isinstance(cache, _shells.Shell) and type(cache.content) is CompressedState:
            return self._compressed(queries, cache, scale, sinks)
        if type(cache) is not SharedShell or sinks is not None or id(cache) not in self.pending:
            if self.kernel:
                return routing.routed_read(queries, keys, values, cache, scale, sinks, mask)
            return None
        del self.pending[id(cache)]
        return shared_read(cache.record, queries, scale=scale, layouts=self.layouts)

    def _compressed(self, queries, cache, scale, sinks):
        """A compressed layer's read: its own mask over the columns it keeps, and
        the scores its policy takes (``kvstate.kinds.compressed.attend_and_score``)."""
        if sinks is not None:
            raise bad("model", "attention without sinks over compressed rows", "attention sinks")
        out, cache.content = attend_and_score(
            cache.content, queries, scale=scale, n=queries.shape[2]
        )
        self.compressed_reads += 1
        return out

    def __enter__(self):
        self.compressed_reads = 0
        self.routing = routing.routed_attention(self.mods, self._read).__enter__()
        self.ctx.route = self
        return self

    def __exit__(self, *exc):
        try:
            self.routing.__exit__(*exc)
        finally:
            self.ctx.route = None
        if exc[0] is None and self.compressed_reads != self.compressed:
            raise bad(
                "model",
                "attention that reads compressed rows through mlx-lm's "
                f"scaled_dot_product_attention ({self.compressed} layer reads)",
                f"{self.compressed_reads} routed reads",
            )
        if exc[0] is None and self.pending:
            raise bad(
                "model",
                "attention that reads shared rows through mlx-lm's "
                "scaled_dot_product_attention (the cascade read)",
                f"{len(self.pending)} layer reads that bypassed it",
            )
        return False


# --- states and forward -----------------------------------------------------------

_CPU = mx.DeviceType.cpu

_LAYERS: dict = {}  # id(model) -> records it reads; an entry leaves with its model


def layer_count(model: Model) -> int:
    """How many records ``model`` reads: ``len(model.make_cache())`` when it has
    one (a model may share a cache between layers), else ``len(model.layers)``.

    mlx-lm models zip their layers with the caches, so a list of another
    length would silently run fewer layers; ``forward`` refuses it.
    """
    n = _LAYERS.get(id(model))
    if n is None:
        n = len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)
        _LAYERS[id(model)] = n
        weakref.finalize(model, _LAYERS.pop, id(model), None)
    return n


_VOCAB: dict = {}  # id(model) -> vocabulary size (or None); an entry leaves with its model
_EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings")


def vocab_size(model) -> Optional[int]:
    """The number of token ids ``model`` embeds: ``model.args.vocab_size``, else
    the rows of its token embedding; ``None`` when neither is found."""
    if id(model) in _VOCAB:
        return _VOCAB[id(model)]
    import mlx.nn as nn

    n = getattr(getattr(model, "args", None), "vocab_size", None)
    if type(n) is not int or n < 1:
        n = None
        named = getattr(model, "named_modules", None)
        for name, m in named() if callable(named) else ():
            if (
                isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
                and name.rsplit(".", 1)[-1] in _EMBEDDINGS
            ):
                n = m.weight.shape[0]
                break
    _VOCAB[id(model)] = n
    weakref.finalize(model, _VOCAB.pop, id(model), None)
    return n


# Device ids are read as unsigned ints of their width (a negative id becomes one past
# any vocabulary); narrower ints are widened first, so no cast can wrap a bad id
# into the vocabulary.
_UNSIGNED = {mx.int32: mx.uint32, mx.int64: mx.uint64, mx.uint32: None, mx.uint64: None}


def token_ids(model: Model, tokens: Any, arg: str = "tokens") -> tuple[mx.array, mx.array | None]:
    """``tokens`` as an integer ``mx.array`` ``[B, N]`` the model can embed.

    Ids from the host (lists, tuples, numpy arrays) are checked here: integers
    in ``[0, vocab_size)``, else ``KVStateError`` (an id past the embedding
    makes its gather read outside it: mlx-lm crashes there). An ``mx.array``
    is checked for an integer dtype only; its values are not read back, so
    a pipelined decode loop (the next step built while the device computes
    this one's tokens) never waits. Instead, on the device, an id outside the
    vocabulary is clamped into it (negative ids included: they are read as
    unsigned) and its row's logits become NaN. Returns ``(ids, poisoned)``:
    ``poisoned`` is ``None`` for host ids, else a bool ``[B]`` array of the
    rows holding a bad id (``notes/core.md``).

    The device guard is one ``minimum`` on the ids the embedding reads, and
    a compare, an ``any`` and a ``where`` over the logits off that path:
    ops that come first in the graph are what ``forward``'s early start
    evaluates, so the guard keeps that part to one op (``notes/core.md``).
    """
    if not isinstance(tokens, mx.array):
        return mx.array(_host_ids(model, tokens, arg, 2)), None
    V = vocab_size(model)
    dtype = tokens.dtype
    if not mx.issubdtype(dtype, mx.integer):
        raise bad(f"{arg} dtype", "an integer dtype (token ids)", dtype)
    if V is None or tokens.ndim != 2:
        return tokens, None
    if dtype not in _UNSIGNED:  # (int8/16, uint8/16, ...)
        tokens, dtype = tokens.astype(mx.int64), mx.int64
    unsigned = _UNSIGNED[dtype]
    ids = tokens if unsigned is None else mx.view(tokens, unsigned)
    return mx.minimum(ids, V - 1), mx.any(ids >= V, axis=1)


def _host_ids(model, ids, arg: str, ndim: int) -> np.ndarray:
    """Host token ids as int32 numpy, each in ``[0, vocab_size)`` (``token_ids``)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, np.ndarray)):
        raise bad(arg, "token ids (an mx.array, a list or a numpy array)", type(ids).__name__)
    try:
        host = np.asarray(ids)
    except ValueError as e:
        raise bad(arg, "token ids (rows of equal length)", str(e)) from None
    if host.dtype.kind not in "iu" or host.ndim != ndim:
        raise bad(arg, f"integer token ids of rank {ndim}", f"{host.dtype} {list(host.shape)}")
    V = vocab_size(model)
    if host.size and V is not None and (host.min() < 0 or host.max() >= V):
        wrong = sorted({int(x) for x in host.ravel() if not 0 <= x < V})
        raise bad(f"{arg} ids", f"in [0, {V}) (the model's vocabulary)", wrong[:8])
    return host.astype(np.int32)


def make_states(
    model: Model,
    batch_size: int = 1,
    *,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    ring_full_layers: bool = False,
    kv_budget: Optional[Any] = None,
    policy: Optional[str] = None,
    kv_sinks: int = 4,
    kv_window: int = 16,
    kv_margin: int = 16,
) -> list:
    """One empty record per layer, as ``make_prompt_cache(model, max_kv_size)`` lays out.

    A model's own ``make_cache()`` wins (mlx-lm ignores ``max_kv_size`` then):
    ``KVCache`` becomes ``kv.empty``, ``RotatingKVCache(max_size, keep)``
    ``kv.rotating``, ``QuantizedKVCache`` ``kv.quantized``. Without one, every
    layer is ``kv.empty``, or ``kv.rotating(max_size=max_kv_size, keep=4)``.
    ``kv_bits`` turns the full-attention (non-ring) layers into
    ``kv.quantized(group_size=kv_group_size, bits=kv_bits)``; with
    ``max_kv_size`` it is refused (rings are not quantized: mlx-lm's
    ``RotatingKVCache.to_quantized`` refuses too).

    ``ring_full_layers`` (with ``max_kv_size``): the ``KVCache`` layers of a
    model's own ``make_cache()`` become ``kv.rotating(max_size=max_kv_size,
    keep=4)`` too, where mlx-lm would ignore ``max_kv_size`` (``kvstate serve``
    and ``kvstate generate`` ``--max-kv-size``: an operator's memory bound holds
    for every model).

    ``kv_budget`` (tokens kept per row: an int, or one per row): the
    full-attention (``KVCache``) layers become ``kv.compressed(batch_size,
    kv_budget, policy=policy or "sinks", sinks=kv_sinks, window=kv_window,
    margin=kv_margin)`` (``notes/kinds.md``); the model's rings stay rings.
    Refused with ``max_kv_size`` or ``kv_bits``, and ``policy`` without
    ``kv_budget``.
    """
    batch_size = row_count(batch_size, "batch_size")
    squeeze = None
    if kv_budget is None:
        check(policy is None, "policy", "None without kv_budget", repr(policy))
    else:
        check(max_kv_size is None, "max_kv_size", "None with kv_budget", max_kv_size)
        check(kv_bits is None, "kv_bits", "None with kv_budget", kv_bits)
        squeeze = compressed(
            batch_size,
            kv_budget,
            policy="sinks" if policy is None else policy,
            sinks=kv_sinks,
            window=kv_window,
            margin=kv_margin,
        )
    if max_kv_size is not None:
        max_kv_size = as_int(max_kv_size, "max_kv_size")
        check(max_kv_size >= 1, "max_kv_size", ">= 1", max_kv_size)
        check(kv_bits is None, "kv_bits", "None with max_kv_size (rings: not quantized)", kv_bits)
    dense = _full_layer(
        batch_size, max_kv_size if ring_full_layers else None, kv_bits, kv_group_size
    )
    if squeeze is not None:
        dense = _same(squeeze)

    if not hasattr(model, "make_cache"):
        n = len(model.layers)
        if max_kv_size is not None:
            return share_row_ids(
                [rotating(batch_size, max_size=max_kv_size, keep=4) for _ in range(n)]
            )
        return share_row_ids([dense() for _ in range(n)])
    states = []
    for i, c in enumerate(model.make_cache()):
        if isinstance(c, lm_cache.KVCache):
            states.append(dense())
        elif isinstance(c, lm_cache.RotatingKVCache):
            states.append(rotating(batch_size, max_size=c.max_size, keep=c.keep))
        elif isinstance(c, lm_cache.QuantizedKVCache):
            states.append(quantized(batch_size, group_size=c.group_size, bits=c.bits))
        else:
            states.append(_hybrid.record_for(c, batch_size, dense, f"model.make_cache()[{i}]"))
    return share_row_ids(states)


def _same(record):
    """A maker answering ``record`` (records are values: every layer may hold it)."""
    return lambda: record


def _full_layer(batch_size: int, ring: Optional[int], kv_bits, kv_group_size):
    """The maker of a full-attention layer's record: a ring of ``ring`` tokens, else
    quantized with ``kv_bits``, else dense."""

    def make():
        if ring is not None:
            return rotating(batch_size, max_size=ring, keep=4)
        if kv_bits is None:
            return empty(batch_size)
        return quantized(batch_size, group_size=kv_group_size, bits=kv_bits)

    return make


def forward(
    model: Model,
    tokens: mx.array | np.ndarray | Sequence[Sequence[int]],
    states: Sequence,
    *,
    memo: Optional[MaskMemo] = None,
    start_early: Optional[bool] = None,
    last: bool = False,
) -> tuple[mx.array, list]:
    """Run ``model`` on ``tokens`` ``[B, N]`` over ``states`` (one record per layer).

    ``tokens``: an integer ``mx.array``, or host ids (a list of lists, a
    numpy array), which are checked against the vocabulary (``token_ids``).

    Returns ``(logits [B, N, V], new_states)``; the input records are left
    unchanged. Masks are leased from ``memo`` (a fresh one when ``None``) and
    released before returning. Drop the old records before evaluating the
    result so the appends write in place.

    ``start_early``: start computing the first layer's new keys and values
    on the device (``mx.async_eval``) as soon as the model hands them over,
    so the device works while the host builds the rest of the graph. The
    results are the same either way. ``None`` (the default): only when the
    default device is the CPU, where it measured faster; on the H200 it
    measured slower (``notes/bridge.md``).

    ``last``: only the last position's logits, ``[B, 1, V]`` (a prompt's
    rest and its last token in one forward, ``prefix_cache.prefill``): the
    output layer runs on that position alone where the model's head is
    known (``_last_logits``), else the full logits are sliced.
    """
    tokens, poisoned = _checked_call(model, tokens, states)
    if _hybrid.needs_groups(states):
        return _hybrid.grouped(forward, model, tokens, states, memo=memo, start_early=start_early)
    B, N = tokens.shape
    if start_early is None:
        start_early = mx.default_device().type == _CPU
    ctx = _shells.Eager(MaskMemo() if memo is None else check_memo(memo), start_early)
    shells = _shells_of(states, B, ctx)
    if B == 0:  # mlx-lm models cannot run an empty batch: nothing to run, nothing appended
        V, dtype = _logits_shape(model)
        return mx.zeros((0, N, V), dtype), list(states)
    logits = _run(model, tokens, shells, ctx, last)
    if poisoned is not None:
        logits = mx.where(poisoned[:, None, None], mx.array(float("nan"), logits.dtype), logits)
    return logits, [sh.content for sh in shells]


def _checked_call(model: Model, tokens, states: Sequence) -> tuple[mx.array, Any]:
    """Check a forward's tokens (``[B, N]``, ``N >= 1``) and its records' count.

    Returns:
        ``(tokens, poisoned)`` as ``token_ids`` gives them.
    """
    tokens, poisoned = token_ids(model, tokens)
    shape = tokens.shape
    if len(shape) != 2:
        raise bad("tokens rank", "2 ([B, N])", f"{len(shape)} {list(shape)}")
    check(shape[1] >= 1, "tokens length (shape[1])", ">= 1", shape[1])
    if isinstance(states, (str, bytes)) or not hasattr(states, "__len__"):
        raise bad("states", "a list of records (one per layer)", type(states).__name__)
    layers = layer_count(model)
    if len(states) != layers:
        raise bad("states", f"{layers} records (one per layer of the model)", len(states))
    return tokens, poisoned


def _shells_of(states: Sequence, B: int, ctx) -> list:
    """Each record checked (a record of ``B`` rows) and wrapped in its shell.

    One pass checks and wraps (messages are formatted only on failure: this
    runs every decode step); a failure leaves nothing behind.
    """
    shells = []
    for i, s in enumerate(states):
        if not _shells.is_record(s):
            raise bad(f"states[{i}]", "a kvstate record", type(s).__name__)
        if s.batch_size != B:
            raise bad(f"states[{i}] batch size", f"{B} (tokens rows)", s.batch_size)
        shells.append(_shells.shell(s, ctx))
    return shells


def _run(model: Model, tokens: mx.array, shells: list, ctx, last: bool) -> mx.array:
    """The model's logits over the shells (the cascade read where routed or shared);
    the context's masks released after."""
    run = _last_logits if last else _logits
    try:
        squeezed = sum(type(sh.content) is CompressedState for sh in shells)
        if squeezed or routing.routes_reads() or any(type(sh) is SharedShell for sh in shells):
            with _cascade(model, ctx) as route:
                route.compressed = squeezed
                return run(model, tokens, shells)
        return run(model, tokens, shells)
    finally:
        ctx.release()


def _logits(model, tokens, cache):
    return model(tokens, cache=cache)


#: mlx-lm model modules whose ``Model.__call__`` is its inner ``model`` (the
#: decoder stack and final norm, per position after attention) followed by the
#: output layer, ``lm_head`` or the tied embedding: ``_last_logits`` runs the
#: output layer on the last position only (tested against the full logits).
PLAIN_HEADS = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})


def _last_logits(model, tokens, cache):
    """The logits of the last position, ``[B, 1, V]``: for ``PLAIN_HEADS`` models
    the output layer (``[V, hidden]``, a small model's costliest matmul) runs on
    that position alone; for any other model, the full logits sliced."""
    if type(model).__module__ not in PLAIN_HEADS:
        return model(tokens, cache=cache)[:, -1:]
    h = model.model(tokens, cache)[:, -1:]
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


_LOGITS: dict = {}  # id(model) -> (vocabulary size, logits dtype); leaves with its model


def _logits_shape(model) -> tuple:
    """``(V, dtype)`` of ``model``'s logits, from one probe of one token (once per model)."""
    got = _LOGITS.get(id(model))
    if got is None:
        logits, _ = forward(model, mx.zeros((1, 1), mx.int32), make_states(model, 1))
        got = _LOGITS[id(model)] = (logits.shape[-1], logits.dtype)
        weakref.finalize(model, _LOGITS.pop, id(model), None)
    return got


# --- generation helpers -------------------------------------------------------------
