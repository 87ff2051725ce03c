"""GPU tests of the OSK kernel through the public API: ``cosa.plan`` / ``cosa.run`` on
CUDA tensors (the plan must pick the kernel), against the exact float64 reference.

Each case lays a random ragged batch into a shuffled paged cache whose unused rows
are NaN (``batch.make_batch``), runs it on the GPU with poisoned outputs (o = NaN,
lse and the plan's computed/skipped counts = sentinels, so unwritten elements show),
and checks every request against ``cosa.reference`` in float64 on the very same
(bf16/fp16) values.  Stage 1 is the proxy's business (tests/test_proxy.py): the
reference follows the GPU plan's own order mask, so the stage-2 comparison is exact
given the order.  Skip decisions are compared per (query tile, head); the kernel
decides in fp32 from bf16/fp16 products and the reference in float64, so a decision
can flip only when a tile's gain lies within rounding of the threshold.  Flipped
tiles are counted (at most 1% of tiles, or one) and left out of the o/lse comparison.

Fresh random inputs every run; each case prints its seed (shown by pytest on failure).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

import cosa
from cosa import reference
from cosa.cute_kernels import osk
from batch import POISON, fresh_generator, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

LSE_SENTINEL = 12345.0


def skewed_inputs(num_qo_heads, num_kv_heads, head_dim, generator):
    """``make_batch``'s ``qkv``: sharp queries and every 128-key block of K scaled by a
    random factor in [0.1, 1.5], so that stage 2 finds negligible blocks to skip.  Block 0,
    the sink every tile visits right after its local blocks, gets 1.5: with random scales
    alone a batch now and then visits no weak block after a strong one and skips none (1
    of 600 seeds on the CPU); pinned, each of 900 seeds skipped at least 5 blocks."""
    def qkv(_, q_len, kv_len):
        q = 6.0 * torch.randn(q_len, num_qo_heads, head_dim, generator=generator, dtype=torch.float64)
        scale = 0.1 + 1.4 * torch.rand(-(-kv_len // 128), generator=generator, dtype=torch.float64)
        scale[:1] = 1.5
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        k *= scale.repeat_interleave(128)[:kv_len, None, None]
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        return q, k, v
    return qkv


def falling_inputs(num_qo_heads, num_kv_heads, head_dim, generator, *, rises):
    """``make_batch``'s ``qkv`` with a strong attention sink: sharp queries and K's 128-key
    blocks scaled from 1.5 (block 0) down to 0.1 (the last), so that a tile visits its local
    blocks first and the forced sink block after them raises the row max far past theirs.
    Appends to ``rises`` how far, for each request's last row (scaled logits)."""
    def qkv(_, q_len, kv_len):
        blocks = -(-kv_len // 128)
        scale = torch.linspace(1.5, 0.1, blocks, dtype=torch.float64).repeat_interleave(128)[:kv_len]
        q = 6.0 * torch.randn(q_len, num_qo_heads, head_dim, generator=generator, dtype=torch.float64)
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        k *= scale[:, None, None]
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        if q_len > 0 and blocks >= 3:
            last_row = torch.einsum("hd,khd->hk", q[-1], k.repeat_interleave(num_qo_heads // num_kv_heads, 1))
            last_row *= head_dim ** -0.5
            rises.append(float((last_row[:, :128].amax(-1) - last_row[:, (blocks - 2) * 128:].amax(-1)).max()))
        return q, k, v
    return qkv


def repelling_inputs(num_qo_heads, num_kv_heads, head_dim, generator, *, negative_shares):
    """``make_batch``'s ``qkv`` whose logits are (nearly) all negative: q along a direction u,
    K's 128-key blocks against it at random strengths, so that stage 2's row maxima are
    negative and the kernel finds them through ``_row_max_bits``' all-negative branch; the
    strengths spread the maxima so that it skips some blocks.  Appends to ``negative_shares``
    the share of the request's logits below zero."""
    def qkv(_, q_len, kv_len):
        u = torch.randn(head_dim, generator=generator, dtype=torch.float64)
        u /= u.norm()
        strength = 2.0 + 12.0 * torch.rand(-(-kv_len // 128), generator=generator, dtype=torch.float64)
        q = 24.0 * u + 0.5 * torch.randn(q_len, num_qo_heads, head_dim, generator=generator, dtype=torch.float64)
        k = -strength.repeat_interleave(128)[:kv_len, None, None] * u
        k = k + 0.5 * torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        logits = torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(num_qo_heads // num_kv_heads, 1))
        negative_shares.append(float((logits < 0).double().mean()) if logits.numel() else 1.0)
        return q, k, v
    return qkv


def hidden_inputs(num_qo_heads, num_kv_heads, head_dim, generator):
    """``make_batch``'s ``qkv`` where stage 2 computes blocks after skipping others: queries
    along a direction u (one per kv head), and K's 128-key blocks of three kinds at random --
    strong (along u), weak (skipped once a strong block has set the max) and hidden: rows
    alternately along u and against it, as strong, so that their mean, which KAP scores, is
    about 0 and they are listed after the weak blocks, while their maxima are the strong
    blocks'."""
    def qkv(_, q_len, kv_len):
        blocks = -(-kv_len // 128)
        u = torch.randn(num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
        u /= u.norm(dim=-1, keepdim=True)
        kind = torch.randint(0, 3, (blocks,), generator=generator)  # 0 strong, 1 weak, 2 hidden
        scale = torch.where(kind == 1, 0.5 * torch.rand(blocks, generator=generator, dtype=torch.float64), 5.0)
        scale = scale.repeat_interleave(128)
        scale[1::2] *= torch.where(kind.repeat_interleave(128)[1::2] == 2, -1.0, 1.0)
        noise = partial(torch.randn, generator=generator, dtype=torch.float64)
        q = 3 * head_dim ** 0.5 * u.repeat_interleave(num_qo_heads // num_kv_heads, 0) + 0.3 * noise(
            q_len, num_qo_heads, head_dim)
        k = scale[:kv_len, None, None] * u + 0.3 * noise(kv_len, num_kv_heads, head_dim)
        return q, k, noise(kv_len, num_kv_heads, head_dim)
    return qkv


def run_case(*, dtype, head_dim, page_size, layout, group, q_lens, kv_lens, budget, delta,
             causal=True, combined=True, spare_pages=3, num_qo_heads=8, inputs=None,
             dense=False, device="cuda", fused=False, visits=None):
    """Run one batch on the GPU and compare it with the float64 reference; returns the
    stats.  ``inputs``: a factory of ``make_batch``'s ``qkv`` (``skewed_inputs``), called
    as ``inputs(num_qo_heads, num_kv_heads, head_dim, generator)``.  ``dense``: the
    reference is dense attention (needs budget 1, delta 0).  ``device``: where the batch and
    the plan live.  ``fused``: q and o are views into wider rows, as a fused QKV projection
    and an engine's output buffer give them; o's row holds one more (poisoned) head, which
    must stay unwritten.  ``visits``: a list that receives, per request, the reference's
    listed and computed blocks (bool, shaped like the request's order)."""
    g = fresh_generator()
    hkv = num_qo_heads // group
    batch = make_batch(q_lens, kv_lens, num_qo_heads, hkv, head_dim, page_size, layout=layout,
                       combined=combined, dtype=dtype, spare_pages=spare_pages, generator=g,
                       qkv=inputs(num_qo_heads, hkv, head_dim, g) if inputs else None)
    q = batch.q.to(device)
    cache = batch.cache_on(device)
    plan = cosa.plan(*batch.page_table(device), num_qo_heads, hkv, head_dim, page_size,
                     causal=causal, budget=budget, delta=delta, q_data_type=dtype, kv_layout=layout)
    assert plan.uses_kernel, "cosa.plan did not pick the OSK kernel for a supported configuration"
    out_rows = torch.full((q.shape[0], num_qo_heads + (1 if fused else 0), head_dim), float("nan"),
                          dtype=dtype, device=device)
    out = out_rows[:, :num_qo_heads]
    if fused:
        q = torch.cat([q, torch.zeros_like(q[:, :2 * hkv])], dim=1)[:, :num_qo_heads]
    lse = torch.full(q.shape[:2], LSE_SENTINEL, dtype=torch.float32, device=device)
    plan.computed.fill_(POISON)
    plan.skipped.fill_(POISON)
    o, lse = cosa.run(plan, q, cache, out=out, lse=lse, return_lse=True)
    assert o is out
    if fused:  # the reference follows the plan's order, so check KAP's reading of q on its own
        order_from_view = plan.order.clone()
        assert torch.equal(cosa.order_mask(plan, q.contiguous(), cache), order_from_view), "KAP misread q's view"
    stats = plan.stats()
    o, lse, order = o.cpu().double(), lse.cpu().double(), plan.order.cpu()
    computed, skipped = stats.computed, stats.skipped

    assert not o.isnan().any(), "o has unwritten (NaN) elements"
    assert out_rows[:, num_qo_heads:].isnan().all(), "run wrote past o's view"
    assert not (lse == LSE_SENTINEL).any(), "lse has unwritten elements"
    assert not (computed == POISON).any() and not (skipped == POISON).any()
    assert torch.equal(computed + skipped, stats.selected[:, None].expand_as(computed)), \
        "computed + skipped must equal the blocks stage 1 selected"

    rel = lse_err = 0.0   # the worst request's relative error of o, the worst row's of lse
    flips = 0
    for r, (q64, k64, v64) in enumerate(batch.requests):
        if q64.shape[0] == 0:
            continue
        q64, k64, v64 = q64.double(), k64.double(), v64.double()
        rows = slice(plan.qo_indptr_host[r], plan.qo_indptr_host[r + 1])
        tiles = slice(plan.qtile_indptr_host[r], plan.qtile_indptr_host[r + 1])
        if dense:
            ref_o, ref_lse = reference.dense_attention(q64, k64, v64, causal=causal,
                                                       sm_scale=plan.sm_scale)
            ref_c = stats.selected[tiles, None].expand_as(computed[tiles])
            ref_s = torch.zeros_like(ref_c)
        else:
            visited = torch.zeros(order[tiles].shape, dtype=torch.bool)
            ref_o, ref_lse, ref_c, ref_s = reference.ordered_skip_attention(
                q64, k64, v64, order[tiles], causal=causal, sm_scale=plan.sm_scale, delta=delta,
                visited=visited)
            if visits is not None:
                visits.append((order[tiles] >= 0, visited))
        same = (computed[tiles] == ref_c) & (skipped[tiles] == ref_s)    # [tiles, hq]
        flips += int((~same).sum())
        row_same = same.repeat_interleave(128, 0)[:q64.shape[0]]          # [q_len, hq]
        norm = float((ref_o * row_same[..., None]).norm())
        if norm > 0:
            rel = max(rel, float(((o[rows] - ref_o) * row_same[..., None]).norm()) / norm)
        ref_lse = ref_lse.double()
        no_key = torch.isinf(ref_lse) & row_same
        assert torch.equal(torch.isinf(lse[rows]) & row_same, no_key), "lse -inf pattern differs"
        assert (o[rows][no_key] == 0).all(), "rows without a computed key must be 0"
        finite = row_same & ~torch.isinf(ref_lse)
        if finite.any():
            lse_err = max(lse_err, float((lse[rows][finite] - ref_lse[finite]).abs().max()))
    num_tiles = computed.numel()
    skip_rate = float(skipped.sum()) / max(1, int((computed + skipped).sum()))
    print(f"rel={rel:.2e} lse_err={lse_err:.2e} flips={flips}/{num_tiles} skip_rate={skip_rate:.3f}")
    # per request, so that one short request's wrong rows are not averaged away by the others:
    # bf16's output rounding alone is ~1e-3; lse, from fp32 sums, is off by ~1e-5
    assert rel <= 1e-2, f"relative error {rel}"
    assert lse_err <= 1e-3, f"lse error {lse_err}"
    assert flips <= max(1, num_tiles // 100), f"skip decisions differ on {flips}/{num_tiles} tiles"
    if delta == 0:
        assert flips == 0 and int(skipped.sum()) == 0
    return stats


# A ragged batch: chunked prefill (q < kv), one token, exactly one block, q == kv with a
# partial last block, a longer request, and an empty request (kv_len = 0).
RAGGED_Q = [300, 1, 128, 77, 256, 0]
RAGGED_KV = [700, 513, 128, 77, 1000, 0]

SWEEP = [
    # dtype, head_dim, page_size, layout, group, combined, spare_pages (0: the cache's last page is used)
    (torch.bfloat16, 128, 16, "NHD", 1, True, 0),
    (torch.bfloat16, 128, 32, "HND", 4, False, 3),
    (torch.bfloat16, 64, 64, "NHD", 8, True, 0),
    (torch.float16, 128, 128, "HND", 1, True, 3),
    (torch.float16, 64, 256, "NHD", 4, False, 0),
    (torch.bfloat16, 128, 256, "HND", 8, True, 3),
    (torch.float16, 128, 16, "HND", 8, False, 3),
    (torch.bfloat16, 64, 128, "HND", 1, True, 0),
    (torch.float16, 64, 32, "NHD", 1, True, 3),
]


@pytest.mark.parametrize("dtype,head_dim,page_size,layout,group,combined,spare_pages", SWEEP)
def test_ordered_skip_matches_reference(dtype, head_dim, page_size, layout, group, combined,
                                        spare_pages):
    stats = run_case(dtype=dtype, head_dim=head_dim, page_size=page_size, layout=layout,
                     group=group, combined=combined, spare_pages=spare_pages, q_lens=RAGGED_Q,
                     kv_lens=RAGGED_KV, budget=0.7, delta=0.5, inputs=skewed_inputs)
    assert int(stats.skipped.sum()) > 0, "the inputs are built so that stage 2 skips some blocks"


@pytest.mark.parametrize("dtype,head_dim,page_size,layout", [
    (torch.bfloat16, 128, 16, "NHD"), (torch.float16, 64, 256, "HND"), (torch.bfloat16, 64, 128, "NHD"),
])
def test_full_budget_no_skip_equals_dense(dtype, head_dim, page_size, layout):
    run_case(dtype=dtype, head_dim=head_dim, page_size=page_size, layout=layout, group=4,
             q_lens=RAGGED_Q, kv_lens=RAGGED_KV, budget=1.0, delta=0.0, dense=True)


@pytest.mark.parametrize("dtype,head_dim,page_size,layout,budget,delta", [
    (torch.bfloat16, 128, 16, "NHD", 1.0, 0.0), (torch.float16, 64, 128, "HND", 0.6, 0.0),
    (torch.float16, 128, 32, "NHD", 0.6, 0.05), (torch.bfloat16, 64, 256, "HND", 1.0, 0.5),
])
def test_a_sink_that_raises_the_max(dtype, head_dim, page_size, layout, budget, delta):
    # The kernel takes P against a reference that may lag the running max and rescales O only
    # when a block raises it by more than osk.STALE_SUM_MAX allows (the turns redo such a
    # block, the vote loop tests its max first): the sink block, visited after the local ones,
    # does here.
    rises = []
    run_case(dtype=dtype, head_dim=head_dim, page_size=page_size, layout=layout, group=2,
             q_lens=RAGGED_Q, kv_lens=RAGGED_KV, budget=budget, delta=delta,
             inputs=partial(falling_inputs, rises=rises), dense=budget == 1.0 and delta == 0)
    assert max(rises) > math.log(osk.STALE_SUM_MAX), "the sink must raise some row's max past the limit"


@pytest.mark.parametrize("dtype,head_dim,page_size,layout,delta", [
    (torch.bfloat16, 128, 16, "NHD", 0.5), (torch.float16, 64, 128, "HND", 0.5),
    (torch.float16, 128, 64, "HND", 0.0),
])
def test_negative_logits(dtype, head_dim, page_size, layout, delta):
    # Row maxima come from S's bit patterns, whose order is the floats' only where a value is
    # >= 0: rows whose logits are all negative take the other branch (on every block with stage
    # 2 on, and for the first block and a redone one with delta = 0, where a wrong max would
    # overflow fp16's P).
    negative_shares = []
    stats = run_case(dtype=dtype, head_dim=head_dim, page_size=page_size, layout=layout, group=2,
                     q_lens=RAGGED_Q, kv_lens=RAGGED_KV, budget=0.7, delta=delta,
                     inputs=partial(repelling_inputs, negative_shares=negative_shares))
    assert min(negative_shares) > 0.99, "the inputs are built so that nearly every logit is negative"
    if delta > 0:
        assert int(stats.skipped.sum()) > 0, "the inputs are built so that stage 2 skips some blocks"


@pytest.mark.parametrize("dtype,head_dim,page_size,layout", [
    (torch.bfloat16, 128, 128, "NHD"), (torch.float16, 64, 256, "HND"), (torch.bfloat16, 64, 16, "NHD"),
])
def test_blocks_computed_after_a_skip(dtype, head_dim, page_size, layout):
    # The kernel takes a tile's blocks in turns until both of its warp groups know of a skip,
    # then in lockstep (the vote loop), from the first odd position two or three past the first
    # skip.  So the batch must have first skips at odd and even positions, and blocks computed
    # three or more positions after them.
    # About one draw in 30 puts every first skip at one parity, so up to five draws are taken;
    # each is checked against the reference all the same.
    for _ in range(5):
        visits = []
        run_case(dtype=dtype, head_dim=head_dim, page_size=page_size, layout=layout, group=2,
                 q_lens=[300, 640, 1, 1100], kv_lens=[2000, 640, 1500, 1100], budget=1.0, delta=0.5,
                 inputs=hidden_inputs, visits=visits)
        first_skip_parities, computed_after = set(), 0
        for listed, visited in visits:
            for listed_row, visited_row in zip(listed.flatten(0, 1), visited.flatten(0, 1)):
                skipped = (listed_row & ~visited_row).nonzero()
                if len(skipped):
                    first_skip = int(skipped[0])
                    first_skip_parities.add(first_skip % 2)
                    computed_after += bool(visited_row[first_skip + 3:].any())
        if first_skip_parities == {0, 1} and computed_after > 0:
            return
    pytest.fail("five draws of the inputs did not put first skips at both parities with blocks computed "
                f"three or more positions after them (last: parities {first_skip_parities}, {computed_after} rows)")


def test_non_causal_equals_dense():
    run_case(dtype=torch.bfloat16, head_dim=128, page_size=64, layout="NHD", group=2,
             q_lens=[100, 260], kv_lens=[300, 390], budget=1.0, delta=0.0, causal=False, dense=True)


def test_non_causal_ordered_skip_matches_reference():
    # without the causal mask only keys past kv_len are masked: the skip rule sees whole blocks of keys
    stats = run_case(dtype=torch.float16, head_dim=64, page_size=32, layout="HND", group=4, q_lens=RAGGED_Q,
                     kv_lens=RAGGED_KV, budget=0.7, delta=0.5, causal=False, inputs=skewed_inputs)
    assert int(stats.skipped.sum()) > 0, "the inputs are built so that stage 2 skips some blocks"


def test_one_block_tiles():
    # every tile has exactly one candidate block: it is computed, never skipped
    stats = run_case(dtype=torch.bfloat16, head_dim=128, page_size=32, layout="HND", group=1,
                     q_lens=[1, 64, 128], kv_lens=[1, 100, 128], budget=0.1, delta=1.0)
    assert (stats.computed == 1).all() and (stats.skipped == 0).all()


@pytest.mark.parametrize("dtype,head_dim,layout", [(torch.bfloat16, 128, "NHD"), (torch.float16, 64, "HND")])
def test_q_and_o_as_views_into_wider_rows(dtype, head_dim, layout):
    run_case(dtype=dtype, head_dim=head_dim, page_size=16, layout=layout, group=4,
             q_lens=RAGGED_Q, kv_lens=RAGGED_KV, budget=0.7, delta=0.5, inputs=skewed_inputs, fused=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_gpu_that_is_not_the_current_one():
    # Like torch's own ops, plan and run follow their tensors' device, not the current one: a
    # model spread over GPUs (transformers' device_map) runs layers on GPUs that are not current.
    with torch.cuda.device(0):
        stats = run_case(dtype=torch.bfloat16, head_dim=128, page_size=16, layout="NHD", group=4,
                         q_lens=RAGGED_Q, kv_lens=RAGGED_KV, budget=0.7, delta=0.5,
                         inputs=skewed_inputs, device="cuda:1")
        assert torch.cuda.current_device() == 0, "run must leave the current device as it was"
    assert int(stats.skipped.sum()) > 0, "the inputs are built so that stage 2 skips some blocks"


@pytest.mark.parametrize("dtype,head_dim,page_size", [(torch.bfloat16, 128, 16), (torch.bfloat16, 64, 128)])
def test_full_budget_matches_flash_attention_4(dtype, head_dim, page_size):
    """Budget 1 with delta 0 against an independent kernel: FlashAttention-4 dense (causal,
    bottom-right aligned like CoSA) on each request's contiguous K/V."""
    fa4 = pytest.importorskip("flash_attn.cute")
    g = fresh_generator()
    num_qo_heads, hkv = 8, 2
    batch = make_batch([300, 128, 77], [300, 520, 1000], num_qo_heads, hkv, head_dim, page_size,
                       dtype=dtype, generator=g)
    plan = cosa.plan(*batch.page_table("cuda"), num_qo_heads, hkv, head_dim, page_size, budget=1.0, delta=0.0,
                     q_data_type=dtype)
    cache = batch.cache_on("cuda")
    o = cosa.run(plan, batch.q.cuda(), cache, out=torch.full_like(batch.q, float("nan"), device="cuda"))
    for (q, k, v), rows in zip(batch.requests, zip(batch.qo_indptr[:-1].tolist(), batch.qo_indptr[1:].tolist())):
        expected = fa4.flash_attn_func(*(x.to(device="cuda", dtype=dtype)[None] for x in (q, k, v)),
                                       softmax_scale=head_dim ** -0.5, causal=True)[0][0].float()
        got = o[slice(*rows)].float()
        rel = float((got - expected).norm() / expected.norm())
        print(f"q_len={q.shape[0]} kv_len={k.shape[0]} rel={rel:.2e}")
        assert rel <= 1e-2
