"""FlexPrefill-style proxy: a softmax over pooled logits, read with a cumulative threshold.

FlexPrefill's query-aware estimate is ``softmax(avgpool(Q) avgpool(K)^T /
sqrt(d))`` over the causally visible key blocks; it keeps the fewest blocks
whose probabilities sum to ``gamma``. The softmax is monotone in KAP's pooled
dot product, so at a budget fixed by the plan it ranks like KAP, but for blocks
whose probabilities underflow to 0 (logits ~100 below the tile's best), which
tie and go in block order, as FlexPrefill's own softmax cannot tell them apart;
what differs is the budget the threshold picks per tile, which
:func:`cumulative_threshold_counts` gives (the studies compare at that count).
"""

from __future__ import annotations

import math

import torch

from ..blocks import compute_dtype
from ..checks import check_float
from .order import block_means, candidate_mask, grouped_products


def flexprefill_scores(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, *, causal: bool,
                       sm_scale: float) -> torch.Tensor:
    """``[hq, tiles, kv_blocks]`` pooled attention probabilities over each tile's candidates (0 elsewhere)."""
    dtype = compute_dtype(q)
    logits = grouped_products(block_means(q, dtype), block_means(k, dtype)) * sm_scale
    logits = logits.masked_fill(~candidate_mask(qtiles, logits.shape[-1]), -math.inf)
    return torch.softmax(logits, dim=-1)


def cumulative_threshold_counts(probabilities: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per row of ``probabilities [..., blocks]``: the fewest blocks whose largest probabilities sum
    to ``gamma`` in (0, 1]; all of them where rounding keeps the sum below it."""
    if not 0 < check_float("gamma", gamma) <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    cumulative = probabilities.sort(dim=-1, descending=True).values.cumsum(-1)
    return ((cumulative < gamma).sum(-1) + 1).clamp(max=probabilities.shape[-1])
