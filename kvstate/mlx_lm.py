"""The mlx-lm bridge: run unmodified mlx-lm models on kvstate records.

An mlx-lm model reads its cache through a small protocol: ``offset`` (the
RoPE position of the next token), ``update_and_fetch(k, v)``, ``make_mask``
and, for quantized caches, ``bits``/``group_size``. ``forward`` hands the
model one thin *shell* per layer (``kvstate.bridge.shells``, the same shells the
compiled ``Decoder`` uses) that answers that protocol from a record; the
shell swaps in the appended record as the model writes, and ``forward``
returns the new records. The input records are never changed::

    states = make_states(model, batch_size=B)          # one record per layer
    logits, states = forward(model, tokens, states)    # tokens [B, N]

One ``MaskMemo`` serves a whole forward: the model asks one layer per mask
family for its mask, every other layer of that family reads the same array,
and the leases are released when the model returns. Decisions are in
``notes/bridge.md``.
"""

from __future__ import annotations

from functools import singledispatch
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, cast

import attrs
import mlx.core as mx
import numpy as np

from .batch import Batch, sample_batch
from .bridge import hybrid as _hybrid
from .bridge.decoder import (
    Decoder as Decoder,
)
from .bridge.decoder import (
    compiled_decoder as compiled_decoder,
)
from .bridge.decoder import (
    make_step as make_step,
)
from .bridge.forward import (
    PLAIN_HEADS as PLAIN_HEADS,
)
from .bridge.forward import (
    SharedQuantizedShell as SharedQuantizedShell,
)
from .bridge.forward import (
    SharedShell as SharedShell,
)
from .bridge.forward import (
    _host_ids,
    _logits_shape,
)
from .bridge.forward import (
    forward as forward,
)
from .bridge.forward import (
    layer_count as layer_count,
)
from .bridge.forward import (
    make_states as make_states,
)
from .bridge.forward import (
    shell_class_shared as shell_class_shared,
)
from .bridge.forward import (
    token_ids as token_ids,
)
from .bridge.forward import (
    vocab_size as vocab_size,
)
from .bridge.prompt_cache import (
    from_prompt_cache as from_prompt_cache,
)
from .bridge.prompt_cache import (
    to_prompt_cache as to_prompt_cache,
)
from .bridge.shells import Model
from .core import ops
from .core.args import PerRowInts, as_int
from .core.layers import ModelCheckpoint
from .core.masks import MaskMemo
from .core.records import CacheState, QuantizedState
from .errors import bad, check
from .sampling import Sampling, row_keys

__all__ = [
    "make_states",
    "forward",
    "from_prompt_cache",
    "to_prompt_cache",
    "prefill",
    "step",
    "merge_rows",
    "filter_rows",
    "extend",
    "extract_row",
    "admit",
    "advance",
    "collect",
    "feed",
    "layer_count",
    "Decoder",
    "compiled_decoder",
    "make_step",
    "rollback",
]


# A model's records are one value to every kv function (kvstate.core.layers); the
# bridge's names for the row operations are those functions.
merge_rows = ops.merge_rows
filter_rows = ops.filter_rows
extend = ops.extend
extract_row = ops.extract_row


