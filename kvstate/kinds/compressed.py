"""Compressed rows: ``CompressedState`` (layout pictured in ``kvstate.core.records``).

A row keeps at most ``budget`` columns after each eviction. Which columns go
is one rule for every policy: the lowest-scored live column outside the
first ``sinks`` positions and the ``window`` newest, the oldest first on ties.
The policies differ only in the scores:

* ``sinks`` (StreamingLLM): no scores, so the oldest non-sink column goes:
  the first ``sinks`` tokens and the newest ``budget - sinks``.
* ``snapkv``: a block longer than ``observe`` (a prompt chunk) marks nothing
  and sets every column's score to the attention its last ``observe`` queries
  pay it (summed over heads, max-pooled over ``POOL`` neighbouring kept
  columns): the prompt's end ranks the whole prompt, as SnapKV compresses
  once after prefill (the first decode step marks). Decode steps and verify
  blocks score nothing, so once out of the window they go first; nothing
  before a scored block's end can be rolled back to.
* ``h2o``: every query adds its attention (heavy hitters).

Eviction is lazy and reversible. Before appending, a row marks its excess
columns ``dropped`` with its length (nothing moves); a query at position
``p`` sees the columns with ``pos <= p < dropped``. Marked columns are
compacted away only once no rollback can reach them (``floor``: the
length minus ``margin``), and a query's attention stays separable for
``margin`` tokens (``recent``, slot ``position % margin``) before it is
folded into ``score``. So ``rollback``/``trim`` to any length ``>= floor``
unmarks what later appends marked and subtracts what later queries scored:
the row is exactly what a row that never saw the dropped tokens holds.
Decisions: ``notes/kinds.md``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..compiled import boundary as compiled
from ..core import ops
from ..core.args import as_int, per_row, row_count, row_index, row_list
from ..core.invariants import clear_hidden, distinct_row_ids, validate
from ..core.records import Checkpoint, CompressedState, derived
from ..errors import bad, check
from ..kernels.stock import column_writer
from . import rows as _rows
from .shared import fork, fork_copied

#: ``dropped`` (and ``pos``) of a column that is not marked (hidden columns hold it in both).
LIVE = 1 << 30
POLICIES = ("sinks", "snapkv", "h2o")
#: ``snapkv``'s pooling kernel over neighbouring columns (SnapKV's default is 7 at 4K+ prompts).
POOL = 5


def compressed(
    batch_size: int = 1,
    budget: Any = 1024,
    *,
    policy: str = "sinks",
    sinks: int = 4,
    window: int = 16,
    margin: int = 16,
    observe: int = 32,
    step: int = 256,
) -> CompressedState:
    """Empty compressed rows: each keeps at most ``budget`` columns (an int, or one per row).

    Args:
        policy: ``"sinks"``, ``"snapkv"`` or ``"h2o"`` (module docstring).
        sinks: the first positions never evicted.
        window: the newest positions never evicted; ``budget >= sinks + window``.
        margin: tokens a rollback or trim can give back (``>= 1``); the
            marked columns and per-query scores held for it.
        observe: ``snapkv``'s observation window: a block longer than this
            is a prompt chunk, whose last ``observe`` queries score the columns
            (32, SnapKV's; keep verify blocks shorter).
        step: capacity grows in multiples of this.
    """
    B = row_count(batch_size, "batch_size")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise bad("policy", f"one of {POLICIES}", repr(policy))
    sinks, window, margin = (
        as_int(sinks, "sinks"),
        as_int(window, "window"),
        as_int(margin, "margin"),
    )
    observe = as_int(observe, "observe")
    step = as_int(step, "step")
    check(sinks >= 0, "sinks", ">= 0", sinks)
    check(window >= 1, "window", ">= 1", window)
    check(margin >= 1, "margin", ">= 1", margin)
    check(observe >= 1, "observe", ">= 1", observe)
    check(step >= 1, "step", ">= 1", step)
    budgets = per_row(budget, B, "budget", low=1)
    for b, n in enumerate(budgets):
        check(n >= sinks + window, f"budget[{b}]", f">= sinks + window = {sinks + window}", n)
    zeros = (0,) * B
    return CompressedState(
        zeros,
        zeros,
        zeros,
        zeros,
        budgets,
        ((),) * B,
        policy=policy,
        sinks=sinks,
        window=window,
        margin=margin,
        observe=observe,
        step=step,
    )


# --- the layout: eviction marks, compaction, capacity ----------------------------------


def _cols(C: int) -> mx.array:
    return mx.arange(C, dtype=mx.int32)[None, :]


def _total(state):
    """Each column's score: folded plus the recent queries' (``[B, C]`` float32)."""
    return state.score + state.recent.sum(axis=1)


def _excess(state) -> tuple:
    """Per row, the columns the next append marks (host ints)."""
    return tuple(max(0, k - n) for k, n in zip(state.kept, state.budget))


def _marks_of(pos, dropped, total, t, need, *, sinks, window):
    """``dropped`` with each row's ``need`` excess columns marked at ``t`` (int32
    ``[B, 1]`` each): the eviction rule, on arrays (eager and traced alike).
    ``total``: the scores (``None``: the oldest candidates go)."""
    cand = (dropped == LIVE) & (pos >= sinks) & (pos < t - window)
    if total is not None:
        key = mx.where(cand, total, mx.array(float("inf"), mx.float32))
        rank = mx.argsort(mx.argsort(key, axis=-1), axis=-1)  # stable: oldest first on ties
        evict = cand & (rank < need)
    else:
        evict = cand & (mx.cumsum(cand.astype(mx.int32), axis=-1) <= need)
    return mx.where(evict, t, dropped)


def _marked_log(state, excess) -> tuple:
    return tuple(
        e + ((t_, n),) if n else e for e, t_, n in zip(state.evictions, state.lengths, excess)
    )


def _mark(state):
    """Mark each row's excess columns dropped (at its length): the eviction rule."""
    excess = _excess(state)
    if not any(excess):
        return state
    t = mx.array(state.lengths, dtype=mx.int32)[:, None]
    need = mx.array(excess, dtype=mx.int32)[:, None]
    total = _total(state) if state.scored else None
    dropped = _marks_of(
        state.pos, state.dropped, total, t, need, sinks=state.sinks, window=state.window
    )
    return derived(
        state,
        dropped=dropped,
        kept=tuple(k - n for k, n in zip(state.kept, excess)),
        evictions=_marked_log(state, excess),
    )


