"""cosa.paged's cache builders: paged_kv_cache, page_table, scatter_pages (CPU)."""

from __future__ import annotations

import pytest
import torch

from cosa.paged import (gather_pages, indptr, page_table, paged_kv_cache, scatter_pages, split_kv_cache,
                        to_pages, uniform_page_table)

from batch import fresh_generator

KV_LENS = [1, 129, 300, 0, 128, 17]
HEADS, D = 2, 8


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("kv_layout,combined", [("NHD", True), ("HND", True), ("NHD", False), ("HND", False)])
def test_paged_kv_cache_round_trips(kv_layout, combined, page_size):
    g = fresh_generator()
    k, v = (torch.randn(sum(KV_LENS), HEADS, D, generator=g) for _ in range(2))
    cache, kv_indptr, kv_indices, last = paged_kv_cache(k, v, KV_LENS, page_size, kv_layout, combined=combined,
                                                        generator=g)
    assert isinstance(cache, torch.Tensor) == combined
    k_cache, v_cache = split_kv_cache(cache)
    pages = [-(-n // page_size) for n in KV_LENS]
    assert kv_indptr.tolist() == indptr(pages).tolist()
    assert sorted(kv_indices.tolist()) == list(range(sum(pages))), "every page used once"
    assert last.tolist() == [(n - 1) % page_size + 1 if n else 0 for n in KV_LENS]
    rows = indptr(KV_LENS)
    for r, kv_len in enumerate(KV_LENS):
        request_pages = kv_indices[kv_indptr[r]:kv_indptr[r + 1]]
        for cache_part, x in ((k_cache, k), (v_cache, v)):
            torch.testing.assert_close(gather_pages(cache_part, kv_layout, request_pages, kv_len),
                                       x[rows[r]:rows[r + 1]], rtol=0, atol=0)
            padding = gather_pages(cache_part, kv_layout, request_pages, len(request_pages) * page_size)[kv_len:]
            assert not padding.any(), "rows past a request's last key are zero"


def test_page_table_shuffles_only_when_asked():
    plain = page_table([300, 40], 16)
    assert plain[1].tolist() == list(range(19 + 3))
    seed = torch.seed()
    shuffled = [page_table([300, 40], 16, shuffle=True, generator=torch.Generator().manual_seed(seed))
                for _ in range(2)]
    assert shuffled[0][1].tolist() == shuffled[1][1].tolist(), "the generator makes it reproducible"
    assert shuffled[0][1].tolist() != plain[1].tolist()
    assert all(x.dtype == torch.int32 for x in plain + shuffled[0])


def test_scatter_pages_keeps_the_rows_after_it():
    cache = torch.full((4, HEADS, 16, D), 7.0)                        # HND
    pages = torch.tensor([2, 0], dtype=torch.int32)
    x = torch.randn(20, HEADS, D)
    scatter_pages(cache, "HND", pages, x)
    torch.testing.assert_close(gather_pages(cache, "HND", pages, 20), x, rtol=0, atol=0)
    assert (gather_pages(cache, "HND", pages, 32)[20:] == 7).all()
    assert (cache[[1, 3]] == 7).all()


def test_scatter_pages_and_to_pages_refuse_what_does_not_fit():
    cache = torch.full((4, 16, HEADS, D), 7.0)                        # NHD
    pages = torch.tensor([2, 0], dtype=torch.int32)
    for x, match in ((torch.randn(33, HEADS, D), r"x has 33 rows, more than 2 pages of 16 hold"),
                     (torch.randn(20, HEADS + 1, D), rf"x must be \[n, {HEADS}, {D}\] as the cache's rows"),
                     (torch.randn(20, HEADS * D), r"x must be 3-D")):
        with pytest.raises(ValueError, match=match):
            scatter_pages(cache, "NHD", pages, x)
    assert (cache == 7).all(), "nothing was written"
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., n, heads, d\], got shape \(40, 8\)"):
        to_pages(torch.randn(40, 8), 16)


def test_uniform_page_table_describes_to_pages():
    x = torch.randn(3, 40, HEADS, D)
    qo_indptr, kv_indptr, kv_indices, last = uniform_page_table(3, 10, 40, 16, "cpu")
    assert qo_indptr.tolist() == [0, 10, 20, 30] and last.tolist() == [8, 8, 8]
    for r in range(3):
        torch.testing.assert_close(gather_pages(to_pages(x, 16), "NHD", kv_indices[kv_indptr[r]:kv_indptr[r + 1]], 40),
                                   x[r], rtol=0, atol=0)


def test_empty_requests_and_caches_give_empty_pages_and_rows():
    assert to_pages(torch.zeros(0, HEADS, D), 16).shape == (0, 16, HEADS, D)
    assert to_pages(torch.zeros(3, 0, HEADS, D), 16).shape == (0, 16, HEADS, D)
    cache = torch.randn(4, 16, HEADS, D)
    for kv_layout, layout_cache in (("NHD", cache), ("HND", cache.transpose(1, 2))):
        assert gather_pages(layout_cache, kv_layout, torch.zeros(0, dtype=torch.long), 0).shape == (0, HEADS, D)
    headless = torch.zeros(4, 16, 0, D)   # rows of no elements: reshape(-1, ...) cannot size them
    assert gather_pages(headless, "NHD", torch.tensor([2, 0]), 20).shape == (20, 0, D)


def test_bad_arguments_are_named():
    k = torch.randn(40, HEADS, D)
    with pytest.raises(ValueError, match="kv_lens must add up to k's 40 rows, got 60"):
        paged_kv_cache(k, k, [30, 30], 16)
    with pytest.raises(ValueError, match="kv_lens must add up to k's 40 rows, got 20"):
        paged_kv_cache(k, k, [10, 10], 16)
    with pytest.raises(ValueError, match="v must be like k"):
        paged_kv_cache(k, k[:, :1], [40], 16)
    with pytest.raises(ValueError, match="v must be like k"):
        paged_kv_cache(k, k.double(), [40], 16)
    with pytest.raises(ValueError, match="k must be 3-D"):
        paged_kv_cache(k[0], k, [40], 16)
    with pytest.raises(ValueError, match="v must be 3-D"):
        paged_kv_cache(k, k[None], [40], 16)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        paged_kv_cache(k, k, [40], 16, kv_layout="NDH")
    with pytest.raises(TypeError, match=r"kv_lens\[1\] must be an int, got float"):
        page_table([10, 30.0], 16)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        to_pages(k.tolist(), 16)
    with pytest.raises(ValueError, match=r"kv_lens\[0\] must be >= 0, got -5"):
        page_table([-5], 16)
    for page_size, error in ((0, ValueError), (-16, ValueError), (16.0, TypeError)):
        with pytest.raises(error, match="page_size"):
            page_table([10], page_size)
        with pytest.raises(error, match="page_size"):
            to_pages(k[None], page_size)
    cache, kv_indptr, kv_indices, _ = paged_kv_cache(k, k, [40], 16, combined=False)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        gather_pages(cache[0], "XYZ", kv_indices, 40)
    with pytest.raises(TypeError, match="cache must be a torch.Tensor, got tuple"):
        gather_pages(cache, "NHD", kv_indices, 40)
    combined = torch.stack(cache, dim=1)
    with pytest.raises(ValueError, match=r"cache must be 4-D, got shape \(3, 2, 16, "):
        gather_pages(combined, "NHD", kv_indices, 40)
    with pytest.raises(ValueError, match="cache must be 4-D"):
        scatter_pages(combined, "NHD", kv_indices, k)
    for bad_pages, error, message in ((kv_indices.tolist(), TypeError, "pages must be a torch.Tensor, got list"),
                                      (kv_indices.float(), TypeError, "pages must be int32 or int64 page ids"),
                                      (kv_indices[None], ValueError, "pages must be 1-D")):
        with pytest.raises(error, match=message):
            gather_pages(cache[0], "NHD", bad_pages, 40)
        with pytest.raises(error, match=message):
            scatter_pages(cache[0], "NHD", bad_pages, k)
    with pytest.raises(ValueError, match=r"kv_len must be in \[0, 48\] for 3 pages of 16 rows, got -1"):
        gather_pages(cache[0], "NHD", kv_indices, -1)
    with pytest.raises(ValueError, match="the head_dim axis must be contiguous"):
        split_kv_cache((cache[0], cache[1].transpose(-1, -2).contiguous().transpose(-1, -2)))
