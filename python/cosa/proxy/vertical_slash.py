"""MInference-style proxy: vertical and slash lines estimated from the last queries.

The last ``last_q`` (64) queries attend to every key exactly; summing their
probabilities per key gives the vertical lines (keys every query reads, such as
sinks) and per distance ``query position - key position`` the slash lines
(fixed offsets, such as the local window). A (tile, key block) scores the
vertical mass of its keys plus the slash mass its diagonals carry, averaged
over the tile's rows: both in units of the last queries' attention mass.
"""

from __future__ import annotations

import math

import torch

from ..blocks import BLOCK, compute_dtype, num_blocks
from .order import grouped_products

LAST_Q = 64


def vertical_slash_scores(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, *, causal: bool,
                          sm_scale: float, last_q: int = LAST_Q) -> torch.Tensor:
    """``[hq, tiles, kv_blocks]`` vertical plus slash attention mass per block."""
    q_len, num_qo_heads, _ = q.shape
    kv_len = k.shape[0]
    dtype = compute_dtype(q)
    device = q.device
    tiles, kv_blocks = num_blocks(q_len), num_blocks(kv_len)
    last = min(last_q, q_len)
    query_pos = kv_len - q_len + torch.arange(q_len - last, q_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    logits = grouped_products(q[-last:].to(dtype).transpose(0, 1), k.to(dtype).transpose(0, 1)) * sm_scale
    if causal:
        logits = logits.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], -math.inf)
    probabilities = torch.softmax(logits, dim=-1)                          # [hq, last, kv_len]

    vertical = probabilities.sum(1)
    vertical = torch.nn.functional.pad(vertical, (0, kv_blocks * BLOCK - kv_len))
    vertical = vertical.view(num_qo_heads, kv_blocks, BLOCK).sum(-1)       # [hq, kv_blocks]

    # slash[o]: mass at distance o - (span - 1), offsets shifted to be >= 0.  Distances run
    # from 1 - q_len (the first query row, at position kv_len - q_len, to the last key) to
    # kv_len - 1, so span = max(q_len, kv_len) covers them.  Row r's keys kv_len-1 .. 0 land
    # on offsets p_r + span - kv_len onwards.
    span = max(q_len, kv_len)
    slash = torch.zeros((num_qo_heads, span + kv_len - 1), dtype=torch.float64, device=device)
    for row, position in enumerate(query_pos.tolist()):
        first = position + span - kv_len
        slash[:, first:first + kv_len] += probabilities[:, row].flip(-1)
    # Sum of slash over a key range [a, b) for a row at position p is C[p-a+span] - C[p-b+span]
    # (C the prefix sum); summed over a tile's rows [p0, p1) it is a difference of D = prefix sum of C.
    prefix = torch.nn.functional.pad(slash.cumsum(-1), (1, 0))             # C
    prefix2 = torch.nn.functional.pad(prefix.cumsum(-1), (1, 0))           # D
    tile_first = kv_len - q_len + torch.arange(tiles, device=device) * BLOCK
    tile_rows = (q_len - torch.arange(tiles, device=device) * BLOCK).clamp(max=BLOCK)
    block_first = torch.arange(kv_blocks, device=device) * BLOCK
    block_end = (block_first + BLOCK).clamp(max=kv_len)

    def rows_sum(key_start):                     # sum over the tile's rows of C[p - key_start + span]
        base = span - key_start[None, :]
        upper = (tile_first + tile_rows)[:, None] + base
        lower = tile_first[:, None] + base
        return prefix2[:, upper.flatten()] - prefix2[:, lower.flatten()]

    diagonal = (rows_sum(block_first) - rows_sum(block_end)).view(num_qo_heads, tiles, kv_blocks)
    slash_per_block = diagonal / tile_rows[None, :, None]
    return (vertical[:, None, :].double() + slash_per_block).to(dtype)
