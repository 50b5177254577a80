"""A prefix cache: token prefixes -> shared state, with a byte budget, LRU and pins.

``PrefixCache`` keeps, per cached token sequence, one record per layer (one
row each). ``lookup(tokens)`` finds the entry sharing the longest common
prefix with ``tokens`` (at most ``len(tokens) - 1`` tokens, so at least one
is left to prefill and give the next token's logits) and leases it: the
lease's ``states`` are ``SharedState`` rows reading the entry's records
with no copy, cut to the matched length (a cut of a shared row only
shortens its view). A request then prefills only ``tokens[matched:]``::

    cache = PrefixCache(max_bytes=1 << 30, identity=model_identity(path))
    with cache.lookup(prompt) as hit:          # None on a miss
        states = hit.states                    # rows reading the cached prefix
        logits, states = bridge.forward(model, mx.array([prompt[hit.matched:]]), states)
    cache.insert(prompt, states)               # the whole prompt, for the next request

Bytes are counted once per record, however many entries or rows share it
(an entry made from a leased row shares the leased entry's records). When
an insert takes the total over ``max_bytes``, least recently used entries
that no lease pins are dropped until it fits; a pinned entry is never
dropped, so the budget counts what running rows still read (dropping it
would free nothing: the rows hold the arrays). ``save``/``load`` write the
entries to one ``.safetensors`` file (``kv.save``), refused on load for
another model identity. Decisions: ``notes/kinds.md``.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from functools import singledispatch
from typing import Any, Optional

import attrs
import mlx.core as mx
import numpy as np

from .. import mlx_lm as bridge
from ..core import ops
from ..core.args import as_int
from ..core.masks import Releasable
from ..core.records import (
    CacheState,
    ChunkedState,
    CompositeState,
    CompressedState,
    QuantizedState,
    RecurrentState,
    RotatingState,
)
from ..errors import bad, check
from ..kinds.shared import SharedState, fork, materialize, resident_records
from ..persist import files as persist

__all__ = [
    "Partial",
    "PrefixCache",
    "PrefixLease",
    "advance",
    "begin",
    "common_prefix",
    "model_identity",
    "settle",
    "splits",
]

ENTRIES_KEY = "prefix_cache.entries"


def model_identity(path: str | os.PathLike) -> str:
    """A model's identity for ``PrefixCache``: ``kv.persist.model_digest`` of a
    directory of ``*.safetensors`` weights, or the SHA-256 of one weight file
    (a GGUF), memoized like the digest."""
    if not isinstance(path, (str, os.PathLike)):
        raise bad("path", "a model directory or weight file", type(path).__name__)
    if os.path.isdir(path):
        return persist.model_digest(path)
    check(
        os.path.isfile(path), "path", "an existing model directory or weight file", os.fspath(path)
    )
    return persist.file_digest(os.fspath(path))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return _common(_ids(a), _ids(b))


def _ids(tokens) -> np.ndarray:
    return np.asarray(list(tokens), dtype=np.int64)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """``common_prefix`` of two int64 arrays (compared vectorised: a lookup
    compares a prompt with every entry)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class _Entry:
    __slots__ = ("array", "cuts", "pins", "reach", "states", "tokens")

    def __init__(self, tokens: tuple, states: list):
        self.tokens, self.states, self.pins = tokens, states, 0
        self.array = _ids(tokens)  # (lookup compares vectorised)
        self.cuts = all(map(cuts_freely, states))  # else only a match of all its tokens
        self.reach = min(map(reach, states))  # the longest prompt it may serve

    def usable(self, matched: int, prompt: int) -> int:
        """``matched`` if a prompt of ``prompt`` tokens sharing ``matched`` with
        this entry may read it, else 0."""
        if prompt > self.reach or not (self.cuts or matched == len(self.tokens)):
            return 0
        return matched


