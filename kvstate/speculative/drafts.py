"""Draft sources for speculative decoding: prompt lookup and a draft model.

A drafter proposes, for every row of a batch, up to ``k[b]`` tokens that
continue the row's context; the target then verifies every row's window in
one forward (``kvstate.speculative``). Two sources:

* ``Lookup``: prompt lookup. The row's last ``n`` tokens are searched for
  in its own earlier context (``n`` from ``max_ngram`` down to
  ``min_ngram``); the tokens that followed the latest match are the draft.
  No second model, no device work: it pays where the output repeats the
  input (rewriting, summarizing, editing code) and proposes nothing (a plain
  step) where there is no match.
* ``DraftModel``: any mlx-lm model with the target's vocabulary, run on its
  own kvstate records through the bridge. It drafts one token per step,
  so its records take the draft one token at a time; ``settle`` brings them
  back to each row's accepted count (``kvstate.speculative.commit``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..core.args import as_int
from ..errors import bad, check

if TYPE_CHECKING:
    from ..bridge.shells import Model


@attrs.frozen
class Lookup:
    """Prompt lookup: drafts copied from the row's own context.

    Attributes:
        max_ngram: longest suffix searched for.
        min_ngram: shortest suffix searched for (>= 1).
        ride_ngram: shortest suffix searched for a row with no draft of its own in a
            round that verifies a wider window anyway (its columns are paid for: a
            weaker match costs nothing there); ``min_ngram``: no such rows.
    """

    max_ngram: int = 3
    min_ngram: int = 2
    ride_ngram: int = 1

    def __attrs_post_init__(self):
        lo, hi = as_int(self.min_ngram, "min_ngram"), as_int(self.max_ngram, "max_ngram")
        ride = as_int(self.ride_ngram, "ride_ngram")
        check(lo >= 1, "min_ngram", ">= 1", lo)
        check(hi >= lo, "max_ngram", f">= min_ngram={lo}", hi)
        check(1 <= ride <= lo, "ride_ngram", f"in [1, min_ngram={lo}]", ride)


@attrs.frozen
class DraftModel:
    """A smaller mlx-lm model with the target's vocabulary.

    Attributes:
        model: the draft model (runs through ``kvstate.mlx_lm.forward``).
        make: ``make_states`` options for its records (``max_kv_size``,
            ``kv_bits``, ``kv_group_size``).
    """

    model: Model = attrs.field(eq=False)
    make: dict = attrs.field(factory=dict, eq=False)


def lookup(context: Sequence[int], k: int, *, max_ngram: int = 3, min_ngram: int = 2) -> list:
    """Up to ``k`` tokens that followed the latest earlier match of the context's suffix.

    The suffix of length ``n`` (``max_ngram`` down to ``min_ngram``) is
    matched against every earlier window of the context; the longest ``n``
    that matches wins, and of its matches the latest (nearest the end: what
    a rewrite copies next). Returns ``[]`` when nothing matches.

    Args:
        context: the row's tokens so far (prompt and output).
        k: most tokens to propose.
    """
    L = len(context)
    if k <= 0 or L < min_ngram + 1:
        return []
    # One C-speed byte search per n (4 bytes a token; a match must start on a
    # token boundary): a round's lookups are host work between device steps.
    buf = array("I", context).tobytes()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        pattern, end = buf[4 * (L - n) :], 4 * (L - 1)  # windows inside context[:-1]
        at = buf.rfind(pattern, 0, end)
        while at > 0 and at % 4:
            at = buf.rfind(pattern, 0, at + 4 * n - 1)
        if at >= 0:
            start = at // 4 + n
            return list(context[start : start + k])
    return []


def validate_drafter(drafter: Any) -> Lookup | DraftModel | None:
    """``drafter`` if it is ``None``, a ``Lookup`` or a ``DraftModel``, else KVStateError."""
    if drafter is None or isinstance(drafter, (Lookup, DraftModel)):
        return drafter
    raise bad(
        "drafter",
        "None, kvstate.drafts.Lookup or kvstate.drafts.DraftModel",
        type(drafter).__name__,
    )


def truncated(model: Model, layers: int) -> Model:
    """The first ``layers`` layers of an mlx-lm llama-family ``model`` as a draft
    model (its embedding, final norm and head are shared, not copied).

    A draft with the target's vocabulary and no training: "the target's first
    layers". Works for models whose inner module keeps ``layers`` as a list.
    """
    import copy

    layers = as_int(layers, "layers")
    inner: Any = getattr(model, "model", None)
    check(
        inner is not None and hasattr(inner, "layers"),
        "model",
        "an mlx-lm model with model.layers",
        type(model).__name__,
    )
    n = len(inner.layers)
    check(1 <= layers <= n, "layers", f"in [1, {n}]", layers)
    draft = copy.copy(model)
    draft.model = copy.copy(inner)
    draft.model.layers = inner.layers[:layers]
    if hasattr(inner, "num_hidden_layers"):
        draft.model.num_hidden_layers = layers
    if hasattr(draft, "args"):
        draft.args = copy.copy(model.args)
        draft.args.num_hidden_layers = layers
    return draft


__all__ = ["DraftModel", "Lookup", "lookup", "truncated", "validate_drafter"]
