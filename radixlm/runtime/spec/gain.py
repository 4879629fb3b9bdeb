"""The expected-gain model that sizes speculative drafts: what a step costs by its row count
(measured) against how many draft tokens are expected to stand (learned per request and draft
source).

A verification adds one forward row per draft token. On a CPU the forward is flat in its row
count only up to a few rows (the linears stream their weights once), then grows linearly (they
become compute-bound: at batch 8 a k = 4 verification is 40 rows, ~2.6x an 8-row decode step on
an AVX512_BF16 EPYC at 1 thread). So a draft token pays only where its chance of standing beats
the share of the step it adds, which depends on the batch: drafting is sized per step by
`plan_draft_lengths`, not by fixed thresholds.

Acceptance is modelled as geometric: after an accepted draft token the next one stands with
probability `alpha`, so the j-th token of a draft adds `alpha ** j` expected tokens and a draft
of k tokens `sum(alpha ** j, j = 1..k)`. `alpha` is estimated from verified drafts as successes
/ (successes + failures) (a draft of k tokens with a accepted: a successes, one failure when
a < k), the maximum-likelihood estimate of the truncated geometric.

The geometric model is only a model: drafts are planned where the estimates are high, and what
then stands can fall short of them (measured, AVX2 EPYC, batch 8: 0.83x of the expected
accepted tokens on `edit`, 0.87x on `free`; 1.16x on `extract`). `Calibration` keeps the
realized over the expected accepted tokens of the verified drafts, and the plan scales every
expected gain by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class AcceptanceCounts:
    """Decayed successes / failures of verified drafts (the geometric model above)."""

    successes: float = 0.0
    failures: float = 0.0

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        """A verified draft of `drafted` tokens of which `accepted` stood; older counts are
        weighted down by `decay` (in (0, 1]) first."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must lie in [0, drafted={drafted}], got {accepted}")
        self.successes = decay * self.successes + accepted
        self.failures = decay * self.failures + (1 if accepted < drafted else 0)

    def alpha(self, prior: float, weight: float) -> float:
        """The per-token acceptance estimate, shrunk to `prior` with `weight` pseudo-counts."""
        return (self.successes + weight * prior) / (self.successes + self.failures + weight)


@dataclass
class Calibration:
    """Decayed expected and realized accepted tokens of verified drafts: `scale()` is their
    ratio (the geometric model's bias), shrunk to 1 with `weight` tokens of each."""

    expected: float = 0.0
    realized: float = 0.0

    def add(self, expected: float, realized: int, decay: float) -> None:
        """A verified draft: `expected` accepted tokens at planning, `realized` stood; older
        drafts weighted down by `decay` (in (0, 1]) first."""
        if expected < 0 or realized < 0:
            raise ValueError(f"expected and realized must be >= 0, got {expected}, {realized}")
        self.expected = decay * self.expected + expected
        self.realized = decay * self.realized + realized

    def scale(self, weight: float = 4.0, lo: float = 0.5, hi: float = 1.5) -> float:
        """Realized / expected, shrunk to 1 by `weight` pseudo-tokens, clipped to [lo, hi]."""
        return min(hi, max(lo, (self.realized + weight) / (self.expected + weight)))