@singledispatch
def cuts_freely(state) -> bool:
    """Whether a one-row record cut to any shorter length reads exactly as that
    prefix prefilled alone: dense rows (``trim``), a ring that evicted nothing,
    a chunked row that dropped no front. A recurrent row is a snapshot at its
    last token (no earlier state can be recovered from it): only a prompt
    matching all of its tokens reads it."""
    return False


@cuts_freely.register(CacheState)
@cuts_freely.register(QuantizedState)
@cuts_freely.register(SharedState)
def _cuts_dense(state) -> bool:
    return True


@cuts_freely.register(RotatingState)
def _cuts_ring(state: RotatingState) -> bool:
    return state.held == state.lengths


@cuts_freely.register(ChunkedState)
def _cuts_chunked(state: ChunkedState) -> bool:
    return state.start == (0,)


@cuts_freely.register(CompositeState)
def _cuts_composite(state: CompositeState) -> bool:
    return all(map(cuts_freely, state.parts))


def row_cuts_freely(states, row: int) -> bool:
    """Whether every layer of row ``row`` of ``states`` cuts freely (``cuts_freely``):
    its records may be cut to any shorter prompt and completion."""
    return all(cuts_freely(ops.extract_row(s, row)) for s in states)


@singledispatch
def reach(state) -> float:
    """The longest prompt whose prefill may start from this record and end as
    the whole prompt prefilled in one forward: any (``inf``), except for a ring,
    whose whole-prompt block reads a sliding window that a split prompt reads
    otherwise once the prompt outgrows the ring (``max_size``)."""
    return math.inf


@reach.register(RotatingState)
def _reach_ring(state: RotatingState) -> float:
    return state.max_size


@reach.register(CompressedState)
def _reach_compressed(state: CompressedState) -> float:
    # In pieces, a row marks columns between them, and snapkv scores only blocks
    # longer than ``observe``: exact while nothing is marked and no block is scored.
    return min(state.budget, default=0) if state.policy != "snapkv" else state.observe


@reach.register(CompositeState)
def _reach_composite(state: CompositeState) -> float:
    return min(map(reach, state.parts))


def splits(states: Any) -> bool:
    """Whether a prompt may run over these one-row records in pieces and end as
    if it ran in one forward: every kind but a ring (``reach``)."""
    return min(map(reach, states)) == math.inf


def _seen(state) -> int:
    """The tokens a one-row record has seen."""
    return seen(state, 0)


def seen(state, row: int) -> int:
    """The tokens row ``row`` of a record has seen (a chunked record's ``offsets``:
    its ``lengths`` count only the tokens it holds, its current chunk's)."""
    return (state.offsets if isinstance(state, ChunkedState) else state.lengths)[row]


def _supersedes(key: tuple, entry: _Entry) -> bool:
    """Whether an entry for ``key`` makes ``entry`` redundant: it holds a strict
    prefix of ``key`` and no lease pins it."""
    n = len(entry.tokens)
    return not entry.pins and n < len(key) and entry.tokens == key[:n]


def _units(states) -> list:
    """The records ``resident_bytes`` counts once each for ``states``."""
    return [x for s in states for x in resident_records(s)]


class PrefixLease(Releasable):
    """A pin on one cache entry, with rows reading its first ``matched`` tokens.

    Attributes:
        tokens: the entry's tokens.
        matched: how many leading tokens of the looked-up sequence it holds.
        states: one ``SharedState`` row per layer reading those tokens (no copy).
    """

    __slots__ = ("_cache", "_entry", "matched", "released", "states", "tokens")

    def __init__(self, cache: PrefixCache, entry: _Entry, matched: int) -> None:
        self._cache, self._entry = cache, entry
        self.tokens, self.matched = entry.tokens, matched
        cut = len(entry.tokens) - matched
        self.states = [fork(s, 0, 0) for s in entry.states]  # (dense rows shared)
        if cut:  # (only entries that cut freely are cut: _Entry.usable)
            self.states = [ops.trim(s, cut) for s in self.states]
        self.released = False
        entry.pins += 1

    def release(self) -> None:
        """Unpin the entry (exactly once); the ``states`` stay valid."""
        if self.released:
            raise bad("lease", "an unreleased prefix lease", "one released already")
        self.released = True
        self._entry.pins -= 1
        self._cache._fit()