def _hide(state, held, **planes):
    """``planes`` (by field name) with the columns at or past each row's ``held`` hidden."""
    C = planes["keys"].shape[2]
    vis = _cols(C) < mx.array(held, dtype=mx.int32)[:, None]
    out = {}
    for name, p in planes.items():
        if p is None:
            out[name] = None
        elif name in ("keys", "values"):
            out[name] = mx.where(vis[:, None, :, None], p, mx.zeros((), p.dtype))
        elif name in ("pos", "dropped"):
            out[name] = mx.where(vis, p, LIVE)
        elif name == "recent":
            out[name] = mx.where(vis[:, None, :], p, 0.0)
        else:
            out[name] = mx.where(vis, p, 0.0)
    return out


def _planes(state):
    return {
        "keys": state.keys,
        "values": state.values,
        "pos": state.pos,
        "dropped": state.dropped,
        "score": state.score,
        "recent": state.recent,
    }


def _gather(planes, src):
    out = {}
    for name, p in planes.items():
        if p is None:
            out[name] = None
        elif name in ("keys", "values"):
            out[name] = mx.take_along_axis(p, src[:, None, :, None], axis=2)
        elif name == "recent":
            out[name] = mx.take_along_axis(p, src[:, None, :], axis=2)
        else:
            out[name] = mx.take_along_axis(p, src, axis=1)
    return out


def _compact(state, n, always=False):
    """Drop marked columns no rollback reaches (marked below ``floor``), when a row
    would otherwise hold more than ``budget + margin`` columns after ``n`` more
    (``always``: whenever a row holds one, ``compiled.prepare``'s)."""
    gone = tuple(sum(c for t, c in log if t < f) for log, f in zip(state.evictions, state.floor))
    over = zip(gone, state.held, state.budget)
    if not (any(gone) if always else any(g and h + n > b + state.margin for g, h, b in over)):
        return state
    C = state.capacity
    cols = _cols(C)
    floor = mx.array(state.floor, dtype=mx.int32)[:, None]
    held = tuple(h - g for h, g in zip(state.held, gone))
    stay = (state.dropped >= floor) & (cols < mx.array(state.held, dtype=mx.int32)[:, None])
    src = mx.argsort(mx.where(stay, cols, cols + C), axis=-1)  # distinct keys: order kept
    planes = _hide(state, held, **_gather(_planes(state), src))
    log = tuple(tuple((t, c) for t, c in e if t >= f) for e, f in zip(state.evictions, state.floor))
    return derived(state, held=held, evictions=log, **planes)


