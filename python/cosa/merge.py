"""Merging attention states: two partial results over disjoint key sets, from their LSEs."""

from __future__ import annotations

import torch


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from ``(o [n, heads, d],
    lse [n, heads])`` over each (natural-log LSE, as ``cosa.run`` returns it):
    ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse)``.
    A row that saw no key in either part (both ``-inf``) stays ``o = 0, lse = -inf``."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = lse.masked_fill(lse == -torch.inf, 0)
    weight_a = torch.exp(lse_a - base)[..., None]
    weight_b = torch.exp(lse_b - base)[..., None]
    dtype = torch.promote_types(o_a.dtype, torch.float32)
    o = o_a.to(dtype) * weight_a + o_b.to(dtype) * weight_b
    return o.to(o_a.dtype), lse