def _check_states(states, arg="states") -> list:
    if isinstance(states, (str, bytes)) or not hasattr(states, "__len__"):
        raise bad(arg, "a list of records (one per layer)", type(states).__name__)
    states = list(states)
    check(len(states) >= 1, arg, "at least one record", "none")
    for i, s in enumerate(states):
        if not isinstance(s, _KINDS):
            raise bad(f"{arg}[{i}]", "a kvstate record", type(s).__name__)
    return states


_KINDS = (
    CacheState,
    CompressedState,
    QuantizedState,
    SharedState,
    RotatingState,
    ChunkedState,
    RecurrentState,
    CompositeState,
)


def _compact(state):
    """What an entry stores of a one-row record: the record itself when it is
    a dense row without padding (the running row and the entry then share
    it), else ``extract_row`` (the row's own tokens copied; a shared prefix
    stays shared; a ring, chunked, recurrent or composite row copied whole)."""
    if type(state) in (CacheState, QuantizedState) and state.left_pad == (0,):
        return state
    return ops.extract_row(state, 0)


class PrefixCache:
    """Token prefixes -> one-row records per layer, LRU within a byte budget.

    Args:
        max_bytes: the budget; inserts drop unpinned least recently used
            entries until the resident bytes fit (0: keep nothing unpinned).
        identity: the model's identity (``model_identity``); ``save`` records
            it and ``load`` refuses a file made for another one.
    """

    def __init__(self, max_bytes: int, *, identity: str | None = None) -> None:
        max_bytes = as_int(max_bytes, "max_bytes")
        check(max_bytes >= 0, "max_bytes", ">= 0", max_bytes)
        if identity is not None and not isinstance(identity, str):
            raise bad("identity", "a str (model_identity(path))", type(identity).__name__)
        self.max_bytes, self.identity = max_bytes, identity
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # oldest first
        self._resident: dict = {}  # id(record) -> [record, entries holding it]: bytes counted once
        self._bytes = 0  # resident_bytes(self.records()), kept as entries come and go
        self.peak_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def records(self) -> list:
        """Every record the entries hold (for ``resident_bytes`` over a batch and its cache)."""
        return [s for e in self._entries.values() for s in e.states]

    def __contains__(self, tokens) -> bool:
        return tuple(tokens) in self._entries

    def keys(self) -> list:
        """The entries' token tuples, oldest first."""
        return list(self._entries)

    def copy(self) -> PrefixCache:
        """A cache with the same budget, identity and entries, none pinned. The
        records are immutable values, so the copy holds the same ones: no bytes
        are copied, and what either cache does later leaves the other as it is."""
        out = PrefixCache(self.max_bytes, identity=self.identity)
        for key, entry in self._entries.items():
            out._add(_Entry(key, entry.states))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold, each shared record counted once
        (``resident_bytes(self.records())``, counted as entries come and go: an
        insert costs its own records, not a walk over every entry)."""
        return self._bytes

    def _add(self, entry: _Entry) -> None:
        self._entries[entry.tokens] = entry
        for x in _units(entry.states):
            got = self._resident.get(id(x))
            if got is None:
                self._resident[id(x)] = [x, 1]
                self._bytes += x.nbytes
            else:
                got[1] += 1

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key)
        for x in _units(entry.states):
            got = self._resident[id(x)]
            got[1] -= 1
            if not got[1]:
                del self._resident[id(x)]
                self._bytes -= x.nbytes

    @property
    def pinned(self) -> int:
        """Entries that a lease holds now."""
        return sum(1 for e in self._entries.values() if e.pins)

    def insert(self, tokens: Sequence[int], states: Sequence) -> bool:
        """Cache ``states`` (one record per layer, one row each, holding exactly
        ``tokens``). A row is stored compactly (``extract_row``: its own tokens
        copied, a shared prefix still shared). Returns whether the entry is
        kept once the budget is enforced. A sequence cached already is only
        marked as recently used."""
        key = tuple(as_int(t, f"tokens[{i}]") for i, t in enumerate(tokens))
        check(len(key) >= 1, "tokens", "at least one token", "none")
        states = _check_states(states)
        for i, s in enumerate(states):
            check(
                s.batch_size == 1, f"states[{i}] batch size", "1 (one row per entry)", s.batch_size
            )
            check(
                _seen(s) == len(key), f"states[{i}] tokens", f"{len(key)} (len(tokens))", _seen(s)
            )
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        self._add(_Entry(key, [_compact(s) for s in states]))
        self._fit()
        return key in self._entries

    def insert_row(self, tokens: Sequence[int], states: Sequence, row: int) -> bool:
        """Cache the first ``len(tokens)`` tokens that row ``row`` of ``states`` (one
        record per layer, a batch) holds: a finished request's prompt and completion.

        The row's own tokens are copied once (``extract_row``; a prefix it reads
        stays shared), then cut to ``tokens``. Where the row's records cut freely
        (dense, quantized), entries no lease pins whose tokens are a strict prefix
        of ``tokens`` are dropped first (the new entry serves every prompt they
        served: a conversation keeps one entry, not one a turn); a recurrent or
        composite entry serves only a match of all its tokens, so its prefixes stay.
        Returns whether the entry is kept once the budget is enforced."""
        key = tuple(as_int(t, f"tokens[{i}]") for i, t in enumerate(tokens))
        check(len(key) >= 1, "tokens", "at least one token", "none")
        states = _check_states(states)
        row = as_int(row, "row")
        check(0 <= row < states[0].batch_size, "row", f"in [0, {states[0].batch_size})", row)
        held = seen(states[0], row)
        check(len(key) <= held, "tokens", f"at most {held} (the tokens row {row} holds)", len(key))
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        layers = [ops.extract_row(s, row) for s in states]
        if held > len(key):
            layers = [ops.trim(s, held - len(key)) for s in layers]
        entry = _Entry(key, layers)
        if entry.cuts:  # it serves every prompt a prefix of it served (rows that cut freely)
            for old in [k for k, e in self._entries.items() if _supersedes(key, e)]:
                self._drop(old)
        self._add(entry)
        self._fit()
        return key in self._entries

    def pin(self, tokens: Sequence[int]) -> PrefixLease | None:
        """A lease on the entry holding exactly ``tokens`` (all of them), or ``None``."""
        e = self._entries.get(tuple(tokens))
        if e is None:
            return None
        self._entries.move_to_end(e.tokens)
        return PrefixLease(self, e, len(e.tokens))

    def lookup(self, tokens: Sequence[int], *, min_tokens: int = 1) -> PrefixLease | None:
        """A lease on the entry sharing the longest prefix with ``tokens``
        (at most ``len(tokens) - 1`` tokens, at least ``min_tokens``), or ``None``."""
        query = _ids(tokens)
        limit = len(query) - 1
        best, best_n = None, 0
        for e in self._entries.values():
            n = e.usable(min(_common(e.array, query), limit), len(query))
            if n > best_n or (
                n == best_n and best is not None and n and len(e.tokens) < len(best.tokens)
            ):
                best, best_n = e, n
        if best is None or best_n < max(1, min_tokens):
            return None
        self._entries.move_to_end(best.tokens)
        return PrefixLease(self, best, best_n)

    def _fit(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        self.shrink(self.max_bytes)

    def shrink(self, max_bytes: int) -> int:
        """Drop unpinned entries, least recently used first, until the entries hold at
        most ``max_bytes`` (or only pinned ones are left: rows read them); the budget
        ``max_bytes`` of later inserts is unchanged. Returns the entries dropped."""
        dropped = 0
        while self.nbytes > max_bytes:
            victim = next((k for k, e in self._entries.items() if not e.pins), None)
            if victim is None:
                break  # everything left is pinned: rows read it
            self._drop(victim)
            self.evictions += 1
            dropped += 1
        return dropped

    # --- persistence -------------------------------------------------------------

    def save(self, path) -> None:
        """Write every entry to one ``.safetensors`` file (``kv.save``).

        Shared rows are written materialized (each entry self-contained), so
        the file holds dense records; ``identity`` is recorded when set.
        """
        records, entries = [], []
        for e in self._entries.values():
            layers = [materialize(s) if isinstance(s, SharedState) else s for s in e.states]
            entries.append({"tokens": list(e.tokens), "layers": len(layers)})
            records += layers
        meta = {ENTRIES_KEY: json.dumps(entries, separators=(",", ":"))}
        if self.identity is not None:
            meta[persist.DIGEST_KEY] = self.identity
        persist.save(path, records, meta)

    @classmethod
    def load(cls, path, max_bytes: int, *, identity: str | None = None) -> PrefixCache:
        """The cache ``save`` wrote. With ``identity``, a file recorded for
        another model (or with no identity) is refused (``KVStateError``)."""
        records, meta = persist.load(path)
        have = meta.get(persist.DIGEST_KEY)
        if identity is not None:
            if have is None:
                raise bad(
                    "path",
                    "a prefix cache recording a model identity",
                    "a file with no model identity",
                )
            check(
                have == identity,
                "path",
                f"a prefix cache for this model ({identity[:16]}…)",
                f"one for another model ({have[:16]}…)",
            )
        check(
            ENTRIES_KEY in meta,
            "path",
            "a file written by PrefixCache.save",
            f"no {ENTRIES_KEY!r} metadata",
        )
        out = cls(max_bytes, identity=identity if identity is not None else have)
        at = 0
        for e in json.loads(meta[ENTRIES_KEY]):
            layers = records[at : at + e["layers"]]
            at += e["layers"]
            out.insert(e["tokens"], layers)
        mx.eval([p for s in records for p in s.planes])
        return out


# --- prefill through the mlx-lm bridge ---------------------------------------------------


def prefill(
    model,
    prompts: Sequence[Sequence[int]],
    cache: PrefixCache | None = None,
    *,
    memo=None,
    prefill_step_size: int | None = None,
    **make,
) -> tuple:
    """Prefill each prompt, reusing the longest cached prefix, then merge the rows.

    A prompt whose start is cached prefills only the rest (its rows read the
    cached records, no copy); every prompt is then cached for the requests
    that follow. A prompt with tokens to run besides its last runs them and
    its last token in one forward, the output layer on the last position
    only (``kvstate.mlx_lm.forward(..., last=True)``): a cached request is
    one forward, not two. Prompts whose every token but the last is cached
    (the n samples of a prompt, a repeated request) run their last tokens
    together in one batched ``step``. Rows are ``SharedState`` records, so
    rows of different prefixes merge into one batch.

    Args:
        model: an mlx-lm model.
        prompts: lists of token ids, one per row.
        cache: the prefix cache (``None``: no reuse; rows still share nothing).
        prefill_step_size: most tokens per forward (``None``: each prompt's
            uncached rest in one forward).
        make: ``make_states`` options (``kv_bits``, ``kv_group_size``).

    Returns:
        ``(logits [B, V], states, leases, prefilled)``: the last logits per
        row, the merged states (one ``SharedState`` per layer), per row the
        lease pinning the cache entry it reads (``None`` when none; release
        each when its row finishes), and per row the tokens actually run
        through the model.
    """
    check(len(prompts) >= 1, "prompts", "at least one prompt", "none")
    if prefill_step_size is not None:
        prefill_step_size = as_int(prefill_step_size, "prefill_step_size")
        check(prefill_step_size >= 1, "prefill_step_size", ">= 1", prefill_step_size)
    prompts = [list(p) for p in prompts]
    leases: list = []
    try:
        return _prefill_all(model, prompts, cache, memo, prefill_step_size, make, leases)
    except BaseException:  # a failed prefill pins nothing: the leases it took go back
        for lease in leases:
            if lease is not None:
                lease.release()
        raise


def _prefill_all(model, prompts, cache, memo, prefill_step_size, make, leases: list) -> tuple:
    """``prefill``'s work; each lease taken goes into ``leases`` as it is taken."""
    rows, prefilled = [], []
    last: dict[int, mx.array] = {}  # prompt -> its logits, where its rest ran alone
    for i, p in enumerate(prompts):
        check(len(p) >= 1, f"prompts[{i}]", "at least one token", "an empty prompt")
        row, ran, logits = _prefill_prompt(model, p, cache, memo, prefill_step_size, make, leases)
        if logits is not None:
            last[i] = logits
        prefilled.append(ran)
        rows.append(row)
    ran = sorted(last)
    wait = [b for b in range(len(prompts)) if b not in last]
    if not wait:
        return (
            mx.concatenate([last[b] for b in ran], axis=0),
            bridge.merge_rows(rows),
            leases,
            prefilled,
        )
    logits, states = _step_waiting(model, prompts, rows, last, wait, cache, memo)
    return logits, states, leases, prefilled