def _resize(state, C):
    """Capacity ``C`` (a slice, or hidden columns added)."""
    old = state.capacity
    if C == old:
        return state
    planes = _planes(state)
    out = {}
    for name, p in planes.items():
        if p is None:
            out[name] = None
            continue
        axis = 2 if name in ("keys", "values", "recent") else 1
        if C < old:
            out[name] = mx.split(p, [C], axis=axis)[0]
            continue
        shape = list(p.shape)
        shape[axis] = C - old
        fill = LIVE if name in ("pos", "dropped") else 0
        out[name] = mx.concatenate([p, mx.full(shape, fill, p.dtype)], axis=axis)
    return derived(state, **out)


def _start(state, k, v):
    """Empty planes shaped after the first tokens."""
    B, H, _, Dk = k.shape
    Dv = v.shape[-1]
    C = state.step
    planes = {
        "keys": mx.zeros((B, H, C, Dk), k.dtype),
        "values": mx.zeros((B, v.shape[1], C, Dv), v.dtype),
        "pos": mx.full((B, C), LIVE, mx.int32),
        "dropped": mx.full((B, C), LIVE, mx.int32),
        "score": mx.zeros((B, C), mx.float32) if state.scored else None,
        "recent": mx.zeros((B, state.margin, C), mx.float32) if state.scored else None,
    }
    return derived(state, **planes)


def settle(state, n):
    """What an append of ``n`` tokens does before writing: mark the excess
    columns, compact what no rollback reaches, make room for ``n`` columns."""
    if not (state.policy == "snapkv" and n > state.observe):  # a prompt chunk marks nothing
        state = _mark(state)
    state = _compact(state, n)
    need = max((h + n for h in state.held), default=0)
    C = state.capacity
    fit = _rows.round_up(need, state.step)
    if need > C or C > fit + state.step:
        state = _resize(state, max(fit, need))
    return state


def _check_kv(state, k, v):
    _rows.check_kv("k", k, "v", v)
    B = state.batch_size
    check(k.shape[0] == B, "k batch size", B, k.shape[0])
    check(v.shape[0] == B, "v batch size", B, v.shape[0])
    check(k.shape[2] == v.shape[2], "v tokens (shape[2])", k.shape[2], v.shape[2])
    check(k.shape[2] >= 1, "k tokens (shape[2])", ">= 1", k.shape[2])
    if state.keys is not None:
        want = (state.keys.shape[1], state.keys.shape[3], state.values.shape[3], state.keys.dtype)
        got = (k.shape[1], k.shape[3], v.shape[3], k.dtype)
        check(got == want, "k, v (heads, key dim, value dim, dtype)", want, got)


@ops.append.register(CompressedState)
def append_compressed(state, k, v):
    """Mark, compact, then write ``N`` new tokens after each row's held columns."""
    _check_kv(state, k, v)
    B, N = state.batch_size, k.shape[2]
    if B == 0:
        return state
    if state.keys is None:
        state = _start(state, k, v)
    state = settle(state, N)
    if state.scored:
        state = _rotate(state, N)
    write = column_writer(state.held, N, slice_write=False)
    at = mx.array([[h + i for i in range(N)] for h in state.held], dtype=mx.int32)
    new_pos = mx.array([[n + i for i in range(N)] for n in state.lengths], dtype=mx.int32)
    lengths = tuple(n + N for n in state.lengths)
    return derived(
        state,
        keys=write(state.keys, k),
        values=write(state.values, v),
        pos=mx.put_along_axis(state.pos, at, new_pos, axis=1),
        lengths=lengths,
        held=tuple(h + N for h in state.held),
        kept=tuple(c + N for c in state.kept),
        floor=tuple(max(f, n - state.margin) for f, n in zip(state.floor, lengths)),
    )


@ops.update_and_read.register(CompressedState)
def update_and_read_compressed(state, k, v, plans=None):
    new = append_compressed(state, k, v)
    return new, new.keys, new.values


# --- the read ---------------------------------------------------------------------------


def read_mask(state, n):
    """Bool ``[B, 1, n, C]``: the last ``n`` positions' view (``pos <= p < dropped``)."""
    return _view(state.pos, state.dropped, mx.array(state.lengths, dtype=mx.int32), n)


def _view(pos, dropped, lengths, n):
    """``read_mask`` on arrays: ``lengths`` int32 ``[B]``, after the append of ``n``."""
    p = (lengths[:, None] - n + mx.arange(n, dtype=mx.int32)[None, :])[:, None, :, None]
    return (pos[:, None, None, :] <= p) & (dropped[:, None, None, :] > p)


