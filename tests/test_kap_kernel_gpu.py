"""GPU tests of the fused KAP kernels (cute_kernels/kap.py) through ``cosa.order_mask``,
against the torch proxy in float64 on the very same (bf16/fp16) values.

Each case lays a random ragged batch into a shuffled paged cache whose unused rows are
NaN (``batch.make_batch``), poisons the plan's order mask and pooled means, ranks on the
GPU and checks every request:

- the pooled means ``plan.qbar`` / ``plan.kbar`` equal the float64 block means to 1e-5
  (relative to the largest mean);
- per (query tile, head): the forced blocks come first, exactly as in the float64
  reference; the selected set equals the reference's except for blocks whose float64
  score lies within ``SCORE_TOL`` of the reference's cut-off score (the kernel scores in
  fp32); the scored blocks follow in non-increasing float64 score (within ``SCORE_TOL``);
  the row is -1 from ``num_selected`` on.

Fresh random inputs every run; each case prints its seed (shown by pytest on failure).
"""

from __future__ import annotations

import pytest
import torch

import cosa
from cosa import _C
from cosa.cute_kernels import kap
from cosa.paged import uniform_page_table
from cosa.proxy import block_means, proxy_order
from cosa.proxy.order import grouped_products, is_forced
from batch import POISON, fresh_generator, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

MEAN_TOL = 1e-5
# the fp32 score's error allowance, relative to sum_i |qbar_i kbar_i| (errors are ~1e-7 of it)
SCORE_TOL = 1e-5