@attrs.frozen(eq=False)
class Partial:
    """A prompt on its way through the model: a value the scheduler holds between rounds.

    Attributes:
        prompt: the prompt's token ids.
        states: one record per layer, one row, holding ``prompt[:done]``.
        done: prompt tokens the states hold (the cached prefix, then the chunks run).
        ran: tokens run through the model so far (``done`` less the cached prefix).
        lease: the prefix-cache entry the states read (``None``: none).
        logits: the last prompt token's logits ``[1, V]`` once ``done == len(prompt)``.
    """

    prompt: tuple
    states: tuple
    done: int
    ran: int = 0
    lease: Optional[PrefixLease] = None
    logits: Optional[mx.array] = None

    @property
    def rest(self) -> int:
        """Prompt tokens still to run."""
        return len(self.prompt) - self.done


def begin(
    model: Any, prompt: Sequence[int], cache: PrefixCache | None = None, **make: Any
) -> Partial:
    """A ``Partial`` of ``prompt``: its longest cached prefix leased (at most all but
    the last token), nothing run yet.

    Args:
        model: an mlx-lm model.
        prompt: the prompt's token ids (at least one).
        cache: the prefix cache, or ``None``.
        make: ``make_states`` options.
    """
    prompt = tuple(prompt)
    check(len(prompt) >= 1, "prompt", "at least one token", "an empty prompt")
    hit = cache.lookup(prompt) if cache is not None else None
    if hit is None:
        return Partial(prompt, tuple(bridge.make_states(model, 1, **make)), 0)
    return Partial(prompt, tuple(hit.states), hit.matched, lease=hit)