def read(state, q, *, scale, weights=True, mask=None):
    """Attention of the last ``N`` appended positions' queries ``q`` ``[B, Hq, N, D]``
    over exactly the columns each may see. Returns ``(out, weights)``; ``weights``
    ``[B, N, C]`` (float32, summed over heads) when asked and the policy scores,
    else ``None`` (then the read is the fused SDPA)."""
    B, Hq, N, D = q.shape
    keys, values = state.keys, state.values
    mask = read_mask(state, N) if mask is None else mask
    if not (state.scored and weights):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask), None
    Hk, C = keys.shape[1], keys.shape[2]
    rep = Hq // Hk
    qg = q.reshape(B, Hk, rep * N, D).astype(mx.float32)
    s = (qg * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)  # [B, Hk, rep*N, C]
    s = s.reshape(B, Hk, rep, N, C)
    s = mx.where(mask[:, :, None], s, mx.array(-float("inf"), mx.float32))
    w = mx.softmax(s, axis=-1)
    out = (w.reshape(B, Hk, rep * N, C) @ values.astype(mx.float32)).reshape(B, Hq, N, -1)
    return out.astype(q.dtype), w.sum(axis=(1, 2))


def scored(state, weights):
    """``state`` with the attention ``weights`` ``[B, N, C]`` of its last ``N``
    positions' queries added to its scores, as the policy takes them."""
    if not state.scored:
        return state
    B, N, C = weights.shape
    R = state.margin
    if state.policy == "snapkv":
        if N <= state.observe:  # decode steps and verify blocks: not a prompt
            return state
        # the block's last ``observe`` queries rank every column anew (the prompt's
        # end, its question, decides); nothing before the block's end is given back
        return derived(state, score=_ranked(state, weights), floor=tuple(state.lengths))
    score, recent = _taken(
        state.score, state.recent, weights, mx.array(state.lengths, dtype=mx.int32), R
    )
    return derived(state, score=score, recent=recent)


def _taken(score, recent, weights, lengths, R):
    """``(score, recent)`` with the weights ``[B, N, C]`` of the last ``N`` queries
    (``lengths`` int32 ``[B]``, after their append) added: a query among the last
    ``R`` positions into its slot (``position % R``), an older one into ``score``."""
    N = weights.shape[1]
    # ``where``, never a product or a matmul with 0/1: a rejected query's NaN
    # weights (a poisoned draft) must not reach any other slot (0 * NaN)
    if N > R:  # the block's first ``N - R`` queries fold at once
        old = mx.split(weights, [N - R], axis=1)[0]
        score = score + old.sum(axis=1)
    # slot s holds the query at L - 1 - d, d = (L - 1 - s) mod R: the block's query N - 1 - d
    d = (lengths[:, None] - 1 - mx.arange(R, dtype=mx.int32)[None, :]) % R  # [B, R]
    takes = (d < N)[:, :, None]
    idx = mx.maximum(N - 1 - d, 0)
    mine = mx.take_along_axis(weights, idx[:, :, None], axis=1)
    return score, mx.where(takes, recent + mine, recent)


def _ranked(state, weights):
    """``snapkv``'s scores from a prompt chunk's weights ``[B, N, C]``: its last
    ``observe`` queries', max-pooled over kept neighbours (``_pool``)."""
    N = weights.shape[1]
    zero = mx.array(0.0, mx.float32)
    tail = mx.split(weights, [N - state.observe], axis=1)[1]
    tail = mx.where(mx.isnan(tail), zero, tail)
    return _pool(state, tail).sum(axis=1)


def _rotate(state, n):
    """Before ``n`` tokens are appended: fold into ``score`` the recent slots whose
    queries fall out of the last ``margin`` positions, and empty them (the new
    positions' slots start empty, whether or not their queries are scored)."""
    R = state.margin
    if not any(t0 > 0 and t0 + n > R for t0 in state.lengths):
        return state
    score, recent = _rotated(
        state.score, state.recent, mx.array(state.lengths, dtype=mx.int32), n, R
    )
    return derived(state, score=score, recent=recent)


def _rotated(score, recent, lengths, n, R):
    """``_rotate`` on arrays (``lengths`` int32 ``[B]``, before the append)."""
    # slot s holds the query at t0 - R + d, d = (s - t0) mod R; it leaves if that
    # position exists and is older than the last R after the append
    d = (mx.arange(R, dtype=mx.int32)[None, :] - lengths[:, None]) % R
    out = ((d < n) & (d >= R - lengths[:, None]))[:, :, None]
    zero = mx.array(0.0, mx.float32)
    return score + mx.where(out, recent, zero).sum(axis=1), mx.where(out, zero, recent)


