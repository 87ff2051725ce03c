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
from ..blocks import BLOCK, blocked

# Visiting priority of a key block within its tile; higher is visited first.
_NOT_CANDIDATE, _SCORED, _SINK, _LOCAL_LAST, _LOCAL_FIRST = range(5)


def score_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def block_means(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean of each 128-row block of ``x [n, heads, d]`` over its valid rows: ``[heads, blocks, d]``."""
    sums = blocked(x, dtype).sum(2)
    rows = (x.shape[0] - torch.arange(sums.shape[1], device=x.device) * BLOCK).clamp(max=BLOCK)
    return sums / rows[:, None].to(dtype)


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


def visiting_priority(qtiles: torch.Tensor, num_kv_blocks: int, force_local: bool,
                      force_sink: bool) -> torch.Tensor:
    """``[tiles, num_kv_blocks]`` priorities (see the module doc) from the plan's qtile rows."""
    blocks = torch.arange(num_kv_blocks, device=qtiles.device)[None, :]
    candidates = candidate_mask(qtiles, num_kv_blocks)
    priority = torch.where(candidates, _SCORED, _NOT_CANDIDATE)
    if force_sink:
        priority = torch.where(candidates & (blocks == 0), _SINK, priority)
    if force_local:
        priority = torch.where(blocks == qtiles[:, _C.QT_LOCAL_LAST, None], _LOCAL_LAST, priority)
        priority = torch.where(blocks == qtiles[:, _C.QT_LOCAL_FIRST, None], _LOCAL_FIRST, priority)
    return priority


def order_from_scores(scores: torch.Tensor, qtiles: torch.Tensor, out: torch.Tensor, *,
                      force_local: bool, force_sink: bool) -> None:
    """Writes the order mask for ``scores [hq, tiles, num_kv_blocks]`` into
    ``out [tiles, hq, k_max]`` (int32, -1 past each tile's ``num_selected``).
    Scores of non-candidate blocks are ignored; they must not be NaN."""
    num_qo_heads, _, num_kv_blocks = scores.shape
    # Lexicographic (priority, score, block index) descending: two stable sorts,
    # least significant key first, over blocks listed from the largest index.
    priority = visiting_priority(qtiles, num_kv_blocks, force_local, force_sink)
    by_score = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices
    reversed_priority = priority.flip(-1).expand(num_qo_heads, -1, -1)
    by_priority = torch.sort(reversed_priority.gather(-1, by_score), dim=-1, descending=True,
                             stable=True).indices
    ranked = num_kv_blocks - 1 - by_score.gather(-1, by_priority)   # [hq, tiles, blocks]

    k_max = out.shape[-1]
    width = min(k_max, num_kv_blocks)
    slot = torch.arange(width, device=scores.device)
    selected = slot < qtiles[:, _C.QT_NUM_SELECTED, None, None]          # [tiles, 1, width]
    out[..., :width] = torch.where(selected, ranked[..., :width].transpose(0, 1), -1)
    out[..., width:] = -1
