"""Paged KV-cache layouts (FlashInfer conventions).

A cache is one tensor ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
(NHD) / ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), or a
tuple ``(k_cache, v_cache)`` of ``[num_pages, page_size, num_kv_heads,
head_dim]`` (NHD) / ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND).
What ``run`` uses works on views; only :func:`gather_pages` copies (for the
proxy and the reference, never for the kernel). :func:`paged_kv_cache` builds a
new cache and its page table from contiguous K/V (demo, benchmarks);
:func:`page_table` and :func:`scatter_pages` are its two steps, for a caller that
writes K/V layer by layer as a serving engine does.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch

from .checks import check_int, check_tensor

KV_LAYOUTS = ("NHD", "HND")


class CacheGeometry(NamedTuple):
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def check_kv_layout(kv_layout: str, name: str = "kv_layout") -> str:
    """``kv_layout``, if it is one of ``KV_LAYOUTS``; ``name`` is the argument's in the error, as
    in ``cosa.checks``."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{name} must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def split_kv_cache(paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
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
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("paged_kv_cache: the head_dim axis must be contiguous")
    return k, v


def cache_geometry(cache: torch.Tensor, kv_layout: str) -> CacheGeometry:
    """The geometry of one 4-D cache (K or V: ``split_kv_cache``'s views) in ``kv_layout``."""
    check_tensor("cache", cache, dim=4)
    if check_kv_layout(kv_layout) == "NHD":
        num_pages, page_size, num_kv_heads, head_dim = cache.shape
    else:
        num_pages, num_kv_heads, page_size, head_dim = cache.shape
    return CacheGeometry(num_pages, page_size, num_kv_heads, head_dim)


def _check_page_ids(pages) -> torch.Tensor:
    check_tensor("pages", pages, dim=1)
    if pages.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pages must be int32 or int64 page ids, got {pages.dtype}")
    return pages


