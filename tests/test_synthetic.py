"""cosa.synthetic.structured_qkv: shapes, the last positions, and its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from cosa.synthetic import structured_qkv

from batch import fresh_generator


@pytest.mark.parametrize("seq_len,q_len", [(300, None), (300, 100), (300, 0), (0, None), (1, 1)])
def test_shapes_and_the_last_positions(seq_len, q_len):
    # a chunk's q, k and v are the whole request's, noise included, from the same seed
    seed = torch.seed()
    q, k, v = structured_qkv(seq_len, 8, 2, 16, q_len=q_len, generator=torch.Generator().manual_seed(seed))
    rows = seq_len if q_len is None else q_len
    assert q.shape == (rows, 8, 16) and k.shape == v.shape == (seq_len, 2, 16)
    full_q, full_k, full_v = structured_qkv(seq_len, 8, 2, 16, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(q, full_q[seq_len - rows:], rtol=0, atol=0)
    torch.testing.assert_close(k, full_k, rtol=0, atol=0)
    torch.testing.assert_close(v, full_v, rtol=0, atol=0)


@pytest.mark.parametrize("args,kwargs,error,message", [
    ((100, 4, 2, 64), {"q_len": 150}, ValueError, "q_len must be at most seq_len=100"),
    ((100, 6, 4, 64), {}, ValueError, "num_kv_heads must divide num_qo_heads=6"),
    ((100, 4, 0, 64), {}, ValueError, "num_kv_heads must be >= 1"),
    ((100, 4, 2, 63), {}, ValueError, "head_dim must be even"),
    ((-1, 4, 2, 64), {}, ValueError, "seq_len must be >= 0"),
    ((100.0, 4, 2, 64), {}, TypeError, "seq_len must be an int"),
    ((100, 4, 2, 64), {"segment_len": 0}, ValueError, "segment_len must be >= 1"),
    ((100, 4, 2, 64), {"num_topics": 0}, ValueError, "num_topics must be >= 1"),
    ((100, 4, 2, 64), {"q_len": -1}, ValueError, "q_len must be >= 0"),
    ((100, 0, 2, 64), {}, ValueError, "num_qo_heads must be >= 1"),
    ((100, 4, 2, 0), {}, ValueError, "head_dim must be >= 2"),
    ((100, 4, 2, 64.0), {}, TypeError, "head_dim must be an int"),
    ((100, 4, 2, 64), {"local_strength": -1.0}, ValueError, "local_strength must be in"),
    ((100, 4, 2, 64), {"sink_strength": -1.0}, ValueError, "sink_strength must be in"),
    ((100, 4, 2, 64), {"topic_strength": math.nan}, ValueError, "topic_strength must be a number"),
    ((100, 4, 2, 64), {"noise": "0.3"}, TypeError, "noise must be a float"),
])
def test_bad_arguments_are_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        structured_qkv(*args, **kwargs)


@pytest.mark.parametrize("component", ["local", "sink", "topic"])
def test_each_strength_is_its_logit_gain_in_nats(component):
    # one component alone, no noise: the local one on the diagonal (q and k at the same position),
    # the sink at key 0, a topic (one for all segments) at every key
    strengths = {"local_strength": 0.0, "sink_strength": 0.0, "topic_strength": 0.0, f"{component}_strength": 7.0}
    q, k, _ = structured_qkv(700, 4, 2, 64, noise=0.0, num_topics=1, segment_len=128, generator=fresh_generator(),
                             dtype=torch.float64, **strengths)
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) / 64 ** 0.5
    gains = {"local": logits.diagonal(dim1=1, dim2=2), "sink": logits[..., 0], "topic": logits}[component]
    torch.testing.assert_close(gains, torch.full_like(gains, 7.0))
    if component == "sink":
        assert (logits[..., 1:] == 0).all()
