"""Rows that move between processes over ``mx.distributed``.

Disaggregated serving prefills a request on one rank and decodes it on
another; a replica that is full hands rows to one that is not. ``send_rows``
takes chosen rows out of a batch (one record per layer, any record kind) and
``recv_rows`` merges them into the receiver's batch::

    rank 0 (prefill)                          rank 1 (decode)
    states = send_rows(states, [2], dst=1)    states = recv_rows(states, src=0)
      rows without row 2                        its rows, then row 2 of rank 0

Each moved row travels as ``kv.extract_row`` makes it (its tokens only: no
padding, no stale or spare columns; a ring as the ``held`` entries in ring
order), so a row's bytes on the wire are its tokens' bytes, and the receiver
gets back exactly the record the sender held (lengths, padding, ring
position, quantization planes), merged with ``kv.merge_rows``.

One migration is a handshake, then the arrays::

    receiver                                   sender
    READY  {receiver's layer signatures}  ──▶
                                          ◀──  OFFER {layer signatures, records,
                                                      tensor specs}  or  ABORT {error}
    both check OFFER against READY with one function (``mismatch``):
    a mismatch raises KVStateError on both sides and nothing more is sent
                                          ◀──  the arrays, in the offer's order

Every message is a fixed header ``int32[4] = (MAGIC, VERSION, kind, n)``
followed by ``n`` bytes of UTF-8 JSON. The sender checks everything it can
(rows, records, ``dst``) before the handshake and answers ABORT with its
error when a check fails, so the receiver raises too instead of waiting. A
peer that never answers (a ``dst`` that names no rank reaches nobody) is
caught by ``timeout``: the handshake waits at most that long.

Two transports carry the messages: ``"p2p"`` (``mx.distributed.send`` /
``recv``: the ring and MPI backends) and ``"collective"`` (``all_gather``
only: NCCL, which has no send/recv in MLX 0.32; the two ranks each give a
buffer of one agreed size, so it needs a group of exactly two ranks). The
default picks ``"collective"`` when the default device is a GPU, else
``"p2p"``. Decisions are in ``notes/distributed.md``.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Sequence
from functools import singledispatch
from typing import ClassVar

import attrs
import mlx.core as mx
import numpy as np

from . import _rows, ops, persist
from . import batch as batches
from ._args import as_int, row_list
from .batch import Batch
from .errors import KVStateError, bad, check
from .sampling import Sampling

__all__ = ["batch_rows", "mismatch", "pack", "recv_rows", "send_rows", "signature", "unpack"]

MAGIC = 0x6B767374  # "kvst"
VERSION = 1
READY, OFFER, ABORT = 1, 2, 3
_KINDS = {READY: "READY", OFFER: "OFFER", ABORT: "ABORT"}
TRANSPORTS = ("auto", "p2p", "collective")

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


def signature(state) -> dict:
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


def _fits(offered, held) -> bool:
    """Geometries agree where both are known (``None`` fits anything)."""
    if offered is None or held is None:
        return True
    if isinstance(offered, list) and isinstance(held, list):
        return len(offered) == len(held) and all(map(_fits, offered, held))
    return offered == held


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


def _differ_all(offered: Sequence[dict], held: Sequence[dict], where: str) -> str | None:
    """The first difference between two lists of signatures (item ``j`` is
    named ``where[j]``), or ``None``."""
    if len(offered) != len(held):
        return f"{where}: expected {len(held)} (the receiver's), got {len(offered)}"
    for j, (o, h) in enumerate(zip(offered, held)):
        why = _differ(o, h, f"{where}[{j}]")
        if why:
            return why
    return None


def mismatch(offered: Sequence[dict], held: Sequence[dict] | None) -> str | None:
    """Why rows with layer signatures ``offered`` cannot join a batch with
    ``held`` (``None``: the receiver has no batch yet), or ``None`` when they can.

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
    tensors, entries = {}, []
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
    fields = {}
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
def _(states: Batch) -> tuple:
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
    check(isinstance(rows, list) and rows, "offer rows", "a non-empty list", type(rows).__name__)
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


# --- transports ----------------------------------------------------------------------


