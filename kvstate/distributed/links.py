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

from ..errors import LinkError, bad, check

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

    def exchange(self, header, n, body):
        g, p = self.group, self.peer

        def send():
            mx.eval(mx.distributed.send(header, p, group=g))
            if n:
                mx.eval(mx.distributed.send(body, p, group=g))

        def recv():
            h = mx.distributed.recv((4,), mx.int32, p, group=g)
            mx.eval(h)
            kind, m = _parse(h, p)
            data = mx.distributed.recv((m,), mx.uint8, p, group=g) if m else None
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

    def _gather(self, x):
        flat = x.reshape(1, -1)
        return mx.distributed.all_gather(flat, group=self.group)[self.peer]

    def exchange(self, header, n, body):
        h = self._gather(header)
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
            data = self._gather(mine)[:m]
            mx.eval(data)
        return kind, data if m else None

    def move_one(self, array, dtype, shape):
        got = self._gather(mx.zeros(shape, dtype) if array is None else array).reshape(shape)
        mx.eval(got)
        return got if array is None else array


def _over(link, fn, *args):
    """``fn(*args)`` on ``link``; MLX's ``RuntimeError`` from it (a peer whose process
    died, a broken connection) becomes a ``LinkError`` naming the peer and this rank."""
    try:
        return fn(*args)
    except RuntimeError as e:
        raise bad(
            f"rank {link.peer}",
            f"a live link to this process (rank {link.group.rank()})",
            f"MLX's RuntimeError: {e}",
            cls=LinkError,
        ) from e


def _move(link, arrays, specs) -> list:
    """Carry the offer's arrays (``arrays``: the sender's, ``None`` on the
    receiver) in the specs' order; empty arrays are made, not sent."""
    out = []
    for i, (_, dtype, shape) in enumerate(specs):
        mine = None if arrays is None else arrays[i]
        if 0 in shape:
            out.append(mx.zeros(shape, dtype) if mine is None else mine)
        else:
            out.append(_over(link, link.move_one, mine, dtype, shape))
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
    """A long-lived daemon thread that runs handshakes.

    MLX 0.32 streams belong to the thread that made them, and every new
    stream starts threads of its own that never end, so one waiter serves
    every handshake instead of a thread and streams each. A handshake on the
    waiter passes no stream: each op takes the waiter thread's own default
    stream of the device it runs on, made there at its first use. The
    communication ops take the group's backend's own choice
    (``mx.distributed``: the CPU for ring and MPI, the GPU for NCCL); a GPU
    stream given to a ring collective fails on MLX's CUDA backend ("There is
    no Stream(cpu, i) in current thread", on the H200). A waiter
    whose handshake timed out stays blocked; it is dropped and the next
    handshake makes a new one.
    """

    _lock = threading.Lock()
    _live: ClassVar[list] = []  # the waiter, once made

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="kvstate-handshake", daemon=True).start()

    def _loop(self):
        while True:
            fn, box, done = self.jobs.get()
            try:
                box["out"] = fn()
            except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["err"] = e
            done.set()

    @classmethod
    def run(cls, fn, timeout: float):
        """``fn()`` on the waiter; ``None`` when it timed out."""
        with cls._lock:
            if not cls._live:
                cls._live.append(cls())
            waiter = cls._live[0]
        box: dict = {}
        done = threading.Event()
        waiter.jobs.put((fn, box, done))
        if not done.wait(timeout):
            with cls._lock:
                if cls._live and cls._live[0] is waiter:
                    cls._live.clear()
            return None
        if "err" in box:
            raise box["err"]
        return box["out"]


def _handshake(link, kind: int, obj, timeout: float | None, peer: int):
    """Send one message and receive the peer's, waiting at most ``timeout`` seconds.

    The wait runs on a waiter thread (``_Waiter``), on that thread's own
    streams: a peer that never answers leaves those streams blocked, not the
    caller's, and the caller gets a KVStateError instead of a hang. A peer
    whose process died raises ``LinkError`` (``_over``).
    """
    n, body = _body(obj)
    header = _header(kind, n)
    if timeout is None:  # wait in the caller's thread, on its default streams
        their, data = _over(link, link.exchange, header, n, body)
        return their, _message(data, peer)
    out = _Waiter.run(lambda: _over(link, link.exchange, header, n, body), timeout)
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
