"""Random ragged batches in a paged cache, with the contiguous copies the oracle reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# what int32 outputs (order masks, counts) are filled with before the code under test writes them:
# no block index or count it writes is negative but -1
POISON = -7


@dataclass
class Batch:
    q: torch.Tensor                 # [total_q, hq, d]
    cache: object                   # combined tensor or (k, v) tuple, in `layout`
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    requests: list                  # per request: (q, k, v) contiguous
    q_lens: list
    kv_lens: list

    def page_table(self, device=None) -> list:
        """``[qo_indptr, kv_indptr, kv_indices, kv_last_page_len]`` on ``device``: cosa.plan's first four
        arguments."""
        return [t.to(device) for t in (self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len)]

    def cache_on(self, device):
        """The cache on ``device``: the tensor, or each part of a ``(k, v)`` tuple."""
        if isinstance(self.cache, tuple):
            return tuple(t.to(device) for t in self.cache)
        return self.cache.to(device)


def fresh_generator() -> torch.Generator:
    """A generator on a fresh seed, printed so that a failing case (pytest shows its output) replays."""
    seed = torch.seed()
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def make_batch(q_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size, *, layout="NHD",
               combined=True, dtype=torch.float64, spare_pages=3, generator=None, qkv=None) -> Batch:
    """Pages are shuffled in a cache with spare pages; unused rows hold NaN so any read of them shows."""
    requests, pages_of = [], []
    total_pages = spare_pages
    for r, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if qkv is not None:
            q, k, v = qkv(r, q_len, kv_len)
        else:
            q = torch.randn(q_len, num_qo_heads, head_dim, generator=generator, dtype=torch.float64)
            k = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
            v = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        requests.append((q.to(dtype), k.to(dtype), v.to(dtype)))
        pages = -(-kv_len // page_size)
        pages_of.append(list(range(total_pages, total_pages + pages)))
        total_pages += pages
    slot = torch.randperm(total_pages, generator=generator)     # logical page -> physical page
    k_cache = torch.full((total_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for (_, k, v), pages in zip(requests, pages_of):
        for n, page in enumerate(pages):
            rows = slice(n * page_size, min((n + 1) * page_size, k.shape[0]))
            k_cache[slot[page], :rows.stop - rows.start] = k[rows]
            v_cache[slot[page], :rows.stop - rows.start] = v[rows]
    if layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    cache = torch.stack([k_cache, v_cache], dim=1) if combined else (k_cache, v_cache)
    indptr = lambda lens: torch.tensor([0] + list(lens)).cumsum(0).int()  # noqa: E731
    return Batch(
        q=torch.cat([q for q, _, _ in requests]) if requests else torch.empty(0, num_qo_heads, head_dim),
        cache=cache, qo_indptr=indptr(q_lens), kv_indptr=indptr(len(p) for p in pages_of),
        kv_indices=torch.tensor([int(slot[p]) for pages in pages_of for p in pages], dtype=torch.int32),
        kv_last_page_len=torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in kv_lens],
                                      dtype=torch.int32),
        requests=requests, q_lens=list(q_lens), kv_lens=list(kv_lens))
