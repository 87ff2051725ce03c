"""cosa.eval's metrics and the visiting-order ablation, on hand-built and small random cases."""

from __future__ import annotations

import math

import pytest
import torch

import cosa
from cosa.eval.metrics import iou, mass_recall, order_to_mask, relative_error, top_k_mask
from cosa.eval.studies import captured_attention_study, reorder_scored_blocks
from cosa.paged import uniform_page_table
from cosa.proxy import PROXIES, proxy_order
from cosa.proxy.oracle import attention_block_mass
from cosa.synthetic import structured_qkv

import oracle
from batch import fresh_generator


def test_order_to_mask_and_hand_built_recall_and_iou():
    order = torch.tensor([[[2, 0, -1], [1, -1, -1]]], dtype=torch.int32)        # 1 tile, 2 heads
    mask = order_to_mask(order, 4)
    assert mask.tolist() == [[[True, False, True, False], [False, True, False, False]]]
    visited = torch.tensor([[[True, False, False], [True, False, False]]])
    assert order_to_mask(order, 4, visited).tolist() == [[[False, False, True, False],
                                                         [False, True, False, False]]]
    mass = torch.tensor([[[0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]]])
    torch.testing.assert_close(mass_recall(mass, mask), torch.tensor([0.75, 0.2]))
    oracle = top_k_mask(mass, mask.sum(-1))
    assert oracle.tolist() == [[[True, True, False, False], [False, False, False, True]]]
    # head 0: {0, 2} vs {0, 1} -> 1/3; head 1: {1} vs {3} -> 0
    torch.testing.assert_close(iou(mask, oracle), torch.tensor([1 / 3, 0.0]))


def test_relative_error_per_head():
    reference = torch.zeros(3, 2, 4)
    reference[..., 0] = 1.0
    o = reference.clone()
    o[:, 1] *= 1.5
    torch.testing.assert_close(relative_error(o, reference), torch.tensor([0.0, 0.5], dtype=torch.float64))


@pytest.mark.parametrize("q_len, kv_len, causal", [(300, 300, True), (256, 256, True), (200, 520, True),
                                                    (200, 330, False)])
