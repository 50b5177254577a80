"""The wire format of a row migration, pure (``kvstate.distributed`` sends it).

What rows are (``signature``: kind, geometry, layer fields, nested parts),
whether they fit a batch (``mismatch``, run by both ends on the same two
lists), and rows to a JSON description plus arrays and back (``pack`` /
``unpack``, through ``persist``'s field walk; a ``kv.Batch``'s per-row data
by ``batch_rows``). Everything ``unpack`` reads came over the wire: it is
checked as outside input.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import singledispatch
from typing import Any

import attrs
import mlx.core as mx

from .. import batch as batches
from ..batch import Batch
from ..core import ops
from ..errors import KVStateError, bad, check
from ..kinds import rows as _rows
from ..persist import files as persist
from ..sampling import Sampling

__all__ = ["batch_rows", "mismatch", "pack", "signature", "unpack"]

# Dtypes an array on the wire may have, by the name ``str(dtype)`` ends with.
_DTYPES = {
    str(d).rsplit(".", 1)[-1]: d
    for d in (
        mx.bool_,
        mx.uint8,
        mx.uint16,
        mx.uint32,
        mx.uint64,
        mx.int8,
        mx.int16,
        mx.int32,
        mx.int64,
        mx.float16,
        mx.bfloat16,
        mx.float32,
    )
}

# --- what a layer is, and whether rows fit a batch -------------------------------


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _geometry(state):
    """``[H, Dk, Dv, dtype]`` of a KV record (``_rows.geometry``); for a record
    of fixed-size arrays (recurrent slots), ``[dtype, *shape[1:]]`` per array
    (``None`` for a slot not yet written); ``None`` before the first write."""
    try:
        geo = _rows.geometry(state)
        return None if geo is None else [*geo[:3], _dtype_name(geo[3])]
    except NotImplementedError:
        pass
    out = []
    for field in attrs.fields(type(state)):
        value = getattr(state, field.name)
        if persist._is_arrays(value):
            out += [None if a is None else [_dtype_name(a.dtype), *a.shape[1:]] for a in value]
    return out or None


def signature(state: Any) -> dict:
    """What rows need to agree on to share a batch, JSON-ready: the record
    kind, its geometry (``_geometry``), its layer fields (the host fields that
    are not per-row tuples: ``group_size``/``bits``, ``max_size``/``keep``,
    ``chunk_size``; ``step`` may differ) and the signatures of nested parts."""
    cls = type(state)
    if persist.RECORDS.get(cls.__name__) is not cls:
        raise bad("state", f"a kvstate record ({', '.join(persist.RECORDS)})", cls.__name__)
    sig = {"kind": cls.__name__, "geometry": _geometry(state), "params": {}}
    for field in attrs.fields(cls):
        value = getattr(state, field.name)
        if persist._is_records(value):
            sig.setdefault("parts", {})[field.name] = [signature(p) for p in value]
        elif field.name != "step" and isinstance(value, (bool, int, float, str)):
            sig["params"][field.name] = value
    return sig


def _fits(offered, ready) -> bool:
    """Geometries agree where both are known (``None`` fits anything)."""
    if offered is None or ready is None:
        return True
    if isinstance(offered, list) and isinstance(ready, list):
        return len(offered) == len(ready) and all(map(_fits, offered, ready))
    return offered == ready


def _differ(o: dict, h: dict, where: str) -> str | None:
    for key in ("kind", "params"):
        if o[key] != h[key]:
            return f"{where} {key}: expected {h[key]} (the receiver's), got {o[key]}"
    if not _fits(o["geometry"], h["geometry"]):
        return f"{where} geometry: expected {h['geometry']} (the receiver's), got {o['geometry']}"
    for field, parts in h.get("parts", {}).items():
        theirs = o.get("parts", {}).get(field, [])
        why = _differ_all(theirs, parts, f"{where} {field}")
        if why:
            return why
    return None


def _differ_all(offered: Sequence[dict], ready: Sequence[dict], where: str) -> str | None:
    """The first difference between two lists of signatures (item ``j`` is
    named ``where[j]``), or ``None``."""
    if len(offered) != len(ready):
        return f"{where}: expected {len(ready)} (the receiver's), got {len(offered)}"
    for j, (o, h) in enumerate(zip(offered, ready)):
        why = _differ(o, h, f"{where}[{j}]")
        if why:
            return why
    return None


def mismatch(offered: Sequence[dict], held: Sequence[dict] | None) -> str | None:
    """Why rows with layer signatures ``offered`` cannot join a batch whose
    layers have the signatures ``held`` (the receiver's, ready for rows;
    ``None``: the receiver has no batch yet), or ``None`` when they can.

    Both ends of a migration run this on the same two lists, so they agree.
    """
    return None if held is None else _differ_all(offered, held, "layers")


def _layers(states, arg: str) -> list:
    if isinstance(states, (str, bytes)) or not hasattr(states, "__len__"):
        raise bad(arg, "a list of records (one per layer)", type(states).__name__)
    states = list(states)
    check(len(states) >= 1, arg, "at least one record (one per layer)", "none")
    B = states[0].batch_size if hasattr(states[0], "batch_size") else None
    for i, s in enumerate(states):
        signature(s)  # refuses anything but a record
        check(s.batch_size == B, f"{arg}[{i}] batch size", f"{B} (as {arg}[0])", s.batch_size)
    return states


# --- pure halves: rows to (JSON, arrays) and back -----------------------------------


def pack(states: Sequence, rows: Sequence[int]) -> tuple:
    """The offer for ``rows`` of ``states``: ``(description, arrays)``.

    ``description`` is JSON-ready: the layer signatures, one ``persist``
    entry per row and layer (host fields and array names) and the spec
    ``[name, dtype, shape]`` of each array; ``arrays`` are in the specs'
    order. Each row is ``kv.extract_row`` of its layer: its tokens only.
    """
    tensors: dict = {}
    entries: list = []
    for j, r in enumerate(rows):
        entries.append(
            [
                persist._encode(j * len(states) + i, ops.extract_row(s, r), tensors)
                for i, s in enumerate(states)
            ]
        )
    specs = [[name, _dtype_name(a.dtype), list(a.shape)] for name, a in tensors.items()]
    desc = {"layers": [signature(s) for s in states], "rows": entries, "arrays": specs}
    return desc, [tensors[name] for name, _, _ in specs]


# --- a kv.Batch's per-row data (pending token, key, sampling, id, payload) ----------

_ITEMS = {"Sampling": Sampling}  # records a per-row tuple item may be, by name


def _encode_item(x):
    if attrs.has(type(x)) and _ITEMS.get(type(x).__name__) is type(x):
        return {"record": type(x).__name__, "fields": attrs.asdict(x)}
    return {"value": x}


def _decode_item(item):
    if "record" in item:
        return _ITEMS[item["record"]](**item["fields"])
    return item["value"]


def batch_rows(b: Batch, rows: Sequence[int]) -> list:
    """Per row of ``b`` in ``rows``: its per-row fields, JSON-ready (arrays as
    their row's values and dtype; a ``kv.Sampling`` by its fields; ids and
    payloads must be JSON values)."""
    out = []
    for r in rows:
        item = {}
        for name in batches.row_fields():
            value = getattr(b, name)
            if isinstance(value, mx.array):
                item[name] = {"dtype": _dtype_name(value.dtype), "value": value[r].tolist()}
            else:
                item[name] = _encode_item(value[r])
        out.append(item)
    return out


def _batch_row(layers: list, item, j: int) -> Batch:
    """A one-row ``kv.Batch`` of ``layers`` and the per-row data ``item``
    (received: checked by the ``Batch`` and ``Sampling`` constructors)."""
    names = batches.row_fields()
    check(
        isinstance(item, dict) and sorted(item) == sorted(names),
        f"offer batch[{j}]",
        f"the fields {sorted(names)}",
        item if not isinstance(item, dict) else sorted(item),
    )
    fields: dict = {}
    try:
        for name in names:
            x = item[name]
            if "dtype" in x:
                check(
                    x["dtype"] in _DTYPES,
                    f"offer batch[{j}].{name} dtype",
                    f"one of {sorted(_DTYPES)}",
                    x["dtype"],
                )
                fields[name] = mx.array([x["value"]], _DTYPES[x["dtype"]])
            else:
                fields[name] = (_decode_item(x),)
        return Batch(tuple(layers), **fields)
    except KVStateError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"offer batch[{j}]", "a row of a kv.Batch", repr(e)) from None


@singledispatch
def _parts(states) -> tuple:
    """``(layer records, the kv.Batch or None)`` of what a caller migrates."""
    return _layers(states, "states"), None


@_parts.register
def parts_batch(states: Batch) -> tuple:
    return _layers(states.states, "states.states"), states


def _disagree(offer: dict, ready: dict | None) -> str | None:
    """Why an offer does not fit the receiver (both ends run this), or ``None``."""
    if ready is None:
        return None
    if bool(offer.get("batch")) != bool(ready.get("batch")):
        want = "a kv.Batch's rows" if ready.get("batch") else "layer records (no kv.Batch)"
        got = "a kv.Batch's rows" if offer.get("batch") else "layer records"
        return f"rows: expected {want} (the receiver's), got {got}"
    return mismatch(offer.get("layers", []), ready.get("layers"))


def _specs(desc) -> list:
    """The array specs of an offer as ``(name, dtype, shape)``, each checked
    (the description came over the wire: it is outside input)."""
    out = []
    try:
        for i, (name, dtype, shape) in enumerate(desc["arrays"]):
            check(isinstance(name, str), f"offer arrays[{i}] name", "a string", name)
            check(dtype in _DTYPES, f"offer arrays[{i}] dtype", f"one of {sorted(_DTYPES)}", dtype)
            check(
                isinstance(shape, list)
                and len(shape) <= 8
                and all(type(n) is int and n >= 0 for n in shape),
                f"offer arrays[{i}] shape",
                "a list of at most 8 non-negative ints",
                shape,
            )
            out.append((name, _DTYPES[dtype], tuple(shape)))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, KVStateError):
            raise
        raise bad("offer arrays", "a list of [name, dtype, shape]", repr(e)) from None
    return out


def _received(rec, where: str) -> None:
    """A received record is outside input: one row, every array holding that
    row (nested parts too), no negative row count, and a KV record's row
    within its columns. (Deeper per-kind invariants belong to the record
    validation of issue 10.)"""
    check(rec.batch_size == 1, f"{where} batch size", 1, rec.batch_size)
    for a in persist._arrays(rec):
        check(a.ndim >= 1 and a.shape[0] == 1, f"{where} array rows (shape[0])", 1, list(a.shape))
    for field in attrs.fields(type(rec)):
        value = getattr(rec, field.name)
        if isinstance(value, tuple) and all(type(x) is int for x in value):
            check(min(value, default=0) >= 0, f"{where}.{field.name}", ">= 0", value)
    if rec.planes and hasattr(rec, "width"):
        check(
            rec.width <= rec.capacity,
            f"{where} row end",
            f"<= {rec.capacity} (its columns)",
            rec.width,
        )


def unpack(desc: dict, arrays: Sequence) -> list:
    """The rows an offer carries: one list of records (one per layer) per row,
    or one-row ``kv.Batch``es when the offer came from a ``kv.Batch``.

    Every record is rebuilt through ``persist`` (the kinds it allows, the
    record constructors) and must be a one-row record of the offered kind.
    """
    tensors = {name: a for (name, _, _), a in zip(_specs(desc), arrays)}
    try:
        layers, rows = desc["layers"], desc["rows"]
    except (KeyError, TypeError):
        raise bad("offer", "a dict with layers, rows and arrays", type(desc).__name__) from None
    check(
        isinstance(rows, list) and bool(rows), "offer rows", "a non-empty list", type(rows).__name__
    )
    out = []
    for j, entries in enumerate(rows):
        check(
            isinstance(entries, list) and len(entries) == len(layers),
            f"offer rows[{j}]",
            f"{len(layers)} records (one per layer)",
            entries,
        )
        row = []
        for i, entry in enumerate(entries):
            rec = persist._decode(j * len(layers) + i, entry, tensors)
            _received(rec, f"offer rows[{j}][{i}]")
            sig = signature(rec)
            check(
                mismatch([sig], [layers[i]]) is None,
                f"offer rows[{j}][{i}]",
                f"a record of the offered layer {layers[i]}",
                sig,
            )
            row.append(rec)
        out.append(row)
    if desc.get("batch") is None:
        return out
    data = desc["batch"]
    check(
        isinstance(data, list) and len(data) == len(out),
        "offer batch",
        f"{len(out)} rows of per-row data",
        type(data).__name__,
    )
    return [_batch_row(row, item, j) for j, (row, item) in enumerate(zip(out, data))]