def _pool(state, w):
    """Max-pool ``[B, N, C]`` over ``POOL`` neighbouring kept columns (in position
    order, zero-padded): the kept columns are gathered to the front, pooled and put
    back, so marked columns held for a rollback never count as neighbours."""
    half = POOL // 2
    B, N, C = w.shape
    cols = _cols(C)
    live = (state.pos < LIVE) & (state.dropped == LIVE)
    order = mx.argsort(mx.where(live, cols, cols + C), axis=-1)  # kept first, in order
    back = mx.argsort(order, axis=-1)
    front = mx.take_along_axis(w, order[:, None, :], axis=2)
    front = mx.where(mx.take_along_axis(live, order, axis=1)[:, None, :], front, 0.0)
    pad = mx.zeros((B, N, half), w.dtype)
    wide = mx.concatenate([pad, front, pad], axis=-1)
    out = front
    for s in range(POOL):
        out = mx.maximum(out, wide[:, :, s : s + C])
    out = mx.take_along_axis(out, back[:, None, :], axis=2)
    return mx.where(live[:, None, :], out, 0.0)


def attend_and_score(state, q, *, scale, n):
    """``(out, new_state)``: the read of the last ``n`` positions and their scores added."""
    check(q.shape[2] == n, "q queries (shape[2])", n, q.shape[2])
    wanted = state.policy == "h2o" or (state.policy == "snapkv" and n > state.observe)
    out, w = read(state, q, scale=scale, weights=wanted)
    return out, (state if w is None else scored(state, w))


@ops.attend.register(CompressedState)
def attend_compressed(state, q, *, scale: float, memo=None, window=None):
    """The read of the last ``q.shape[2]`` positions (no scores added: ``attend_and_score``)."""
    check(window is None, "window", "None (compressed rows hold full-attention layers)", window)
    check(state.keys is not None, "state", "a record holding tokens", "an empty record")
    N = q.shape[2]
    check(all(n >= N for n in state.lengths), "q queries (shape[2])", "<= every row's length", N)
    return read(state, q, scale=scale)[0]


@ops.next_mask.register(CompressedState)
def next_mask_compressed(state, n, *, memo=None, window=None, array=False):
    """No mask: the bridge routes every compressed read to ``read``, which builds
    each layer's own (scored policies evict per layer). ``None`` or ``"causal"``
    stand in for the model's shared mask, which the routed read ignores."""
    check(window is None, "window", "None (compressed rows hold full-attention layers)", window)
    return (None if n == 1 else "causal"), None


@ops.positions.register(CompressedState)
def positions_compressed(state):
    if len(set(state.lengths)) <= 1:
        return None
    return mx.array(state.lengths, dtype=mx.int32)


# --- reading the kept columns -----------------------------------------------------------


def kept_columns(state):
    """Per row, the columns a next query sees, in position order (host ints)."""
    if state.keys is None:
        return [[] for _ in state.lengths]
    pos, dropped = np.array(state.pos), np.array(state.dropped)
    return [
        [int(c) for c in np.nonzero((pos[b] < LIVE) & (dropped[b] == LIVE))[0]]
        for b in range(state.batch_size)
    ]


def kept_positions(state):
    """Per row, the positions it keeps, ascending (host ints)."""
    if state.keys is None:
        return [[] for _ in state.lengths]
    pos = np.array(state.pos)
    return [[int(pos[b, c]) for c in cols] for b, cols in enumerate(kept_columns(state))]


@ops.fetch.register(CompressedState)
def fetch_compressed(state):
    """The kept columns of every row in position order, ``[B, H, max(kept), D]``,
    shorter rows left-padded with zeros."""
    B = state.batch_size
    if state.keys is None:
        return None, None
    W = max(state.kept, default=0)
    C = state.capacity
    cols = _cols(C)
    live = (state.pos < LIVE) & (state.dropped == LIVE)
    src = mx.argsort(mx.where(live, cols + C, cols), axis=-1)[:, C - W :]
    lead = mx.array([[c >= W - k for c in range(W)] for k in state.kept], dtype=mx.bool_)
    if B == 0:
        lead = mx.zeros((0, W), mx.bool_)
    idx = src[:, None, :, None]
    out = []
    for p in (state.keys, state.values):
        g = mx.take_along_axis(p, idx, axis=2)
        out.append(mx.where(lead[:, None, :, None], g, mx.zeros((), p.dtype)))
    return tuple(out)


# --- trim, checkpoints, rollback --------------------------------------------------------


