"""The alternative stage-1 proxies against small float64 models of their scoring, written here.

Each model scores one (query tile, head) at a time from the proxy's published
recipe (the oracle's: the true attention mass); the library's order mask must
rank the non-forced candidates by it.
"""

from __future__ import annotations

import math

import pytest
import torch

import cosa
from cosa.paged import uniform_page_table
from cosa.proxy import PROXIES, cumulative_threshold_counts, xattention
from cosa.cute_kernels import rank_key
from cosa.proxy.order import order_from_scores
from cosa.synthetic import structured_qkv

import oracle
from batch import POISON, fresh_generator, make_batch

BLOCK = 128
HQ, HKV, D, PAGE = 4, 2, 64, 32


def xattention_model(q, k, tile, h, causal, sm_scale, stride):
    q_len, kv_len = q.shape[0], k.shape[0]
    kh = h // (q.shape[1] // k.shape[1])
    padded_k = torch.zeros(-(-kv_len // BLOCK) * BLOCK, D, dtype=torch.float64)
    padded_k[:kv_len] = k[:, kh]
    scores = torch.zeros(padded_k.shape[0] // BLOCK, dtype=torch.float64)
    for start in range(tile * BLOCK, min(tile * BLOCK + BLOCK, q_len), stride):
        last = min(start + stride - 1, q_len - 1)
        logits, blocks = [], []
        for key_start in range(0, kv_len, stride):
            if causal and key_start > kv_len - q_len + last:
                break
            antidiagonal = sum(float(q[start + stride - 1 - s, h] @ padded_k[key_start + s])
                               for s in range(stride) if start + stride - 1 - s < q_len)
            logits.append(antidiagonal * sm_scale / stride)
            blocks.append(key_start // BLOCK)
        for p, j in zip(torch.softmax(torch.tensor(logits, dtype=torch.float64), 0), blocks):
            scores[j] += p
    return scores


def flexprefill_model(q, k, tile, h, causal, sm_scale, candidates):
    kh = h // (q.shape[1] // k.shape[1])
    qbar = q[tile * BLOCK:tile * BLOCK + BLOCK, h].mean(0)
    logits = [float(qbar @ k[j * BLOCK:j * BLOCK + BLOCK, kh].mean(0)) * sm_scale for j in range(candidates)]
    scores = torch.zeros(-(-k.shape[0] // BLOCK), dtype=torch.float64)
    scores[:candidates] = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
    return scores


def vertical_slash_model(q, k, tile, h, causal, sm_scale, last_q=64):
    q_len, kv_len = q.shape[0], k.shape[0]
    kh = h // (q.shape[1] // k.shape[1])
    last = min(last_q, q_len)
    positions = [kv_len - q_len + t for t in range(q_len - last, q_len)]
    vertical = torch.zeros(kv_len, dtype=torch.float64)
    slash = {}                                          # distance -> mass
    for t, pos in zip(range(q_len - last, q_len), positions):
        visible = range(pos + 1) if causal else range(kv_len)
        probabilities = torch.softmax(torch.stack([q[t, h] @ k[j, kh] for j in visible]) * sm_scale, 0)
        for j, p in zip(visible, probabilities.tolist()):
            vertical[j] += p
            slash[pos - j] = slash.get(pos - j, 0.0) + p
    rows = range(tile * BLOCK, min(tile * BLOCK + BLOCK, q_len))
    per_key = vertical + torch.tensor([[slash.get(kv_len - q_len + t - j, 0.0) for j in range(kv_len)]
                                       for t in rows], dtype=torch.float64).mean(0)
    return torch.nn.functional.pad(per_key, (0, -kv_len % BLOCK)).view(-1, BLOCK).sum(1)


def oracle_model(q, k, tile, h, causal, sm_scale):
    q_len, kv_len = q.shape[0], k.shape[0]
    kh = h // (q.shape[1] // k.shape[1])
    scores = torch.zeros(-(-kv_len // BLOCK), dtype=torch.float64)
    for t in range(tile * BLOCK, min(tile * BLOCK + BLOCK, q_len)):
        visible = kv_len - q_len + t + 1 if causal else kv_len
        p = torch.softmax(k[:visible, kh].double() @ q[t, h].double() * sm_scale, 0)
        for j in range(-(-visible // BLOCK)):
            scores[j] += p[j * BLOCK:(j + 1) * BLOCK].sum()
    return scores


def model_scores(proxy, q, k, tile, h, causal, sm_scale, candidates):
    if proxy.startswith("xattention"):
        return xattention_model(q, k, tile, h, causal, sm_scale, int(proxy.removeprefix("xattention")))
    if proxy == "flexprefill":
        return flexprefill_model(q, k, tile, h, causal, sm_scale, candidates)
    if proxy == "oracle":
        return oracle_model(q, k, tile, h, causal, sm_scale)
    return vertical_slash_model(q, k, tile, h, causal, sm_scale)


@pytest.mark.parametrize("proxy", ["xattention8", "xattention16", "flexprefill", "vertical_slash", "oracle"])
@pytest.mark.parametrize("q_len,kv_len,causal", [(300, 700, True), (200, 200, True), (300, 700, False),
                                                 (300, 200, False), (300, 40, False)])
def test_alternative_proxies_rank_by_their_scoring(proxy, q_len, kv_len, causal, monkeypatch):
    g = fresh_generator()
    if q_len > 256:   # XAttention scores its tiles in chunks: here two, the last one partial
        monkeypatch.setattr(xattention, "_TILES_PER_CHUNK", 2)

    def structured(r, q_len, kv_len):   # more queries than keys (non-causal): keys of the first positions
        q, k, v = structured_qkv(max(q_len, kv_len), HQ, HKV, D, q_len=q_len, segment_len=96, generator=g,
                                 dtype=torch.float64)
        return q, k[:kv_len], v[:kv_len]
    batch = make_batch([q_len], [kv_len], HQ, HKV, D, PAGE, generator=g, qkv=structured)
    plan = cosa.plan(*batch.page_table(), HQ, HKV, D, PAGE, causal=causal, budget=0.4, delta=0.0,
                     q_data_type=torch.float64, proxy=proxy)
    assert plan.proxy == proxy
    plan.order.fill_(POISON)   # the proxy writes every entry
    cosa.run(plan, batch.q, batch.cache)
    q, k, _ = batch.requests[0]
    sm_scale = 1 / math.sqrt(D)
    schedule = oracle.tile_schedule(q_len, kv_len, causal, 0.4, True, True)
    scores = PROXIES[proxy](q, k, plan.qtiles, causal=causal, sm_scale=sm_scale)
    for i, (candidates, local, selected) in enumerate(schedule):
        for h in range(HQ):
            want = model_scores(proxy, q, k, i, h, causal, sm_scale, candidates)
            torch.testing.assert_close(scores[h, i, :candidates], want[:candidates], rtol=1e-9, atol=1e-12)
            forced = local + ([0] if 0 not in local else [])
            rest = sorted((j for j in range(candidates) if j not in forced),
                          key=lambda j: (float(want[j]), j), reverse=True)
            assert plan.order[i, h, :selected].tolist() == (forced + rest)[:selected]
            assert (plan.order[i, h, selected:] == -1).all()


def test_proxies_disagree_somewhere_and_full_budget_is_dense_for_all():
    g = fresh_generator()
    structured = lambda r, q_len, kv_len: structured_qkv(  # noqa: E731
        kv_len, HQ, HKV, D, q_len=q_len, segment_len=96, generator=g, dtype=torch.float64)
    batch = make_batch([1024], [2048], HQ, HKV, D, PAGE, generator=g, qkv=structured)
    args = (*batch.page_table(), HQ, HKV, D, PAGE)
    orders = {}
    q, k, v = batch.requests[0]
    dense, _ = oracle.dense(q, k, v, 1024, 2048, True, 1 / math.sqrt(D))
    for proxy in PROXIES:
        plan = cosa.plan(*args, budget=0.5, delta=0.0, q_data_type=torch.float64, proxy=proxy)
        cosa.run(plan, batch.q, batch.cache)
        orders[proxy] = plan.order.clone()
        full = cosa.plan(*args, budget=1.0, delta=0.0, q_data_type=torch.float64, proxy=proxy)
        torch.testing.assert_close(cosa.run(full, batch.q, batch.cache), dense, rtol=1e-10, atol=1e-10)
    assert torch.equal(orders["kap"], orders["flexprefill"]), "a softmax keeps the pooled ranking"
    assert not torch.equal(orders["kap"], orders["xattention8"])
    assert not torch.equal(orders["kap"], orders["vertical_slash"])


@pytest.mark.parametrize("proxy", ["no_such_proxy", ["kap"]])   # a list is not even hashable
def test_plan_rejects_an_unknown_proxy(proxy):
    batch = make_batch([10], [10], HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match="proxy must be one of"):
        cosa.plan(*batch.page_table(), HQ, HKV, D, PAGE, proxy=proxy)


def test_xattention_refuses_a_stride_that_does_not_divide_the_block():
    from cosa.proxy.xattention import xattention_scores
    q = torch.randn(128, 2, 16)
    with pytest.raises(ValueError, match="stride must divide the block size 128, got 3"):
        xattention_scores(q, q, torch.zeros(1, 8, dtype=torch.int32), causal=True, sm_scale=0.25, stride=3)


def test_cumulative_threshold_counts():
    probabilities = torch.tensor([[0.2, 0.5, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    assert cumulative_threshold_counts(probabilities, 0.79).tolist() == [2, 4]
    assert cumulative_threshold_counts(probabilities, 0.81).tolist() == [3, 4]
    assert cumulative_threshold_counts(probabilities, 0.5).tolist() == [1, 2]
    # a sum that rounding keeps below gamma counts every block, not one more
    short_of_one = torch.tensor([[0.5, 0.25, 0.25 - 1e-9]], dtype=torch.float64)
    assert cumulative_threshold_counts(short_of_one, 1.0).tolist() == [3]
    for gamma in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="gamma must be"):
            cumulative_threshold_counts(probabilities, gamma)


def test_the_ranking_key_s_fields_hold_their_values_apart():
    # a block index of any int32 kv_len, a signed int32 score code and the top priority
    assert 2**rank_key.BLOCK_BITS >= -(-(2**31 - 1) // BLOCK)
    assert rank_key.PRIORITY_SHIFT >= rank_key.BLOCK_BITS + 32
    top = max(rank_key.NOT_CANDIDATE, rank_key.SCORED, rank_key.SINK, rank_key.LOCAL_LAST, rank_key.LOCAL_FIRST)
    assert (top + 1) << rank_key.PRIORITY_SHIFT <= 2**63


@pytest.mark.parametrize("force_local,force_sink", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_order_puts_forced_blocks_first_breaks_score_ties_by_the_larger_block_and_ties_signed_zeros(
        dtype, force_local, force_sink):
    g = fresh_generator()
    q_len, kv_len = 1500, 1500 + int(torch.randint(0, 300, (), generator=g))   # diagonals across blocks
    plan = cosa.plan(*uniform_page_table(1, q_len, kv_len, 128, "cpu"), HQ, HKV, D, 128, budget=0.5,
                     q_data_type=dtype, force_local=force_local, force_sink=force_sink)
    tiles, blocks = plan.qtiles.shape[0], -(-kv_len // BLOCK)
    scores = torch.randint(-2, 3, (HQ, tiles, blocks), generator=g).to(dtype)   # many ties
    scores[torch.rand(scores.shape, generator=g) < 0.3] = -0.0
    scores[0, -1, :3] = torch.tensor([-math.inf, math.inf, 0.0])
    plan.order.fill_(POISON)
    order_from_scores(scores, plan.qtiles, plan.order, force_local=force_local, force_sink=force_sink)
    schedule = oracle.tile_schedule(q_len, kv_len, True, 0.5, force_local, force_sink)
    for i, (candidates, local, selected) in enumerate(schedule):
        forced = local if force_local else []
        forced = forced + ([0] if force_sink and 0 not in forced else [])
        for h in range(HQ):
            rest = sorted((j for j in range(candidates) if j not in forced),
                          key=lambda j: (float(scores[h, i, j]), j), reverse=True)
            assert plan.order[i, h, :selected].tolist() == (forced + rest)[:selected]
            assert (plan.order[i, h, selected:] == -1).all()
