"""The verify call's cost model: its context term fitted from measured gaps, and measured on a
real engine without feeding a long prompt."""

from __future__ import annotations

import pytest

from specrt.runtime import SpeculativeRuntime
from specrt.runtime.costs import (
    PREFIX,
    StepCosts,
    fill_slots,
    fit_context,
    measure_costs,
    measure_narrow,
)


def test_the_context_term_is_fitted_from_the_gaps():
    """Gaps made by a known term give it back; a term that noise would make negative is 0,
    the other fitted alone (the control: plain least squares gives it below 0)."""
    per_request, per_row, tokens = 5.3e-6, 5.5e-7, 4048
    shapes = [(1, 1), (1, 9), (4, 1), (4, 9)]
    gaps = {(b, w): tokens * (per_request * b + per_row * b * w) for b, w in shapes}
    assert fit_context(gaps, tokens) == (pytest.approx(per_request), pytest.approx(per_row))
    flat = {(b, w): tokens * per_request * b * (1.1 if w == 1 else 1.0) for b, w in shapes}
    fitted = fit_context(flat, tokens)
    assert fitted[1] == 0.0 and fitted[0] == pytest.approx(per_request, rel=0.1)


def test_a_call_is_priced_by_its_rows_its_requests_and_their_context():
    costs = StepCosts(verify={4: 0.10, 8: 0.14}, per_request=1e-5, per_row=1e-6)
    assert costs.verify_cost(8, 4) == pytest.approx(0.14)  # calibration's own context
    costs.observe_verify(4, 0.10 + 1000 * (4e-5 + 4e-6), context=PREFIX + 1000, requests=4)
    assert costs.drift == pytest.approx((1.0, 1.0))  # the model's price, to the microsecond
    assert costs.verify_cost(8, 4) == pytest.approx(0.14 + 1000 * (4e-5 + 8e-6))
    assert costs.verify_cost(8, 8) == pytest.approx(0.14 + 1000 * (8e-5 + 8e-6))


def test_calibration_measures_the_context_term_and_leaves_the_slots_empty(agree_bundle):
    """On a real engine: a long context is written straight into each slot's cache (no
    prompt fed), the term is measured on it (never negative; how large is the machine's), and
    every slot is empty again after."""
    rt = SpeculativeRuntime.load(agree_bundle, threads=1, slots=2, calibrate=False)
    fill_slots(rt.target, 2, 100)
    assert list(rt.target.lengths) == [100, 100]
    costs = measure_costs(rt.draft, rt.target, 4, slots=2)
    assert costs.per_request >= 0 and costs.per_row >= 0
    assert list(rt.target.lengths) == [0, 0]
    assert not costs.learning and costs.verify_cost(5) > 0


def test_a_narrow_call_is_priced_as_it_was_timed_at_the_knots():
    """After a long context the 2- and 3-token calls cost what they were timed to cost over the
    1-token call at the knots, interpolated between them, and a wider call adds `per_row` a
    row beyond the widest narrow one. The control: the same costs without the knots price the
    2-token call by the line through the rows, 1.5 ms over the 1-token call after 4,096
    tokens where it was timed 10 ms over."""
    curve = {1: 0.080, 2: 0.084, 3: 0.090, 4: 0.096}
    narrow = {1024: {1: 0.0, 2: 0.006, 3: 0.020}, 4096: {1: 0.0, 2: 0.010, 3: 0.030}}
    timed = StepCosts(verify=curve, per_request=5e-6, per_row=1e-6, narrow=narrow)
    plain = StepCosts(verify=curve, per_request=5e-6, per_row=1e-6)
    for costs in (timed, plain):
        costs.context = 4096
    one = timed.verify_cost(1)
    assert one == pytest.approx(plain.verify_cost(1))  # the 1-token call is the reads' alone
    assert timed.verify_cost(2) - one == pytest.approx(0.010)
    assert timed.verify_cost(3) - one == pytest.approx(0.030)
    assert timed.verify_cost(4) - timed.verify_cost(3) == pytest.approx(0.006 + 4048e-6)
    assert plain.verify_cost(2) - plain.verify_cost(1) == pytest.approx(0.004 + 4048e-6)
    timed.context = (1024 + 4096) / 2  # halfway: half of each knot's gap
    assert timed.verify_cost(2) - timed.verify_cost(1) == pytest.approx(0.008)
    timed.context = 8192  # past the last knot: per_row a row and a token on
    assert timed.verify_cost(2) - timed.verify_cost(1) == pytest.approx(0.010 + 4096e-6)
    timed.context = PREFIX  # calibration's own context: its curve
    assert timed.verify_cost(2) == pytest.approx(0.084)


def test_a_batch_is_priced_by_the_line_where_one_request_is_priced_at_the_knots():
    """The knots time one request's narrow calls. A batch's are priced by the line through the
    rows: B times one request's gap carried B times its error, and a batch's rows take another
    path through attention. The control: the same costs price a lone request's 2-token call at
    the knots' gap (10 ms over its 1-token call), not the line's (4 ms + per_row's 4 ms)."""
    curve = {1: 0.080, 2: 0.084, 3: 0.090, 4: 0.096, 8: 0.120, 12: 0.150}
    narrow = {1024: {1: 0.0, 2: 0.006, 3: 0.020}, 4096: {1: 0.0, 2: 0.010, 3: 0.030}}
    timed = StepCosts(verify=curve, per_request=5e-6, per_row=1e-6, narrow=narrow)
    plain = StepCosts(verify=curve, per_request=5e-6, per_row=1e-6)
    for costs in (timed, plain):
        costs.context = 4096
    for rows in (4, 6, 8, 12):  # 4 requests at 1, 1.5, 2 and 3 tokens each
        assert timed.verify_cost(rows, 4) == pytest.approx(plain.verify_cost(rows, 4))
    assert timed.verify_cost(8, 4) - timed.verify_cost(4, 4) == pytest.approx(0.024 + 4 * 4048e-6)
    assert timed.verify_cost(2) - timed.verify_cost(1) == pytest.approx(0.010)


def test_the_narrow_calls_are_timed_at_each_knot_up_to_the_longest_context(agree_bundle):
    """On a real engine: each width's gap over the 1-token call at each knot the longest
    context reaches, never below a narrower width's, and the slot empty again after."""
    rt = SpeculativeRuntime.load(agree_bundle, threads=1, calibrate=False)
    narrow = measure_narrow(rt.target, [1, 2, 3], [64, 100], rotations=3)
    assert sorted(narrow) == [64, 100] and list(rt.target.lengths) == [0]
    for gaps in narrow.values():
        assert gaps[1] == 0.0 and 0.0 <= gaps[2] <= gaps[3]
    costs = measure_costs(rt.draft, rt.target, 4, longest=80, knots=(64, 100))
    assert sorted(costs.narrow) == [64] and list(rt.target.lengths) == [0]
