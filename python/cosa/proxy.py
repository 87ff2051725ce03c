"""KAP, the kernel-aware proxy (SPEC stage 1).

For every (query tile, query head) the proxy scores each candidate key block by
``qbar . kbar`` (mean query of the tile against mean key of the block) and
lists the blocks the kernel must visit, in visiting order: forced local
block(s) first (ascending), then the sink block 0, then the other candidates by
descending score with ties going to the larger block index. Which blocks are
candidates, which are local and how many are selected is decided once per
batch shape by the plan (``qtiles``); the proxy only ranks.
"""

from __future__ import annotations

import torch

from . import _C
from .blocks import BLOCK, blocked

# Visiting priority of a key block within its tile; higher is visited first.
_NOT_CANDIDATE, _SCORED, _SINK, _LOCAL_LAST, _LOCAL_FIRST = range(5)


def block_means(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean of each 128-row block of ``x [n, heads, d]`` over its valid rows: ``[heads, blocks, d]``."""
    sums = blocked(x, dtype).sum(2)
    rows = (x.shape[0] - torch.arange(sums.shape[1], device=x.device) * BLOCK).clamp(max=BLOCK)
    return sums / rows[:, None].to(dtype)


def visiting_priority(qtiles: torch.Tensor, num_kv_blocks: int, force_local: bool,
                      force_sink: bool) -> torch.Tensor:
    """``[tiles, num_kv_blocks]`` priorities (see the module doc) from the plan's qtile rows."""
    blocks = torch.arange(num_kv_blocks, device=qtiles.device)[None, :]
    candidates = blocks < qtiles[:, _C.QT_NUM_CANDIDATES, None]
    priority = torch.where(candidates, _SCORED, _NOT_CANDIDATE)
    if force_sink:
        priority = torch.where(candidates & (blocks == 0), _SINK, priority)
    if force_local:
        priority = torch.where(blocks == qtiles[:, _C.QT_LOCAL_LAST, None], _LOCAL_LAST, priority)
        priority = torch.where(blocks == qtiles[:, _C.QT_LOCAL_FIRST, None], _LOCAL_FIRST, priority)
    return priority


def kap_order(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, out: torch.Tensor,
              *, force_local: bool = True, force_sink: bool = True) -> None:
    """Writes the order mask of one request into ``out``.

    ``q [q_len, num_qo_heads, d]`` and ``k [kv_len, num_kv_heads, d]`` are the
    request's queries and keys, ``qtiles`` its rows of the plan's qtile table
    (on q's device), ``out [tiles, num_qo_heads, k_max]`` int32 receives block
    indices in visiting order, -1 past each tile's ``num_selected``.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qbar = block_means(q, dtype)                       # [hq, tiles, d]
    kbar = block_means(k, dtype)                       # [hkv, blocks, d]
    num_qo_heads, tiles, d = qbar.shape
    num_kv_heads, num_kv_blocks, _ = kbar.shape
    group = num_qo_heads // num_kv_heads
    scores = qbar.reshape(num_kv_heads, group * tiles, d) @ kbar.transpose(1, 2)
    scores = scores.view(num_qo_heads, tiles, num_kv_blocks)

    # Lexicographic (priority, score, block index) descending: two stable sorts,
    # least significant key first, over blocks listed from the largest index.
    priority = visiting_priority(qtiles, num_kv_blocks, force_local, force_sink)
    reversed_scores = scores.flip(-1)
    by_score = torch.sort(reversed_scores, dim=-1, descending=True, stable=True).indices
    reversed_priority = priority.flip(-1).expand(num_qo_heads, -1, -1)
    by_priority = torch.sort(reversed_priority.gather(-1, by_score), dim=-1, descending=True,
                             stable=True).indices
    ranked = num_kv_blocks - 1 - by_score.gather(-1, by_priority)   # [hq, tiles, blocks]

    k_max = out.shape[-1]
    width = min(k_max, num_kv_blocks)
    slot = torch.arange(width, device=q.device)
    selected = slot < qtiles[:, _C.QT_NUM_SELECTED, None, None]          # [tiles, 1, width]
    order = torch.where(selected, ranked[..., :width].transpose(0, 1), -1)
    out[..., :width] = order
    out[..., width:] = -1