def test_block_mass_matches_a_loop_over_rows(q_len, kv_len, causal):
    g = fresh_generator()
    q = torch.randn(q_len, 4, 64, generator=g)
    k = torch.randn(kv_len, 2, 64, generator=g) * 2
    mass = attention_block_mass(q, k, causal=causal, sm_scale=0.125)
    tiles, blocks = -(-q_len // 128), -(-kv_len // 128)
    want = torch.zeros(tiles, 4, blocks, dtype=torch.float64)
    for row in range(q_len):
        visible = kv_len - q_len + row + 1 if causal else kv_len
        for h in range(4):
            p = torch.softmax(k[:visible, h // 2].double() @ q[row, h].double() * 0.125, 0)
            for j in range(blocks):
                want[row // 128, h, j] += p[j * 128:(j + 1) * 128].sum()
    torch.testing.assert_close(mass.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mass.sum((0, 2)).double(), torch.full((4,), float(q_len), dtype=torch.float64),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("force_local,force_sink", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("ordering", ["ascending", "random"])
def test_reordering_keeps_the_forced_prefix_and_the_selected_set(ordering, force_local, force_sink):
    g = fresh_generator()
    n = 1500
    q, k = torch.randn(n, 2, 64, generator=g), torch.randn(n, 1, 64, generator=g)
    flags = {"force_local": force_local, "force_sink": force_sink}
    plan = cosa.plan(*uniform_page_table(1, n, n, 128, "cpu"), 2, 1, 64, 128, budget=0.6,
                     q_data_type=torch.float32, **flags)
    order = torch.empty_like(plan.order)
    proxy_order(q, k, plan.qtiles, order, **flags)
    moved = reorder_scored_blocks(order, plan, ordering, g)
    for tile in range(order.shape[0]):
        # the diagonal block, then the sink (the first tile's diagonal block)
        forced = force_local + (force_sink and (tile > 0 or not force_local))
        selected = int(plan.qtiles[tile, cosa._C.QT_NUM_SELECTED])
        for h in range(2):
            assert moved[tile, h, :forced].tolist() == order[tile, h, :forced].tolist()
            assert sorted(moved[tile, h].tolist()) == sorted(order[tile, h].tolist())
            if ordering == "ascending":
                assert moved[tile, h, forced:selected].tolist() == order[tile, h, forced:selected].flip(0).tolist()
    assert not torch.equal(moved, order)


def test_oracle_proxy_recalls_the_most_mass_any_proxy_can():
    """The oracle proxy lists the forced blocks, then the most massive others (float64 brute force
    here); so its mass recall bounds every proxy's at the same budget."""
    g = fresh_generator()
    n, budget = 700, 0.3
    q, k, v = torch.randn(n, 2, 64, generator=g) * 2, torch.randn(n, 1, 64, generator=g), torch.randn(n, 1, 64)
    records = captured_attention_study([(0, (q, k, v))], [budget], [0.0], ordering_budgets=(), gammas=(),
                                       progress=lambda _: None)
    recall = {r["proxy"]: r["recall_stage1"] for r in records if r["study"] == "proxy"}
    assert set(recall) == set(PROXIES)

    plan = cosa.plan(*uniform_page_table(1, n, n, 128, "cpu"), 2, 1, 64, 128, budget=budget,
                     q_data_type=torch.float32)
    counts = plan.qtiles[:, cosa._C.QT_NUM_SELECTED].tolist()
    blocks = -(-n // 128)
    for h in range(2):
        logits = (q[:, h].double() @ k[:, 0].double().T) * 64 ** -0.5
        p = torch.softmax(logits.masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf), -1)
        mass = torch.zeros(blocks, blocks, dtype=torch.float64)
        for row in range(n):
            mass[row // 128] += torch.nn.functional.pad(p[row], (0, blocks * 128 - n)).view(blocks, 128).sum(-1)
        best = 0.0
        for t in range(blocks):
            forced = {t, 0}
            others = sorted((float(mass[t, j]) for j in range(t + 1) if j not in forced), reverse=True)
            best += sum(float(mass[t, j]) for j in forced) + sum(others[:counts[t] - len(forced)])
        assert recall["oracle"][h] == pytest.approx(best / n, abs=2e-6)
        for name in PROXIES:
            assert recall[name][h] <= recall["oracle"][h] + 2e-6


def test_a_fidelity_record_is_the_oracle_s_stage_2_over_kap_s_order():
    n, budget, delta, sm_scale = 700, 1.0, 0.05, 64 ** -0.5
    # a sink 30 nats strong: each head skipped 1-10 of its 42 blocks in 200 seeds, and computed some unforced
    q, k, v = structured_qkv(n, 2, 1, 64, sink_strength=30.0, generator=fresh_generator(), dtype=torch.float64)
    records = captured_attention_study([(0, (q, k, v))], [budget], [delta], proxies=("kap",), ordering_budgets=(),
                                       gammas=(), progress=lambda _: None)
    (record,) = [r for r in records if r["study"] == "fidelity"]
    order = oracle.order_mask(q, k, n, n, True, budget, True, True)
    o, _, computed, skipped = oracle.ordered_skip(q, k, v, order, n, n, True, sm_scale, delta)
    dense, _ = oracle.dense(q, k, v, n, n, True, sm_scale)
    schedule = oracle.tile_schedule(n, n, True, budget, True, True)
    candidates = sum(c for c, _, _ in schedule)
    for h in range(2):
        assert record["error"][h] == pytest.approx(float((o[:, h] - dense[:, h]).norm() / dense[:, h].norm()), abs=2e-6)
        assert record["density_stage1"][h] == pytest.approx(sum(s for _, _, s in schedule) / candidates, abs=2e-6)
        assert record["density_stage2"][h] == pytest.approx(float(computed[:, h].sum()) / candidates, abs=2e-6)
        assert record["skip_rate"][h] == pytest.approx(
            float(skipped[:, h].sum() / (computed[:, h] + skipped[:, h]).sum()), abs=2e-6)
    assert min(record["skip_rate"]) > 0, "the inputs are built so that stage 2 skips some blocks"
