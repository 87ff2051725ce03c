"""Stage-1 proxies: score key blocks, emit the order mask (one format for all).

``PROXIES`` maps a name (``cosa.plan(..., proxy=name)``) to a scoring function
``(q, k, qtiles, *, causal, sm_scale) -> [hq, tiles, kv_blocks]``; the order
mask is built from the scores by :func:`order_from_scores`, the same for every
proxy, so they differ only in how they rank the non-forced candidates.

- ``kap``: CoSA's kernel-aware proxy, pooled ``qbar . kbar`` (the default).
- ``xattention8`` / ``xattention16``: XAttention's antidiagonal scoring, stride 8 / 16.
- ``flexprefill``: FlexPrefill's pooled softmax (ranks like ``kap`` at a fixed budget, but for
  blocks whose probabilities underflow).
- ``vertical_slash``: MInference's vertical and slash lines from the last 64 queries.
- ``oracle``: the exact attention mass per block (dense attention; the ceiling for studies).
"""

from __future__ import annotations

from functools import partial

import torch

from .flexprefill import cumulative_threshold_counts, flexprefill_scores
from .kap import kap_scores
from .oracle import oracle_scores
from .order import block_means, is_forced, order_from_scores
from .vertical_slash import vertical_slash_scores
from .xattention import xattention_scores

PROXIES = {
    "kap": kap_scores,
    "xattention8": partial(xattention_scores, stride=8),
    "xattention16": partial(xattention_scores, stride=16),
    "flexprefill": flexprefill_scores,
    "vertical_slash": vertical_slash_scores,
    "oracle": oracle_scores,
}


def check_proxy(proxy) -> str:
    if not isinstance(proxy, str) or proxy not in PROXIES:
        raise ValueError(f"proxy must be one of {tuple(PROXIES)}, got {proxy!r}")
    return proxy


def proxy_order(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, out: torch.Tensor, *,
                force_local: bool, force_sink: bool, proxy: str = "kap", causal: bool = True,
                sm_scale: float | None = None) -> None:
    """Writes the order mask of one request into ``out``.

    ``q [q_len, num_qo_heads, d]`` and ``k [kv_len, num_kv_heads, d]`` are the
    request's queries and keys, ``qtiles`` its rows of the plan's qtile table (on
    q's device), ``force_local`` and ``force_sink`` the plan's; ``out [tiles,
    num_qo_heads, k_max]`` int32 receives block indices in visiting order, -1 past
    each tile's ``num_selected``.
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    scores = PROXIES[check_proxy(proxy)](q, k, qtiles, causal=causal, sm_scale=sm_scale)
    order_from_scores(scores, qtiles, out, force_local=force_local, force_sink=force_sink)


__all__ = ["PROXIES", "block_means", "check_proxy", "cumulative_threshold_counts", "is_forced",
           "proxy_order"]
