"""Cost-aware verify windows: how wide a speculative round is, from measured cost.

A round verifies a ``[B, W]`` window: every row pays the widest draft. It
pays when the tokens it is expected to emit beat a plain step's ``B`` by
more than the round costs over a plain step::

    value(W) = (B + sum_b E[accepted_b | min(avail_b, W - 1) drafts]) / cost(B, W)

in tokens per plain-step time (``cost`` in plain steps: a plain step is worth ``B``).

``E[accepted | k] = a + a^2 + .. + a^k`` for a row whose drafts are
accepted position by position with probability ``a`` (its running
acceptance: recent evidence, decayed each round toward a prior, so a row
that stopped drafting is tried again later). ``cost(B, W)`` is the median
of the last rounds measured on the device in use (wall time of a whole
round, host work included); until a width has ``samples`` rounds, the model
``1 + slope * (W - 1)`` plain steps, ``slope`` taken from the widest width
measured so far (the prior ``slope`` before any). The chosen width maximizes
``value``; ``W = 1`` (a plain step) unless a wider round beats it by
``margin``. Decisions and the reasons: ``notes/speculative.md``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import cast

import attrs

from ._buckets import BUCKETS, bucket_of
from .errors import check


def bucket(B: int) -> int:
    """The power of two at or above ``B`` (the compiled decoder's batch bucket,
    ``_buckets.bucket_of``): batch sizes whose round costs are pooled."""
    return bucket_of(max(B, 1), BUCKETS)


def expected_accepted(alpha: float, k: int) -> float:
    """``alpha + alpha^2 + .. + alpha^k``: accepted drafts of ``k`` when each is
    accepted with probability ``alpha`` given the ones before it were."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= alpha
        total += term
    return total


@attrs.frozen
class Window:
    """The cost-aware window rule and the round costs measured so far (data only).

    Attributes:
        costs: ``{(bucket(B), W): (seconds, ...)}``: the last ``keep`` measured
            rounds of window width ``W`` at batch sizes in ``B``'s bucket.
        slope: modelled cost of each window column past the first, in plain
            steps, for a width not yet measured ``samples`` times.
        samples: measured rounds of a ``(B, W)`` before its median replaces the model.
        keep: measured rounds kept per ``(B, W)``.
        prior: a row's acceptance before (and long after) it drafted.
        weight: pseudo-drafts behind the prior.
        decay: per round, how much of a row's older acceptance evidence is kept.
        margin: a wider round is chosen only when its value beats a plain
            step's by this factor.
    """

    costs: dict = attrs.field(factory=dict, eq=False)
    slope: float = 0.25
    samples: int = 3
    keep: int = 9
    prior: float = 0.5
    weight: float = 1.0
    decay: float = 0.9
    margin: float = 1.05

    def __attrs_post_init__(self):
        check(self.samples >= 1, "samples", ">= 1", self.samples)
        check(self.keep >= self.samples, "keep", f">= samples={self.samples}", self.keep)
        check(0.0 <= self.decay <= 1.0, "decay", "in [0, 1]", self.decay)
        check(0.0 <= self.prior <= 1.0, "prior", "in [0, 1]", self.prior)
        check(self.weight > 0, "weight", "> 0", self.weight)
        check(self.slope >= 0, "slope", ">= 0", self.slope)

    def measured(self, B: int, W: int) -> float | None:
        """The median measured seconds of a ``(B, W)`` round, or ``None`` below ``samples``.

        Batch sizes share their power-of-two bucket (``bucket``): rows join and
        leave, and a new ``B`` should not start measuring from nothing."""
        got = self.costs.get((bucket(B), W), ())
        return statistics.median(got) if len(got) >= self.samples else None

    def cost(self, B: int, W: int) -> float:
        """A ``(B, W)`` round's cost in plain steps of ``B`` rows (measured, else modelled)."""
        if W == 1:
            return 1.0
        plain, wide = self.measured(B, 1), self.measured(B, W)
        if plain is None:
            return 1.0 + self.slope * (W - 1)
        if wide is not None:
            return wide / plain
        return 1.0 + self._slope(B, plain) * (W - 1)

    def _slope(self, B: int, plain: float) -> float:
        """Cost per extra column: from the widest width measured at ``B``, else ``slope``."""
        widths = [w for (b, w) in self.costs if b == bucket(B) and w > 1 and self.measured(B, w)]
        if not widths:
            return self.slope
        W = max(widths)
        return max(0.0, (cast(float, self.measured(B, W)) / plain - 1.0) / (W - 1))

    def record(self, B: int, W: int, seconds: float) -> Window:
        """This rule with one more measured round."""
        key = (bucket(B), W)
        costs = dict(self.costs)
        costs[key] = (costs.get(key, ()) + (seconds,))[-self.keep :]
        return attrs.evolve(self, costs=costs)

    def alpha(self, seen: tuple) -> float:
        """A row's running acceptance from its decayed ``(accepted, tried)``."""
        hits, tries = seen
        return (hits + self.prior * self.weight) / (tries + self.weight)

    def observe(self, seen: tuple, drafted: int, accepted: int, missing: bool) -> tuple:
        """A row's ``(accepted, tried)`` after a round (decayed, then this round's
        evidence): ``accepted`` of ``drafted`` drafts; a row asked for drafts
        that had none to offer (``missing``: prompt lookup found no match)
        counts one failed try."""
        hits, tries = (self.decay * x for x in seen)
        if drafted:
            return hits + accepted, tries + accepted + (accepted < drafted)
        return hits, tries + bool(missing)

    def choose(self, B: int, alphas: Sequence[float], avail: Sequence[int]) -> int:
        """The window width of a round: 1 (a plain step) or ``1 + k``.

        Args:
            B: rows in the round.
            alphas: each row's running acceptance.
            avail: each row's draft tokens at hand (or its limit, for a bound
                taken before drafting).
        """
        if self.measured(B, 1) is None:  # measure the plain step first: it is never worse
            return 1
        best, best_value = 1, float(B) * self.margin
        for W in range(2, 2 + max(avail, default=0)):
            gain = sum(expected_accepted(a, min(n, W - 1)) for a, n in zip(alphas, avail))
            value = (B + gain) / self.cost(B, W)
            if value > best_value:
                best, best_value = W, value
        return best


__all__ = ["Window", "bucket", "expected_accepted"]
