"""The exact reference path of cosa.run (CPU) against the float64 oracle in tests/oracle.py."""

from __future__ import annotations

import math

import pytest
import torch

import cosa
from cosa.reference import dense_attention, ordered_skip_attention
from cosa.synthetic import structured_qkv

import oracle
from batch import POISON, fresh_generator, make_batch

PAGE_SIZES = (16, 32, 64, 128, 256)


def run_batch(batch, hq, hkv, d, page_size, layout="NHD", **options):
    plan = cosa.plan(*batch.page_table(), hq, hkv, d, page_size, kv_layout=layout, q_data_type=batch.q.dtype,
                     **options)
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), dtype=torch.float32)
    for written in (plan.order, plan.computed, plan.skipped):   # run writes every entry
        written.fill_(POISON)
    o, lse = cosa.run(plan, batch.q, batch.cache, out=out, lse=lse, return_lse=True)
    assert o is out and torch.isfinite(o).all(), "every output element must be written"
    assert not torch.isnan(lse).any(), "every lse element must be written"
    return plan, o, lse


def request_rows(batch, r):
    return slice(int(batch.qo_indptr[r]), int(batch.qo_indptr[r + 1]))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout,combined", [("NHD", True), ("HND", True), ("NHD", False), ("HND", False)])
def test_full_budget_without_skipping_is_dense(page_size, layout, combined):
    g = fresh_generator()
    hq, hkv, d = 4, 2, 64
    q_lens, kv_lens = [130, 0, 77, 256], [300, 40, 77, 500]     # ragged, chunked, empty, aligned
    batch = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, layout=layout, combined=combined, generator=g)
    _, o, lse = run_batch(batch, hq, hkv, d, page_size, layout, budget=1.0, delta=0.0)
    for r, (q, k, v) in enumerate(batch.requests):
        if q_lens[r] == 0:
            continue
        want_o, want_lse = oracle.dense(q, k, v, q_lens[r], kv_lens[r], True, 1 / math.sqrt(d))
        rows = request_rows(batch, r)
        torch.testing.assert_close(o[rows], want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[rows].double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("q_len,kv_len", [(200, 333), (600, 733)])   # 600: dense_attention's 512-row chunks
def test_dense_reference_matches_oracle(causal, group, q_len, kv_len):
    g = fresh_generator()
    q = torch.randn(q_len, 2 * group, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv_len, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse = dense_attention(q, k, v, causal=causal, sm_scale=0.1)
    want_o, want_lse = oracle.dense(q, k, v, q_len, kv_len, causal, 0.1)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("budget,delta", [(0.25, 0.05), (0.5, 0.2), (0.1, 0.0), (1.0, 0.05)])
@pytest.mark.parametrize("force", [(True, True), (False, True), (True, False), (False, False)])
def test_order_mask_outputs_and_statistics_match_oracle(budget, delta, force, causal):
    g = fresh_generator()
    hq, hkv, d, page_size = 4, 1, 64, 32
    q_lens, kv_lens = [384, 200], [1100, 200]
    structured = lambda r, q_len, kv_len: structured_qkv(  # noqa: E731
        kv_len, hq, hkv, d, q_len=q_len, generator=g, dtype=torch.float64)
    batch = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, generator=g, qkv=structured)
    force_local, force_sink = force
    plan, o, lse = run_batch(batch, hq, hkv, d, page_size, budget=budget, delta=delta,
                             force_local=force_local, force_sink=force_sink, causal=causal)
    stats = plan.stats()
    qtile = 0
    for r, (q, k, v) in enumerate(batch.requests):
        want_order = oracle.order_mask(q, k, q_lens[r], kv_lens[r], causal, budget, force_local, force_sink)
        want_o, want_lse, want_computed, want_skipped = oracle.ordered_skip(
            q, k, v, want_order, q_lens[r], kv_lens[r], causal, 1 / math.sqrt(d), delta)
        tiles = len(want_order)
        for i in range(tiles):
            for h in range(hq):
                got = plan.order[qtile + i, h]
                assert got[:len(want_order[i][h])].tolist() == want_order[i][h]
                assert (got[len(want_order[i][h]):] == -1).all()
        assert stats.computed[qtile:qtile + tiles].tolist() == want_computed.tolist()
        assert stats.skipped[qtile:qtile + tiles].tolist() == want_skipped.tolist()
        assert stats.selected[qtile:qtile + tiles].tolist() == [len(t[0]) for t in want_order]
        rows = request_rows(batch, r)
        torch.testing.assert_close(o[rows], want_o, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse[rows].double(), want_lse, rtol=1e-6, atol=1e-6)
        # the reference's record of the visited blocks, which the eval studies read
        order = plan.order[qtile:qtile + tiles]
        visited = torch.ones_like(order, dtype=torch.bool)
        ordered_skip_attention(q, k, v, order, causal=causal, sm_scale=1 / math.sqrt(d), delta=delta,
                               visited=visited)
        assert not (visited & (order < 0)).any()
        assert visited.sum(-1).tolist() == want_computed.tolist()
        qtile += tiles
    assert stats.computed.sum() + stats.skipped.sum() == stats.selected.sum() * hq


def test_visiting_order_does_not_change_the_output_without_skipping():
    g = fresh_generator()
    q_len, kv_len = 256, 640
    q = torch.randn(q_len, 2, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv_len, 1, 64, generator=g, dtype=torch.float64) for _ in range(2))
    order = torch.tensor([[[3, 0, 1], [3, 2, 0]], [[4, 3, 2], [4, 0, 1]]], dtype=torch.int32)
    shuffled = order.roll(1, -1)
    base = ordered_skip_attention(q, k, v, order, causal=True, sm_scale=0.125, delta=0.0)
    again = ordered_skip_attention(q, k, v, shuffled, causal=True, sm_scale=0.125, delta=0.0)
    torch.testing.assert_close(base[0], again[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(base[1], again[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strong_later_block", [False, True])
def test_hand_built_skips(strong_later_block):
    """Block 0's keys dominate every row, so with delta > 0 every later block is
    negligible, unless a later block is made even stronger."""
    d, q_len, kv_len = 64, 128, 512
    direction = torch.zeros(d, dtype=torch.float64)
    direction[0] = 1.0
    g = fresh_generator()
    q = direction.expand(q_len, 1, d).clone()
    k = 0.01 * torch.randn(kv_len, 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(kv_len, 1, d, generator=g, dtype=torch.float64)
    k[:128, 0, 0] = 200.0                                    # logits 25 in block 0, ~0 elsewhere
    if strong_later_block:
        k[256:384, 0, 0] = 240.0                             # block 2 beats block 0 by 5 nats
    order = torch.tensor([[[0, 1, 2, 3]]], dtype=torch.int32)
    was_visited = torch.ones_like(order, dtype=torch.bool)   # poisoned: every step is written
    o, _, computed, skipped = ordered_skip_attention(q, k, v, order, causal=False, sm_scale=0.125,
                                                     delta=0.05, visited=was_visited)
    visited = [0, 2] if strong_later_block else [0]
    assert computed.item() == len(visited) and skipped.item() == 4 - len(visited)
    assert was_visited[0, 0].tolist() == [j in visited for j in range(4)]
    keys = torch.cat([torch.arange(128 * j, 128 * j + 128) for j in visited])
    want, _ = oracle.dense(q, k[keys], v[keys], q_len, len(keys), False, 0.125)
    torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
    # delta = 0 never skips
    _, _, computed, skipped = ordered_skip_attention(q, k, v, order, causal=False, sm_scale=0.125, delta=0.0)
    assert computed.item() == 4 and skipped.item() == 0


def test_first_block_is_never_skipped():
    q = torch.zeros(128, 1, 64, dtype=torch.float64)
    k = torch.zeros(256, 1, 64, dtype=torch.float64)
    v = torch.ones(256, 1, 64, dtype=torch.float64)
    order = torch.tensor([[[1, 0]]], dtype=torch.int32)
    o, lse, computed, skipped = ordered_skip_attention(q, k, v, order, causal=False, sm_scale=1.0, delta=1e9)
    assert computed.item() == 1 and skipped.item() == 1
    torch.testing.assert_close(o, torch.ones_like(o))
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(128)))


def test_the_smallest_delta_skips_nothing():
    # the threshold ln(delta) - ln(kv_len) is finite although delta / kv_len underflows to 0
    g = fresh_generator()
    q = torch.randn(256, 2, 64, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 512, 2, 64, generator=g, dtype=torch.float64)
    order = torch.randperm(4, generator=g, dtype=torch.int32).expand(2, 2, 4).contiguous()
    o, lse, computed, skipped = ordered_skip_attention(q, k, v, order, causal=False, sm_scale=0.125, delta=5e-324)
    assert (computed == 4).all() and (skipped == 0).all()
    want_o, want_lse = oracle.dense(q, k, v, 256, 512, False, 0.125)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_track_float64(dtype):
    g = fresh_generator()
    hq, hkv, d, page_size = 8, 2, 128, 64
    batch = make_batch([300], [700], hq, hkv, d, page_size, dtype=dtype, generator=g)
    _, o, _ = run_batch(batch, hq, hkv, d, page_size, budget=1.0, delta=0.0)
    q, k, v = batch.requests[0]
    want, _ = oracle.dense(q, k, v, 300, 700, True, 1 / math.sqrt(d))
    # computed in float32: the error is the output's rounding to dtype, plus float32's own
    rounding = (want.to(dtype).double() - want).norm() / want.norm()
    error = (o.double() - want).norm() / want.norm()
    assert error < 1.05 * rounding + 2e-6, f"relative error {error:.3g}, rounding to {dtype} alone {rounding:.3g}"
