"""How the messages of a row migration travel between two ranks.

A message is a fixed header ``int32[4] = (MAGIC, VERSION, kind, n)`` and
``n`` bytes of UTF-8 JSON. Two transports carry messages and arrays:
``_P2P`` (``send``/``recv``: ring, MPI; the receiver speaks first, so two
blocking sends never wait on each other) and ``_Collective``
(``all_gather`` only: NCCL; each rank of a two-rank group gives a buffer
of one agreed size and keeps the other's). Handshakes wait on a
``_Waiter`` thread, at most ``timeout`` seconds.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import ClassVar

import mlx.core as mx
import numpy as np

from .errors import bad, check

MAGIC = 0x6B767374  # "kvst"
VERSION = 1
READY, OFFER, ABORT = 1, 2, 3
_KINDS = {READY: "READY", OFFER: "OFFER", ABORT: "ABORT"}
TRANSPORTS = ("auto", "p2p", "collective")


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
        box: dict = {}
        done = threading.Event()
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
