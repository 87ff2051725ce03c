"""KAP, the kernel-aware proxy (SPEC stage 1): ``s[i, j] = qbar[i] . kbar[j]``.

The mean query of a 128-row tile against the mean key of a 128-key block, the
same granularity the kernel computes and skips at.
"""

from __future__ import annotations

import torch

from ..blocks import compute_dtype
from .order import block_means, grouped_products


def kap_scores(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, *, causal: bool,
               sm_scale: float) -> torch.Tensor:
    """``[hq, tiles, kv_blocks]`` pooled dot products (``causal``/``sm_scale`` do not change the ranking)."""
    dtype = compute_dtype(q)
    return grouped_products(block_means(q, dtype), block_means(k, dtype))
