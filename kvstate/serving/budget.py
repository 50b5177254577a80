"""The scheduler's budgets: prompt tokens per round, and KV bytes.

**Prompt tokens per round** (``prefill_budget``, vLLM's ``max_num_batched_tokens``
for prompts): each round runs the decode rows and at most this many prompt
tokens, so a long prompt is prefilled over several rounds
(``prefix_cache.Partial``) instead of stalling every running row for its
whole prefill.

**KV bytes** (``kv_budget``): a job is admitted when the bytes its rows could
reach (``prompt + max_tokens`` tokens per row, at ``bytes_per_token``) fit
beside what the running rows could reach; before each round the bytes the
rows will hold after it (their records' planes, plus the columns the round's
appends will grow) must fit, with the prefix cache's unpinned entries evicted
first and the newest rows parked (``Parked``: their records copied to host
memory) until they do. A parked row rejoins, bit for bit, when it fits again.
Decisions: ``notes/serving.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Optional

import attrs
import mlx.core as mx
import numpy as np

from .. import mlx_lm as bridge
from ..core.args import as_int
from ..core.records import CompositeState, CompressedState, RecurrentState, RotatingState
from ..errors import bad, check
from ..kinds.shared import SharedState
from . import prefix_cache

__all__ = [
    "DEFAULT_PREFILL_BUDGET",
    "Parked",
    "bytes_per_token",
    "default_kv_budget",
    "grown_bytes",
    "park",
    "prefill_budget",
    "unpark",
]

#: Prompt tokens per round by default: one prefill forward's worth at the default
#: ``prefill_step_size``, so a round costs at most a decode step and one such forward.
DEFAULT_PREFILL_BUDGET = 512

#: The share of the device's memory (the machine's RAM on the CPU) that the default
#: KV budget takes, less the model's weights.
DEFAULT_KV_SHARE = 0.6


def prefill_budget(model: Any, tokens: Optional[int], make: Optional[dict] = None) -> Optional[int]:
    """``tokens`` checked (``None``: off), and ``None`` for a model whose records (made
    with ``make_states`` options ``make``) cannot run a prompt in pieces: rings
    (``prefix_cache.splits``)."""
    if tokens is None:
        return None
    tokens = as_int(tokens, "prefill_budget")
    check(tokens >= 1, "prefill_budget", ">= 1 (or None: off)", tokens)
    if not prefix_cache.splits(bridge.make_states(model, 1, **(make or {}))):
        return None
    return tokens


# --- KV bytes ---------------------------------------------------------------------------


def bytes_per_token(model: Any, make: Optional[dict] = None) -> int:
    """KV bytes one token of one row costs in ``model``'s records: every layer's
    planes of a one-row record over its capacity (shapes and dtypes: one probe
    forward of one token, once)."""
    empty = bridge.make_states(model, 1, **(make or {}))
    _, states = bridge.forward(model, mx.zeros((1, 1), mx.int32), empty)
    return sum(math.ceil(s.nbytes / max(s.capacity, 1)) for s in states)


def memory_size() -> int:
    """Bytes of the default device's memory: ``mx.device_info()["memory_size"]`` on a
    GPU, the machine's RAM on the CPU."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = info.get("memory_size") if mx.default_device().type != mx.cpu else None
    if size:
        return int(size)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_budget(model: Any) -> int:
    """``DEFAULT_KV_SHARE`` of ``memory_size()`` less the model's weights (at least 0)."""
    weights = sum(v.nbytes for _, v in _leaves(model.parameters()))
    return max(int(DEFAULT_KV_SHARE * memory_size()) - weights, 0)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    elif isinstance(tree, mx.array):
        yield prefix, tree


def kv_budget(value: Optional[int]) -> Optional[int]:
    """``value`` checked: bytes >= 1, or ``None`` (no budget)."""
    if value is None:
        return None
    value = as_int(value, "kv_budget")
    check(value >= 1, "kv_budget", ">= 1 byte (or None: no budget)", value)
    return value


def grown_bytes(states: Sequence[Any], n: int) -> int:
    """Bytes the records grow by when every row appends ``n`` more tokens: the whole
    growth steps each layer adds past its capacity (zero while the columns fit; a ring
    grows up to its size, a recurrent record never)."""
    return sum(_grown(s, n) for s in states)


def _grown(s, n: int) -> int:
    if isinstance(s, CompositeState):
        return sum(_grown(p, n) for p in s.parts)
    rows = getattr(s, "suffix", s)  # (a shared row appends to its suffix)
    if isinstance(rows, RecurrentState) or rows.capacity == 0 or not rows.planes:
        return 0
    if isinstance(rows, RotatingState) and rows.capacity >= rows.max_size:
        return 0
    end = max(rows.held if isinstance(rows, (RotatingState, CompressedState)) else rows.ends)
    need = end + n - rows.capacity
    if need <= 0:
        return 0
    per_column = rows.nbytes // (rows.batch_size * rows.capacity)
    return math.ceil(need / rows.step) * rows.step * rows.batch_size * per_column