def _back_to(state, target, arg):
    """Rows back to ``target`` tokens: the newest columns dropped, the marks made
    at or after ``target`` undone, the dropped queries' scores subtracted."""
    for b, (t, L, f) in enumerate(zip(target, state.lengths, state.floor)):
        if not f <= t <= L:
            raise bad(
                f"{arg} for row {b}",
                f"in [{f}, {L}] (the row has seen {L} tokens and can give back "
                f"{L - f}: margin {state.margin})",
                t,
            )
    if target == state.lengths:
        return state
    held = tuple(h - (L - t) for h, L, t in zip(state.held, state.lengths, target))
    log = tuple(tuple((s, c) for s, c in e if s < t) for e, t in zip(state.evictions, target))
    kept = tuple(h - sum(c for _, c in e) for h, e in zip(held, log))
    if state.keys is None:
        return derived(state, lengths=target, held=held, kept=kept, evictions=log)
    t = mx.array(target, dtype=mx.int32)[:, None]
    planes = _planes(state)
    planes["dropped"] = mx.where(
        (planes["dropped"] >= t) & (planes["dropped"] < LIVE), LIVE, planes["dropped"]
    )
    if state.scored:
        R = state.margin
        stay = np.ones((state.batch_size, R, 1), np.float32)
        for b, (tb, L) in enumerate(zip(target, state.lengths)):
            for q in range(tb, L):
                stay[b, q % R] = 0
        planes["recent"] = mx.where(mx.array(stay.astype(bool)), planes["recent"], 0.0)
    return derived(
        state, lengths=target, held=held, kept=kept, evictions=log, **_hide(state, held, **planes)
    )


@ops.trim.register(CompressedState)
def trim_compressed(state, n):
    n = per_row(n, state.batch_size, "n")
    return _back_to(state, tuple(L - k for L, k in zip(state.lengths, n)), "lengths - n")


@ops.checkpoint.register(CompressedState)
def checkpoint_compressed(state):
    return Checkpoint(state.lengths, state.left_pad, row_ids=state.row_ids)


@ops.rollback.register(CompressedState)
def rollback_compressed(state, checkpoint, keep=0):
    target = _rows.checkpoint_target(state, checkpoint, keep)
    return _back_to(state, target, "checkpoint + keep")


@ops.anchor.register(CompressedState)
def anchor_compressed(state):
    return checkpoint_compressed(state)


@ops.commit.register(CompressedState)
def commit_compressed(state, anchor, keep=0):
    return rollback_compressed(state, anchor, keep)


# --- rows: filter, extract, merge -------------------------------------------------------

_PER_ROW = ("lengths", "held", "kept", "floor", "budget", "evictions")


def _take_rows(state, rows):
    out: dict = {f: tuple(getattr(state, f)[r] for r in rows) for f in _PER_ROW}
    if state.keys is not None:
        idx = mx.array(rows, dtype=mx.int32)
        for name, p in _planes(state).items():
            out[name] = None if p is None else p[idx]
    return out


@ops.filter_rows.register(CompressedState)
def filter_rows_compressed(state, rows):
    rows = row_list(rows, state.batch_size)
    ids = distinct_row_ids(tuple(state.row_ids[r] for r in rows))
    return derived(state, row_ids=ids, **_take_rows(state, rows))


@ops.extract_row.register(CompressedState)
def extract_row_compressed(state, row):
    row = row_index(row, state.batch_size)
    fields = _take_rows(state, [row])
    if state.keys is not None:  # compact: its own buffers, capacity to what it holds
        fields = {
            k: (mx.contiguous(v) if isinstance(v, mx.array) else v) for k, v in fields.items()
        }
    return derived(state, row_ids=(state.row_ids[row],), **fields)


# A fork copies the row (``shared.fork_copied``): marks and scores are per row, so a
# prefix record nobody writes cannot hold them.
fork.register(CompressedState, fork_copied)

_STATIC = ("policy", "sinks", "window", "margin", "observe")


@ops.merge_same_kind.register(CompressedState)
def merge_rows_compressed(first, states):
    want = tuple(getattr(first, f) for f in _STATIC)
    for i, s in enumerate(states):
        got = tuple(getattr(s, f) for f in _STATIC)
        check(got == want, f"states[{i}] ({', '.join(_STATIC)})", want, got)
    full = [s for s in states if s.keys is not None]
    fields: dict = {f: sum((getattr(s, f) for s in states), ()) for f in _PER_ROW}
    ids = distinct_row_ids(sum((s.row_ids for s in states), ()))
    if not full:
        return derived(first, row_ids=ids, **fields)
    geo = {(s.keys.shape[1], s.keys.shape[3], s.values.shape[3], s.keys.dtype) for s in full}
    check(
        len(geo) == 1,
        "states (heads, key dim, value dim, dtype)",
        "one geometry",
        sorted(map(str, geo)),
    )
    C = max(s.capacity for s in full)
    proto = full[0]
    parts = []
    for s in states:
        if s.keys is None:
            shape = (s.batch_size,) + tuple(proto.keys.shape[1:])
            vshape = (s.batch_size,) + tuple(proto.values.shape[1:])
            s = _start(s, mx.zeros(shape, proto.keys.dtype), mx.zeros(vshape, proto.values.dtype))
        parts.append(_resize(s, C))
    for name in _planes(first):
        ps = [getattr(s, name) for s in parts]
        fields[name] = None if ps[0] is None else mx.concatenate(ps, axis=0)
    return derived(first, row_ids=ids, step=first.step, **fields)