class StepCost:
    """Measured seconds of a step by its row count, the input of `plan_draft_lengths`: the
    scheduler records the whole step on the engine thread (planning, forward, sampling,
    accepting), so that a draft's host work counts beside its rows. Each row count (rounded up
    to a multiple of `coarse` past `exact` rows) keeps a moving average of its steps' seconds
    (each clipped to twice the average: a step the OS descheduled moves it a little, not 10x),
    forgotten after `max_age` steps without a new measurement.
    `cost(rows)` interpolates linearly between the measured counts after an isotonic fit (more
    rows never cost less: adjacent averages that fall are pooled, weighted by their number of
    measurements, so one slow step raises its neighbours a little rather than every larger
    count); below the smallest and above the largest measured count it is flat: optimistic
    where nothing was measured, so drafts get tried there and the step that verifies them
    measures it (and forgetting stale counts tries them again once in a while). None until a
    step has been measured."""

    def __init__(
        self, rate: float = 0.25, exact: int = 16, coarse: int = 8, max_age: int = 256
    ) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"rate must lie in (0, 1], got {rate}")
        self.rate = rate
        self.exact = exact
        self.coarse = coarse
        self.max_age = max_age
        # row key -> (moving average, measurements (capped at 1 / rate), step last measured)
        self._seconds: dict[int, tuple[float, float, int]] = {}
        self._step = 0
        self._points: list[tuple[int, float]] = []  # sorted, non-decreasing; rebuilt per record

    def _key(self, rows: int) -> int:
        if rows <= self.exact:
            return rows
        return -(-rows // self.coarse) * self.coarse

    def record(self, rows: int, seconds: float) -> None:
        """One step of `rows` forward rows took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        self._step += 1
        k = self._key(rows)
        prev = self._seconds.get(k)
        if prev is None:
            self._seconds[k] = (seconds, 1.0, self._step)
        else:  # a descheduled step counts as at most twice the average
            avg = prev[0] + self.rate * (min(seconds, 2 * prev[0]) - prev[0])
            self._seconds[k] = (avg, min(prev[1] + 1, 1 / self.rate), self._step)
        old = self._step - self.max_age
        self._seconds = {r: v for r, v in self._seconds.items() if v[2] > old}
        self._points = _isotonic([(r, v[0], v[1]) for r, v in sorted(self._seconds.items())])

    def measured(self, rows: int) -> bool:
        return self._key(rows) in self._seconds

    def cost(self, rows: int) -> float | None:
        pts = self._points
        if not pts:
            return None
        if rows <= pts[0][0]:
            return pts[0][1]
        if rows >= pts[-1][0]:
            return pts[-1][1]
        lo, hi = 0, len(pts) - 1
        while hi - lo > 1:  # invariant: pts[lo][0] < rows <= pts[hi][0]
            mid = (lo + hi) // 2
            if pts[mid][0] < rows:
                lo = mid
            else:
                hi = mid
        (r0, c0), (r1, c1) = pts[lo], pts[hi]
        return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)


def _isotonic(points: list[tuple[int, float, float]]) -> list[tuple[int, float]]:
    """The non-decreasing fit of `(x, y, weight)` points sorted by x (pool adjacent
    violators): each run of points that would fall is replaced by its weighted mean."""
    blocks: list[list[float]] = []  # [sum of weight * y, sum of weight, number of points]
    for _, y, w in points:
        blocks.append([w * y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += n
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[2]))]
    return [(x, y) for (x, _, _), y in zip(points, ys)]


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted tokens of a k-token draft under the geometric model."""
    return sum(alpha**j for j in range(1, k + 1))


# A step drafts only when its expected tokens per second beat the step without drafts by this
# share: the measured costs and learned acceptance are noisy, so a draft that "pays" by less is
# a loss as often as a gain. (The cost is the whole step's, host work included: the proposals,
# the verification's per-row sampling and checks, ~3-5% of a batch-8 CPU step, ~20% of a
# batch-8 step on an H200.) NOTE: while the cost was the forward and sampling only, the margin
# did not settle `free` at batch 8 (2 threads, AVX512_BF16 EPYC): 0.89-0.95x without it,
# 0.89-1.06x with it (the acceptance estimates ran above what stood there); with the whole
# step's cost, 1.01-1.02x there and 1.18-1.22x on an H200 (0.89x before).
DRAFT_MARGIN = 0.10


def plan_draft_lengths(
    alphas: Sequence[float],
    lengths: Sequence[int],
    base_rows: int,
    base_tokens: int,
    cost: StepCost,
    margin: float = DRAFT_MARGIN,
    scale: float = 1.0,
) -> list[int]:
    """Per candidate i a draft length in [0, lengths[i]] maximizing the step's expected tokens
    per second, (base_tokens + scale * sum_i sum_{j<=k_i} alphas[i] ** j) / cost(base_rows +
    sum k_i) (`scale`: `Calibration.scale()`):
    the draft tokens with the largest expected gain first (for each candidate its gains fall
    with j, so the chosen tokens are each draft's prefix), as many as raise the ratio; none
    when the best ratio beats the step without drafts by less than `margin` (a share). With
    no step measured yet every draft is taken whole (the first verification measures it)."""
    if len(alphas) != len(lengths):
        raise ValueError(f"alphas ({len(alphas)}) and lengths ({len(lengths)}) differ in length")
    if cost.cost(base_rows) is None:
        return list(lengths)
    gains = sorted(
        ((a**j, i) for i, (a, m) in enumerate(zip(alphas, lengths)) for j in range(1, m + 1)),
        reverse=True,
    )
    tokens = float(base_tokens)
    plain = best = tokens / cost.cost(base_rows)  # type: ignore[operator]
    best_d = 0
    for d, (g, _) in enumerate(gains, 1):
        tokens += scale * g
        rate = tokens / cost.cost(base_rows + d)  # type: ignore[operator]
        if rate > best:
            best, best_d = rate, d
    if best < plain * (1 + margin):
        best_d = 0
    out = [0] * len(lengths)
    for _, i in gains[:best_d]:
        out[i] += 1
    return out