def prefill(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    memo: Optional[MaskMemo] = None,
    prefill_step_size: int = 512,
    **make: Any,
) -> tuple:
    """Prefill every prompt in one batch; ``(last logits [B, V], states)``.

    All but each prompt's last token run together, right-padded to the
    longest and in chunks of at most ``prefill_step_size`` tokens; then each
    row's padding is trimmed and the last tokens run as one ``step``, which
    writes each row at its own end and gives the logits (no ``[B, N, V]``
    logits are ever computed)::

        right-padded, one forward per chunk      trimmed: row b holds its prompt
        row 0:  a a a a a a . .                  row 0:  a a a a a a ~ ~
        row 1:  b b b . . . . .        ->        row 1:  b b b ~ ~ ~ ~ ~
        row 2:  c c c c c c c c                  row 2:  c c c c c c c c

    (``.`` padding, ``~`` stale columns past a row's end, which masks never
    expose and the next append overwrites). Padding comes after a row's
    tokens, so causal attention never lets a real token see it. A model with
    records other than dense and quantized ones (sliding-window rings, ...)
    runs each whole prompt alone in one forward and merges the rows, as
    before: padding written into a ring would evict real tokens, and
    splitting a prompt changes what a ring shows its last tokens
    (``_prefill_alone``).

    Args:
        prompts: lists of token ids, one per row (lengths may differ).
        prefill_step_size: most tokens per forward (bounds the attention
            scores' memory on long prompts).
        make: ``max_kv_size``, ``kv_bits``, ``kv_group_size`` for ``make_states``.

    Returns:
        ``(logits [B, V], states)``: each row's logits after its last prompt
        token, and the states (row ``b`` holds prompt ``b``, no left padding).
    """
    if not prompts:  # an empty batch
        V, dtype = _logits_shape(model)
        return mx.zeros((0, V), dtype), make_states(model, 0, **make)
    prompts = [list(p) for p in prompts]
    for i, p in enumerate(prompts):
        check(len(p) >= 1, f"prompts[{i}]", "at least one token", "an empty prompt")
        _host_ids(model, p, f"prompts[{i}]", 1)
    step_size = as_int(prefill_step_size, "prefill_step_size")
    check(step_size >= 1, "prefill_step_size", ">= 1", step_size)
    states = make_states(model, len(prompts), **make)
    if not all(map(paddable, states)):
        return _prefill_alone(model, prompts, memo, make)
    return _prefill_rows(model, prompts, states, step_size, memo)


@singledispatch
def paddable(state) -> bool:
    """Whether right-padded rows of this kind come out of a batched prefill
    exactly as prefilled alone (``pad_right`` before, ``unpad`` after): dense
    and quantized rows (a trim drops the padding columns) and recurrent rows
    (they skip the padding, ``kvstate.bridge.hybrid``). A ring would evict real
    tokens for padding, a chunked layer drop them at its next ``trim_front``."""
    return False


@paddable.register(CacheState)
@paddable.register(QuantizedState)
def _paddable_rows(state) -> bool:
    return True


pad_right = _hybrid.pad_right  # one generic: the batched prefill and hybrid rollback's replay


@singledispatch
def unpad(state, cut: tuple):
    """``state`` without the padding ``pad_right`` announced (``cut`` per row)."""
    return ops.trim(state, cut)


_hybrid.register_prefill(paddable, unpad)


def _prefill_alone(model, prompts, memo, make):
    """Each whole prompt in one forward on its own records, then the rows merged.

    For ring layers: a ring's multi-token append keeps every new token
    visible to the block, so splitting a prompt (into chunks, or into its
    head and last token) would change what its last tokens see.
    """
    last, rows = [], []
    for p in prompts:
        logits, states = forward(model, [p], make_states(model, 1, **make), memo=memo)
        last.append(logits[:, -1, :])
        rows.append(states)
    return mx.concatenate(last, axis=0), merge_rows(rows)


def _prefill_rows(model, prompts, states, step_size, memo):
    """``prefill`` on validated prompts and empty ``states`` of their batch size."""
    heads = [p[:-1] for p in prompts]
    width = max(len(h) for h in heads)
    if width:
        tokens = np.array([h + [0] * (width - len(h)) for h in heads], dtype=np.int32)
        for start in range(0, width, step_size):
            if start:  # bound the graph (and memory) of long prompts, as mlx-lm does
                mx.eval([s.planes for s in states])
            n = min(step_size, width - start)
            real = tuple(min(max(len(h) - start, 0), n) for h in heads)
            states = [pad_right(s, real) for s in states]
            _, states = forward(model, tokens[:, start : start + step_size], states, memo=memo)
        cut = tuple(width - len(h) for h in heads)
        states = [unpad(s, cut) for s in states]
    return step(model, np.array([p[-1] for p in prompts], dtype=np.int32), states, memo=memo)


