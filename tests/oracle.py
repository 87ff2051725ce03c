"""An independent, loop-by-loop float64 model of SPEC stages 1 and 2, for tests.

Written from SPEC.md and docs/design.md alone: one (request, query tile,
head) at a time, plain Python sorting, no code shared with the library.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128


def tile_schedule(q_len, kv_len, causal, budget, force_local, force_sink):
    """Per query tile: (candidates, local blocks, num_selected); the one model of the schedule
    that the plan tests (test_remap) and the order-mask tests share."""
    tiles = []
    kv_blocks = -(-kv_len // BLOCK)
    for i in range(-(-q_len // BLOCK)):
        first, last = i * BLOCK, min(i * BLOCK + BLOCK, q_len) - 1
        if causal:
            candidates = (kv_len - q_len + last) // BLOCK + 1
        else:
            candidates = kv_blocks
        clamp = lambda j: min(max(j, 0), candidates - 1)  # noqa: E731
        local = sorted({clamp((kv_len - q_len + first) // BLOCK), clamp((kv_len - q_len + last) // BLOCK)})
        forced = set(local if force_local else []) | ({0} if force_sink else set())
        # at least one block, as SPEC's ceil(b1 * n) >= 1 for b1 > 0
        budgeted = max(1, math.ceil(budget * candidates - 1e-9))
        selected = min(candidates, max(len(forced), budgeted))
        tiles.append((candidates, local, selected))
    return tiles


def order_mask(q, k, q_len, kv_len, causal, budget, force_local, force_sink):
    """``[tiles][heads] -> list of blocks`` in visiting order."""
    hq, hkv = q.shape[1], k.shape[1]
    result = []
    for i, (candidates, local, selected) in enumerate(
            tile_schedule(q_len, kv_len, causal, budget, force_local, force_sink)):
        rows = q[i * BLOCK:min(i * BLOCK + BLOCK, q_len)].double()
        per_head = []
        for h in range(hq):
            qbar = rows[:, h].mean(0)
            kh = h // (hq // hkv)
            scores = {j: float(qbar @ k[j * BLOCK:min(j * BLOCK + BLOCK, kv_len), kh].double().mean(0))
                      for j in range(candidates)}
            forced = list(local) if force_local else []
            if force_sink and 0 not in forced:
                forced.append(0)
            rest = sorted((j for j in scores if j not in forced), key=lambda j: (scores[j], j), reverse=True)
            per_head.append((forced + rest)[:selected])
        result.append(per_head)
    return result


def ordered_skip(q, k, v, order, q_len, kv_len, causal, sm_scale, delta):
    """SPEC stage 2, one tile and head at a time. Returns (o, lse, computed, skipped) in float64."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    o = torch.zeros(q_len, hq, d, dtype=torch.float64)
    lse = torch.full((q_len, hq), -math.inf, dtype=torch.float64)
    tiles = len(order)
    computed = torch.zeros(tiles, hq, dtype=torch.int64)
    skipped = torch.zeros(tiles, hq, dtype=torch.int64)
    threshold = math.log(delta) - math.log(kv_len) if delta > 0 else -math.inf   # ln(delta / kv_len)
    for i in range(tiles):
        rows = range(i * BLOCK, min(i * BLOCK + BLOCK, q_len))
        for h in range(hq):
            kh = h // (hq // hkv)
            rq = q[rows.start:rows.stop, h].double()
            pos = kv_len - q_len + torch.arange(rows.start, rows.stop)
            m = torch.full((len(rows),), -math.inf, dtype=torch.float64)
            l = torch.zeros(len(rows), dtype=torch.float64)
            acc = torch.zeros(len(rows), d, dtype=torch.float64)
            for step, j in enumerate(order[i][h]):
                keys = torch.arange(j * BLOCK, min(j * BLOCK + BLOCK, kv_len))
                logits = rq @ k[keys, kh].double().T * sm_scale
                if causal:
                    logits = logits.masked_fill(keys[None, :] > pos[:, None], -math.inf)
                block_max = logits.max(1).values
                gains = [float(b - a) if b > -math.inf else -math.inf for a, b in zip(m, block_max)]
                if step > 0 and max(gains) < threshold:
                    skipped[i, h] += 1
                    continue
                computed[i, h] += 1
                for t in range(len(rows)):
                    m_new = max(float(m[t]), float(block_max[t]))
                    if m_new == -math.inf:
                        continue
                    p = torch.exp(logits[t] - m_new)
                    keep = math.exp(float(m[t]) - m_new)
                    l[t] = l[t] * keep + p.sum()
                    acc[t] = acc[t] * keep + p @ v[keys, kh].double()
                    m[t] = m_new
            for t, r in enumerate(rows):
                if l[t] > 0:
                    o[r, h] = acc[t] / l[t]
                    lse[r, h] = m[t] + math.log(l[t])
    return o, lse, computed, skipped


def dense(q, k, v, q_len, kv_len, causal, sm_scale):
    """Plain float64 softmax attention with bottom-right causal alignment."""
    hq, hkv = q.shape[1], k.shape[1]
    keys = k.double().repeat_interleave(hq // hkv, dim=1)
    values = v.double().repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), keys) * sm_scale
    if causal:
        pos = kv_len - q_len + torch.arange(q_len)
        logits = logits.masked_fill(torch.arange(kv_len)[None, None, :] > pos[None, :, None], -math.inf)
    lse = torch.logsumexp(logits, -1)
    o = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), values)
    return o, lse.T