def _header(kind: int, n: int) -> mx.array:
    return mx.array([MAGIC, VERSION, kind, n], dtype=mx.int32)


def _body(obj) -> tuple:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return len(data), mx.array(np.frombuffer(data, dtype=np.uint8))


def _parse(header: mx.array, peer: int) -> tuple:
    magic, version, kind, n = (int(x) for x in np.array(header).reshape(-1)[:4])
    check(
        magic == MAGIC and version == VERSION,
        f"header from rank {peer}",
        f"a kvstate migration header (magic {MAGIC:#x}, version {VERSION})",
        f"magic {magic & 0xFFFFFFFF:#x}, version {version}",
    )
    check(
        kind in _KINDS and n >= 0,
        f"header from rank {peer}",
        "READY, OFFER or ABORT",
        f"kind {kind}, {n} bytes",
    )
    return kind, n


class _P2P:
    """``send``/``recv`` (ring, MPI). Receivers speak first, so two blocking
    sends never wait on each other."""

    def __init__(self, group, peer: int, speaks_first: bool):
        self.group, self.peer, self.first = group, peer, speaks_first

    def exchange(self, header, n, body, stream):
        g, p = self.group, self.peer

        def send():
            mx.eval(mx.distributed.send(header, p, group=g, stream=stream))
            if n:
                mx.eval(mx.distributed.send(body, p, group=g, stream=stream))

        def recv():
            h = mx.distributed.recv((4,), mx.int32, p, group=g, stream=stream)
            mx.eval(h)
            kind, m = _parse(h, p)
            data = mx.distributed.recv((m,), mx.uint8, p, group=g, stream=stream) if m else None
            if m:
                mx.eval(data)
            return kind, data

        if self.first:
            send()
            return recv()
        got = recv()
        send()
        return got

    def move_one(self, array, dtype, shape):
        g, p = self.group, self.peer
        if array is not None:
            mx.eval(mx.distributed.send(mx.contiguous(array), p, group=g, stream=mx.cpu))
            return array
        array = mx.distributed.recv(shape, dtype, p, group=g, stream=mx.cpu)
        mx.eval(array)
        return array


class _Collective:
    """``all_gather`` only (NCCL): each rank of a two-rank group gives a buffer of
    one agreed size and keeps the other's."""

    def __init__(self, group, peer: int):
        self.group, self.peer = group, peer

    def _gather(self, x, stream=None):
        flat = x.reshape(1, -1)
        return mx.distributed.all_gather(flat, group=self.group, stream=stream)[self.peer]

    def exchange(self, header, n, body, stream):
        h = self._gather(header, stream)
        mx.eval(h)
        kind, m = _parse(h, self.peer)
        size = max(n, m)
        data = None
        if size:
            mine = (
                body
                if n == size
                else mx.concatenate(
                    [body if n else mx.zeros((0,), mx.uint8), mx.zeros((size - n,), mx.uint8)]
                )
            )
            data = self._gather(mine, stream)[:m]
            mx.eval(data)
        return kind, data if m else None

    def move_one(self, array, dtype, shape):
        got = self._gather(mx.zeros(shape, dtype) if array is None else array).reshape(shape)
        mx.eval(got)
        return got if array is None else array


def _move(link, arrays, specs) -> list:
    """Carry the offer's arrays (``arrays``: the sender's, ``None`` on the
    receiver) in the specs' order; empty arrays are made, not sent."""
    out = []
    for i, (_, dtype, shape) in enumerate(specs):
        mine = None if arrays is None else arrays[i]
        if 0 in shape:
            out.append(mx.zeros(shape, dtype) if mine is None else mine)
        else:
            out.append(link.move_one(mine, dtype, shape))
    return out


def _transport(group, peer: int, transport: str, speaks_first: bool):
    if transport not in TRANSPORTS:
        raise bad("transport", f"one of {TRANSPORTS}", repr(transport))
    if transport == "auto":
        transport = "collective" if mx.default_device().type == mx.DeviceType.gpu else "p2p"
    if transport == "collective":
        check(
            group.size() == 2,
            "group size",
            "2 for the collective transport (make a "
            "two-rank group with group.split, or use transport='p2p')",
            group.size(),
        )
        return _Collective(group, peer)
    return _P2P(group, peer, speaks_first)