def step(
    model: Model,
    tokens: mx.array | np.ndarray | Sequence[int],
    states: Sequence,
    *,
    memo: Optional[MaskMemo] = None,
    start_early: Optional[bool] = None,
) -> tuple:
    """One decode step: ``tokens`` ``[B]`` (one per row) -> ``(logits [B, V], states)``."""
    if not isinstance(tokens, mx.array):  # host ids: checked by forward, on the host
        try:
            tokens = np.asarray(tokens)
        except ValueError as e:
            raise bad("tokens", "token ids [B], one per row", str(e)) from None
        if tokens.dtype == object:
            raise bad(
                "tokens",
                "token ids [B] (an mx.array, a list or a numpy array)",
                type(tokens).__name__,
            )
    check(tokens.ndim == 1, "tokens rank", "1 ([B], one token per row)", tokens.ndim)
    logits, states = forward(model, tokens[:, None], states, memo=memo, start_early=start_early)
    return logits[:, -1, :], states


# --- a batch in flight (Batch) -------------------------------------------------------


def admit(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: Sampling | Sequence[Sampling] | None = None,
    keys: mx.array | None = None,
    ids: Sequence | None = None,
    payload: Sequence | None = None,
    seeds: Sequence[int] | None = None,
    memo: Optional[MaskMemo] = None,
    **make: Any,
) -> Batch:
    """Prefill ``prompts`` and sample each row's first token: a ``kv.Batch`` ready to decode.

    Args:
        prompts: lists of token ids, one per row (each prefilled alone, then merged).
        sampling: one ``kv.Sampling`` for every row, or one per row (default
            greedy); a row's PRNG key comes from its ``seed`` (or pass ``keys``).
        ids, payload: one value per row (default ``None``).
        seeds: one int per row, the seeds of the rows' keys (overriding the
            ``kv.Sampling`` seeds; ``keys`` overrides both).
        make: ``max_kv_size``, ``kv_bits``, ``kv_group_size`` for ``make_states``.

    Returns:
        A ``kv.Batch`` whose ``tokens`` are the first sampled tokens: emitted,
        not in the cache yet (the pending-token rule, ``kvstate.batch``).
    """
    logits, states = prefill(model, prompts, memo=memo, **make)
    if keys is None and seeds is not None:
        keys = row_keys(seeds)
    given: dict[str, Any] = {"sampling": sampling, "keys": keys, "ids": ids, "payload": payload}
    pending = Batch(
        states,
        mx.zeros((len(prompts),), mx.uint32),
        **{k: v for k, v in given.items() if v is not None},
    )
    tokens, keys = sample_batch(logits, pending)
    return attrs.evolve(pending, tokens=tokens, keys=keys)


def advance(
    model: Model,
    batch: Batch,
    *,
    step: Callable[[mx.array, list], tuple] | None = None,
    memo: Optional[MaskMemo] = None,
) -> Batch:
    """One decode step of every row: feed the pending tokens, sample the next ones.

    Each row samples with its own ``kv.Sampling`` and PRNG key. Pure: ``batch``
    is left unchanged; the new batch's ``tokens`` are the tokens to emit.

    Args:
        batch: a ``kv.Batch``.
        step: a callable ``(tokens [B], states) -> (logits [B, V], states)``,
            e.g. ``kv.compiled_decoder(model)``; default this module's ``step``.
    """
    if not isinstance(batch, Batch):
        raise bad("batch", "a kv.Batch (kvstate.mlx_lm.admit makes one)", type(batch).__name__)
    if batch.batch_size == 0:  # nothing to feed, nothing to sample
        return batch
    if step is None:
        logits, states = globals()["step"](model, batch.tokens, list(batch.states), memo=memo)
    else:
        logits, states = step(batch.tokens, list(batch.states))
    tokens, keys = sample_batch(logits, batch)
    return attrs.evolve(batch, states=states, tokens=tokens, keys=keys)


