"""cosa.run captured in a CUDA graph and replayed on new data written into the same buffers.

Capture fails on any host synchronisation inside ``run``; replay must then give exactly what an
eager ``run`` gives on the new data (output and statistics), so nothing data-dependent (the
proxy's order mask, stage-2 skips) may be frozen at capture time. Fresh random inputs every run.
"""

from __future__ import annotations

import pytest
import torch

import cosa
from batch import POISON, fresh_generator, make_batch
from cosa.synthetic import structured_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

HQ, HKV, D = 8, 2, 128
Q_LENS, KV_LENS = [1200, 200], [2000, 600]   # ragged, chunked, partial tiles, blocks and pages
DELTA = 0.5   # with these lengths stage 2 skips blocks on every input tried (57 to 222 of 560)


def fill(batch, q: torch.Tensor, cache: torch.Tensor, generator: torch.Generator) -> None:
    """New structured requests written in place into ``q`` and the pages the batch's page table
    names (NHD combined cache; rows past each kv_len zero). I.i.d. noise would never skip."""
    page_size = cache.shape[2]
    for r, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        q_r, k_r, v_r = structured_qkv(kv_len, HQ, HKV, D, q_len=q_len, generator=generator)
        q[int(batch.qo_indptr[r]):int(batch.qo_indptr[r + 1])] = q_r.to(q.dtype)
        pages = batch.kv_indices[int(batch.kv_indptr[r]):int(batch.kv_indptr[r + 1])].long()
        rows = torch.zeros(len(pages) * page_size, 2, HKV, D)
        rows[:kv_len, 0], rows[:kv_len, 1] = k_r, v_r
        cache[pages.to(cache.device)] = rows.view(len(pages), page_size, 2, HKV, D).transpose(1, 2).to(cache)


@pytest.mark.parametrize("page_size", [16, 128])
def test_run_replays_in_a_cuda_graph_on_new_data(page_size):
    g = fresh_generator()
    batch = make_batch(Q_LENS, KV_LENS, HQ, HKV, D, page_size, dtype=torch.bfloat16, generator=g)
    q, cache = batch.q.cuda(), batch.cache_on("cuda")
    fill(batch, q, cache, g)
    plan = cosa.plan(*batch.page_table("cuda"), HQ, HKV, D, page_size, budget=0.5, delta=DELTA,
                     q_data_type=torch.bfloat16)
    out = torch.empty_like(q)

    side = torch.cuda.Stream()   # warm-up (and kernel compilation) off the default stream, as torch asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cosa.run(plan, q, cache, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cosa.run(plan, q, cache, out=out)
    graph.replay()
    old = out.clone()

    fill(batch, q, cache, g)
    for written, poison in ((out, float("nan")), (plan.computed, POISON), (plan.skipped, POISON)):
        written.fill_(poison)   # the replay must write every entry again
    graph.replay()
    replayed, computed, skipped = out.clone(), plan.computed.clone(), plan.skipped.clone()
    eager = cosa.run(plan, q, cache)

    assert not torch.equal(replayed, old), "replay ignored the new data"
    assert torch.equal(replayed, eager), "replay differs from an eager run on the new data"
    assert torch.equal(computed, plan.computed) and torch.equal(skipped, plan.skipped), \
        "replayed statistics differ from the eager run's"
    assert int(skipped.sum()) > 0, "stage 2 skipped nothing, so skipping went untested"
