"""The expected-gain model that sizes drafts: the measured step cost, the acceptance counts, and
the per-step plan of draft lengths."""

from __future__ import annotations

import pytest

from radixlm.runtime.spec.gain import (
    AcceptanceCounts,
    Calibration,
    StepCost,
    expected_accepted,
    plan_draft_lengths,
)


def cost_of(points: dict[int, float], **kw) -> StepCost:
    c = StepCost(rate=1.0, **kw)
    for rows, seconds in points.items():
        c.record(rows, seconds)
    return c


def test_step_cost_interpolates_is_flat_outside_and_never_falls():
    assert StepCost().cost(4) is None
    c = cost_of({1: 0.020, 9: 0.024, 40: 0.070})
    assert c.cost(1) == c.cost(0) == pytest.approx(0.020)  # flat below the smallest
    assert c.cost(5) == pytest.approx(0.022)
    assert c.cost(20) == pytest.approx(0.024 + 0.046 * 11 / 31)
    assert c.cost(80) == pytest.approx(0.070)  # flat (optimistic) past the largest
    c.record(16, 0.010)  # a fast reading: more rows never cost less, so 1, 9 and 16 pool
    assert c.cost(1) == c.cost(9) == c.cost(16) == c.cost(12) == pytest.approx(0.018)
    c.record(40, 0.050)  # rate 1: the new reading replaces the old
    assert c.cost(40) == pytest.approx(0.050)
    assert c.measured(40) and c.measured(33) and not c.measured(32)  # 33..40: one key


def test_one_slow_step_does_not_raise_every_larger_row_count():
    c = StepCost(rate=0.25)
    for _ in range(4):
        for rows, ms in ((1, 20), (2, 20), (3, 21), (5, 21)):
            c.record(rows, ms / 1000)
    c.record(2, 0.2)  # a descheduled step (10x): counted as 40 ms, 2's average 25 ms...
    # ... pooled with 3's and 5's 21 ms (weight 4 each): 22.3 ms, where 1 row costs 20 ms
    assert c.cost(2) == c.cost(5) == pytest.approx((0.025 + 0.021 * 2) / 3)
    assert c.cost(1) == pytest.approx(0.020)


def test_step_cost_groups_large_row_counts_and_forgets_stale_ones():
    c = cost_of({100: 0.1}, exact=16, coarse=8)
    assert c.measured(97) and c.measured(104) and not c.measured(105)
    c = cost_of({8: 0.02, 40: 0.05}, max_age=3)
    c.record(8, 0.02)
    assert c.measured(40)
    c.record(8, 0.02)
    c.record(8, 0.02)  # three records since 40 was measured: forgotten, flat past 8 again
    assert not c.measured(40) and c.cost(40) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="rate"):
        StepCost(rate=0)


def test_acceptance_counts_are_the_geometric_estimate():
    a = AcceptanceCounts()
    assert a.alpha(prior=0.5, weight=2) == 0.5
    a.add(4, 4, decay=1.0)  # 4 successes, no failure
    a.add(4, 1, decay=1.0)  # 1 success, 1 failure
    assert (a.successes, a.failures) == (5, 1)
    assert a.alpha(prior=0.5, weight=0) == pytest.approx(5 / 6)
    assert a.alpha(prior=0.5, weight=2) == pytest.approx(6 / 8)
    a.add(2, 0, decay=0.5)
    assert (a.successes, a.failures) == (2.5, 1.5)
    with pytest.raises(ValueError, match="accepted"):
        a.add(2, 3, decay=1.0)
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)
    assert expected_accepted(1.0, 4) == 4


def test_flat_cost_takes_whole_drafts_and_a_compute_bound_step_none():
    flat = cost_of({1: 0.02, 200: 0.02})
    assert plan_draft_lengths([0.3, 0.9], [4, 3], 2, 2, flat) == [4, 3]
    linear = cost_of({r: 0.001 * r for r in range(1, 65)})  # every row costs the same
    assert plan_draft_lengths([0.9, 0.99], [4, 4], 8, 8, linear) == [0, 0]
    # Nothing measured yet: whole drafts (the verification measures the step).
    assert plan_draft_lengths([0.1], [4], 1, 1, StepCost()) == [4]
    with pytest.raises(ValueError, match="differ"):
        plan_draft_lengths([0.5], [1, 2], 1, 1, flat)