# --- the compile boundary (kvstate.compiled) ------------------------------------------
#
# Every host field an append changes (lengths, held, kept, floor, evictions) follows
# from host ints alone: how many columns a row marks is its excess over its budget;
# which ones is decided on the device. So a compiled step gets (lengths, held,
# excess) as int32 arrays and marks, rotates the recent slots, writes and reads
# with fixed shapes; ``advanced`` gives the host fields. The one host-side move is
# ``prepare``'s: when a row would pass the capacity, the marked columns no rollback
# reaches are compacted away (one gather per plane) and the capacity grows or
# shrinks to its bucket, outside the compiled call. Inside it, marked columns just
# stay masked, so the step holds no gather.


def _prompt_chunk(state, n) -> bool:
    """A block ``snapkv`` ranks the row with (and marks nothing before)."""
    return state.policy == "snapkv" and n > state.observe


@compiled.host_positions.register(CompressedState)
def host_positions_compressed(state):
    return (state.lengths, state.held, _excess(state))


def _fit(state, n):
    """The capacity a step of ``n`` needs, or ``None`` when the present one serves."""
    need = max((h + n for h in state.held), default=0)
    C, fit = state.capacity, _rows.round_up(need, state.step)
    return None if need <= C <= fit + state.step else max(fit, need)


@compiled.with_capacity.register(CompressedState)
def with_capacity_compressed(state, capacity: int):
    capacity = compiled.check_capacity(state, capacity)
    check(capacity >= state.width, "capacity", f">= {state.width} (columns a row holds)", capacity)
    return _resize(state, capacity)


@compiled.prepare.register(CompressedState)
def prepare_compressed(state, n: int = 1):
    n = compiled.check_room(state, n)
    if _fit(state, n) is None:
        return state
    state = _compact(state, n, always=True)
    C = _fit(state, n)
    return state if C is None else _resize(state, C)


@compiled.room.register(CompressedState)
def room_compressed(state) -> int:
    if state.keys is None or _fit(state, 1) is not None:
        return 0
    return state.capacity - state.width


@compiled.advanced.register(CompressedState)
def advanced_compressed(state, n: int = 1) -> dict:
    excess = (0,) * state.batch_size if _prompt_chunk(state, n) else _excess(state)
    lengths = tuple(L + n for L in state.lengths)
    floor = (
        lengths
        if _prompt_chunk(state, n)
        else tuple(max(f, L - state.margin) for f, L in zip(state.floor, lengths))
    )
    return {
        "lengths": lengths,
        "held": tuple(h + n for h in state.held),
        "kept": tuple(k - e + n for k, e in zip(state.kept, excess)),
        "floor": floor,
        "evictions": _marked_log(state, excess),
    }


_PLANES = ("keys", "values", "pos", "dropped", "score", "recent")


def _named(view):
    return dict(zip(_PLANES, view.planes))


@compiled.traced_offset.register(CompressedState)
def traced_offset_compressed(proto, view: compiled.Traced, ctx: compiled.TraceContext):
    return view.positions[0]


@compiled.traced_update.register(CompressedState)
def traced_update_compressed(proto, view: compiled.Traced, k, v, ctx: compiled.TraceContext):
    """Mark, rotate the recent slots, write ``N`` tokens after each row's held columns."""
    p = _named(view)
    lengths, held, excess = view.positions
    N = k.shape[2]
    check(
        k.shape[1:] == p["keys"].shape[1:2] + (N,) + p["keys"].shape[3:],
        "k (heads, key dim)",
        p["keys"].shape[1::2],
        k.shape[1::2],
    )
    t = lengths[:, None]
    if not _prompt_chunk(proto, N):
        total = p["score"] + p["recent"].sum(axis=1) if proto.scored else None
        p["dropped"] = _marks_of(
            p["pos"],
            p["dropped"],
            total,
            t,
            excess[:, None],
            sinks=proto.sinks,
            window=proto.window,
        )
    if proto.scored:
        p["score"], p["recent"] = _rotated(p["score"], p["recent"], lengths, N, proto.margin)
    steps = mx.arange(N, dtype=mx.int32)[None, :]
    at = held[:, None] + steps  # [B, N]: in range (prepare made room)
    idx = at[:, None, :, None]
    p["keys"] = mx.put_along_axis(p["keys"], idx, k, axis=2)
    p["values"] = mx.put_along_axis(p["values"], idx, v, axis=2)
    p["pos"] = mx.put_along_axis(p["pos"], at, t + steps, axis=1)
    planes = tuple(p[name] for name in _PLANES[: len(view.planes)])
    after = (lengths + N, held + N, excess)
    return compiled.Traced(proto, planes, after, view.same_end), p["keys"], p["values"]


