"""pd.tools.percentile: the one percentile rule of every tool (linear between the closest ranks)."""
import math
import random
import statistics

import pytest

from pd.tools.percentile import percentile


def test_matches_statistics_inclusive_quantiles_at_whole_percents():
    rng = random.Random(7)
    for size in (2, 3, 10, 101, 257):
        values = [rng.uniform(-5.0, 50.0) for _ in range(size)]
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        for q in range(1, 100):
            assert percentile(values, q) == pytest.approx(cuts[q - 1], rel=1e-12, abs=1e-12)
        assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)


def test_interpolates_between_ranks_whatever_the_order():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([10.0, 0.0], 25) == 2.5
    assert percentile((x for x in [3.0]), 90) == 3.0  # one value: every percentile is that value


def test_no_values_give_the_callers_empty_value():
    assert percentile([], 50) == 0.0
    assert math.isnan(percentile([], 90, math.nan))


@pytest.mark.parametrize("q", [-1, 100.5])
def test_a_percentile_outside_0_100_is_refused(q):
    with pytest.raises(ValueError, match="within \\[0, 100\\]"):
        percentile([1.0, 2.0], q)