def advance(
    model: Any, part: Partial, n: int, *, step_size: int | None = None, memo: Any = None
) -> Partial:
    """``part`` with up to ``n`` more prompt tokens run (in forwards of at most
    ``step_size``, cut where a whole-prompt prefill cuts, at multiples of
    ``step_size`` past the cached prefix); each forward runs the output layer
    on its last position only (``forward(..., last=True)``), and the one that
    reaches the prompt's end gives its logits. The input is unchanged.

    A ring's prompt runs whole (``splits``: what a ring shows its last tokens
    depends on where a prompt is cut), so ``n`` must then be all of its rest."""
    n = min(as_int(n, "n"), part.rest)
    check(n >= 0, "n", ">= 0", n)
    states: Sequence = part.states
    if not splits(states):
        check(n in (0, part.rest), "n", f"0 or {part.rest} (a ring's prompt runs whole)", n)
        step_size = None
    done, ran, logits = part.done, part.ran, part.logits
    target = done + n
    while done < target:
        take = target - done
        if step_size is not None:
            take = min(take, step_size - ran % step_size)
        end = done + take == len(part.prompt)
        logits, states = bridge.forward(  # (the output layer on the last position only)
            model, mx.array([part.prompt[done : done + take]]), states, memo=memo, last=True
        )
        done, ran = done + take, ran + take
        if not end:  # bound the graph, as a whole-prompt prefill does between chunks
            mx.eval([p for s in states for p in s.planes])
    out = part.logits
    if n and done == len(part.prompt):
        assert logits is not None  # (a forward ran)
        out = logits[:, -1, :]
    return attrs.evolve(part, states=tuple(states), done=done, ran=ran, logits=out)


