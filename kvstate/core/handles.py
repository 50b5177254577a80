"""Handles: no record shares an array object with anyone.

MLX's in-place write (``a[...] = x``, ``a[i] += 1``) rebinds the array
*object* ``a`` to a new graph node; every holder of that same object sees
the change, while another object over the same data does not (the write
copies the buffer then: it is no longer free). So a record's arrays are
stored under handles that nobody else holds: every array field copies the
handle it is given (``fresh``) and hands out a new one on every read. A
handle copy is a new Python object over the same graph node: no data is
copied, and a write through it copies the buffer only when it happens
(``notes/core.md``, "Handles").
"""

from __future__ import annotations

import attrs
import mlx.core as mx

__all__ = ["Owned", "fresh", "owns_arrays"]

_copy_handle = mx.array.__copy__


def fresh(value):
    """``value`` with every ``mx.array`` in it (alone, or in nested tuples) a
    new handle over the same data: writing into the result in place never
    changes ``value``, nor the other way round. Anything else is returned as
    it is."""
    if type(value) is mx.array:
        return _copy_handle(value)
    if type(value) is tuple:
        return tuple(map(fresh, value))
    return value


class Owned:
    """An array field (a slot) whose handle only its record holds: ``__set__``
    stores a fresh handle of what it is given (a caller's array stays the
    caller's), ``__get__`` returns a fresh handle (a reader's write in place
    changes the reader's handle, never the record)."""

    __slots__ = ("get", "put")

    def __init__(self, slot):
        self.get = slot.__get__
        self.put = slot.__set__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = self.get(obj, cls)
        return _copy_handle(value) if type(value) is mx.array else fresh(value)

    def __set__(self, obj, value):
        self.put(obj, _copy_handle(value) if type(value) is mx.array else fresh(value))


def owns_arrays(*names: str):
    """Class decorator (after ``attrs.frozen``): fields ``names`` hold arrays
    (or tuples of them) behind handles only the record holds (``Owned``).

    Equality compares those fields by their stored handles (the same arrays,
    as records derived from one another share them) and the other fields by
    ``==``: the arrays' contents are never read, as before handles, when two
    records holding the same array objects compared equal."""

    def install(cls):
        for name in names:
            setattr(cls, name, Owned(cls.__dict__[name]))
        fields = tuple((f.name, f.name in names) for f in attrs.fields(cls) if f.eq)
        cls.__eq__ = _equal(fields)
        cls.__ne__ = lambda self, other: not (self == other)
        return cls

    return install


def _equal(fields: tuple):
    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        for name, owned in fields:
            if owned:
                get = type(self).__dict__[name].get
                if not _same(get(self), get(other)):
                    return False
            elif getattr(self, name) != getattr(other, name):
                return False
        return True

    return __eq__


def _same(a, b) -> bool:
    """``a`` and ``b`` are the same stored arrays (identity, item by item in tuples)."""
    if type(a) is tuple and type(b) is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    return a is b
