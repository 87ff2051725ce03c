"""Chunked prefill against a growing paged cache, and merging partial results through LSE."""

from __future__ import annotations

import math

import pytest
import torch

import cosa
import oracle
from batch import fresh_generator, make_batch

HQ, HKV, D = 4, 2, 64


def prefix_page_table(batch, kv_len: int, page_size: int):
    """The page table of the first ``kv_len`` keys of the batch's single request."""
    pages = -(-kv_len // page_size)
    return (torch.tensor([0, pages], dtype=torch.int32), batch.kv_indices[:pages].clone(),
            torch.tensor([(kv_len - 1) % page_size + 1], dtype=torch.int32))


@pytest.mark.parametrize("page_size", [16, 128])
def test_chunks_against_a_growing_cache_equal_one_prefill(page_size):
    """Dense mode: each chunk's queries attend to the cache written so far (the
    chunk's own keys included, bottom-right causal), as a serving engine does."""
    g = fresh_generator()
    seq = 700
    batch = make_batch([seq], [seq], HQ, HKV, D, page_size, generator=g)
    q, k, v = batch.requests[0]
    chunks = [0, 130, 131, 400, seq]                     # uneven, one of a single row
    outputs, lses = [], []
    for start, end in zip(chunks, chunks[1:]):
        kv_indptr, kv_indices, last = prefix_page_table(batch, end, page_size)
        plan = cosa.plan(torch.tensor([0, end - start], dtype=torch.int32), kv_indptr, kv_indices, last,
                         HQ, HKV, D, page_size, budget=1.0, delta=0.0, q_data_type=torch.float64)
        o, lse = cosa.run(plan, q[start:end].contiguous(), batch.cache, return_lse=True)
        outputs.append(o)
        lses.append(lse)
    want_o, want_lse = oracle.dense(q, k, v, seq, seq, True, 1 / math.sqrt(D))
    torch.testing.assert_close(torch.cat(outputs), want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(lses).double(), want_lse, rtol=1e-6, atol=1e-6)


def test_merging_prefix_and_chunk_states_equals_attention_over_both():
    """A chunk's attention splits into the cached prefix (every row sees all of it:
    non-causal) and the chunk's own keys (causal); merging the two by LSE gives
    attention over the whole cache."""
    g = fresh_generator()
    prefix, chunk, page_size = 384, 200, 32
    q = torch.randn(chunk, HQ, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(prefix + chunk, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))

    def attend(keys, values, causal):
        batch = make_batch([chunk], [keys.shape[0]], HQ, HKV, D, page_size, generator=g,
                           qkv=lambda r, q_len, kv_len: (q, keys, values))
        plan = cosa.plan(*batch.page_table(), HQ, HKV, D, page_size, causal=causal, budget=1.0, delta=0.0,
                         q_data_type=torch.float64)
        return cosa.run(plan, batch.q, batch.cache, return_lse=True)

    o, lse = cosa.merge_states(*attend(k[:prefix], v[:prefix], False), *attend(k[prefix:], v[prefix:], True))
    want_o, want_lse = oracle.dense(q, k, v, chunk, prefix + chunk, True, 1 / math.sqrt(D))
    # the merge weights come from float32 LSEs: float32 rounding, not float64
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_merge_keeps_rows_that_saw_nothing_empty():
    o = torch.randn(3, 2, 8)
    empty = torch.full((3, 2), -math.inf)
    merged, lse = cosa.merge_states(torch.zeros_like(o), empty, torch.zeros_like(o), empty)
    assert (merged == 0).all() and (lse == -math.inf).all()
    lse_b = torch.randn(3, 2)
    # a part without keys adds nothing, even where its o holds NaN (a buffer left unwritten)
    merged, lse = cosa.merge_states(torch.full_like(o, math.nan), empty, o, lse_b)
    torch.testing.assert_close(merged, o)
    torch.testing.assert_close(lse, lse_b)


def test_merge_rejects_parts_that_do_not_match():
    o, lse = torch.randn(5, 3, 8), torch.randn(5, 3)
    cases = [((o, lse[:, :1], o, lse), ValueError, r"lse_a \[n, heads\] = \(5, 3\)"),
             ((o, lse, o[:1], lse), ValueError, r"o_b must be \[n, heads, d\] = \(5, 3, 8\)"),
             ((o[0], lse, o, lse), ValueError, "o_a must be 3-D"),
             ((o, lse, o[None], lse), ValueError, "o_b must be 3-D"),
             ((o, lse, o, lse[0]), ValueError, "lse_b must be 2-D"),
             ((o.long(), lse, o.long(), lse), TypeError, "o_a and lse_a must be floating"),
             ((o, lse, o, lse.long()), TypeError, "o_b and lse_b must be floating"),
             ((o, lse, o, lse.to("meta")), ValueError, "o_b and lse_b must be on o_a's device cpu, got cpu and meta"),
             ((o, lse, o.bfloat16(), lse), TypeError, "o_b must have o_a's dtype torch.float32"),
             ((o.tolist(), lse, o, lse), TypeError, "o_a must be a torch.Tensor")]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            cosa.merge_states(*args)