class _Waiter:
    """A long-lived daemon thread with its own stream that runs handshakes.

    MLX 0.32 streams belong to the thread that made them, and every new
    stream starts threads of its own that never end, so one waiter per
    device serves every handshake instead of a thread and a stream each.
    A waiter whose handshake timed out stays blocked; it is dropped and
    the next handshake makes a new one.
    """

    _lock = threading.Lock()
    _live: ClassVar[dict] = {}  # str(device) -> _Waiter

    def __init__(self, device):
        self.device = device
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="kvstate-handshake", daemon=True).start()

    def _loop(self):
        stream = mx.new_stream(self.device)
        while True:
            fn, box, done = self.jobs.get()
            try:
                box["out"] = fn(stream)
            except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["err"] = e
            done.set()

    @classmethod
    def run(cls, device, fn, timeout: float):
        """``fn(stream)`` on the waiter of ``device``; ``None`` when it timed out."""
        key = str(device)
        with cls._lock:
            waiter = cls._live.get(key)
            if waiter is None:
                waiter = cls._live[key] = cls(device)
        box, done = {}, threading.Event()
        waiter.jobs.put((fn, box, done))
        if not done.wait(timeout):
            with cls._lock:
                if cls._live.get(key) is waiter:
                    del cls._live[key]
            return None
        if "err" in box:
            raise box["err"]
        return box["out"]


def _handshake(link, kind: int, obj, timeout: float | None, peer: int):
    """Send one message and receive the peer's, waiting at most ``timeout`` seconds.

    The wait runs on a waiter thread with its own stream (``_Waiter``): a
    peer that never answers leaves that stream blocked, not the caller's,
    and the caller gets a KVStateError instead of a hang.
    """
    n, body = _body(obj)
    header = _header(kind, n)
    device = mx.default_device() if isinstance(link, _Collective) else mx.cpu
    if timeout is None:  # wait in the caller's thread, on the default stream
        their, data = link.exchange(header, n, body, mx.cpu if device == mx.cpu else None)
        return their, _message(data, peer)
    out = _Waiter.run(device, lambda stream: link.exchange(header, n, body, stream), timeout)
    if out is None:
        raise bad(
            f"rank {peer}",
            f"an answer within timeout={timeout} s",
            "none (it never reached this migration; the link to it now holds a "
            "pending message: re-create the group before using it again)",
        )
    their, data = out
    return their, _message(data, peer)


def _message(data, peer: int):
    """The JSON a message's body holds (``None`` for an empty body)."""
    try:
        return None if data is None else json.loads(bytes(np.array(data)).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"message from rank {peer}", "UTF-8 JSON", repr(e)) from None


# --- the two ends ------------------------------------------------------------------


def _group(group):
    return mx.distributed.init() if group is None else group


def _peer(value, arg: str, group) -> int:
    peer = as_int(value, arg)
    rank, size = group.rank(), group.size()
    check(
        0 <= peer < size and peer != rank,
        arg,
        f"another rank of the group: in [0, {size}), not {rank} (this rank)",
        peer,
    )
    return peer