def check_means(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got [blocks, heads, d]`` float32 against float64 ``want [heads, blocks, d]``."""
    want = want.transpose(0, 1)
    torch.testing.assert_close(got.double(), want, rtol=MEAN_TOL, atol=MEAN_TOL * float(want.abs().max()),
                               msg=lambda message: f"{what}: {message}")


def check_rows(got, want, qtiles, forced, scores, magnitudes, where: str) -> int:
    """One request's order rows ``got`` against the float64 reference ``want`` [tiles, hq, k_max];
    ``forced`` [tiles, blocks]: the blocks visited first; ``scores`` / ``magnitudes`` [hq, tiles,
    blocks]: float64 scores and sums of |products|.  Returns how many rows selected a block by
    its score (the rest hold forced blocks only)."""
    ranked = 0
    for t in range(got.shape[0]):
        n, selected = int(qtiles[t, _C.QT_NUM_CANDIDATES]), int(qtiles[t, _C.QT_NUM_SELECTED])
        num_forced = int(forced[t, :n].sum())
        for h in range(got.shape[1]):
            row, ref = got[t, h].tolist(), want[t, h].tolist()
            at = f"{where} tile {t} head {h}: got {row[:selected]}, want {ref[:selected]}"
            assert row[selected:] == [-1] * (len(row) - selected), f"-1 padding, {at}"
            assert row[:num_forced] == ref[:num_forced], f"forced blocks, {at}"
            picked = row[num_forced:selected]
            assert len(set(row[:selected])) == selected and all(0 <= j < n for j in picked), at
            if not picked:
                continue
            ranked += 1
            s = scores[h, t]
            tol = SCORE_TOL * float(magnitudes[h, t, :n].max())
            cut = float(s[ref[selected - 1]])
            for j in set(picked) ^ set(ref[num_forced:selected]):
                assert abs(float(s[j]) - cut) <= tol, f"block {j}: score {float(s[j])}, cut-off {cut}, {at}"
            for a, b in zip(picked, picked[1:]):
                assert float(s[a]) >= float(s[b]) - tol, f"blocks {a}, {b} out of order, {at}"
    return ranked


def check(plan, batch, order: torch.Tensor) -> None:
    qtiles, kv_block_indptr = plan.qtiles.cpu(), plan.kv_block_indptr.cpu()
    flags = {"force_local": plan.force_local, "force_sink": plan.force_sink}
    qbar, kbar = plan.qbar.cpu(), plan.kbar.cpu()
    ranked = 0
    for r, (q, k, _) in enumerate(batch.requests):
        if q.shape[0] == 0:
            continue
        tiles = slice(plan.qtile_indptr_host[r], plan.qtile_indptr_host[r + 1])
        q64, k64 = q.double(), k.double()
        qbar64, kbar64 = block_means(q64, torch.float64), block_means(k64, torch.float64)
        check_means(qbar[tiles], qbar64, f"request {r} qbar")
        check_means(kbar[int(kv_block_indptr[r]):int(kv_block_indptr[r + 1])], kbar64, f"request {r} kbar")
        want = torch.full_like(order[tiles], POISON)
        proxy_order(q64, k64, qtiles[tiles], want, causal=plan.causal, **flags)
        ranked += check_rows(order[tiles], want, qtiles[tiles], is_forced(qtiles[tiles], kbar64.shape[1], **flags),
                             grouped_products(qbar64, kbar64), grouped_products(qbar64.abs(), kbar64.abs()),
                             f"request {r}")
    assert ranked, "no row selected a block by its score: the ranking went untested"


def run_case(*, dtype, head_dim, page_size, layout, group, budget, q_lens, kv_lens, combined=True,
             num_qo_heads=8, force_local=True, force_sink=True):
    g = fresh_generator()
    num_kv_heads = num_qo_heads // group
    batch = make_batch(q_lens, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size, layout=layout,
                       combined=combined, dtype=dtype, generator=g)
    cache = batch.cache_on("cuda")
    plan = cosa.plan(*batch.page_table("cuda"), num_qo_heads, num_kv_heads, head_dim, page_size,
                     budget=budget, q_data_type=dtype, kv_layout=layout, force_local=force_local,
                     force_sink=force_sink)
    assert plan.rank_kernel is not None, "cosa.plan did not pick the KAP kernel for a supported configuration"
    plan.order.fill_(POISON)
    plan.qbar.fill_(float("nan"))
    plan.kbar.fill_(float("nan"))
    order = cosa.order_mask(plan, batch.q.cuda(), cache)
    assert order is plan.order
    check(plan, batch, order.cpu())


# A ragged batch: chunked prefill (q < kv), one token, exactly one block, q == kv with a
# partial last block, a longer request, an empty request (kv_len = 0) and a 20-block one.
RAGGED_Q = [300, 1, 128, 77, 256, 0, 2000]
RAGGED_KV = [700, 513, 128, 77, 1000, 0, 2500]

SWEEP = [
    # dtype, head_dim, page_size, layout, group, combined, budget
    (torch.bfloat16, 128, 16, "NHD", 1, True, 0.25),
    (torch.float16, 64, 64, "HND", 4, False, 0.3),
    (torch.bfloat16, 64, 128, "NHD", 8, False, 1.0),
    (torch.float16, 128, 256, "HND", 8, True, 0.25),
    (torch.bfloat16, 128, 256, "NHD", 4, True, 0.3),
    (torch.float16, 128, 16, "HND", 4, False, 1.0),
    (torch.bfloat16, 64, 32, "HND", 1, True, 0.25),
    (torch.float16, 64, 128, "NHD", 1, True, 0.3),
]


@pytest.mark.parametrize("dtype,head_dim,page_size,layout,group,combined,budget", SWEEP)
def test_order_matches_float64_proxy(dtype, head_dim, page_size, layout, group, combined, budget):
    run_case(dtype=dtype, head_dim=head_dim, page_size=page_size, layout=layout, group=group,
             combined=combined, budget=budget, q_lens=RAGGED_Q, kv_lens=RAGGED_KV)


@pytest.mark.parametrize("force_local,force_sink", [(True, False), (False, True), (False, False)])
def test_forced_blocks_as_the_plan_says(force_local, force_sink):
    run_case(dtype=torch.bfloat16, head_dim=128, page_size=64, layout="NHD", group=4, budget=0.3,
             q_lens=RAGGED_Q, kv_lens=RAGGED_KV, force_local=force_local, force_sink=force_sink)


def test_group_ranked_in_four_passes():
    # 1094 key blocks: the sort is 2048 wide, so 2 of the group's 8 heads fit KEY_SLOTS a pass
    run_case(dtype=torch.bfloat16, head_dim=64, page_size=256, layout="NHD", group=8, budget=0.25,
             q_lens=[384], kv_lens=[140_000])


@pytest.mark.parametrize("slots", [kap.KEY_SLOTS, kap.MAX_KEY_BLOCKS])
def test_widest_sort_one_head_per_pass(slots):
    # just over half of the slots in key blocks: a sort as wide as the slots, one head per pass;
    # the longer request (1M tokens) gets the larger shared memory
    run_case(dtype=torch.float16, head_dim=64, page_size=128, layout="HND", group=2, num_qo_heads=2,
             budget=0.1, q_lens=[128], kv_lens=[(slots // 2 + 4) * 128])


def test_short_requests_beside_one_past_the_small_sort():
    # one request just past KEY_SLOTS key blocks makes every tile's CTA take MAX_KEY_BLOCKS
    # slots: its tiles (width 8192) rank two heads a pass, the short requests' all four at once
    # (as with KEY_SLOTS: what this adds is a batch whose widths differ by 1024x)
    run_case(dtype=torch.bfloat16, head_dim=64, page_size=128, layout="NHD", group=4, budget=0.25,
             q_lens=[256, 300, 1], kv_lens=[(kap.KEY_SLOTS + 10) * 128, 700, 513])


@pytest.mark.parametrize("kv_len,uses_kernel", [(kap.MAX_KEY_BLOCKS * 128, True),
                                                (kap.MAX_KEY_BLOCKS * 128 + 1, False)])
def test_plan_falls_back_to_torch_beyond_the_sort(kv_len, uses_kernel):
    plan = cosa.plan(*uniform_page_table(1, 1, kv_len, 256, "cuda"), 8, 2, 128, 256)
    assert (plan.rank_kernel is not None) == uses_kernel
    assert plan.qbar.shape[0] == (1 if uses_kernel else 0)
