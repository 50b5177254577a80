"""Compact files: only the columns in use, and a batch's per-row data.

``kv.save`` writes each row of each layer as ``kv.extract_row`` gives it: the
tokens the row holds and nothing else (no padding, no stale columns, no
spare capacity), so a file holds the bytes of the tokens held plus its
header. ``kv.load`` merges the rows back (``kv.merge_rows``: rows left-padded
to a common end) and gives each layer its capacity in whole ``step``s, so
the next append writes in place instead of growing first::

    in memory (B = 2, capacity 256)        file              loaded (capacity 256)
    row 0:  . . k k k s s . . . . .        row 0: k k k      row 0:  . . k k k . . .
    row 1:  k k k k k . . . . . . .        row 1: k k k k k  row 1:  k k k k k . . .

What a model sees of every row (its columns, masks, positions) is unchanged;
the padding may differ (a checkpoint taken before the save does not apply
after the load). A ``kv.Batch`` saves its per-row data too: array fields as
tensors ``batch.<field>``, the others as JSON (``kv.Sampling`` by its
fields; ids and payloads must be JSON values).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import singledispatch
from typing import Any

import attrs
import mlx.core as mx

from ..batch import Batch, row_fields
from ..core import ops
from ..core.records import CacheState, QuantizedState, RotatingState, _Rows
from ..errors import KVStateError, bad, check
from ..sampling import Sampling

__all__ = ["compact_rows", "decode", "decode_batch", "encode", "encode_batch", "restore_rows"]

LAYOUT_KEY = "kvstate.layout"  # "rows": one entry per row of each layer (compact)
BATCH_KEY = "kvstate.batch"  # JSON: a Batch's host per-row fields


def encode(value: Any, tensors: dict, encode_record: Callable[..., Any], *, exact: bool) -> tuple:
    """``(entries, metadata)`` for a file of ``value`` (layer records or a ``kv.Batch``).

    ``encode_record(name, record, tensors)`` writes one record (``persist``'s
    encoder). ``exact``: write each layer as it is (whole capacity, byte-exact)
    instead of its rows' columns in use.
    """
    meta = {}
    if type(value) is Batch:
        meta[BATCH_KEY] = json.dumps(encode_batch(value, tensors), separators=(",", ":"))
        value = value.states
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad("states", "a list of records (one per layer) or a kv.Batch", type(value).__name__)
    if exact:
        return [encode_record(i, s, tensors) for i, s in enumerate(value)], meta
    meta[LAYOUT_KEY] = "rows"
    entries = []
    for i, s in enumerate(value):
        rows = compact_rows(s)
        entries.append(
            encode_record(i, s, tensors)
            if rows is None
            else [encode_record(f"{i}.{r}", row, tensors) for r, row in enumerate(rows)]
        )
    return entries, meta


def _decode_layer(i, entry, tensors, decode_record):
    if not isinstance(entry, list):
        return decode_record(i, entry, tensors)
    check(len(entry) >= 1, f"record {i}", "at least one row entry", "none")
    return restore_rows([decode_record(f"{i}.{r}", e, tensors) for r, e in enumerate(entry)])


def decode(
    entries: list, meta: dict, tensors: dict, decode_record: Callable[..., Any], used: set
) -> list | Batch:
    """What ``encode`` wrote: a list of records, or a ``kv.Batch``.

    ``decode_record(name, entry, tensors)`` reads one record (``persist``'s
    decoder); ``used`` collects the tensor names read. A malformed table
    raises ``KVStateError`` naming what is wrong."""
    rows = meta.get(LAYOUT_KEY)
    check(rows in (None, "rows"), LAYOUT_KEY, "'rows' or absent", rows)
    check(isinstance(entries, list), "kvstate.records", "a JSON list", type(entries).__name__)
    try:
        if rows:
            states = [_decode_layer(i, e, tensors, decode_record) for i, e in enumerate(entries)]
        else:
            states = [decode_record(i, e, tensors) for i, e in enumerate(entries)]
        if BATCH_KEY not in meta:
            return states
        host = json.loads(meta[BATCH_KEY])
        check(isinstance(host, dict), BATCH_KEY, "a JSON object", type(host).__name__)
        return decode_batch(states, host, tensors, used)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        if isinstance(e, KVStateError):
            raise
        raise bad(
            "kvstate.records", "a table that save wrote", f"{type(e).__name__}: {e}"
        ) from None


@singledispatch
def compact_rows(state: Any) -> list | None:
    """``state``'s rows as compact one-row records, or ``None``: write it as it is.

    Registered for the kinds whose ``extract_row`` copies exactly the tokens a
    row holds and whose ``merge_rows`` puts them back (dense, quantized, ring
    rows). Other kinds (and empty batches) are written whole.
    """
    return None


@compact_rows.register(_Rows)
@compact_rows.register(RotatingState)
def _rows_of(state):
    if type(state) not in (CacheState, QuantizedState, RotatingState) or not state.batch_size:
        return None
    return [ops.extract_row(state, b) for b in range(state.batch_size)]


def restore_rows(rows: list) -> Any:
    """The rows merged back into one record; dense rows get capacity in whole steps
    (a ring's capacity is what its rows hold; it grows by its own rule)."""
    return ops.merge_same_kind(rows[0], rows)


# --- a batch's per-row data ---------------------------------------------------------


def _json_value(value, arg):
    if isinstance(value, Sampling):
        return {"kv.Sampling": attrs.asdict(value)}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise bad(
            arg, "a JSON value (str, number, bool, None, list, dict) to save", type(value).__name__
        ) from None
    return value


def _from_json(value):
    if isinstance(value, dict) and set(value) == {"kv.Sampling"}:
        return Sampling(**value["kv.Sampling"])
    return value


def encode_batch(b: Batch, tensors: dict) -> dict:
    """``b``'s per-row fields: arrays into ``tensors``, the rest as a JSON-ready dict."""
    host = {}
    for name in row_fields():
        value = getattr(b, name)
        if isinstance(value, mx.array):
            tensors[f"batch.{name}"] = value
        else:
            host[name] = [_json_value(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return host


def decode_batch(states: list, host: dict, tensors: dict, used: set) -> Batch:
    """The ``Batch`` of ``states`` with the per-row fields ``encode_batch`` wrote."""
    fields = {}
    for name in row_fields():
        if f"batch.{name}" in tensors:
            fields[name] = tensors[f"batch.{name}"]
            used.add(f"batch.{name}")
        elif name in host:
            check(
                isinstance(host[name], list),
                f"{BATCH_KEY} {name}",
                "a JSON list",
                type(host[name]).__name__,
            )
            fields[name] = tuple(_from_json(v) for v in host[name])
    return Batch(states, **fields)
