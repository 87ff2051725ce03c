"""What every proxy shares: the order mask built from block scores (SPEC stage 1).

A proxy only scores key blocks; the order is the same for all of them: forced
local block(s) first (ascending), then the sink block 0, then the other
candidates by descending score with ties going to the larger block index.
Which blocks are candidates, which are local and how many are selected is
decided once per batch shape by the plan (``qtiles``), so every proxy emits the
same format at the same budget.
"""

from __future__ import annotations

import torch

from .. import _C
from ..blocks import BLOCK
from ..cute_kernels.rank_key import (BLOCK_BITS, LOCAL_FIRST, LOCAL_LAST, NOT_CANDIDATE, PRIORITY_SHIFT,
                                     SCORED, SINK)


def block_means(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean of each 128-row block of ``x [n, heads, d]`` over its valid rows: ``[heads, blocks, d]``.

    Sums in ``dtype`` straight from ``x``'s rows, without a padded copy of ``x`` in ``dtype``."""
    n = x.shape[0]
    whole = n - n % BLOCK
    means = x[:whole].unflatten(0, (-1, BLOCK)).permute(2, 0, 1, 3).sum(2, dtype=dtype).div_(BLOCK)
    if whole < n:
        tail = x[whole:].sum(0, dtype=dtype).div_(n - whole)
        means = torch.cat([means, tail[:, None]], dim=1)
    return means


def grouped_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [hq, m, e] @ b [hkv, n, e]^T`` per query head, reading kv head ``h // group`` without repeating ``b``."""
    num_qo_heads, m, e = a.shape
    num_kv_heads, n, _ = b.shape
    group = num_qo_heads // num_kv_heads
    return (a.reshape(num_kv_heads, group * m, e) @ b.transpose(1, 2)).view(num_qo_heads, m, n)


def candidate_mask(qtiles: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """``[tiles, num_kv_blocks]``: the key blocks each tile may see."""
    blocks = torch.arange(num_kv_blocks, device=qtiles.device)
    return blocks[None, :] < qtiles[:, _C.QT_NUM_CANDIDATES, None]


def unscored_keys(qtiles: torch.Tensor, num_kv_blocks: int, *, force_local: bool,
                  force_sink: bool) -> torch.Tensor:
    """``[tiles, num_kv_blocks]`` int64: each block's ranking key without its score, the
    visiting priority and the block index (``cute_kernels.rank_key``); the plan's ``force_*``."""
    blocks = torch.arange(num_kv_blocks, device=qtiles.device)
    priority = torch.where(candidate_mask(qtiles, num_kv_blocks), SCORED, NOT_CANDIDATE)
    if force_sink:
        priority = torch.where(blocks == 0, SINK, priority)
    if force_local:   # last, then first: a tile whose diagonal is in one block forces it once
        priority = torch.where(blocks == qtiles[:, _C.QT_LOCAL_LAST, None], LOCAL_LAST, priority)
        priority = torch.where(blocks == qtiles[:, _C.QT_LOCAL_FIRST, None], LOCAL_FIRST, priority)
    return priority.long() << PRIORITY_SHIFT | blocks


def is_forced(qtiles: torch.Tensor, num_kv_blocks: int, *, force_local: bool, force_sink: bool) -> torch.Tensor:
    """``[tiles, num_kv_blocks]``: which blocks are forced (local or sink), visited first."""
    keys = unscored_keys(qtiles, num_kv_blocks, force_local=force_local, force_sink=force_sink)
    return (keys >> PRIORITY_SHIFT) > SCORED


def _score_code(scores: torch.Tensor) -> torch.Tensor:
    """A signed 32-bit integer per score, ordered like the scores and tied where they tie
    (-0.0 with +0.0). NaN ranks above +inf, as in ``torch.sort`` (in float32 NaNs with
    different payloads do not tie)."""
    if scores.dtype != torch.float32:
        # Too wide to pack: the score's rank within its row (NaN: the row length) is as good.
        scores = scores.contiguous()  # searchsorted would copy a view's rows, with a warning
        return torch.searchsorted(scores.sort(dim=-1).values, scores)
    # The bits of |s| order like |s| (NaN above inf); negate them for s < 0 (False for NaN).
    magnitude = scores.abs().view(torch.int32)
    return torch.where(scores < 0, -magnitude, magnitude)


def order_from_scores(scores: torch.Tensor, qtiles: torch.Tensor, out: torch.Tensor, *,
                      force_local: bool, force_sink: bool) -> None:
    """Writes the order mask for ``scores [hq, tiles, num_kv_blocks]`` into
    ``out [tiles, hq, k_max]`` (int32, -1 past each tile's ``num_selected``), the blocks
    forced as the plan's ``force_local`` and ``force_sink`` say. Scores of non-candidate
    blocks are ignored."""
    num_kv_blocks = scores.shape[-1]
    base = unscored_keys(qtiles, num_kv_blocks, force_local=force_local, force_sink=force_sink)
    key = torch.add(base, _score_code(scores), alpha=1 << BLOCK_BITS)
    # (priority, score, block index) descending; top-k's results are sorted.
    ranked = key.topk(min(out.shape[-1], num_kv_blocks), dim=-1).indices    # [hq, tiles, width]
    out[..., :ranked.shape[-1]] = ranked.transpose(0, 1)
    slot = torch.arange(out.shape[-1], device=out.device)
    out.masked_fill_(slot >= qtiles[:, _C.QT_NUM_SELECTED, None, None], -1)
