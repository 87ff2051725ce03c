"""The logical 128-token block shared by queries and keys, and the dtype the torch paths (the
exact reference, the proxies) compute in."""

from __future__ import annotations

import torch

from ._C import BLOCK_SIZE as BLOCK


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs (studies), else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def blocked(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [n, heads, d]`` zero-padded to whole blocks: ``[heads, blocks, 128, d]`` in ``dtype``."""
    n, heads, d = x.shape
    blocks = num_blocks(n)
    padded = x.new_zeros((blocks * BLOCK, heads, d), dtype=dtype)
    padded[:n] = x
    return padded.view(blocks, BLOCK, heads, d).permute(2, 0, 1, 3)
