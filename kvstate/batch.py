"""A batch in flight: a model's layer records plus the per-row data that follows each row.

A serving loop holds, besides the cache, one pending token, one set of
sampling parameters, one PRNG key, one request id and maybe some user data
per row. ``Batch`` keeps them in one frozen value, and every row operation
moves them with their row::

    kv.filter_rows(batch, rows)    kv.extract_row(batch, row)    kv.fork(batch, row, n)
    kv.extend(batch, other)        kv.merge_rows([a, b, c])
    kv.checkpoint(batch)           kv.rollback(batch, cp, keep)  kv.trim(batch, n)

The pending-token rule: ``tokens[b]`` is the last token sampled for row
``b``, and it is **not in the cache yet**. The cache holds the prompt and
every token sampled before it; the next step feeds ``tokens`` (appending
them) and samples the next ones::

    cache of row b:   p p p p p t1 t2 t3          tokens[b] = t4   (sampled, not fed)
                      \\_prompt_/\\_fed_/

So a batch saved and loaded resumes by one step, with no guesswork about
which token to feed (``kvstate.mlx_lm.advance``). A row's completion so far
is what the loop emitted: every ``tokens`` it saw, ``t1 .. t4`` above.

Per-row fields are the ``attrs`` fields marked ``metadata={"row": True}``:
an ``mx.array`` is indexed on its first axis, a tuple item by item. A new
per-row field needs nothing else. ``take_rows`` and ``join_rows`` are the
two operations every row function is built from (``kv.fork`` too).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx

from .core import ops
from .core.args import row_index, row_list
from .core.handles import owns_arrays
from .core.layers import _layers
from .core.records import _RowsOfFirst, rows_of
from .errors import bad
from .kinds.shared import fork
from .sampling import Sampling, check_keys, row_keys, sample_arrays

__all__ = ["Batch", "join_rows", "row_fields", "take_rows"]


ROW = {"row": True}  # the metadata of a per-row field


def _records(states) -> tuple:
    return tuple(_layers(ops.filter_rows, states))


def _tokens(value) -> mx.array:
    if isinstance(value, mx.array):
        return value
    if isinstance(value, (list, tuple)):
        return mx.array(list(value), mx.uint32) if value else mx.zeros((0,), mx.uint32)
    raise bad(
        "tokens",
        "an mx.array [B] or a list of ints (the pending token per row)",
        type(value).__name__,
    )


def _per_row(value, self):
    """One value per row; a single ``kv.Sampling`` applies to every row."""
    if isinstance(value, Sampling):
        return (value,) * self.batch_size
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad("per-row data", "a list or tuple (one value per row)", type(value).__name__)
    return tuple(value)


# mypy's attrs plugin does not read attrs.Converter (takes_self): the three fields using it
# carry a narrow ignore[misc].
_PER_ROW = attrs.Converter(_per_row, takes_self=True)


@owns_arrays("tokens", "keys")
@attrs.frozen
class Batch(_RowsOfFirst):
    """A model's records and per-row data, one value (see the module docstring).

    ``kv.Batch(states, tokens)`` fills in the rest: greedy sampling, keys from
    each row's ``sampling.seed`` (the row's index when ``None``), ``None`` ids
    and payloads.

    Attributes:
        states: one record per layer (a tuple), ``B`` rows each.
        tokens: ``[B]`` the pending token per row: sampled, not in the cache yet.
        sampling: per row, a ``kv.Sampling`` (temperature, top_p, top_k, min_p,
            seed); one ``kv.Sampling`` is taken for every row.
        keys: ``[B, 2]`` uint32, the PRNG key per row (``kv.row_keys``).
        ids: per row, a request id (any value).
        payload: per row, any user value.
    """

    states: tuple = attrs.field(converter=_records)
    tokens: mx.array = attrs.field(metadata=ROW, converter=_tokens)
    sampling: tuple = attrs.field(metadata=ROW, converter=_PER_ROW)  # type: ignore[misc]
    keys: mx.array = attrs.field(metadata=ROW)
    ids: tuple = attrs.field(metadata=ROW, converter=_PER_ROW)  # type: ignore[misc]
    payload: tuple = attrs.field(metadata=ROW, converter=_PER_ROW)  # type: ignore[misc]

    @sampling.default
    def _greedy(self):
        return (Sampling(),) * self.states[0].batch_size

    @keys.default
    def _seeded(self):
        sampling = self.sampling if len(self.sampling) == self.batch_size else ()
        return row_keys(
            [b if getattr(s, "seed", None) is None else s.seed for b, s in enumerate(sampling)]
            or range(self.batch_size)
        )

    @ids.default
    def _no_ids(self):
        return (None,) * self.states[0].batch_size

    @payload.default
    def _no_payload(self):
        return (None,) * self.states[0].batch_size

    def __attrs_post_init__(self):
        B = self.states[0].batch_size
        for i, s in enumerate(self.states):
            if s.batch_size != B:
                raise bad(f"states[{i}] batch size", f"{B} like states[0]", s.batch_size)
        tokens = self.tokens
        if tokens.shape != (B,) or not mx.issubdtype(tokens.dtype, mx.integer):
            raise bad(
                "tokens",
                f"an integer mx.array [{B}] (the pending token per row)",
                f"{tokens.dtype} {list(tokens.shape)}".replace("mlx.core.", ""),
            )
        check_keys(self.keys, B)
        for name in ("sampling", "ids", "payload"):
            if len(getattr(self, name)) != B:
                raise bad(name, f"{B} values (one per row)", len(getattr(self, name)))
        for b, s in enumerate(self.sampling):
            if not isinstance(s, Sampling):
                raise bad(f"sampling[{b}]", "a kv.Sampling", type(s).__name__)

    # batch_size, and lengths: per row, the tokens in the cache (the pending
    # token is not one of them), are the first layer's (records._RowsOfFirst).
    _first = "states"


def row_fields() -> list:
    """The names of ``Batch``'s per-row fields (``metadata={"row": True}``)."""
    return [f.name for f in attrs.fields(Batch) if f.metadata.get("row")]


