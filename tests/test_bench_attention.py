"""bench/bench_attention.py's target arithmetic on the CPU (the benchmark itself needs a GPU)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_attention  # noqa: E402
from bench_attention import Row, skip_cost_ratio  # noqa: E402


def rows_from_costs(fixed: float, computed_cost: float, skipped_cost: float, rng: random.Random):
    """The three runs skip_cost_ratio fits, timed exactly by t = fixed + c*computed + s*skipped."""
    selected = rng.randrange(10_000, 100_000)
    forced = rng.randrange(100, selected // 4)
    first = rng.randrange(50, forced)

    def row(name, computed, skipped):
        return Row(32768, 128, name, fixed + computed_cost * computed + skipped_cost * skipped,
                   computed=computed, skipped=skipped)

    return (row(bench_attention.cosa_name(0.25, 0.0), selected, 0),
            row(bench_attention.COSA_FORCED, forced, 0),
            row(bench_attention.COSA_SKIP_ALL, first, selected - first))


def test_skip_cost_ratio_recovers_the_per_block_costs():
    rng = random.Random()
    fixed, c = rng.uniform(0.0, 5.0), rng.uniform(1e-5, 1e-3)
    s = c * rng.uniform(0.05, 1.5)
    assert skip_cost_ratio(*rows_from_costs(fixed, c, s, rng)) == pytest.approx(s / c, rel=1e-6)


@pytest.mark.parametrize("computed_cost,skipped_cost", [(1e-4, -2e-5), (-1e-4, 2e-5), (0.0, 1e-5)])
def test_skip_cost_ratio_is_none_without_positive_costs(computed_cost, skipped_cost):
    """At 8K the fit can give a negative cost (fixed costs and noise dominate): no ratio, rather
    than one that passes the target."""
    rows = rows_from_costs(0.3, computed_cost, skipped_cost, random.Random())
    assert skip_cost_ratio(*rows) is None
