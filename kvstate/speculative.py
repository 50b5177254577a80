"""Batched speculative decoding with per-row acceptance, over bridge models.

mlx-lm speculates one stream at a time (its batch cache has one write index
and one ``trim`` for all rows). kvstate rows advance and roll back on their
own, so every row of a batch can speculate with its own draft length and
keep its own accepted count. One round (``step``)::

    row 0:  y  d1 d2 d3 d4        verify window: the unfed token y, then the draft
    row 1:  y  d1 .  .  .         (shorter drafts are padded; the pad is rolled back)
    row 2:  y  .  .  .  .         no draft: this row takes a plain step

    cp = checkpoint(states); logits, states = forward(target, window, states)
    accepted[b] = leading drafts the target agrees with (greedy or the rejection rule)
    states = rollback(states, cp, 1 + accepted)   # y and the accepted drafts stay
    row b emits d1..d_accepted[b] and the target's own next token (the new y)

The target records always hold every token of a row's context except the
last (``y``, fed by the next round). Rows join (``join``) and leave
(``leave``) between rounds, each with its own draft limit. A round in which
no row drafts is a plain decode step (a window of one token).

Greedy verification in float32 emits exactly the plain loop's tokens;
sampled verification uses the standard rejection rule (accept draft ``x``
with probability ``min(1, p(x)/q(x))``, else sample ``max(p - q, 0)``), so
the output has the target's distribution. Decisions: ``notes/speculative.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import mlx.core as mx

from . import mlx_lm as bridge
from . import ops
from .drafts import DraftModel, Lookup, lookup, validate_drafter
from .errors import bad, check, per_row, row_list

Forward = Callable  # (tokens [B, N], states) -> (logits [B, N, V], states)


@attrs.frozen
class Speculation:
    """A batch of rows in flight (data only; ``step``, ``join``, ``leave`` make new ones).

    Attributes:
        states: the target's records, one per layer; row ``b`` holds
            ``context[b][:-1]``.
        context: per row, every token so far (prompt, then output); the last
            one is not yet fed to the target.
        num_draft: per row, how many tokens the next round drafts at most.
        max_draft: per row, the limit ``num_draft`` adapts under.
        draft_states: the draft model's records (one per layer, holding
            ``context[b][:-1]`` like ``states``), or ``None`` without one.
    """

    states: tuple = attrs.field(converter=tuple)
    context: tuple = attrs.field(converter=lambda c: tuple(tuple(r) for r in c))
    num_draft: tuple = attrs.field(converter=tuple)
    max_draft: tuple = attrs.field(converter=tuple)
    draft_states: tuple | None = attrs.field(
        default=None, converter=lambda s: None if s is None else tuple(s))

    @property
    def batch_size(self) -> int:
        return len(self.context)


@attrs.frozen
class Round:
    """What one round did, per row: tokens emitted, drafted and accepted."""

    emitted: tuple
    drafted: tuple
    accepted: tuple
    width: int  # the verify window (1 + the longest draft)


# --- distributions and the acceptance rules ------------------------------------------


def distribution(logits: mx.array, temperature: float) -> mx.array:
    """``softmax(logits / temperature)`` in float32 over the last axis."""
    return mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)


def accept_greedy(drafts: Sequence[Sequence[int]], target: Sequence[Sequence[int]]) -> tuple:
    """Greedy verification: per row, the leading drafts equal to the target's argmax.

    Args:
        drafts: per row, its draft tokens ``d_1..d_k``.
        target: per row, the target's argmax at each window position (at
            least ``k + 1``: position ``i`` predicts the token after ``d_i``).

    Returns:
        ``(accepted, next_tokens)``: per row the accepted count ``a`` and the
        target's token after the accepted drafts (``target[b][a]``).
    """
    accepted, nxt = [], []
    for d, t in zip(drafts, target):
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        accepted.append(a)
        nxt.append(int(t[a]))
    return tuple(accepted), tuple(nxt)


def accept_sampled(drafts: mx.array, counts: mx.array, p: mx.array, q: mx.array | None,
                   key: mx.array) -> tuple:
    """The rejection rule of speculative sampling, for every row at once.

    Draft ``i`` of row ``b`` is accepted with probability
    ``min(1, p_i(x) / q_i(x))`` while every earlier one was; at the first
    rejection the next token is drawn from ``max(p_i - q_i, 0)`` (normalized),
    and when all ``counts[b]`` drafts are accepted, from ``p`` after them.
    Each emitted token then has the target's distribution.

    Args:
        drafts: int32 ``[B, K]`` draft tokens (columns past ``counts[b]`` are ignored).
        counts: int32 ``[B]``: drafts per row, ``<= K``.
        p: ``[B, K + 1, V]`` the target's probabilities at each window position.
        q: ``[B, K, V]`` the draft's probabilities, or ``None`` for a
            deterministic draft (prompt lookup: ``q`` is one-hot at the draft).
        key: a PRNG key for this round.

    Returns:
        ``(accepted, next_token)``: int32 ``[B]`` arrays.
    """
    B, K = drafts.shape
    k_u, k_s = mx.random.split(key)
    if K == 0:
        return mx.zeros((B,), mx.int32), mx.random.categorical(mx.log(p[:, 0]), key=k_s)
    px = mx.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
    qx = 1.0 if q is None else mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = mx.random.uniform(shape=(B, K), key=k_u)
    ok = (u * qx < px) & (mx.arange(K)[None, :] < counts[:, None])
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    p_a = mx.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    at = mx.minimum(accepted, K - 1)
    if q is None:
        x = mx.take_along_axis(drafts, at[:, None], axis=1)  # [B, 1]
        q_a = (mx.arange(p.shape[-1])[None, :] == x).astype(p_a.dtype)
    else:
        q_a = mx.take_along_axis(q, at[:, None, None], axis=1)[:, 0]
    q_a = mx.where((accepted < counts)[:, None], q_a, 0.0)
    r = mx.maximum(p_a - q_a, 0.0)
    r = mx.where(r.sum(axis=-1, keepdims=True) > 0, r, p_a)  # p == q: nothing to correct
    return accepted, mx.random.categorical(mx.log(r), key=k_s).astype(mx.int32)


# --- forward functions --------------------------------------------------------------


def eager(model) -> Forward:
    """``(tokens, states) -> (logits [B, N, V], states)`` through ``kvstate.mlx_lm.forward``."""
    return lambda tokens, states: bridge.forward(model, tokens, states)


def compiled(model) -> Forward:
    """The same through one ``kvstate.compiled.Decoder`` (one trace per window width
    and capacity bucket)."""
    from .compiled import Decoder

    decoder = Decoder(model)

    def run(tokens, states):
        return decoder(tokens, states)

    run.decoder = decoder
    return run


# --- the batch: start, join, leave -----------------------------------------------------


def _first_tokens(logits, temperature, key):
    if temperature == 0:
        return mx.argmax(logits, axis=-1).tolist()
    return mx.random.categorical(mx.log(distribution(logits, temperature)), key=key).tolist()


def start(target, prompts: Sequence[Sequence[int]], *, drafter=None, num_draft=4,
          temperature: float = 0.0, key: mx.array | None = None, **make) -> Speculation:
    """Prefill ``prompts`` (each alone, then merged) and pick every row's first token.

    Args:
        target: the mlx-lm model whose output is kept.
        prompts: token ids per row.
        drafter: ``None``, ``Lookup()`` or ``DraftModel(model)``; a draft
            model is prefilled on the prompts too.
        num_draft: most drafted tokens per row per round (int or one per row).
        temperature: 0 picks the argmax; otherwise the first token is sampled.
        key: PRNG key for sampling (``temperature > 0``).
        make: ``make_states`` options for the target's records.
    """
    drafter = validate_drafter(drafter)
    check(len(prompts) >= 1, "prompts", "at least one prompt", "none")
    temperature = _temperature(temperature, key)
    limit = per_row(num_draft, len(prompts), "num_draft")
    logits, states = bridge.prefill(target, prompts, **make)
    first = _first_tokens(logits, temperature, key)
    draft_states = None
    if isinstance(drafter, DraftModel):
        _, draft_states = bridge.prefill(drafter.model, prompts, **drafter.make)
    return Speculation(states, [list(p) + [t] for p, t in zip(prompts, first)], limit, limit,
                       draft_states)


def join(batch: Speculation, other: Speculation) -> Speculation:
    """``other``'s rows join after ``batch``'s (``kvstate.mlx_lm.extend`` on each model)."""
    check((batch.draft_states is None) == (other.draft_states is None), "other.draft_states",
          "draft records exactly when batch has them", other.draft_states is not None)
    drafts = None
    if batch.draft_states is not None:
        drafts = bridge.extend(batch.draft_states, other.draft_states)
    return Speculation(bridge.extend(batch.states, other.states), batch.context + other.context,
                       batch.num_draft + other.num_draft, batch.max_draft + other.max_draft,
                       drafts)


def leave(batch: Speculation, rows) -> Speculation:
    """Keep ``rows`` (in that order); the others leave the batch."""
    rows = row_list(rows, batch.batch_size)
    drafts = None
    if batch.draft_states is not None:
        drafts = bridge.filter_rows(batch.draft_states, rows)
    pick = lambda t: tuple(t[r] for r in rows)
    return Speculation(bridge.filter_rows(batch.states, rows), pick(batch.context),
                       pick(batch.num_draft), pick(batch.max_draft), drafts)


# --- one round ---------------------------------------------------------------------------


def _temperature(temperature, key):
    t = float(temperature)
    check(t >= 0, "temperature", ">= 0", temperature)
    if t > 0 and not isinstance(key, mx.array):
        raise bad("key", "an mx.array PRNG key when temperature > 0", type(key).__name__)
    return t


def next_num_draft(k: int, drafted: int, accepted: int, limit: int) -> int:
    """The row's next draft length: two more after a fully accepted draft, one
    fewer after a rejection (at least 1), unchanged when nothing was drafted."""
    if drafted == 0:
        return k
    if accepted == drafted:
        return min(k + 2, limit)
    return max(k - 1, 1)


def _propose_lookup(batch: Speculation, drafter: Lookup):
    return [lookup(c, k, max_ngram=drafter.max_ngram, min_ngram=drafter.min_ngram)
            for c, k in zip(batch.context, batch.num_draft)]


def _propose_model(batch: Speculation, drafter: DraftModel, temperature, key):
    """Draft ``K = max(num_draft)`` tokens for every row, one draft step each.

    Returns ``(drafts [B, K] int32 on the device, q [B, K, V] or None,
    draft states after feeding y, d_1..d_{K-1})``.
    """
    K = max(batch.num_draft)
    y = mx.array([c[-1] for c in batch.context], dtype=mx.int32)
    states, drafts, qs = batch.draft_states, [], []
    keys = mx.random.split(key, K) if temperature > 0 else None
    for j in range(K):
        logits, states = bridge.step(drafter.model, y, states)
        if temperature == 0:
            y = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            q = distribution(logits, temperature)
            y = mx.random.categorical(mx.log(q), key=keys[j]).astype(mx.int32)
            qs.append(q)
        drafts.append(y)
    return mx.stack(drafts, axis=1), (mx.stack(qs, axis=1) if qs else None), states


def _settle_model(drafter: DraftModel, states, anchors, drafts, accepted):
    """Bring the draft records back to each row's context minus its last token:
    the anchor plus ``y`` and the accepted drafts. Rows that accepted all
    ``K`` drafts need ``d_K`` fed first (one more draft step for the batch).

    The draft took its tokens one at a time, so a ring layer comes back by
    ``commit`` (decode by position); dense layers roll back.
    """
    K = drafts.shape[1]
    if K and max(accepted) == K:
        _, states = bridge.step(drafter.model, drafts[:, -1], states)
    keep = [1 + a for a in accepted]
    return [ops.commit(s, a, keep) for s, a in zip(states, anchors)]


def step(target, batch: Speculation, *, drafter=None, temperature: float = 0.0,
         key: mx.array | None = None, forward: Forward | None = None) -> tuple:
    """One speculative round for every row: draft, verify in one target forward, roll back.

    Args:
        target: the mlx-lm model (for the default ``forward``).
        batch: the rows in flight.
        drafter: the ``Lookup`` or ``DraftModel`` the batch was started with
            (``None``: a plain decode step for every row).
        temperature: 0 for greedy verification, else sampled verification at
            this temperature (the rejection rule).
        key: PRNG key for this round (``temperature > 0``).
        forward: ``(tokens [B, N], states) -> (logits [B, N, V], states)``;
            default ``eager(target)``; ``compiled(target)`` for a compiled verify.

    Returns:
        ``(new_batch, Round)``: the batch after the round, and per row the
        emitted tokens (the accepted drafts, then the target's token).
    """
    drafter = validate_drafter(drafter)
    temperature = _temperature(temperature, key)
    is_model = isinstance(drafter, DraftModel)
    check(is_model == (batch.draft_states is not None), "drafter",
          "a DraftModel exactly when the batch holds draft records", type(drafter).__name__)
    forward = forward or eager(target)
    B = batch.batch_size
    k_draft = k_verify = None
    if temperature > 0:
        k_draft, k_verify = mx.random.split(key)

    q = None
    if is_model:
        dcps = [ops.anchor(s) for s in batch.draft_states]
        dev_drafts, q, dstates = _propose_model(batch, drafter, temperature, k_draft)
        counts = batch.num_draft
    elif drafter is not None:
        host = _propose_lookup(batch, drafter)
        counts = tuple(len(d) for d in host)
        K = max(counts)
        dev_drafts = mx.array([d + [0] * (K - len(d)) for d in host], dtype=mx.int32)
        dev_drafts = dev_drafts.reshape(B, K)
    else:
        counts = (0,) * B
        dev_drafts = mx.zeros((B, 0), mx.int32)
    K = max(counts)
    dev_drafts = dev_drafts[:, :K]
    if q is not None:
        q = q[:, :K]

    y = mx.array([c[-1] for c in batch.context], dtype=mx.int32)[:, None]
    window = mx.concatenate([y, dev_drafts], axis=1)  # [B, 1 + K]; rows past counts: padding
    cps = [ops.checkpoint(s) for s in batch.states]
    logits, states = forward(window, batch.states)
    if temperature == 0:
        target_tokens, host_drafts = mx.argmax(logits, axis=-1), dev_drafts
        mx.eval(target_tokens, host_drafts)
        drafts = [d[:c] for d, c in zip(host_drafts.tolist(), counts)]
        accepted, nxt = accept_greedy(drafts, target_tokens.tolist())
    else:
        p = distribution(logits, temperature)
        acc, nx = accept_sampled(dev_drafts, mx.array(counts, dtype=mx.int32), p, q, k_verify)
        mx.eval(acc, nx, dev_drafts)
        accepted, nxt = tuple(acc.tolist()), tuple(nx.tolist())
        drafts = [d[:c] for d, c in zip(dev_drafts.tolist(), counts)]
    states = [ops.rollback(s, cp, [1 + a for a in accepted]) for s, cp in zip(states, cps)]
    draft_states = None
    if is_model:
        draft_states = _settle_model(drafter, dstates, dcps, dev_drafts, accepted)
    emitted = tuple(tuple(d[:a]) + (t,) for d, a, t in zip(drafts, accepted, nxt))
    num_draft = tuple(next_num_draft(k, c, a, m) for k, c, a, m in
                      zip(batch.num_draft, counts, accepted, batch.max_draft))
    new = Speculation(states, [c + e for c, e in zip(batch.context, emitted)], num_draft,
                      batch.max_draft, draft_states)
    return new, Round(emitted, counts, accepted, 1 + K)


__all__ = [
    "DraftModel",
    "Lookup",
    "Round",
    "Speculation",
    "accept_greedy",
    "accept_sampled",
    "compiled",
    "distribution",
    "eager",
    "join",
    "leave",
    "next_num_draft",
    "start",
    "step",
]
