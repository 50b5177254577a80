"""The one error type kvstate raises for bad input, and its message format.

Argument normalisation (ints, per-row values, row indices) is in
``kvstate.core.args``; every refusal it makes is built here, by ``bad``.
"""

from __future__ import annotations


class KVStateError(ValueError):
    """Bad input to a kvstate function.

    The message names the argument, the expected and the actual value. A call
    that raises has changed nothing: records are immutable and every check
    runs on the host before any MLX call.
    """


class LeaseError(KVStateError):
    """A mask lease was used after it was released."""


class LinkError(KVStateError):
    """A row migration's link to its peer failed: the peer's process died or the
    connection broke (MLX's ``RuntimeError``, chained as the cause)."""


def bad(arg: str, expected, actual, cls=KVStateError) -> KVStateError:
    """Build the standard error: ``arg: expected X, got Y``."""
    return cls(f"{arg}: expected {expected}, got {actual}")


def check(ok: bool, arg: str, expected, actual) -> None:
    if not ok:
        raise bad(arg, expected, actual)
