"""Argument normalisation: user values to host ints, refused by name otherwise.

MLX's dynamic slices do not bounds-check, so every index and count a user
passes is turned into Python ints and checked here, on the host, before any
MLX call. Refusals are ``KVStateError``s built by ``errors.bad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from ..errors import bad
from .invariants import MAX_ROWS, ROW_BYTES

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

# One int for every row, or one int per row: a list, a tuple or a 1-D integer
# np.ndarray / mx.array (``per_row`` normalises it).
PerRowInts = Union[int, Sequence[int], "np.ndarray", "mx.array"]


def as_int(value, arg: str) -> int:
    """A Python int (bools refused), else KVStateError."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return int(value)
        except ImportError:  # pragma: no cover
            pass
        raise bad(arg, "an int", f"{type(value).__name__} {value!r}")
    return value


def row_count(value, arg: str, *, existing: int = 0) -> int:
    """``value`` new rows for a record that already has ``existing`` rows: an int in
    ``[0, MAX_ROWS - existing]``.

    Every constructor that takes a batch size and ``fork`` (``existing``: the rows
    forked from) check their count here, before anything is built, so a count
    too large to hold is refused by name, with the host bytes it would need,
    instead of exhausting memory or running for hours.
    """
    n = as_int(value, arg)
    if n < 0:
        raise bad(arg, ">= 0", n)
    if existing + n > MAX_ROWS:
        room = f"at most {MAX_ROWS - existing} (MAX_ROWS = {MAX_ROWS} rows a record may have"
        room += f", the record holds {existing})" if existing else ")"
        need = f"{existing + n} rows: at least {(existing + n) * ROW_BYTES:,} bytes of host memory"
        raise bad(arg, room, f"{n} ({need} for their bookkeeping alone)")
    return n


def _int_vector(
    value, arg: str, expected: str = "an int or one int per row (a list, or a 1-D integer array)"
):
    """A 1-D integer ``np.ndarray`` / ``mx.array`` as a list of ints, else ``value``.

    Per-row counts often come from the device (accepted draft tokens, a
    ``sum`` over a verify mask), so one-per-row arrays are taken as readily
    as lists; anything but a 1-D integer array is refused by name.
    """
    import numpy as np

    if isinstance(value, np.ndarray):
        kind, ndim, shape = value.dtype.kind, value.ndim, list(value.shape)
    else:
        import mlx.core as mx

        if not isinstance(value, mx.array):
            return value
        dt = value.dtype
        kind = "b" if dt == mx.bool_ else ("i" if mx.issubdtype(dt, mx.integer) else "f")
        ndim, shape = value.ndim, list(value.shape)
    if ndim == 0 and kind in "iu":
        return value.item()
    if ndim != 1 or kind not in "iu":
        raise bad(arg, expected, f"{type(value).__name__} {value.dtype} {shape}")
    return value.tolist()


def per_row(value, batch_size: int, arg: str, *, low: int = 0) -> tuple:
    """Normalise an int-or-sequence argument to one int per row, each >= low.

    ``value``: an int (every row), or one int per row as a list, a tuple or
    a 1-D integer ``np.ndarray`` / ``mx.array``.
    """
    if not isinstance(value, (int, list, tuple)):
        value = _int_vector(value, arg)
    if isinstance(value, (list, tuple)):
        if len(value) != batch_size:
            raise bad(arg, f"{batch_size} values (one per row)", f"{len(value)} values")
        out = tuple(as_int(v, f"{arg}[{i}]") for i, v in enumerate(value))
    else:
        out = (as_int(value, arg),) * batch_size
    for i, v in enumerate(out):
        if v < low:
            raise bad(f"{arg}[{i}]" if isinstance(value, (list, tuple)) else arg, f">= {low}", v)
    return out


def row_index(row, batch_size: int, arg: str = "row") -> int:
    """One row index in ``[0, batch_size)`` (checked here: MLX does not bounds-check)."""
    row = as_int(row, arg)
    if not 0 <= row < batch_size:
        raise bad(arg, f"a row index in [0, {batch_size})", row)
    return row


def row_list(rows, batch_size: int, arg: str = "rows") -> list:
    """Row indices for ``filter_rows``: a list, tuple or 1-D integer ``np.ndarray``
    / ``mx.array``, each index in ``[0, batch_size)``; none gives an empty batch."""
    if not isinstance(rows, (list, tuple)):
        rows = _int_vector(rows, arg, "row indices (a list, or a 1-D integer array)")
        if not isinstance(rows, list):
            raise bad(arg, "a list of row indices", type(rows).__name__)
    return [row_index(r, batch_size, f"{arg}[{i}]") for i, r in enumerate(rows)]


def check_scale(scale) -> None:
    """``attend``'s ``scale``: a real number (ints and numpy floats too; not a bool)."""
    import numbers

    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise bad(
            "scale", "a real number (e.g. head_dim ** -0.5)", f"{type(scale).__name__} {scale!r}"
        )
