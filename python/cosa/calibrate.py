"""Stage-2 target density: find the ``delta`` that reaches it on sample inputs."""

from __future__ import annotations

import dataclasses
import math

from .api import Plan, run
from .checks import check_float, check_int


def calibrate_delta(plan: Plan, q, paged_kv_cache, target_density: float, *, low: float = 1e-8,
                    high: float = 1e4, steps: int = 24) -> float:
    """The smallest ``delta`` (to ``steps`` bisections in log space) whose
    stage-2 density (computed over candidate blocks, ``Stats.density_stage2``)
    on these inputs is at most ``target_density``.

    Runs copies of ``plan`` with other deltas: ``plan.delta`` is left as it
    was, but the copies share its buffers, so its stats are then the last
    trial's. Use the result in the next ``plan``. Raises ``ValueError`` when
    even ``high`` skips too little: the first visited block of every tile is
    always computed.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a cosa.Plan (from cosa.plan), got {type(plan).__name__}")
    if not 0 < check_float("target_density", target_density) <= 1:
        raise ValueError(f"target_density must be in (0, 1], got {target_density!r}")
    low, high = check_float("low", low), check_float("high", high)   # finite: plan takes them as delta
    if not 0 < low < high < math.inf:
        raise ValueError(f"need 0 < low < high < inf, got low={low!r}, high={high!r}")
    check_int("steps", steps, minimum=0)

    def density(delta: float) -> float:
        trial = dataclasses.replace(plan, delta=delta)
        run(trial, q, paged_kv_cache)
        return trial.stats().density_stage2

    if density(low) <= target_density:
        return low
    reached = density(high)
    if reached > target_density:
        raise ValueError(f"target_density {target_density} is below the density {reached:.4f} "
                         f"that delta={high} reaches")
    for _ in range(steps):
        middle = math.sqrt(low * high)
        if density(middle) <= target_density:
            high = middle
        else:
            low = middle
    return high
