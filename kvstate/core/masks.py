"""Attention masks: keys, a memo that builds each mask once, and leases.

A forward pass creates one ``MaskMemo`` and hands it to every layer; the
first layer that needs a mask builds it, the others lease the same array.
Each mask *family* (full rows, windowed rows, encoder window, ring block)
keeps one slot, so a sliding layer and a full layer never evict each
other's mask, and a new key in a family replaces the old one.

Masks are bool (True = may attend), or the string ``"causal"`` (the fused
kernel's bottom-right causal mode), or ``None`` (no mask at all).
"""

from __future__ import annotations

from typing import Callable, Optional

import attrs
import mlx.core as mx

from ..errors import LeaseError, bad
from .args import as_int
from .handles import fresh


@attrs.frozen(eq=False)
class MaskKey:
    """What a mask depends on.

    Attributes:
        family: the memo slot this mask lives in.
        params: hashable host values (ints, tuples of ints, strings).
        source: an optional caller array the mask is derived from, compared
            by identity (the key holds it, so its ``id`` cannot be reused).
    """

    family: str
    params: tuple = ()
    source: object = None

    def _ident(self):
        return (self.family, self.params, id(self.source))

    def __eq__(self, other):
        if not isinstance(other, MaskKey):
            return NotImplemented
        return (
            self.family == other.family
            and self.params == other.params
            and self.source is other.source
        )

    def __hash__(self):
        return hash(self._ident())


class _Entry:
    """One built mask: its holders are the leases and, while it sits in a
    memo's slot, the memo. When the last holder lets go the entry drops the
    mask, so nothing in kvstate keeps it alive (a caller's graph still may)."""

    __slots__ = ("key", "mask", "holds", "slotted")

    def __init__(self, key, mask):
        self.key, self.mask, self.holds, self.slotted = key, mask, 0, True

    def unslot(self) -> None:
        self.slotted = False
        if not self.holds:
            self.mask = None

    def drop(self) -> None:
        self.holds -= 1
        if not self.holds and not self.slotted:
            self.mask = None


class Releasable:
    """A hold released exactly once (``release``); as a context manager it
    releases on exit unless released already."""

    __slots__ = ()

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.released:
            self.release()
        return False


class MaskLease(Releasable):
    """A hold on one memoized mask; release it exactly once (or use ``with``)."""

    __slots__ = ("_memo", "_entry", "_key", "_released")

    def __init__(self, memo: "MaskMemo", entry: _Entry) -> None:
        self._memo, self._entry, self._key, self._released = memo, entry, entry.key, False
        entry.holds += 1
        memo._live += 1

    @property
    def key(self) -> MaskKey:
        return self._key

    @property
    def mask(self):
        """``None``, ``"causal"`` or a bool ``mx.array`` (a handle of the caller's
        own: writing into it leaves the memoized mask as it is)."""
        if self._released:
            raise bad("lease", "an unreleased lease", "a released lease", LeaseError)
        return fresh(self._entry.mask)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            raise bad("lease", "an unreleased lease", "a lease released already", LeaseError)
        self._released = True
        entry, memo = self._entry, self._memo
        self._entry = self._memo = None  # type: ignore[assignment]  # a released lease holds nothing
        memo._live -= 1
        entry.drop()


class MaskMemo:
    """Builds each mask once and shares it through leases.

    Create one per forward pass (or per compiled step) and pass it to every
    layer; never share one through a module global.
    """

    def __init__(self) -> None:
        self._slots: dict = {}
        self._live = 0
        self.builds = 0

    @property
    def live(self) -> int:
        """Leases handed out and not yet released."""
        return self._live

    def mask_for(self, key: MaskKey, build: Callable[[], object]) -> MaskLease:
        """Lease the mask for ``key``; ``build()`` runs only if the slot holds another key."""
        if not isinstance(key, MaskKey):
            raise bad("key", "a MaskKey", type(key).__name__)
        entry = self._slots.get(key.family)
        if entry is None or entry.key != key:
            new = _Entry(key, build())
            self.builds += 1
            self._slots[key.family] = new
            if entry is not None:
                entry.unslot()
            entry = new
        return MaskLease(self, entry)

    def clear(self) -> None:
        """Drop the memo's own holds; masks already leased stay valid until released.

        A mask no lease holds is dropped now; one still leased is dropped by
        its last ``release``.
        """
        for entry in self._slots.values():
            entry.unslot()
        self._slots.clear()


def check_memo(memo, arg: str = "memo") -> MaskMemo:
    if not isinstance(memo, MaskMemo):
        raise bad(arg, "a MaskMemo", type(memo).__name__)
    return memo


def lease(memo: Optional[MaskMemo], key: MaskKey, build: Callable[[], object]) -> MaskLease:
    """Lease from ``memo``, or from a throwaway memo when none is given."""
    return (MaskMemo() if memo is None else check_memo(memo)).mask_for(key, build)