def send_rows(
    states: Sequence,
    rows,
    dst: int,
    *,
    note=None,
    group=None,
    transport: str = "auto",
    timeout: float | None = 60.0,
) -> list | None:
    """Move ``rows`` of ``states`` to rank ``dst``, which calls ``recv_rows``.

    Args:
        states: one record per layer (any kinds), all with the same rows, or
            a ``kv.Batch`` (its per-row data moves with the rows).
        rows: the row indices to move (a non-empty list, in the order the
            receiver appends them).
        dst: the receiving rank of ``group``.
        note: any JSON value delivered with the rows (request ids, each row's
            next token: what the receiver needs to go on decoding them).
        group: an ``mx.distributed`` group (default: ``mx.distributed.init()``).
        transport: ``"p2p"`` (send/recv), ``"collective"`` (all_gather, a
            two-rank group) or ``"auto"`` (see the module docstring).
        timeout: seconds to wait for the receiver to show up (``None``: forever,
            in the caller's thread).

    Returns:
        The records without the moved rows (in their order; an empty, B = 0,
        batch when every row moved). The input records are left unchanged.

    Raises:
        KVStateError: bad ``dst``, ``rows`` or ``states`` (before anything is
            sent; the receiver, when ``dst`` names one, is told and raises
            too), or rows that do not fit the receiver's batch.
    """
    g = _group(group)
    peer = _peer(dst, "dst", g)  # no peer to tell: the receiver's timeout answers
    link = _transport(g, peer, transport, speaks_first=False)
    try:
        layers, held = _parts(states)
        B = layers[0].batch_size
        rows = row_list(rows, B)
        check(len(set(rows)) == len(rows), "rows", "distinct row indices", rows)
        stay = [r for r in range(B) if r not in set(rows)]
        # B = 0 when every row moves; a kv.Batch stays a kv.Batch
        remaining = ops.filter_rows(layers if held is None else held, stay)
        desc, arrays = pack(layers, rows)
        for key, value in (
            ("note", note),
            ("batch", None if held is None else batch_rows(held, rows)),
        ):
            try:
                desc[key] = json.loads(json.dumps(value))
            except (TypeError, ValueError) as e:
                arg = "note" if key == "note" else "states ids and payload"
                raise bad(arg, "JSON values (dicts, lists, str, numbers, None)", repr(e)) from None
    except KVStateError as e:
        try:  # tell the receiver, so it raises too instead of waiting
            _handshake(link, ABORT, {"error": str(e)}, timeout, peer)
        except KVStateError:
            pass
        raise
    their, ready = _handshake(link, OFFER, desc, timeout, peer)
    check(their == READY, f"rank {dst}", "READY (a rank calling recv_rows)", _KINDS[their])
    why = _disagree(desc, ready)
    if why is not None:
        raise bad(f"rows for rank {dst}", "rows that fit its batch", why)
    _move(link, arrays, _specs(desc))
    return remaining


def recv_rows(
    states: Sequence | None,
    src: int,
    *,
    group=None,
    transport: str = "auto",
    timeout: float | None = 60.0,
) -> tuple:
    """Receive rows that rank ``src`` sends with ``send_rows`` and append them.

    Args:
        states: this rank's batch (one record per layer, or a ``kv.Batch``),
            or ``None`` when it has none yet (the result is then the received
            rows alone).
        src: the sending rank of ``group``.
        group, transport, timeout: as ``send_rows``.

    Returns:
        ``(states, note)``: ``kv.merge_rows`` of this rank's rows followed by
        the received rows (in the order sent), and the sender's ``note``. A
        ``kv.Batch`` sent arrives as one (its rows' pending tokens, PRNG keys,
        sampling, ids and payloads with them). The input is unchanged.

    Raises:
        KVStateError: the sender aborted (its error is in the message), the
            rows do not fit this batch, the sender never answered within
            ``timeout``, or what arrived is not a valid offer.
    """
    g = _group(group)
    peer = _peer(src, "src", g)
    link = _transport(g, peer, transport, speaks_first=True)
    mine, batch = (None, None) if states is None else _parts(states)
    ready = None
    if mine is not None:
        ready = {"layers": [signature(s) for s in mine], "batch": batch is not None}
    their, offer = _handshake(link, READY, ready, timeout, peer)
    if their == ABORT:
        raise bad(
            f"rows from rank {src}",
            "an offer",
            f"an abort: {(offer or {}).get('error', '(no reason given)')}",
        )
    check(
        their == OFFER and isinstance(offer, dict),
        f"rank {src}",
        "OFFER (a rank calling send_rows)",
        _KINDS[their],
    )
    why = _disagree(offer, ready)
    if why is not None:
        raise bad(f"rows from rank {src}", "rows that fit this batch", why)
    got = unpack(offer, _move(link, None, _specs(offer)))
    base = [] if mine is None else [mine if batch is None else batch]
    return ops.merge_rows(base + got), offer.get("note")
