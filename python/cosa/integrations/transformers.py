"""CoSA as a transformers attention implementation (Llama, Qwen2/Qwen3, Mistral, ...).

    import cosa.integrations.transformers as cosa_hf
    cosa_hf.register(budget=0.25, delta=0.05)          # once; options apply to every layer
    model.set_attn_implementation("cosa")               # or from_pretrained(..., attn_implementation="cosa")

Prefill steps (more than one query row, no padding, plain causal masking or, for a
module that is not causal, none, a head_dim CoSA has) run :func:`cosa.run` on a paged
copy of the layer's K/V: on the GPU the OSK kernel, on the CPU the exact reference.
Everything else (decode steps, padded batches, static caches, sliding windows, other mask
overlays or biases, other head sizes) runs dense SDPA, with CoSA's bottom-right causal mask where a
chunk follows cached keys. Attention sinks (``s_aux``, as gpt-oss passes them), which
neither CoSA nor SDPA computes, raise. The latest plan of each layer is kept as ``module.cosa_plan``
for its statistics.

:func:`capture_qkv` records the post-RoPE queries, keys and values of every
layer of one forward pass, for accuracy studies (``cosa.eval``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ..api import SUPPORTED_HEAD_DIMS, plan, run
from ..blocks import BLOCK
from ..paged import to_pages, uniform_page_table

NAME = "cosa"
_CAPTURE_NAME = "cosa_capture"
_options: dict = {}                 # plan options set by register()
# What register passes on to cosa.plan; the layer's shapes, dtypes, causality and scale are the model's
OPTIONS = ("budget", "delta", "proxy", "force_local", "force_sink")
_captured: list | None = None       # (q, k, v) per layer while capture_qkv runs


def register(**plan_options) -> None:
    """Registers ``"cosa"`` with transformers; ``plan_options`` (``OPTIONS``) go to every
    :func:`cosa.plan`, and are checked here, as a one-token plan takes them, rather than at
    the first forward. Calling it again replaces the options."""
    unknown = sorted(set(plan_options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"register: {', '.join(unknown)} cannot be set for every layer; it takes {OPTIONS}")
    plan(*uniform_page_table(1, 1, 1, BLOCK, "cpu"), 1, 1, SUPPORTED_HEAD_DIMS[0], BLOCK, **plan_options)
    _options.clear()
    _options.update(plan_options)
    for name, forward in ((NAME, cosa_attention_forward), (_CAPTURE_NAME, _capture_attention_forward)):
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, _causal_mask_or_none)


def _causal_mask_or_none(**kwargs):
    """No mask where CoSA's own semantics are meant: plain causal attention of the step's
    queries, the last q_length of the kv_length keys, with no padding.  transformers places
    the queries at q_offset, which is that place only where the cache holds exactly the keys
    seen so far (not a static cache, whose kv_length counts its empty slots), and only where
    the model allows no mask at all (``allow_is_causal_skip``; a model that adds a bias onto the
    mask, ALiBi say, does not).  Otherwise SDPA's mask, always as a tensor (SDPA's own None would
    mean its top-left is_causal), which sends the step to dense attention."""
    padding = kwargs.get("attention_mask")
    queries_end_at_the_last_key = int(kwargs.get("q_offset", 0)) + kwargs["q_length"] == kwargs["kv_length"]
    if (kwargs.get("mask_function") is causal_mask_function and kwargs.get("local_size") is None
            and kwargs.get("allow_is_causal_skip", True)
            and not kwargs.get("kv_offset") and queries_end_at_the_last_key
            and (padding is None or bool(padding.all()))):
        return None
    return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})


def cosa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: ``query [B, Hq, q, d]``, ``key/value
    [B, Hkv, kv, d]`` (cache included); returns ``([B, q, Hq, d], None)``."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{NAME}: attention sinks (s_aux) are not supported; run this model with "
                                  "its own attention implementation")
    batch, num_qo_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    # as SDPA reads it: the call's is_causal, else the module's (False for encoders)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    # a relative-position bias (T5's position_bias) changes every logit: dense, like a mask
    if (q_len == 1 or attention_mask is not None or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None or head_dim not in SUPPORTED_HEAD_DIMS):
        if attention_mask is None and causal and 1 < q_len < kv_len:
            # SDPA's is_causal places the queries top-left (transformers then drops the keys
            # past q_len): CoSA's bottom-right causal mask, spelled out
            attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    # everything the plan below is made of
    cache_key = (batch, q_len, kv_len, num_qo_heads, num_kv_heads, head_dim, causal, scaling, query.dtype,
                 key.dtype, query.device, tuple(sorted(_options.items())))
    plan_ = getattr(module, "cosa_plan", None)
    if getattr(module, "_cosa_plan_key", None) != cache_key:
        plan_ = plan(*uniform_page_table(batch, q_len, kv_len, BLOCK, query.device), num_qo_heads,
                     num_kv_heads, head_dim, BLOCK, causal=causal, sm_scale=scaling,
                     q_data_type=query.dtype, kv_data_type=key.dtype, **_options)
        module.cosa_plan, module._cosa_plan_key = plan_, cache_key
    q = query.transpose(1, 2).reshape(batch * q_len, num_qo_heads, head_dim)
    o = run(plan_, q, (to_pages(key.transpose(1, 2), BLOCK), to_pages(value.transpose(1, 2), BLOCK)))
    return o.view(batch, q_len, num_qo_heads, head_dim), None


def _capture_attention_forward(module, query, key, value, attention_mask, **kwargs):
    _captured.append(tuple(x[0].transpose(0, 1).float().cpu() for x in (query, key, value)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def attention_implementation(model, name: str):
    """Runs the body with ``model`` switched to attention implementation ``name``."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Post-RoPE ``(q [n, Hq, d], k [n, Hkv, d], v [n, Hkv, d])`` float32 on the CPU, per layer,
    from one dense forward pass of ``input_ids [1, n]``."""
    global _captured
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"capture_qkv takes one sequence, input_ids [1, n], got shape {tuple(input_ids.shape)}")
    register(**_options)
    _captured = []
    try:
        with attention_implementation(model, _CAPTURE_NAME):
            model(input_ids.to(model.device), use_cache=False)
        return _captured
    finally:
        _captured = None
