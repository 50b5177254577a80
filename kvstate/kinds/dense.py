"""Dense full-attention rows: ``CacheState`` (layout pictured in ``kvstate.core.records``).

What every dense-layout kind shares (validation, growth, the column writer,
masks, moving rows) is in ``kvstate.kinds.rows``; this module holds what is
``CacheState``'s own: its constructors, its planes (keys and values as
given), the append hot path the bridge takes every decode step, and
``fetch``. ``attend`` is the rows' own (``_rows.attend_rows``: the fused SDPA).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from ..core import ops
from ..core.args import PerRowInts, as_int, per_row, row_count
from ..core.invariants import check_float, check_plane, validate
from ..core.records import CacheState, derived
from ..errors import bad, check
from . import rows as _rows

# --- the kind's hooks ---------------------------------------------------------


@_rows.geometry.register
def geometry_dense(state: CacheState):
    return _rows.kv_geometry(state.keys, state.values)


@_rows.to_planes.register
def to_planes_dense(state: CacheState, k, v):
    return (k, v)


@_rows.with_planes.register
def with_planes_dense(state: CacheState, planes, **changes):
    keys, values = planes if planes else (None, None)
    return derived(state, keys=keys, values=values, **changes)


@validate.register
def validate_dense(state: CacheState):
    """The padded-row checks, then planes ``[B, H, C, D]`` of one batch, head
    count, capacity and float dtype, every row ending inside ``C``."""
    B, ends = _rows.validate_rows(state)
    if ends is None:
        return state
    keys, values = state.keys, state.values
    assert keys is not None and values is not None  # validate_rows: ends are None without planes
    _, H, C, _ = check_plane("state.keys", keys, B)
    check_plane("state.values", values, B, C, H)
    check_float("state.keys", keys.dtype)
    if values.dtype != keys.dtype:
        raise bad("state.values dtype", f"{keys.dtype} as keys", values.dtype)
    _rows.check_ends(state, C)
    return state


# --- construction -------------------------------------------------------------


def empty(batch_size: int = 1, *, step: int = 256) -> CacheState:
    """An empty ``CacheState``: ``batch_size`` rows, no geometry until the first append.

    Args:
        batch_size: rows (``B``), at most ``kvstate.core.invariants.MAX_ROWS``.
        step: capacity grows in multiples of this.
    """
    batch_size = row_count(batch_size, "batch_size")
    step = as_int(step, "step")
    check(step >= 1, "step", ">= 1", step)
    return CacheState((0,) * batch_size, (0,) * batch_size, step)


def from_arrays(
    keys: mx.array,
    values: mx.array,
    *,
    lengths: PerRowInts | None = None,
    left_pad: PerRowInts | None = None,
    step: int = 256,
) -> CacheState:
    """Wrap existing ``[B, H, S, D]`` arrays; row ``b`` holds
    ``[left_pad[b], left_pad[b] + lengths[b])`` (defaults: no padding, full rows)."""
    _rows.check_kv("keys", keys, "values", values)
    B, _, S, _ = keys.shape
    check(B >= 1, "keys batch size", ">= 1", B)
    step = as_int(step, "step")
    check(step >= 1, "step", ">= 1", step)
    lp = per_row(0 if left_pad is None else left_pad, B, "left_pad")
    n = per_row([S - p for p in lp] if lengths is None else lengths, B, "lengths")
    for b in range(B):
        check(
            lp[b] + n[b] <= S,
            f"left_pad[{b}] + lengths[{b}]",
            f"<= {S} (stored columns)",
            lp[b] + n[b],
        )
    return CacheState(n, lp, step, keys=keys, values=values)


# --- append / fetch ---------------------------------------------------------------


@ops.append.register
def append_dense(state: CacheState, k, v):
    return _append(state, k, v, None)[0]


@ops.update_and_read.register
def update_and_read_dense(state: CacheState, k, v, plans: Optional[_rows.Plans] = None):
    """``append`` then ``fetch``: ``(new_state, keys, values)``, the new state's
    keys and values over its columns (what mlx-lm's ``update_and_fetch``
    returns; the bridge's dense layers answer with it).

    ``plans``: shared by the calls of one forward, so the host work of an
    append is done once per layout instead of once per layer.
    """
    state, width = _append(state, k, v, plans)
    keys: Any = state.keys
    values: Any = state.values
    if width == keys.shape[2]:
        return state, keys, values
    return state, keys[:, :, :width], values[:, :, :width]


def _append(state: CacheState, k, v, plans):
    """The decode hot path (every layer, every step): ``(new_state, its width)``.

    Anything that is not the hot path (an empty record, tokens that do not
    fit) takes the general path, which names what is wrong.
    """
    keys: Any = state.keys
    values: Any = state.values
    if keys is not None and _rows.fits(
        k, v, keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype
    ):
        plan = _rows.plan_for(state, k.shape[2], plans)
        return plan.apply(state, (keys, values), (k, v), with_planes_dense), plan.width
    state = _rows.append_rows(state, k, v)
    return state, state.width


@ops.fetch.register
def fetch_dense(state: CacheState):
    keys: Any = state.keys
    values: Any = state.values
    if keys is None:
        raise bad("state", "a state holding keys (append first)", "an empty state")
    width = state.width
    if width == keys.shape[2]:
        return keys, values
    return keys[:, :, :width], values[:, :, :width]  # (the short index parses faster)
