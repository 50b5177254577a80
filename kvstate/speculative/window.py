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
round, host work included); a width's first round at a batch bucket is not
kept (it pays one-time compilation). A price goes stale with the rule's
clock: a width not measured for ``stale`` rounds of its bucket (times its
excess over the prior model, in plain rounds, where that is over 1) is
modelled again (no dearer than its old median), so the rule can choose it,
and one round re-measures it (its old samples dropped): a price measured
under another mix of rounds (another kind of prompt) cannot keep a width out
for long, and a width far dearer than the model is retried rarely. Until a
width has ``samples`` fresh rounds (one, re-measuring a stale width), the
model ``1 + slope * (W - 1)`` plain steps,
``slope`` taken from the widest fresh width measured (the prior ``slope``
before any). The chosen width maximizes ``value``; ``W = 1`` (a plain step)
unless a wider round beats it by ``margin``. Decisions and the reasons: ``notes/speculative.md``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs

from ..compiled.buckets import BUCKETS, bucket_of
from ..core.records import derived
from ..errors import check

FREE = 1e-6  # the least price, in plain rounds: a round charged nothing (``_charge`` floors
# a drafting round's charge at 0) is priced as nearly free, never divided by


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
class Samples:
    """One ``(bucket, W)``'s measured rounds (data only; ``Window.record`` makes new ones).

    Attributes:
        seconds: the last ``Window.keep`` kept rounds, oldest first.
        median: their median (``None`` when there are none).
        at: the bucket's round count (``Window.rounds``) at the latest round recorded.
        uses: rounds recorded, the discarded first-use ones included.
    """

    seconds: tuple = ()
    median: float | None = None
    at: int = 0
    uses: int = 0


_NONE = Samples()


def _samples(costs: dict) -> dict:
    """``costs`` with plain tuples of seconds (a seeded table) as ``Samples``."""
    return {
        key: s
        if isinstance(s, Samples)
        else Samples(tuple(s), statistics.median(s) if s else None, 0, len(s))
        for key, s in costs.items()
    }


