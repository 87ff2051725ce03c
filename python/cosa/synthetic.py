"""Structured attention inputs for demos, tests and benchmarks.

I.i.d. noise spreads attention evenly, so no block is negligible and no
sparse method looks good or bad for the right reasons. These inputs have the
structure of real long-context attention: RoPE-rotated queries and keys that
share a per-head direction (attention decays with distance: local windows), an
attention sink at position 0, and topics: the sequence is cut into segments,
each about one of a few recurring topics, and a query attends to the earlier
segments about its own topic (far, block-coherent attention, as when a model
looks back at a related passage).
"""

from __future__ import annotations

import math

import torch

from .checks import check_float, check_int


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of ``x [n, heads, d]`` at ``positions [n]``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :].to(x.dtype), angle.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def structured_qkv(seq_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
                   q_len: int | None = None, local_strength: float = 14.0, sink_strength: float = 20.0,
                   topic_strength: float = 10.0, num_topics: int = 8, segment_len: int = 384,
                   noise: float = 0.3,
                   generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu"):
    """Post-RoPE ``q [q_len, hq, d]`` (the last ``q_len`` positions, default all)
    and ``k, v [seq_len, hkv, d]`` of one request.

    The strengths are logit gains in nats (the softmax scale ``1/sqrt(d)`` is
    folded in) of the local, sink and topic components; ``noise`` scales the
    isotropic part of every query and key.
    """
    seq_len = check_int("seq_len", seq_len, minimum=0)
    q_len = seq_len if q_len is None else check_int("q_len", q_len, minimum=0)
    if q_len > seq_len:
        raise ValueError(f"q_len must be at most seq_len={seq_len} (the last positions), got {q_len}")
    num_kv_heads = check_int("num_kv_heads", num_kv_heads)
    if check_int("num_qo_heads", num_qo_heads) % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide num_qo_heads={num_qo_heads}, got {num_kv_heads}")
    if check_int("head_dim", head_dim, minimum=2) % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    for name, strength in (("local_strength", local_strength), ("sink_strength", sink_strength),
                           ("topic_strength", topic_strength), ("noise", noise)):
        check_float(name, strength, low=0.0)
    check_int("num_topics", num_topics)
    check_int("segment_len", segment_len)
    group = num_qo_heads // num_kv_heads
    root_d = math.sqrt(head_dim)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def directions(count, strength):
        x = randn(count, num_kv_heads, head_dim)
        return x / x.norm(dim=-1, keepdim=True) * math.sqrt(strength * root_d)

    def per_query_head(x):
        return x.repeat_interleave(group, dim=-2)

    positions = torch.arange(seq_len)
    local = directions(1, local_strength)
    sink = directions(1, sink_strength)[0]
    topics = directions(num_topics, topic_strength)
    topic_of = topics[torch.randint(num_topics, (-(-seq_len // segment_len),), generator=generator)]
    topic_at = topic_of.repeat_interleave(segment_len, dim=0)[:seq_len]        # [n, hkv, d]

    k = rope(local.expand(seq_len, -1, -1), positions) + topic_at + noise * randn(seq_len, num_kv_heads, head_dim)
    k[:1] += sink   # position 0, if there is one
    q = rope(per_query_head(local).expand(seq_len, -1, -1), positions) + per_query_head(topic_at + sink)
    q = q + noise * randn(seq_len, num_qo_heads, head_dim)
    v = randn(seq_len, num_kv_heads, head_dim)
    q = q[seq_len - q_len:]   # drawn whole: a chunk's queries are those of the whole request
    return (q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device),
            v.to(dtype=dtype, device=device))
