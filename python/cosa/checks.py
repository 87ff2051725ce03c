"""Argument checks shared by cosa's public functions; each error names the argument."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch


INT32_MAX = 2**31 - 1  # the plan's tables and the kernels count in int32


def check_int(name: str, x, minimum: int = 1, maximum: int = INT32_MAX) -> int:
    """``x`` as an int, if it is an integer (not a bool) in ``[minimum, maximum]``."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    if x > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {x}")
    return int(x)


def check_bool(name: str, x) -> bool:
    """``x`` as a bool, if it is one (numpy's included): a flag passed on as 0 or 1 must not be
    a string such as "False", which would be true."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def as_float(name: str, x) -> float:
    """``x`` as a float, if it is a real number (not a bool) that a float holds (NaN included)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:   # an int of more than ~1024 bits
        raise ValueError(f"{name} is beyond a float's range: an int of {int(x).bit_length()} bits") from None


def check_float(name: str, x, low: float = -math.inf, high: float = math.inf) -> float:
    """``x`` as a float, if it is a real number (not a bool) in ``[low, high]``."""
    value = as_float(name, x)
    if value != value:
        raise ValueError(f"{name} must be a number, got NaN")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {x!r}")
    return value


def check_tensor(name: str, x, dim: int | None = None) -> torch.Tensor:
    """``x``, if it is a tensor (of ``dim`` dimensions)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    return x


def _check_disjoint(name: str, x: torch.Tensor) -> None:
    """An output's elements are written in parallel: no two may share an address (as in an
    expanded view). Taken by increasing stride, each dim's stride must reach past every
    element the dims below it span.  An empty tensor has no elements to share."""
    if x.numel() == 0:
        return
    span = 1
    for stride, size in sorted((stride, size) for size, stride in zip(x.shape, x.stride()) if size > 1):
        if stride < span:
            raise ValueError(f"{name}'s elements overlap (shape {tuple(x.shape)}, strides {x.stride()}): "
                             "it must not be an expanded or overlapping view")
        span += stride * (size - 1)


def byte_span(name: str, x: torch.Tensor) -> tuple[str, torch.device, int, int]:
    """``(name, device, first, end)``: the byte addresses ``x``'s elements lie in (none for no
    elements), as ``check_apart`` compares them."""
    numel = x.numel()
    if numel == 0:
        return name, x.device, 0, 0
    # a contiguous tensor's elements are its numel; the sum is for views (a run's host cost)
    elements = numel if x.is_contiguous() else 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    start = x.data_ptr()
    return name, x.device, start, start + x.element_size() * elements


def check_apart(outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], who: str = "",
                checked_outputs: tuple = (), input_spans: tuple = ()) -> None:
    """Outputs written in parallel while the inputs are read: no two elements of one output may
    share an address, and no output's memory may meet another output's or an input's.  The
    latter is judged by the address ranges the tensors span, so views that interleave without
    sharing elements are refused too.  ``input_spans``: more inputs, and ``checked_outputs``:
    more outputs, checked already against each other and those inputs; both as ``byte_span``
    gives them, kept by an owner whose tensors never change (a plan, a launcher bound to one).
    ``who`` prefixes the error (a launcher's name)."""
    prefix = f"{who}: " if who else ""
    for name, x in outputs.items():
        _check_disjoint(prefix + name, x)
    output_spans = [byte_span(name, x) for name, x in outputs.items()]
    call_inputs = [byte_span(name, x) for name, x in inputs.items()]
    spans = output_spans + list(checked_outputs) + call_inputs + list(input_spans)
    for i, span in enumerate(output_spans):
        _refuse_overlap(prefix, span, spans[i + 1:])
    for span in checked_outputs:
        _refuse_overlap(prefix, span, call_inputs)


def _refuse_overlap(prefix: str, output: tuple, others: list) -> None:
    name, device, start, end = output
    for other, other_device, other_start, other_end in others:
        if start < other_end and other_start < end and device == other_device:
            raise ValueError(f"{prefix}{name} shares memory with {other}: an output must not overlap "
                             "another output or an input")