# --- parked rows ------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Parked:
    """A row taken out of the batch, its records' arrays in host memory.

    Attributes:
        spec: the row as a one-row ``Speculation`` whose records are empty
            placeholders (``unpark`` puts the row's records back).
        layers: per layer, the record as a ``_Held`` tree: its arrays as host
            bytes, a ``SharedState``'s prefix records left on the device (the
            cache entry or the rows they are shared with hold them too).
        nbytes: the bytes the row's own arrays held.
        order: the row's admission order (parked rows rejoin oldest first).
    """

    spec: Any
    layers: tuple
    nbytes: int
    order: tuple


@attrs.frozen(eq=False)
class _Held:
    """A record's type and its fields, arrays as ``(bytes, dtype, shape)`` on the host."""

    kind: type
    fields: dict


@attrs.frozen(eq=False)
class _HostArray:
    """An array's bytes in host memory, its dtype and shape (``_to_device``: back)."""

    raw: np.ndarray
    dtype: Any
    shape: tuple


def _to_host(value) -> Any:
    """``value`` with every array copied to host memory (records walked field by
    field; a ``SharedState``'s prefixes stay as they are)."""
    if isinstance(value, mx.array):
        return _HostArray(np.array(value.view(mx.uint8)), value.dtype, tuple(value.shape))
    if isinstance(value, tuple):
        return tuple(map(_to_host, value))
    if not attrs.has(type(value)):
        return value
    fields = {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}
    keep = {"prefixes"} if isinstance(value, SharedState) else set()
    return _Held(type(value), {k: v if k in keep else _to_host(v) for k, v in fields.items()})


def _to_device(value) -> Any:
    """What ``_to_host`` copied, back on the device, bit for bit."""
    if isinstance(value, _Held):
        return value.kind(**{k: _to_device(v) for k, v in value.fields.items()})
    if isinstance(value, _HostArray):
        return mx.array(value.raw).view(value.dtype).reshape(value.shape)
    if isinstance(value, tuple):
        return tuple(map(_to_device, value))
    return value


def _host_bytes(value) -> int:
    if isinstance(value, _Held):
        return sum(_host_bytes(v) for k, v in value.fields.items() if k != "prefixes")
    if isinstance(value, _HostArray):
        return value.raw.nbytes
    if isinstance(value, tuple):
        return sum(map(_host_bytes, value))
    return 0


def park(spec: Any, placeholder: list, order: tuple) -> Parked:
    """``spec`` (one row; compact records, ``extract_row``'s) with its records'
    arrays copied to host memory; ``placeholder``: empty one-row records standing
    in for them (``make_states(model, 1)``)."""
    check(spec.batch_size == 1, "spec batch size", "1 (one row)", spec.batch_size)
    layers = tuple(_to_host(s) for s in spec.batch.states)
    held = attrs.evolve(spec, batch=attrs.evolve(spec.batch, states=list(placeholder)))
    return Parked(held, layers, _host_bytes(layers), order)


def unpark(parked: Parked) -> Any:
    """The parked row's ``Speculation``, its records back on the device, as they were."""
    states = [_to_device(layer) for layer in parked.layers]
    return attrs.evolve(parked.spec, batch=attrs.evolve(parked.spec.batch, states=states))


def device_records(parked: Parked) -> list:
    """The records a parked row still reads on the device (a shared row's prefixes)."""
    shared = [layer for layer in parked.layers if layer.kind is SharedState]
    return [p for layer in shared for p in layer.fields["prefixes"]]


#: The growth step of a dense record (``kv.empty``): a row holds whole steps of columns.
STEP = 256


def projected(tokens: int, token_bytes: int) -> int:
    """The KV bytes a row of ``tokens`` tokens can hold: whole growth steps of them."""
    return -(-tokens // STEP) * STEP * token_bytes


def newest(payload) -> int:
    """The row of the most recently submitted job (its last choice): parked first."""
    order = [(job.submitted, choice) for job, choice in payload]
    return max(range(len(order)), key=order.__getitem__)


def refuse(need: int, limit: int, n: int, token_bytes: int) -> None:
    """Raise: a request whose rows could never fit the KV budget."""
    raise bad(
        "max_tokens",
        f"prompt + max_tokens within kv_budget ({limit} bytes at {token_bytes} bytes "
        f"per token, {n} row(s))",
        f"{need} bytes projected",
    )
