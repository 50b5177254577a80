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
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..core import ops
from ..core.args import as_int, row_list
from ..errors import KVStateError, bad, check
from .links import _KINDS, ABORT, OFFER, READY, _handshake, _move, _transport
from .wire import (
    _disagree,
    _parts,
    _specs,
    batch_rows,
    pack,
    signature,
)
from .wire import (
    mismatch as mismatch,
)
from .wire import (
    unpack as unpack,
)

__all__ = ["batch_rows", "mismatch", "pack", "recv_rows", "send_rows", "signature", "unpack"]


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
    rows: Sequence[int],
    dst: int,
    *,
    note: Any = None,
    group: mx.distributed.Group | None = None,
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
        LinkError: a ``KVStateError``: the receiver's process died or the
            link to it broke (MLX's ``RuntimeError``, chained).
    """
    g = _group(group)
    peer = _peer(dst, "dst", g)  # no peer to tell: the receiver's timeout answers
    link = _transport(g, peer, transport, speaks_first=False)
    try:
        layers, batch = _parts(states)
        B = layers[0].batch_size
        rows = row_list(rows, B)
        check(len(set(rows)) == len(rows), "rows", "distinct row indices", rows)
        stay = [r for r in range(B) if r not in set(rows)]
        # B = 0 when every row moves; a kv.Batch stays a kv.Batch
        remaining = ops.filter_rows(layers if batch is None else batch, stay)
        desc, arrays = pack(layers, rows)
        for key, value in (
            ("note", note),
            ("batch", None if batch is None else batch_rows(batch, rows)),
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
    group: mx.distributed.Group | None = None,
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
        LinkError: a ``KVStateError``: the sender's process died or the link
            to it broke (MLX's ``RuntimeError``, chained).
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