def _count(value, arg: str, low: int) -> int:
    value = as_int(value, arg)  # (numpy ints too, as everywhere else)
    if value < low:
        raise bad(arg, f"an int >= {low}", value)
    return value


# --- builders -------------------------------------------------------------


def rows_mask(n: int, left_pad, ends, width: int, window=None) -> mx.array:
    """The per-row batched mask ``[B, 1, n, width]``.

    Query ``i`` of row ``b`` stands at column ``ends[b] - n + i`` and may
    attend column ``j`` iff ``left_pad[b] <= j <= ends[b] - n + i`` (and,
    with a window ``w``, ``ends[b] - n + i - j < w``). ``left_pad`` and
    ``ends`` may be host sequences or int32 arrays ``[B]`` (inside compiled
    code); ``window`` likewise an int or a scalar array.
    """
    if not (
        isinstance(left_pad, mx.array) or isinstance(ends, mx.array) or isinstance(window, mx.array)
    ):
        # Host ints: each query row's first and last visible column computed
        # here (flat, row-major), so the graph is one arange and three
        # comparisons (built once per decode step; fewer kernels and less
        # Python than the general graph below, which compiled code needs).
        # Without a window the first visible column is one per row.
        B = len(ends)
        cols = mx.arange(width, dtype=mx.int32)
        if n == 1 and window is None and min(ends, default=0) == width:
            # One query per row and every row ending at the last column (the
            # decode step of left-padded rows): only the padding is hidden.
            return cols >= mx.array(left_pad, dtype=mx.int32).reshape(B, 1, 1, 1)
        hi = mx.array([e - n + i for e in ends for i in range(n)], dtype=mx.int32)
        if window is None:
            lo = mx.array(left_pad, dtype=mx.int32).reshape(B, 1, 1, 1)
        else:
            lo = mx.array(
                [
                    max(lp, e - n + i - window + 1)
                    for lp, e in zip(left_pad, ends)
                    for i in range(n)
                ],
                dtype=mx.int32,
            ).reshape(B, 1, n, 1)
        return (cols >= lo) & (cols <= hi.reshape(B, 1, n, 1))
    lp = mx.array(left_pad, dtype=mx.int32) if not isinstance(left_pad, mx.array) else left_pad
    en = mx.array(ends, dtype=mx.int32) if not isinstance(ends, mx.array) else ends
    cols = mx.arange(width, dtype=mx.int32)[None, None, None, :]
    qpos = (en - n)[:, None, None, None] + mx.arange(n, dtype=mx.int32)[None, None, :, None]
    mask = (cols >= lp[:, None, None, None]) & (cols <= qpos)
    if window is not None:
        mask = mask & (qpos - cols < window)
    return mask


def rows_key(n: int, left_pad: tuple, ends: tuple, window=None) -> MaskKey:
    family = "rows" if window is None else "rows-window"
    return MaskKey(family, (n, tuple(left_pad), tuple(ends), window))


def encoder_window_mask(memo: MaskMemo, L: int, bidirectional: mx.array) -> MaskLease:
    """Lease of a ``[1, 1, L, L]`` bool mask: causal, OR'd with the overlay
    ``bidirectional[i] & bidirectional[j]`` (``bidirectional``: bool ``[L]``).

    The caller's ``bidirectional`` array is part of the key by identity.
    """
    check_memo(memo)
    L = _count(L, "L", 1)
    if not isinstance(bidirectional, mx.array):
        raise bad("bidirectional", "a bool mx.array [L]", type(bidirectional).__name__)
    if bidirectional.shape != (L,) or bidirectional.dtype != mx.bool_:
        raise bad(
            "bidirectional", f"bool [{L}]", f"{bidirectional.dtype} {list(bidirectional.shape)}"
        )

    def build():
        i = mx.arange(L)
        causal = i[:, None] >= i[None, :]
        both = bidirectional[:, None] & bidirectional[None, :]
        return (causal | both)[None, None]

    return memo.mask_for(MaskKey("encoder-window", (L,), bidirectional), build)


def rotating_block_mask(
    memo: MaskMemo, max_size: int, offset: int, n: int, stored: int
) -> MaskLease:
    """Lease of a ``[1, 1, 1, stored + n]`` bool mask for a block read of a ring.

    Of ``stored`` positions in temporal order, the first ``min(offset,
    stored)`` are valid and the newest ``max_size - 1`` of those are
    visible; then all ``n`` block positions are visible. (mlx-lm's ring keeps
    ``max_size - 1`` old positions when it takes a block, so that every block
    token sees at least ``max_size`` positions.)
    """
    check_memo(memo)
    max_size, offset = _count(max_size, "max_size", 1), _count(offset, "offset", 0)
    n, stored = _count(n, "n", 0), _count(stored, "stored", 0)

    def build():
        j = mx.arange(stored + n)
        valid = min(offset, stored)
        lo = max(0, valid - (max_size - 1))
        return (((j >= lo) & (j < valid)) | (j >= stored))[None, None, None]

    return memo.mask_for(MaskKey("rotating-block", (max_size, offset, n, stored)), build)