@attrs.frozen
class Window:
    """The cost-aware window rule and the round costs measured so far (data only).

    Attributes:
        costs: ``{(bucket(B), W): Samples}``: the measured rounds of window
            width ``W`` at batch sizes in ``B``'s bucket (a tuple of seconds
            is taken as that many rounds measured at round 0); entry rounds under
            ``(bucket(B), W, "entry")`` (``hysteresis``).
        rounds: ``{bucket(B): n}``: rounds recorded at each bucket (the clock
            ``stale`` counts in).
        slope: modelled cost of each window column past the first, in plain
            steps, for a width not yet measured ``samples`` times.
        samples: fresh measured rounds of a ``(B, W)`` before its median replaces the model.
        keep: measured rounds kept per ``(B, W)``.
        discard: first rounds of each ``(B, W)`` not kept (compilation, tracing).
        stale: rounds of its bucket after which a width's last measurement is
            stale (modelled again until one round re-measures it), times its
            excess over the prior model in plain rounds where that is over 1.
        prior: a row's acceptance before (and long after) it drafted.
        weight: pseudo-drafts behind the prior.
        decay: per round, how much of a row's older acceptance evidence is kept.
        margin: a wider round is chosen only when its value beats a plain
            step's by this factor.
        hysteresis: price entering drafting apart from staying in it. A drafting
            round after a plain round (an entry) is recorded with ``entry=True``
            under its own key ``(bucket(B), W, "entry")``, and a round after a plain
            round prices its widths from those samples (``choose``, ``pad`` and
            ``cost`` with ``entry=True``; ``_costs``: a width not measured as an
            entry at its steady cost plus the widest entry width's surcharge; the
            steady costs until an entry is measured). Off: one table, ``entry``
            ignored.
    """

    costs: dict = attrs.field(factory=dict, eq=False, converter=_samples)
    rounds: dict = attrs.field(factory=dict, eq=False)
    slope: float = 0.25
    samples: int = 3
    keep: int = 9
    discard: int = 1
    stale: int = 64
    prior: float = 0.5
    weight: float = 1.0
    decay: float = 0.9
    margin: float = 1.05
    hysteresis: bool = False

    def __attrs_post_init__(self) -> None:
        check(self.samples >= 1, "samples", ">= 1", self.samples)
        check(self.keep >= self.samples, "keep", f">= samples={self.samples}", self.keep)
        check(self.discard >= 0, "discard", ">= 0", self.discard)
        check(self.stale >= 1, "stale", ">= 1", self.stale)
        check(0.0 <= self.decay <= 1.0, "decay", "in [0, 1]", self.decay)
        check(0.0 <= self.prior <= 1.0, "prior", "in [0, 1]", self.prior)
        check(self.weight > 0, "weight", "> 0", self.weight)
        check(self.slope >= 0, "slope", ">= 0", self.slope)

    def _fresh(self, b: int, W: int, s: Samples) -> bool:
        """Measured within ``stale * excess`` rounds of its bucket (``excess``: its
        price over the prior model's, in plain rounds, at least 1). A re-measuring
        round costs the price, so one far dearer than the model is retried less
        often: re-measuring takes about ``1 / stale`` of the time or less however
        dear the width is, and a width near the model is retried every ``stale``
        rounds (a price from another mix of rounds does not last).

        The plain round's median, the unit of every price, is stale after ``4 *
        stale`` rounds: re-measuring it in a run of drafting rounds takes plain
        rounds the rule would not choose (the first after a drafting round is
        broken, no sample: ``speculative._charge``), and it drifts less than the
        prices measured in it."""
        age = self.rounds.get(b, 0) - s.at
        if W == 1:  # the unit (below)
            return age <= 4 * self.stale
        if age <= self.stale:  # fresh at any price (an excess is at least 1)
            return True
        return age <= self.stale * self._excess(b, W, s)

    def _excess(self, b: int, W: int, s: Samples) -> float:
        """A measured width's cost in plain rounds of bucket ``b`` over the prior
        model's ``1 + slope * (W - 1)``, at least 1; 1 where either median is missing."""
        if s.median is None:
            return 1.0
        plain = self._median(b, 1)
        if not plain:
            return 1.0
        return max(1.0, s.median / plain - self.slope * (W - 1) - 1.0)

    def _enough(self, s: Samples) -> bool:
        """``samples`` rounds kept, or one where the width had ``samples`` before: a
        stale width is re-measured in one round (compiled already; it was dropped
        for its age, not its noise)."""
        need = 1 if s.uses > self.discard + self.samples else self.samples
        return len(s.seconds) >= need

    def _key(self, b: int, W: int, entry: bool) -> tuple:
        """The ``costs`` key of a ``(bucket, W)`` round: ``(b, W, "entry")`` for an
        entry round under ``hysteresis``, else ``(b, W)``."""
        return (b, W, "entry") if entry and self.hysteresis and W > 1 else (b, W)

    def _median(self, b: int, W: int, entry: bool = False) -> float | None:
        """``measured`` for a bucket ``b``."""
        s = self.costs.get(self._key(b, W, entry))
        if s is None or not self._enough(s) or not self._fresh(b, W, s):
            return None
        return s.median

    def measured(self, B: int, W: int, entry: bool = False) -> float | None:
        """The median measured seconds of a ``(B, W)`` round, or ``None`` below
        ``samples`` rounds or when stale (``entry``: an entry round's, under
        ``hysteresis``).

        Batch sizes share their power-of-two bucket (``bucket``): rows join and
        leave, and a new ``B`` should not start measuring from nothing."""
        return self._median(bucket(B), W, entry)

    def cost(self, B: int, W: int, entry: bool = False) -> float:
        """A ``(B, W)`` round's cost in plain steps of ``B`` rows (measured, else
        modelled; a stale width no dearer than its old median; ``entry``: after a
        plain round, under ``hysteresis``)."""
        check(W >= 1, "W", ">= 1", W)
        return self._costs(B, W - 1, entry)[W - 1]

    def _costs(self, B: int, K: int, entry: bool = False) -> list:
        """``cost(B, W)`` for ``W = 1 .. K + 1`` (the plain median and the slope read once).

        ``entry`` (under ``hysteresis``): a width measured as an entry costs its entry
        median; another costs its steady cost plus the surcharge an entry measured at
        the widest entry width (what entering adds does not grow with the width)."""
        out = self._steady_costs(B, K)
        b = bucket(B)
        plain = self._median(b, 1)
        if not (entry and self.hysteresis) or plain is None:
            return out
        fresh = {k[1]: self._median(b, k[1], True) for k in self.costs if len(k) == 3 and k[0] == b}
        fresh = {W: m / plain for W, m in fresh.items() if m is not None}
        if not fresh:
            return out
        widest = max(fresh)
        steady = out if widest - 1 <= K else self._steady_costs(B, widest - 1)
        extra = fresh[widest] - steady[widest - 1]
        return [1.0] + [max(fresh.get(W, c + extra), FREE) for W, c in enumerate(out[1:], 2)]

    def _steady_costs(self, B: int, K: int) -> list:
        """``_costs`` of rounds after a drafting round (all rounds without ``hysteresis``)."""
        b = bucket(B)
        plain = self._median(b, 1)
        if plain is None:
            return [1.0 + self.slope * (W - 1) for W in range(1, K + 2)]
        out, slope = [1.0], None
        for W in range(2, K + 2):
            wide = self._median(b, W)
            if wide is not None:
                out.append(max(wide / plain, FREE))
                continue
            if slope is None:
                slope = self._slope(b, plain)
            model = 1.0 + slope * (W - 1)
            old = self.costs.get((b, W))
            if old is not None and self._enough(old):
                model = max(min(model, old.median / plain), FREE)  # stale: re-measured if it pays
            out.append(model)
        return out

    def _slope(self, b: int, plain: float) -> float:
        """Cost per extra column: from the widest fresh width measured at bucket
        ``b``, else ``slope``."""
        widths = [k[1] for k in self.costs if len(k) == 2 and k[0] == b and k[1] > 1]
        widths = [w for w in widths if self._median(b, w)]
        if not widths:
            return self.slope
        W = max(widths)
        return max(0.0, (self.costs[(b, W)].median / plain - 1.0) / (W - 1))

    def record(self, B: int, W: int, seconds: float, entry: bool = False) -> Window:
        """This rule with one more measured round (one more round on its bucket's clock;
        ``entry``: a drafting round after a plain round, kept apart under ``hysteresis``).

        A ``(B, W)``'s first ``discard`` rounds are not kept; a stale width's old
        rounds are dropped when it is measured again."""
        b = bucket(B)
        now = self.rounds.get(b, 0) + 1
        key = self._key(b, W, entry)
        s = self.costs.get(key, _NONE)
        if s.uses < self.discard:
            new = Samples(s.seconds, s.median, now, s.uses + 1)
        else:
            kept = ((s.seconds if self._fresh(b, W, s) else ()) + (seconds,))[-self.keep :]
            new = Samples(kept, statistics.median(kept), now, s.uses + 1)
        # derived from a valid rule: not converted or checked again (every round records)
        return derived(self, costs={**self.costs, key: new}, rounds={**self.rounds, b: now})

    def tick(self, B: int) -> Window:
        """This rule with one more round on ``B``'s bucket's clock and no sample: a
        round whose cost is charged to another round (recorded with that one)."""
        b = bucket(B)
        return derived(self, rounds={**self.rounds, b: self.rounds.get(b, 0) + 1})

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

    def choose(
        self,
        B: int,
        alphas: Sequence[float],
        avail: Sequence[int],
        widest: int = 0,
        entry: bool = False,
    ) -> int:
        """The window width of a round: 1 (a plain step) or ``1 + k``.

        A width ``W`` is priced as the cheapest width from ``W`` to ``widest``
        (``pad``): the round may run padded to a wider window that costs less
        (a device whose kernels favour some widths: on the H200 at B = 8 a 5-wide
        verify measured as cheap as a plain step, 2 to 4 wide ones ~1.5x).

        Args:
            B: rows in the round.
            alphas: each row's running acceptance.
            avail: each row's draft tokens at hand (or its limit, for a bound
                taken before drafting).
            widest: the widest window a round may be padded to (``1 +`` the
                rows' longest draft limit); ``0``: no padding past ``1 + max(avail)``.
            entry: the round follows a plain round (``hysteresis``).
        """
        K = max(avail, default=0)
        if K == 0 or self.measured(B, 1) is None:  # measure the plain step first
            return 1
        gain = [0.0] * (K + 1)  # gain[k]: sum over rows of E[accepted | min(avail, k)]
        for a, n in zip(alphas, avail):
            total, term = 0.0, 1.0
            for k in range(1, min(n, K) + 1):
                term *= a
                total += term
                gain[k] += total
            for k in range(min(n, K) + 1, K + 1):
                gain[k] += total
        costs = self._costs(B, max(K, widest - 1), entry)
        best, best_value = 1, float(B) * self.margin
        for W in range(2, K + 2):
            value = (B + gain[W - 1]) / min(costs[W - 1 : max(W, widest)])
            if value > best_value:
                best, best_value = W, value
        return best

    def pad(self, B: int, W: int, widest: int, entry: bool = False) -> int:
        """The width a round chosen ``W`` wide runs at: the cheapest (measured or
        modelled) width from ``W`` to ``widest``, the narrowest of equals; ``W``
        itself for a plain round or when ``widest <= W``. The pad columns are
        rolled back as a shorter draft's are."""
        if W <= 1 or widest <= W:
            return W
        costs = self._costs(B, widest - 1, entry)
        return min(range(W, widest + 1), key=lambda w: (costs[w - 1], w))


__all__ = ["Samples", "Window", "bucket", "expected_accepted"]