@compiled.traced_mask.register(CompressedState)
def traced_mask_compressed(proto, view: compiled.Traced, n: int, window, ctx):
    """What ``next_mask`` answers: the routed read (``traced_read``) builds its own."""
    check(window is None, "window", "None (compressed rows hold full-attention layers)", window)
    return None if n == 1 else "causal"


@compiled.traced_read.register(CompressedState)
def traced_read_compressed(proto, view: compiled.Traced, q, scale, ctx):
    """``attend_and_score`` on the view: the read over exactly the columns each
    query may see, and the scores its policy takes."""
    p = _named(view)
    N = q.shape[2]
    lengths = view.positions[0]
    mask = ctx.shared(
        ("compressed-view", N),
        (p["pos"], p["dropped"], lengths),
        lambda: _view(p["pos"], p["dropped"], lengths, N),
    )
    wanted = proto.policy == "h2o" or _prompt_chunk(proto, N)
    like = derived(proto, keys=p["keys"], values=p["values"])
    out, w = read(like, q, scale=scale, weights=wanted, mask=mask)
    if w is None:
        return out, view
    if proto.policy == "snapkv":
        like = derived(like, pos=p["pos"], dropped=p["dropped"])
        p["score"] = _ranked(like, w)
    else:
        p["score"], p["recent"] = _taken(p["score"], p["recent"], w, lengths, proto.margin)
    planes = tuple(p[name] for name in _PLANES[: len(view.planes)])
    return out, compiled.Traced(proto, planes, view.positions, view.same_end)


# --- invariants -------------------------------------------------------------------------


@validate.register(CompressedState)
def validate_compressed(state):
    B = len(state.lengths)
    if not isinstance(state.policy, str) or state.policy not in POLICIES:
        raise bad("policy", f"one of {POLICIES}", repr(state.policy))
    for name in ("sinks", "window", "margin", "observe", "step"):
        value = as_int(getattr(state, name), name)
        check(
            value >= (0 if name == "sinks" else 1),
            name,
            ">= 1" if name != "sinks" else ">= 0",
            value,
        )
    for name in _PER_ROW[1:]:
        check(
            len(getattr(state, name)) == B,
            name,
            f"{B} values (one per row)",
            len(getattr(state, name)),
        )
    check(len(state.row_ids) == B, "row_ids", f"{B} values", len(state.row_ids))
    for b in range(B):
        L, h, k, f, n = (getattr(state, x)[b] for x in _PER_ROW[:5])
        check(
            n >= state.sinks + state.window,
            f"budget[{b}]",
            f">= sinks + window = {state.sinks + state.window}",
            n,
        )
        check(
            0 <= k <= h <= L,
            f"row {b} (kept, held, lengths)",
            "0 <= kept <= held <= lengths",
            (k, h, L),
        )
        check(0 <= f <= L, f"floor[{b}]", f"in [0, {L}]", f)
        marks = sum(c for _, c in state.evictions[b])
        check(marks == h - k, f"evictions[{b}]", f"{h - k} marked columns (held - kept)", marks)
    keys = state.keys
    if keys is None:
        check(not any(state.held), "keys", "planes (rows hold columns)", None)
        return state
    C = keys.shape[2]
    check(max(state.held, default=0) <= C, "held", f"<= capacity {C}", max(state.held, default=0))
    for name, shape in (("values", (B, None, C, None)), ("pos", (B, C)), ("dropped", (B, C))):
        p = getattr(state, name)
        check(
            p is not None
            and len(p.shape) == len(shape)
            and all(s is None or s == a for s, a in zip(shape, p.shape)),
            name,
            f"shape {shape}",
            None if p is None else p.shape,
        )
    check(keys.shape[0] == B, "keys batch size", B, keys.shape[0])
    if state.scored:
        check(
            state.score is not None and state.score.shape == (B, C),
            "score",
            (B, C),
            None if state.score is None else state.score.shape,
        )
        R = state.margin
        check(
            state.recent is not None and state.recent.shape == (B, R, C),
            "recent",
            (B, R, C),
            None if state.recent is None else state.recent.shape,
        )
    return state


@clear_hidden.register(CompressedState)
def _clear_compressed(state):
    return state  # built empty; every function writes hidden columns as zeros/LIVE