def collect(
    batch: Batch,
    out: Mapping,
    *,
    stop: Iterable[int] = (),
    max_tokens: int | None = None,
) -> tuple[Batch, dict]:
    """Each row's emitted token added to its completion; the rows that finished leave.

    A row finishes when its token is in ``stop`` (an end-of-sequence id: not added,
    as mlx-lm's ``batch_generate`` leaves it out) or its completion reaches
    ``max_tokens``. Pure: ``batch`` and ``out`` are left unchanged.

    Args:
        batch: a ``kv.Batch`` whose ``tokens`` are to be emitted (what ``admit``
            and ``advance`` return); its ``ids`` name the completions.
        out: ``{id: tuple of token ids}``, the completions so far (``{}`` at first).
        stop: token ids that end a row.
        max_tokens: the most tokens in a completion (``None``: no limit).

    Returns:
        ``(batch, out)``: the batch without the finished rows (``kv.filter_rows``),
        and the completions with this step's tokens; every row's id is a key.

    Raises:
        KVStateError: ``max_tokens`` below 1, or ids that repeat.
    """
    if not isinstance(batch, Batch):
        raise bad("batch", "a kv.Batch (kvstate.mlx_lm.admit makes one)", type(batch).__name__)
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens", "at least 1 (or None)", max_tokens)
    if len(set(batch.ids)) != len(batch.ids):
        raise bad("batch.ids", "one distinct id per row", list(batch.ids))
    stop, out, keep = frozenset(stop), dict(out), []
    for b, (i, token) in enumerate(zip(batch.ids, cast(list, batch.tokens.tolist()))):
        ended = token in stop
        out[i] = tuple(out.get(i, ())) + (() if ended else (token,))
        if not ended and (max_tokens is None or len(out[i]) < max_tokens):
            keep.append(b)
    return (batch if len(keep) == batch.batch_size else ops.filter_rows(batch, keep)), out


def feed(
    model: Model, batch: Batch, tokens: Sequence[Sequence[int]], *, memo: Optional[MaskMemo] = None
) -> Batch:
    """Append each row's pending token and then ``tokens[b]`` (e.g. a new chat turn),
    and sample each row's next token: a resumed session continues with this.

    Rows whose inputs have one length run as one batch; otherwise each row
    runs alone and the rows are merged back (as ``prefill`` does).

    Args:
        batch: a ``kv.Batch``.
        tokens: per row, the token ids to append after its pending token (may be empty).
    """
    if not isinstance(batch, Batch):
        raise bad("batch", "a kv.Batch (kvstate.mlx_lm.admit makes one)", type(batch).__name__)
    if isinstance(tokens, (str, bytes)) or len(tokens) != batch.batch_size:
        raise bad(
            "tokens",
            f"{batch.batch_size} lists of token ids (one per row)",
            type(tokens).__name__ if isinstance(tokens, (str, bytes)) else len(tokens),
        )
    if batch.batch_size == 0:
        return batch
    seqs = [[p, *t] for p, t in zip(cast(list, batch.tokens.tolist()), tokens)]
    if len({len(s) for s in seqs}) == 1:
        logits, states = forward(model, mx.array(seqs), list(batch.states), memo=memo)
        last = logits[:, -1]
    else:
        rows = [
            forward(model, mx.array([s]), ops.extract_row(list(batch.states), b), memo=memo)
            for b, s in enumerate(seqs)
        ]
        last = mx.concatenate([lg[:, -1] for lg, _ in rows], axis=0)
        states = ops.merge_rows([st for _, st in rows])
    new, keys = sample_batch(last, batch)
    return attrs.evolve(batch, states=states, tokens=new, keys=keys)


def rollback(
    model: Model,
    states: Sequence,
    checkpoint: ModelCheckpoint,
    keep: PerRowInts,
    tokens: mx.array,
    *,
    memo: Optional[MaskMemo] = None,
) -> list:
    """Every layer back at ``checkpoint`` plus ``keep`` accepted tokens per row, exactly,
    for every model family (recurrent rows that keep part of a block replay it).

    Args:
        states: the records after feeding ``tokens`` from ``checkpoint``.
        checkpoint: ``kv.checkpoint(states_then)`` (a ``ModelCheckpoint``).
        keep: accepted tokens per row (an int or one per row).
        tokens: ``[B, N]``, the tokens fed since ``checkpoint``.

    Rows that keep all or none of ``tokens`` need no model call
    (``kv.rollback``); the others replay their accepted tokens from the
    checkpoint in one eager forward (``notes/kinds.md``: why, and its cost).
    """
    return _hybrid.rollback(
        states, checkpoint, keep, tokens, lambda t, s: forward(model, t, s, memo=memo)
    )