def take_rows(b: Batch, rows: Sequence[int]) -> dict:
    """The per-row fields of rows ``rows`` (in that order), for ``attrs.evolve``."""
    return {name: rows_of(getattr(b, name), rows) for name in row_fields()}


def join_rows(batches: Sequence[Batch]) -> dict:
    """The per-row fields of ``batches``' rows, in order, for ``attrs.evolve``."""
    out: dict = {}
    for name in row_fields():
        values = [getattr(b, name) for b in batches]
        if isinstance(values[0], mx.array):
            out[name] = mx.concatenate(values, axis=0)
        else:
            out[name] = sum(values, ())
    return out


@ops.filter_rows.register
def filter_batch(b: Batch, rows):
    rows = row_list(rows, b.batch_size)
    return attrs.evolve(b, states=ops.filter_rows(b.states, rows), **take_rows(b, rows))


@ops.extract_row.register
def extract_batch_row(b: Batch, row):
    row = row_index(row, b.batch_size)
    return attrs.evolve(b, states=ops.extract_row(b.states, row), **take_rows(b, [row]))


@ops.merge_same_kind.register
def merge_batches(first: Batch, batches):
    states = ops.merge_rows([b.states for b in batches])
    return attrs.evolve(first, states=states, **join_rows(batches))


@ops.checkpoint.register
def checkpoint_batch(b: Batch):
    return ops.checkpoint(b.states)


@ops.rollback.register
def rollback_batch(b: Batch, checkpoint, keep=0):
    """The rows' records back to ``checkpoint`` plus ``keep``; per-row data unchanged
    (set the new pending tokens with ``attrs.evolve(batch, tokens=...)``)."""
    return attrs.evolve(b, states=ops.rollback(b.states, checkpoint, keep))


@ops.trim.register
def trim_batch(b: Batch, n):
    return attrs.evolve(b, states=ops.trim(b.states, n))


def fork_keys(keys: mx.array, row: int, n: int) -> mx.array:
    """``n`` new keys from row ``row``'s key, none equal to a key that row will use.

    The row itself keeps its key; ``sample`` splits a key in two (parts 0 and
    1), so the copies come from part 2 of a three-way split, split ``n`` ways.
    """
    if n == 0:
        return keys[:0]
    return mx.random.split(mx.random.split(keys[row], 3)[2], n)


def fork_batch(b: Batch, row, n, **kwargs):
    """``b``'s rows followed by ``n`` copies of ``row`` (``kv.fork``): the copies share
    its prefix and per-row data, and get their own keys (``fork_keys``) so that
    they sample differently."""
    row = row_index(row, b.batch_size)
    states = fork(b.states, row, n, **kwargs)
    rows = take_rows(b, list(range(b.batch_size)) + [row] * n)
    rows["keys"] = mx.concatenate([b.keys, fork_keys(b.keys, row, n)], axis=0)
    return attrs.evolve(b, states=states, **rows)


fork.register(Batch, fork_batch)


def sample_batch(logits: mx.array, b: Batch) -> tuple:
    """``(tokens [B], keys [B, 2])``: each row's next token from ``logits`` ``[B, V]``
    with its own sampling parameters and key (``kv.sample_arrays``)."""
    return sample_arrays(logits, b.keys, *sampling_arrays(b))


def sampling_arrays(b: Batch) -> tuple:
    """The rows' sampling parameters as ``sample_arrays`` takes them:
    ``(temperature, top_p, top_k, min_p)``, each ``[B]``."""
    s = b.sampling
    return (
        mx.array([x.temperature for x in s], mx.float32),
        mx.array([x.top_p for x in s], mx.float32),
        mx.array([x.top_k for x in s], mx.int32),
        mx.array([x.min_p for x in s], mx.float32),
    )