def settle(part: Partial, cache: PrefixCache | None) -> tuple:
    """A ``Partial``'s row once its run is over: ``prompt[:done]`` cached (when
    there is a cache) and the row re-pinned to that entry.

    Returns:
        ``(states, lease)``: the row's records (the cache entry's, when cached)
        and the lease it holds (``None``: none; release it when the row leaves).
    """
    states, hit = list(part.states), part.lease
    cached = part.prompt[: part.done]
    if cached and cache is not None and cache.insert(cached, states):
        pinned = cache.pin(cached)  # the row reads the entry (the same records when dense)
        assert pinned is not None  # inserted just above
        states = pinned.states
        if hit is not None:
            hit.release()
        hit = pinned
    return states, hit


def _prefill_prompt(
    model, p: Sequence[int], cache, memo, prefill_step_size, make: dict, leases: list
) -> tuple:
    """Prefill one prompt past its cached prefix, caching it and pinning the entry it reads.

    The lease the row holds (or ``None``) goes into ``leases`` as soon as it is
    taken, so a forward that fails leaves no entry pinned (``prefill``).

    Args:
        model: an mlx-lm model.
        p: the prompt's token ids (at least one).
        cache: the prefix cache, or ``None``.
        memo: the forward's memo.
        prefill_step_size: most tokens per forward, or ``None``.
        make: ``make_states`` options.
        leases: the prompts' leases so far; this prompt's is appended.

    Returns:
        ``(row, ran, logits)``: the row's states (``SharedState``s), the
        tokens run through the model, and the
        last logits ``[1, V]`` where the rest ran here (``None``: the last token
        waits for the batched step).
    """
    part = begin(model, p, cache, **make)
    leases.append(part.lease)
    rest = part.rest  # (lookup leaves at least the last token to run)
    if rest > 1:  # the rest and the last token in one forward (chunks: the last)
        part = advance(model, part, rest, step_size=prefill_step_size, memo=memo)
    states, leases[-1] = settle(part, cache)
    return fork(states, 0, 0), rest, part.logits


def _step_waiting(
    model, prompts: Sequence, rows: list, last: dict, wait: list, cache, memo
) -> tuple:
    """Run the last tokens of the rows in ``wait`` in one batched step; merge all rows.

    Those rows are cached up to their last token; the whole prompts are cached
    after the step (a next turn reuses all of them).

    Returns:
        ``(logits [B, V], states)`` in prompt order.
    """
    ran = sorted(last)
    tokens = mx.array([prompts[b][-1] for b in wait])
    lg, stepped = bridge.step(model, tokens, bridge.merge_rows([rows[b] for b in wait]), memo=memo)
    if cache is not None:  # the whole prompts too (a next turn reuses all of them)
        for j, b in enumerate(wait):
            cache.insert(prompts[b], [ops.extract_row(s, j) for s in stepped])
    logits = mx.concatenate([last[b] for b in ran] + [lg], axis=0)
    states = bridge.merge_rows([rows[b] for b in ran] + [stepped])
    order = ran + wait  # (the rows as merged)
    if order != sorted(order):  # back in prompt order
        back = [order.index(b) for b in range(len(prompts))]
        logits = logits[mx.array(back)]
        states = [ops.filter_rows(s, back) for s in states]
    return logits, states
