"""Paged KV-cache layouts (FlashInfer conventions).

A cache is one tensor ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
(NHD) / ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), or a
tuple ``(k_cache, v_cache)`` of ``[num_pages, page_size, num_kv_heads,
head_dim]`` (NHD) / ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND).
Everything here works on views; only :func:`gather_pages` copies (for the
proxy and the reference, never for the kernel).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_LAYOUTS = ("NHD", "HND")


class CacheGeometry(NamedTuple):
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def split_kv_cache(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns 4-D views ``(k, v)`` of a combined or tuple cache."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2 or not all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
            raise TypeError("paged_kv_cache must be a tensor or a (k_cache, v_cache) tuple of tensors")
        k, v = paged_kv_cache
        if k.dim() != 4:
            raise ValueError(f"paged_kv_cache: k_cache must be 4-D, got shape {tuple(k.shape)}")
        if k.shape != v.shape:
            raise ValueError(
                f"paged_kv_cache: k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} differ in shape")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError("paged_kv_cache: k_cache and v_cache differ in dtype or device")
    elif isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                "paged_kv_cache must be [num_pages, 2, ...] with 5 dims, got shape "
                f"{tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        raise TypeError(f"paged_kv_cache must be a tensor or a tuple, got {type(paged_kv_cache).__name__}")
    if k.stride(-1) != 1:
        raise ValueError("paged_kv_cache: the head_dim axis must be contiguous")
    return k, v


def cache_geometry(k: torch.Tensor, kv_layout: str) -> CacheGeometry:
    if kv_layout == "NHD":
        num_pages, page_size, num_kv_heads, head_dim = k.shape
    else:
        num_pages, num_kv_heads, page_size, head_dim = k.shape
    return CacheGeometry(num_pages, page_size, num_kv_heads, head_dim)


def gather_pages(cache: torch.Tensor, kv_layout: str, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` rows stored in ``pages`` (in order) as ``[kv_len, num_kv_heads, head_dim]``."""
    rows = cache.index_select(0, pages)
    if kv_layout == "HND":
        rows = rows.transpose(1, 2)
    return rows.reshape(-1, rows.shape[-2], rows.shape[-1])[:kv_len]


def to_pages(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Contiguous ``x [..., n, heads, d]`` (each leading index one request) as a zero-padded NHD
    page cache ``[requests * ceil(n / page_size), page_size, heads, d]``, pages in request order."""
    n, heads, d = x.shape[-3:]
    requests = x.reshape(-1, n, heads, d)
    pages = requests.new_zeros(requests.shape[0], -(-n // page_size) * page_size, heads, d)
    pages[:, :n] = requests
    return pages.view(-1, page_size, heads, d)


def uniform_page_table(batch: int, q_len: int, kv_len: int, page_size: int, device) -> tuple[torch.Tensor, ...]:
    """``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` of ``batch`` equal requests laid out by :func:`to_pages`."""
    pages = -(-kv_len // page_size)
    step = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return (step * q_len, step * pages, torch.arange(batch * pages, dtype=torch.int32, device=device),
            torch.full((batch,), kv_len - (pages - 1) * page_size, dtype=torch.int32, device=device))