def gather_pages(cache: torch.Tensor, kv_layout: str, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` rows stored in ``pages`` (in order) as ``[kv_len, num_kv_heads, head_dim]``."""
    page_size = cache_geometry(cache, kv_layout).page_size
    _check_page_ids(pages)
    if not 0 <= kv_len <= pages.shape[0] * page_size:
        raise ValueError(f"kv_len must be in [0, {pages.shape[0] * page_size}] for {pages.shape[0]} pages "
                         f"of {page_size} rows, got {kv_len}")
    rows = cache.index_select(0, pages)
    if kv_layout == "HND":
        rows = rows.transpose(1, 2)
    return rows.reshape(rows.shape[0] * page_size, rows.shape[-2], rows.shape[-1])[:kv_len]


def scatter_pages(cache: torch.Tensor, kv_layout: str, pages: torch.Tensor, x: torch.Tensor) -> None:
    """Writes ``x [n, num_kv_heads, head_dim]`` into the first ``n`` rows stored in ``pages`` (in
    order): the inverse of :func:`gather_pages`. Later rows keep their content; no host sync, so
    the page ids themselves are the caller's to keep in range (torch's indexing asserts)."""
    geometry = cache_geometry(cache, kv_layout)
    _check_page_ids(pages)
    check_tensor("x", x, dim=3)
    if tuple(x.shape[1:]) != (geometry.num_kv_heads, geometry.head_dim):
        raise ValueError(f"x must be [n, {geometry.num_kv_heads}, {geometry.head_dim}] as the cache's rows, "
                         f"got {tuple(x.shape)}")
    if x.shape[0] > pages.shape[0] * geometry.page_size:
        raise ValueError(f"x has {x.shape[0]} rows, more than {pages.shape[0]} pages of {geometry.page_size} hold")
    token = torch.arange(x.shape[0], device=x.device)
    page, row = pages.long()[token // geometry.page_size], token % geometry.page_size
    if kv_layout == "NHD":
        cache[page, row] = x
    else:
        cache[page, :, row] = x


def indptr(lengths, device=None) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` int32: CSR offsets of consecutive ragged lengths (``qo_indptr``, ``kv_indptr``)."""
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)


def page_table(kv_lens: Sequence[int], page_size: int, device=None, *, shuffle: bool = False,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kv_indptr, kv_indices, kv_last_page_len)`` of requests holding ``kv_lens`` keys, each on
    ``ceil(kv_len / page_size)`` pages of its own: consecutive physical pages in request order (the
    layout of :func:`to_pages`), or with ``shuffle`` a random permutation of them, as in a serving
    engine's page pool after some traffic (``generator`` seeds it)."""
    page_size = check_int("page_size", page_size)
    kv_lens = [check_int(f"kv_lens[{r}]", n, minimum=0) for r, n in enumerate(kv_lens)]
    pages = [-(-n // page_size) for n in kv_lens]
    physical = torch.randperm(sum(pages), generator=generator) if shuffle else torch.arange(sum(pages))
    last = [(n - 1) % page_size + 1 if n else 0 for n in kv_lens]
    return (indptr(pages, device), physical.to(device=device, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32, device=device))


def paged_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_lens: Sequence[int], page_size: int,
                   kv_layout: str = "NHD", *, combined: bool = True, shuffle: bool = True,
                   generator: torch.Generator | None = None):
    """A new paged cache holding ``k, v [sum(kv_lens), num_kv_heads, head_dim]`` (requests one
    after the other, as in ``q``), with its page table from :func:`page_table`: ``(cache,
    kv_indptr, kv_indices, kv_last_page_len)``, all on ``k``'s device. The cache is one
    ``[num_pages, 2, ...]`` tensor, or with ``combined=False`` a ``(k_cache, v_cache)`` tuple;
    rows past a request's last key are zero; pages are shuffled unless ``shuffle=False``."""
    check_kv_layout(kv_layout)
    check_tensor("k", k, dim=3)
    check_tensor("v", v, dim=3)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v must be like k: shape {tuple(k.shape)}, {k.dtype}, on {k.device}; got "
                         f"{tuple(v.shape)}, {v.dtype}, on {v.device}")
    kv_indptr, kv_indices, kv_last_page_len = page_table(kv_lens, page_size, k.device, shuffle=shuffle,
                                                         generator=generator)
    if sum(kv_lens) != k.shape[0]:
        raise ValueError(f"kv_lens must add up to k's {k.shape[0]} rows, got {sum(kv_lens)}")
    num_pages, (heads, head_dim) = kv_indices.shape[0], k.shape[1:]
    page = (page_size, heads, head_dim) if kv_layout == "NHD" else (heads, page_size, head_dim)
    if combined:
        cache = k.new_zeros(num_pages, 2, *page)
    else:
        cache = (k.new_zeros(num_pages, *page), v.new_zeros(num_pages, *page))
    k_cache, v_cache = split_kv_cache(cache)
    first_page, first_row = 0, 0
    for kv_len in kv_lens:
        pages = kv_indices[first_page:first_page + -(-kv_len // page_size)]
        rows = slice(first_row, first_row + kv_len)
        scatter_pages(k_cache, kv_layout, pages, k[rows])
        scatter_pages(v_cache, kv_layout, pages, v[rows])
        first_page, first_row = first_page + pages.shape[0], rows.stop
    return cache, kv_indptr, kv_indices, kv_last_page_len


def to_pages(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Contiguous ``x [..., n, heads, d]`` (each leading index one request) as a zero-padded NHD
    page cache ``[requests * ceil(n / page_size), page_size, heads, d]``, pages in request order."""
    page_size = check_int("page_size", page_size)
    if check_tensor("x", x).dim() < 3:
        raise ValueError(f"x must be [..., n, heads, d], got shape {tuple(x.shape)}")
    n, heads, d = x.shape[-3:]
    requests = x.reshape(math.prod(x.shape[:-3]), n, heads, d)   # explicit sizes: x may be empty
    pages_per_request = -(-n // page_size)
    pages = requests.new_zeros(requests.shape[0], pages_per_request * page_size, heads, d)
    pages[:, :n] = requests
    return pages.view(requests.shape[0] * pages_per_request, page_size, heads, d)


def uniform_page_table(batch: int, q_len: int, kv_len: int, page_size: int, device) -> tuple[torch.Tensor, ...]:
    """``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` of ``batch`` equal requests laid
    out by :func:`to_pages`."""
    return (indptr([q_len] * batch, device), *page_table([kv_len] * batch, page_size, device))
