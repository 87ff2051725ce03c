"""The oracle "proxy": each block's exact share of dense attention.

Not a proxy in the cost sense (it runs dense attention); it ranks blocks by the
attention mass they really receive, so its order mask is the best any proxy
can list at the plan's budget and forced blocks. The studies use it as the
ceiling of stage 1 (``proxy="oracle"``, e.g. for the needle study).
"""

from __future__ import annotations

import math

import torch

from ..blocks import BLOCK, compute_dtype, num_blocks

_TILES_PER_CHUNK = 4  # query tiles per chunk of the dense pass, bounding its memory


@torch.no_grad()
def attention_block_mass(q: torch.Tensor, k: torch.Tensor, *, causal: bool, sm_scale: float) -> torch.Tensor:
    """``[tiles, hq, kv_blocks]``: the dense attention probability each key block receives, summed
    over each query tile's rows (causal alignment bottom-right, as everywhere in cosa)."""
    q_len, num_qo_heads, _ = q.shape
    kv_len = k.shape[0]
    dtype = compute_dtype(q)
    keys = k.to(dtype).repeat_interleave(num_qo_heads // k.shape[1], dim=1).transpose(0, 1)  # [hq, kv, d]
    tiles, kv_blocks = num_blocks(q_len), num_blocks(kv_len)
    mass = torch.zeros((tiles, num_qo_heads, kv_blocks), dtype=dtype, device=q.device)
    for first in range(0, tiles, _TILES_PER_CHUNK):
        rows = slice(first * BLOCK, min((first + _TILES_PER_CHUNK) * BLOCK, q_len))
        visible = kv_len - q_len + rows.stop if causal else kv_len
        logits = q[rows].to(dtype).transpose(0, 1) @ keys[:, :visible].transpose(1, 2) * sm_scale
        if causal:
            row_pos = kv_len - q_len + torch.arange(rows.start, rows.stop, device=q.device)
            logits = logits.masked_fill(torch.arange(visible, device=q.device) > row_pos[:, None], -math.inf)
        p = torch.softmax(logits, dim=-1)
        p = torch.nn.functional.pad(p, (0, -visible % BLOCK, 0, -(rows.stop - rows.start) % BLOCK))
        chunk = p.view(num_qo_heads, -1, BLOCK, p.shape[-1] // BLOCK, BLOCK).sum((2, 4))
        mass[first:first + chunk.shape[1], :, :chunk.shape[2]] = chunk.transpose(0, 1)
    return mass


def oracle_scores(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, *, causal: bool,
                  sm_scale: float) -> torch.Tensor:
    """``[hq, tiles, kv_blocks]`` exact attention mass per block (``qtiles``: unused, every
    tile of the request is scored)."""
    return attention_block_mass(q, k, causal=causal, sm_scale=sm_scale).transpose(0, 1)
