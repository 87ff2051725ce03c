"""Accuracy metrics of block-sparse attention against dense attention, one request at a time.

Masks are ``[tiles, hq, kv_blocks]`` bool (a block listed / computed for a
query tile and head); masses are ``[tiles, hq, kv_blocks]``: the dense
attention probability each block receives, summed over the tile's rows.
"""

from __future__ import annotations

import math

import torch

from ..blocks import BLOCK, num_blocks

_TILES_PER_CHUNK = 4  # query tiles per chunk of the dense pass, bounding its memory


@torch.no_grad()
def attention_block_mass(q: torch.Tensor, k: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Dense causal attention mass per (tile, head, key block) of one request, ``q_len == kv_len``, float32."""
    n, num_qo_heads, _ = q.shape
    group = num_qo_heads // k.shape[1]
    tiles = num_blocks(n)
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)       # [hq, n, d]
    mass = torch.zeros((tiles, num_qo_heads, tiles), dtype=torch.float32, device=q.device)
    for first in range(0, tiles, _TILES_PER_CHUNK):
        rows = slice(first * BLOCK, min((first + _TILES_PER_CHUNK) * BLOCK, n))
        logits = q[rows].float().transpose(0, 1) @ keys[:, :rows.stop].transpose(1, 2) * sm_scale
        causal = torch.arange(rows.stop, device=q.device)[None, :] > torch.arange(rows.start, rows.stop,
                                                                                  device=q.device)[:, None]
        p = torch.softmax(logits.masked_fill(causal, -math.inf), dim=-1)
        p = torch.nn.functional.pad(p, (0, -rows.stop % BLOCK, 0, -(rows.stop - rows.start) % BLOCK))
        chunk = p.view(num_qo_heads, -1, BLOCK, p.shape[-1] // BLOCK, BLOCK).sum((2, 4))
        mass[first:first + chunk.shape[1], :, :chunk.shape[2]] = chunk.transpose(0, 1)
    return mass


def order_to_mask(order: torch.Tensor, num_kv_blocks: int, listed: torch.Tensor | None = None) -> torch.Tensor:
    """``order [tiles, hq, k_max]`` (-1 padded) as a block mask; ``listed`` (like ``order``) keeps a subset."""
    keep = order >= 0 if listed is None else (order >= 0) & listed
    mask = torch.zeros(order.shape[:2] + (num_kv_blocks + 1,), dtype=torch.bool, device=order.device)
    mask.scatter_(-1, torch.where(keep, order.long(), num_kv_blocks), True)
    return mask[..., :num_kv_blocks]


def mass_recall(mass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[hq]``: the share of the attention mass that lands in masked blocks, over all rows of all tiles."""
    return (mass * mask).sum((0, 2)) / mass.sum((0, 2))


def top_k_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per (tile, head) row of ``scores [tiles, hq, blocks]``, the ``counts [tiles, hq]`` highest blocks."""
    rank = scores.argsort(-1, descending=True).argsort(-1)
    return rank < counts[..., None]


def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[hq]``: intersection over union of two block masks, averaged over tiles."""
    union = (a | b).sum(-1).clamp(min=1)
    return ((a & b).sum(-1) / union).mean(0)


def relative_error(o: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[hq]``: ``||o - ref|| / ||ref||`` per head of ``[n, hq, d]`` outputs."""
    o, reference = o.double(), reference.double()
    return (o - reference).norm(dim=(0, 2)) / reference.norm(dim=(0, 2))
