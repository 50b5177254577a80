"""A model's records as one value: every ``kv`` function over a list or tuple of layers.

A model's cache is one record per layer (``kvstate.mlx_lm.make_states``).
Every generic function in ``kvstate.core.ops`` also takes such a list or tuple
and applies to each layer, returning the same container, JAX-style::

    cp = kv.checkpoint(states)                # one ModelCheckpoint for every layer
    states = kv.rollback(states, cp, keep=[2, 0, 1])
    states = kv.filter_rows(states, [0, 2])   # a list in, a list out
    states = kv.extend(states, newcomers)     # layer by layer
    states = kv.merge_rows([states_a, states_b, states_c])

Arguments that are per layer are a list with one item per layer: ``append``'s
``k`` and ``v`` and ``attend``'s ``q``. Every other argument (row indices,
``n``, ``keep``) applies to every layer. Results that are not records come
back per layer in the same container (``fetch``: ``(keys, values)`` per
layer; ``positions``, ``next_mask`` likewise); ``checkpoint`` gives one
``ModelCheckpoint``.
"""

from __future__ import annotations

import attrs

from ..errors import bad
from . import ops
from .records import Checkpoint, _RowsOfFirst, _tuple, share_row_ids

__all__ = ["ModelCheckpoint"]

_RECORD = "a kvstate record (CacheState, RotatingState, QuantizedState, ...)"


@attrs.frozen
class ModelCheckpoint(_RowsOfFirst):
    """One checkpoint of every layer of a model's records; holds no arrays.

    Attributes:
        layers: one ``Checkpoint`` per layer, in layer order.
    """

    layers: tuple = attrs.field(converter=_tuple)

    # batch_size, and lengths: per row, the tokens held at the checkpoint
    # (every layer has seen the same), are the first layer's (records._RowsOfFirst).
    _first = "layers"


def _like(states, items):
    return tuple(items) if isinstance(states, tuple) else list(items)


def _layers(fn, states) -> list:
    """``states`` as a list of records ``fn`` takes, else the error that says what to pass."""
    if not states:
        raise bad(
            "states", f"at least one layer record ({_RECORD})", "an empty " + type(states).__name__
        )
    generic = fn.dispatch(object)
    for i, s in enumerate(states):
        impl = fn.dispatch(type(s))
        if impl is generic or impl in _MODEL_IMPLS:
            raise bad(f"states[{i}]", f"{_RECORD}: pass one record per layer", type(s).__name__)
    return list(states)


def _per_layer_arg(value, n: int, arg: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad(arg, f"a list of {n} arrays (one per layer)", type(value).__name__)
    if len(value) != n:
        raise bad(arg, f"{n} arrays (one per layer)", len(value))
    return list(value)


_MODEL_IMPLS: set = set()


def _register(fn, per_layer: tuple = (), moves_rows: bool = False):
    """Register the list and tuple forms of generic ``fn``: each layer in turn.

    ``per_layer`` names the positional arguments (after the state) that
    carry one item per layer; the rest apply to every layer. ``moves_rows``:
    ``fn`` may give a repeated row a fresh id, which each layer would draw
    on its own; the layers then take one set (``share_row_ids``).
    """

    def over_layers(states, *args, **kwargs):
        layers = _layers(fn, states)
        n = len(layers)
        columns = [
            _per_layer_arg(a, n, per_layer[i]) if i < len(per_layer) else [a] * n
            for i, a in enumerate(args)
        ]
        out = [fn(s, *(c[j] for c in columns), **kwargs) for j, s in enumerate(layers)]
        return _like(states, share_row_ids(out) if moves_rows else out)

    over_layers.__name__ = over_layers.__qualname__ = f"{fn.__name__}_over_layers"
    over_layers.__doc__ = f"``kv.{fn.__name__}`` on each layer of a model's records."
    for container in (list, tuple):
        fn.register(container, over_layers)
    _MODEL_IMPLS.add(over_layers)


_register(ops.append, ("k", "v"))
_register(ops.fetch)
_register(ops.attend, ("q",))
_register(ops.next_mask)
_register(ops.positions)
_register(ops.trim)
_register(ops.filter_rows, moves_rows=True)
_register(ops.extract_row)


def checkpoint_layers(states) -> ModelCheckpoint:
    """One ``ModelCheckpoint`` of every layer (``kv.checkpoint`` on a list or tuple)."""
    return ModelCheckpoint(tuple(ops.checkpoint(s) for s in _layers(ops.checkpoint, states)))


def rollback_layers(states, checkpoint, keep=0):
    """Every layer back to ``checkpoint`` plus ``keep`` accepted tokens (``kv.rollback``)."""
    layers = _layers(ops.rollback, states)
    if isinstance(checkpoint, Checkpoint):  # one record's checkpoint, for every layer
        cps = [checkpoint] * len(layers)
    elif isinstance(checkpoint, ModelCheckpoint):
        cps = list(checkpoint.layers)
        if len(cps) != len(layers):
            raise bad("checkpoint layers", f"{len(layers)} (one per layer of states)", len(cps))
    else:
        raise bad(
            "checkpoint",
            "the ModelCheckpoint kv.checkpoint(states) returned",
            type(checkpoint).__name__,
        )
    return _like(states, (ops.rollback(s, cp, keep) for s, cp in zip(layers, cps)))


def merge_models(first, models):
    """``kv.merge_rows`` of models: per layer, the merge of that layer's records."""
    n = len(first)
    for i, m in enumerate(models):
        _layers(ops.filter_rows, m)
        if len(m) != n:
            raise bad(f"states[{i}] layers", f"{n} like states[0]", len(m))
    return _like(first, share_row_ids([ops.merge_rows([m[j] for m in models]) for j in range(n)]))


for _container in (list, tuple):
    ops.checkpoint.register(_container, checkpoint_layers)
    ops.rollback.register(_container, rollback_layers)
    ops.merge_same_kind.register(_container, merge_models)
_MODEL_IMPLS.update((checkpoint_layers, rollback_layers))
