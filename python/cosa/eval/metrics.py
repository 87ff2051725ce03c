"""Accuracy metrics of block-sparse attention against dense attention, one request at a time.

Masks are ``[tiles, hq, kv_blocks]`` bool (a block listed / computed for a
query tile and head); masses are ``[tiles, hq, kv_blocks]``: the dense
attention probability each block receives, summed over the tile's rows
(:func:`cosa.proxy.oracle.attention_block_mass`).
"""

from __future__ import annotations

import torch


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
