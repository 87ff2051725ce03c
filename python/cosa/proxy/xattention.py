"""XAttention-style proxy: antidiagonal scoring with a stride.

Every ``stride`` consecutive queries and keys are folded into one vector
(queries in reverse order), so one dot product sums a ``stride``-long
antidiagonal of the logit matrix: each antidiagonal crosses every vertical and
every slash line once. The strided logits (scale ``sm_scale / stride``, as in
XAttention) are soft-maxed per strided query row under the causal mask and
summed over each (tile, key block): an estimate of the block's attention mass.
"""

from __future__ import annotations

import math

import torch

from ..blocks import BLOCK, blocked, compute_dtype
from .order import grouped_products

_TILES_PER_CHUNK = 8  # query tiles scored at once, bounding memory at long contexts


def xattention_scores(q: torch.Tensor, k: torch.Tensor, qtiles: torch.Tensor, *, causal: bool,
                      sm_scale: float, stride: int) -> torch.Tensor:
    """``[hq, tiles, kv_blocks]`` antidiagonal attention mass per block."""
    if BLOCK % stride:
        raise ValueError(f"stride must divide the block size {BLOCK}, got {stride}")
    q_len, kv_len = q.shape[0], k.shape[0]
    dtype = compute_dtype(q)
    q_blocks, k_blocks = blocked(q, dtype), blocked(k, dtype)        # [h, blocks, 128, d]
    num_qo_heads, tiles, _, d = q_blocks.shape
    num_kv_heads, kv_blocks = k_blocks.shape[:2]
    per_block = BLOCK // stride
    # Strided rows: queries S*a+S-1, ..., S*a (reversed) and keys S*b, ..., S*b+S-1.
    q_folded = q_blocks.reshape(num_qo_heads, tiles * per_block, stride, d).flip(2)
    q_folded = q_folded.reshape(num_qo_heads, tiles * per_block, stride * d)
    k_folded = k_blocks.reshape(num_kv_heads, kv_blocks * per_block, stride * d)

    group_start = torch.arange(tiles * per_block, device=q.device) * stride
    query_valid = group_start < q_len
    query_pos = kv_len - q_len + (group_start + stride - 1).clamp(max=q_len - 1)
    key_start = torch.arange(kv_blocks * per_block, device=q.device) * stride
    visible = (key_start < kv_len)[None, :].expand(tiles * per_block, -1)
    if causal:
        visible = visible & (key_start[None, :] <= query_pos[:, None])

    scores = torch.zeros((num_qo_heads, tiles, kv_blocks), dtype=dtype, device=q.device)
    for first in range(0, tiles, _TILES_PER_CHUNK):
        rows = slice(first * per_block, min(first + _TILES_PER_CHUNK, tiles) * per_block)
        logits = grouped_products(q_folded[:, rows], k_folded) * (sm_scale / stride)
        logits = logits.masked_fill(~visible[rows], -math.inf)
        probabilities = torch.softmax(logits, dim=-1).nan_to_num(0.0)   # rows seeing no key: 0
        probabilities = probabilities * query_valid[rows, None]
        chunk_tiles = (rows.stop - rows.start) // per_block
        scores[:, first:first + chunk_tiles] = probabilities.view(
            num_qo_heads, chunk_tiles, per_block, kv_blocks, per_block).sum((2, 4))
    return scores
