"""The exact reference: SPEC stage 2 (ordered skip) and dense attention, in plain torch.

Works on one request with contiguous ``q [q_len, num_qo_heads, d]`` and
``k, v [kv_len, num_kv_heads, d]``, on any device, computing in float64 for
float64 inputs and in float32 otherwise. Causal alignment is bottom-right:
query row ``t`` sits at position ``kv_len - q_len + t``. LSE is the natural log
of the softmax denominator of scaled logits; a row that computes no key gets
output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import math

import torch

from .blocks import BLOCK, blocked, compute_dtype, num_blocks
_DENSE_ROWS = 512  # query rows per chunk of dense attention, bounding its memory


def skip_threshold(delta: float, kv_len: int) -> float:
    """``ln(delta / kv_len)``: a block whose best row gains less than this is skipped."""
    return math.log(delta) - math.log(kv_len) if delta > 0 else -math.inf   # delta / kv_len may underflow


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over every visible key: ``(o [q_len, hq, d] in q's dtype, lse [q_len, hq] float32)``."""
    q_len, num_qo_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    dtype = compute_dtype(q)
    group = num_qo_heads // num_kv_heads
    keys = k.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)     # [hq, kv, d]
    values = v.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    key_pos = torch.arange(kv_len, device=q.device)
    o = torch.empty_like(q)
    lse = torch.empty((q_len, num_qo_heads), dtype=torch.float32, device=q.device)
    for start in range(0, q_len, _DENSE_ROWS):
        rows = slice(start, min(start + _DENSE_ROWS, q_len))
        logits = q[rows].to(dtype).transpose(0, 1) @ keys.transpose(1, 2) * sm_scale
        if causal:
            row_pos = kv_len - q_len + torch.arange(rows.start, rows.stop, device=q.device)
            logits = logits.masked_fill(key_pos[None, :] > row_pos[:, None], -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)                             # [hq, rows]
        weights = torch.exp(logits - row_lse.masked_fill(row_lse == -math.inf, 0)[..., None])
        o[rows] = (weights @ values).transpose(0, 1).to(q.dtype)
        lse[rows] = row_lse.transpose(0, 1).float()
    return o, lse


def ordered_skip_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor,
                           *, causal: bool, sm_scale: float, delta: float,
                           visited: torch.Tensor | None = None):
    """SPEC stage 2 for one request.

    ``order [tiles, hq, k_max]`` lists each (query tile, head)'s key blocks in
    visiting order, -1 padded. Every listed block but the first is skipped
    when, over the tile's valid rows, the largest ``mloc - m`` (block row max
    minus running max, scaled logits) is below ``ln(delta / kv_len)``; a row
    with no visible key in the block wants to skip. Returns ``(o, lse,
    computed [tiles, hq], skipped [tiles, hq])``. ``visited``, a bool tensor
    shaped like ``order``, receives which listed blocks were computed (for studies).
    """
    q_len, num_qo_heads, d = q.shape
    kv_len, num_kv_heads, _ = k.shape
    tiles, kv_blocks = num_blocks(q_len), num_blocks(kv_len)
    dtype = compute_dtype(q)
    device = q.device
    q_tiles = blocked(q, dtype)                                        # [hq, tiles, 128, d]
    k_blocks, v_blocks = blocked(k, dtype), blocked(v, dtype)
    kv_head = (torch.arange(num_qo_heads, device=device) // (num_qo_heads // num_kv_heads))[:, None]

    row = torch.arange(tiles * BLOCK, device=device).view(tiles, BLOCK)
    row_valid = row < q_len
    row_pos = kv_len - q_len + row
    key_pos = torch.arange(kv_blocks * BLOCK, device=device).view(kv_blocks, BLOCK)
    threshold = skip_threshold(delta, kv_len)

    m = torch.full((num_qo_heads, tiles, BLOCK), -math.inf, dtype=dtype, device=device)
    l = torch.zeros_like(m)
    acc = torch.zeros((num_qo_heads, tiles, BLOCK, d), dtype=dtype, device=device)
    computed = torch.zeros((num_qo_heads, tiles), dtype=torch.int32, device=device)
    skipped = torch.zeros_like(computed)
    order = order.to(device=device, dtype=torch.long).permute(1, 0, 2)        # [hq, tiles, k_max]
    for step in range(order.shape[-1]):
        block = order[..., step]
        listed = block >= 0
        block = block.clamp(min=0)
        keys, values = k_blocks[kv_head, block], v_blocks[kv_head, block]      # [hq, tiles, 128, d]
        visible = (key_pos[block] < kv_len)[:, :, None, :] & row_valid[None, :, :, None]
        if causal:
            visible = visible & (key_pos[block][:, :, None, :] <= row_pos[None, :, :, None])
        logits = (q_tiles @ keys.transpose(-1, -2) * sm_scale).masked_fill(~visible, -math.inf)

        block_max = logits.amax(-1)                                            # mloc
        gain = torch.where(block_max == -math.inf, -math.inf, block_max - m)
        gain = gain.masked_fill(~row_valid[None], -math.inf)
        skip = (gain.amax(-1) < threshold) & (step > 0)
        visit = listed & ~skip

        m_new = torch.where(visit[..., None], torch.maximum(m, block_max), m)
        base = m_new.masked_fill(m_new == -math.inf, 0)
        p = torch.exp(logits - base[..., None])
        rescale = torch.exp(m - base)
        l = torch.where(visit[..., None], l * rescale + p.sum(-1), l)
        acc = torch.where(visit[..., None, None], acc * rescale[..., None] + p @ values, acc)
        m = m_new
        computed += visit
        if visited is not None:
            visited[..., step] = visit.T
        skipped += listed & skip

    o = torch.where(l[..., None] > 0, acc / l[..., None], 0.0)
    lse = torch.where(l > 0, m + torch.log(l), -math.inf)
    o = o.permute(1, 2, 0, 3).reshape(tiles * BLOCK, num_qo_heads, d)[:q_len].to(q.dtype)
    lse = lse.permute(1, 2, 0).reshape(tiles * BLOCK, num_qo_heads)[:q_len].float()
    return o, lse, computed.T.contiguous(), skipped.T.contiguous()
