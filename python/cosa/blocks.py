"""The logical 128-token block shared by queries and keys."""

from __future__ import annotations

import torch

from ._C import BLOCK_SIZE as BLOCK


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def blocked(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [n, heads, d]`` zero-padded to whole blocks: ``[heads, blocks, 128, d]`` in ``dtype``."""
    n, heads, d = x.shape
    blocks = num_blocks(n)
    padded = x.new_zeros((blocks * BLOCK, heads, d), dtype=dtype)
    padded[:n] = x
    return padded.view(blocks, BLOCK, heads, d).permute(2, 0, 1, 3)
