"""Merging attention states: two partial results over disjoint key sets, from their LSEs."""

from __future__ import annotations

import torch

from .checks import check_tensor


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from ``(o [n, heads, d],
    lse [n, heads])`` over each (natural-log LSE, as ``cosa.run`` returns it):
    ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse)``.
    A part whose ``lse`` is ``-inf`` (no key) adds nothing, whatever its ``o`` holds; a row that
    saw no key in either part stays ``o = 0, lse = -inf``.
    Both parts' ``o`` share one floating dtype, which the result keeps; the LSEs are float."""
    for name, o, lse in (("o_a", o_a, lse_a), ("o_b", o_b, lse_b)):
        check_tensor(name, o, dim=3)
        check_tensor("lse" + name[1:], lse, dim=2)
        if not o.is_floating_point() or not lse.is_floating_point():
            raise TypeError(f"{name} and lse{name[1:]} must be floating tensors, got {o.dtype} and {lse.dtype}")
        if o.shape != o_a.shape or lse.shape != o_a.shape[:2]:
            raise ValueError(f"{name} must be [n, heads, d] = {tuple(o_a.shape)} and lse{name[1:]} [n, heads] = "
                             f"{tuple(o_a.shape[:2])}, got {tuple(o.shape)} and {tuple(lse.shape)}")
        if o.device != o_a.device or lse.device != o_a.device:
            raise ValueError(f"{name} and lse{name[1:]} must be on o_a's device {o_a.device}, got {o.device} and "
                             f"{lse.device}")
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"o_b must have o_a's dtype {o_a.dtype}, got {o_b.dtype}")
    lse = torch.logaddexp(lse_a, lse_b)
    base = lse.masked_fill(lse == -torch.inf, 0)
    weight_a = torch.exp(lse_a - base)[..., None]
    weight_b = torch.exp(lse_b - base)[..., None]
    dtype = torch.promote_types(o_a.dtype, torch.float32)
    # a part of weight 0 (no keys) adds nothing, whatever its o holds (NaN, say, left unwritten)
    merged = sum(torch.where(weight == 0, 0.0, part.to(dtype) * weight)
                 for part, weight in ((o_a, weight_a), (o_b, weight_b)))
    return merged.to(o_a.dtype), lse