def test_a_gain_below_the_margin_drafts_nothing():
    """Batch 8, each row past 8 adds 1% to the step: a draft token standing with probability
    0.6 raises the expected rate by ~6.4% (below the 10% margin: no draft), one at 0.95 by
    ~10.8%."""
    slope = cost_of({r: 0.010 * (1 + 0.01 * max(0, r - 8)) for r in range(1, 65)})
    one = [1] + [0] * 7
    assert plan_draft_lengths([0.6] + [0.0] * 7, one, 8, 8, slope) == [0] * 8
    assert plan_draft_lengths([0.6] + [0.0] * 7, one, 8, 8, slope, margin=0) == one
    assert plan_draft_lengths([0.95] + [0.0] * 7, one, 8, 8, slope) == one


def test_a_knee_in_the_cost_goes_to_the_likeliest_tokens_first():
    """Flat up to 10 rows, then 1 ms per row (a CPU's linears turning compute-bound): at
    batch 8 the two free rows go to the likeliest draft tokens; past the knee a token must
    stand with probability above its share of the step."""
    knee = cost_of({r: 0.010 * max(1.0, r / 10) for r in range(1, 65)})
    # gains: 0.9, 0.81, 0.729, ...; 0.5, 0.25, ...; 0.2
    lengths = plan_draft_lengths([0.9, 0.5, 0.2] + [0.0] * 5, [4, 4, 4] + [0] * 5, 8, 8, knee)
    assert lengths[:3] == [2, 0, 0]
    # At batch 1 the same drafts are all free, and worth taking if likely at all.
    assert plan_draft_lengths([0.9], [4], 1, 1, knee) == [4]
    # Past the knee a row costs a full token's share of the step (~1 token per row): even
    # alpha 0.99 stops at the knee; a cheaper slope lets it go on.
    assert plan_draft_lengths([0.99] + [0.0] * 7, [4] + [0] * 7, 8, 8, knee) == [2] + [0] * 7
    gentle = cost_of({r: 0.010 * max(1.0, 1 + (r - 10) / 40) for r in range(1, 65)})
    assert plan_draft_lengths([0.99] + [0.0] * 7, [4] + [0] * 7, 8, 8, gentle) == [4] + [0] * 7


def test_calibration_is_realized_over_expected_shrunk_and_clipped():
    c = Calibration()
    assert c.scale() == 1.0  # nothing verified: the model as it is
    c.add(8.0, 4, decay=1.0)  # half of what was expected stood
    assert c.scale() == pytest.approx((4 + 4) / (8 + 4))
    for _ in range(50):
        c.add(4.0, 1, decay=0.9)
    assert c.scale() == 0.5  # clipped at `lo`
    for _ in range(200):
        c.add(1.0, 4, decay=0.9)
    assert c.scale() == 1.5  # and at `hi`
    with pytest.raises(ValueError, match="expected and realized"):
        c.add(-1.0, 0, decay=1.0)


def test_a_draft_the_calibration_discounts_is_not_taken():
    """Batch 8, each row past 8 adds 1% to the step: a draft token at 0.95 gains ~10.8% (over
    the 10% margin); the same token when drafts have realized 0.8x of their expected tokens
    gains ~8.6% (under it)."""
    slope = cost_of({r: 0.010 * (1 + 0.01 * max(0, r - 8)) for r in range(1, 65)})
    one = [1] + [0] * 7
    assert plan_draft_lengths([0.95] + [0.0] * 7, one, 8, 8, slope) == one
    assert plan_draft_lengths([0.95] + [0.0] * 7, one, 8, 8, slope, scale=0.8) == [0] * 8
