"""Argument checks shared by cosa's public functions; each error names the argument."""

from __future__ import annotations

import math
import numbers

import torch


def check_int(name: str, x, minimum: int = 1) -> int:
    """``x`` as an int, if it is an integer (not a bool) of at least ``minimum``."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def check_float(name: str, x, low: float = -math.inf, high: float = math.inf) -> float:
    """``x`` as a float, if it is a real number (not a bool) in ``[low, high]``."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    if not low <= x <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {x!r}")
    return float(x)


def check_tensor(name: str, x, dim: int | None = None) -> torch.Tensor:
    """``x``, if it is a tensor (of ``dim`` dimensions)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    return x


def check_disjoint(name: str, x: torch.Tensor) -> None:
    """An output's elements are written in parallel: no two may share an address (as in an
    expanded view). Taken by increasing stride, each dim's stride must reach past every
    element the dims below it span."""
    span = 1
    for stride, size in sorted((stride, size) for size, stride in zip(x.shape, x.stride()) if size > 1):
        if stride < span:
            raise ValueError(f"{name}'s elements overlap (shape {tuple(x.shape)}, strides {x.stride()}): "
                             "it must not be an expanded or overlapping view")
        span += stride * (size - 1)
