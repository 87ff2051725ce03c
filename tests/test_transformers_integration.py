"""CoSA inside a tiny randomly initialised Llama: full budget equals dense attention.

The model runs in float64; SDPA keeps that precision, eager attention takes its
softmax in float32, hence the two tolerances.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
cosa_hf = pytest.importorskip("cosa.integrations.transformers")

from cosa.reference import dense_attention  # noqa: E402


def float64_norms(model):
    """transformers' RMSNorms round their input to float32 even in a float64 model. About one
    model in 500, a last-bit difference between SDPA and CoSA then lands on a float32 rounding
    boundary, and the flipped rounding moves the logits by up to ~1e-7; so here every RMSNorm
    computes in its input's dtype."""
    def forward(norm, x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms, "the model's RMSNorms were renamed"
    for norm in norms:
        norm.forward = functools.partial(forward, norm)
    return model


def tiny_llama(seed, attn_implementation="sdpa"):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=2048,
                                      attn_implementation=attn_implementation)
    return float64_norms(transformers.LlamaForCausalLM(config).eval().double())


@pytest.fixture
def model_and_ids():
    seed = torch.seed()
    ids = torch.randint(512, (2, 333), generator=torch.Generator().manual_seed(seed))
    return tiny_llama(seed % 2**31), ids


@torch.no_grad()
def test_full_budget_prefill_and_decode_equal_dense(model_and_ids):
    model, ids = model_and_ids
    dense = model(ids).logits
    model.set_attn_implementation("eager")
    eager = model(ids).logits
    cosa_hf.register(budget=1.0, delta=0.0)
    model.set_attn_implementation("cosa")
    logits = model(ids).logits
    torch.testing.assert_close(logits, dense, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    assert model.model.layers[1].self_attn.cosa_plan.stats().density_stage2 == 1.0
    generated = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    model.set_attn_implementation("sdpa")
    assert torch.equal(generated, model.generate(ids[:1], max_new_tokens=4, do_sample=False))


@torch.no_grad()
def test_sparse_prefill_changes_the_logits_and_reports_density(model_and_ids):
    model, ids = model_and_ids
    dense = model(ids[:, :300]).logits
    cosa_hf.register(budget=0.1, delta=0.05, force_sink=False)
    model.set_attn_implementation("cosa")
    sparse = model(ids[:, :300]).logits
    stats = model.model.layers[0].self_attn.cosa_plan.stats()
    assert stats.density_stage1 < 1.0
    assert not torch.allclose(sparse, dense)


@torch.no_grad()
def test_padded_batches_fall_back_to_dense(model_and_ids):
    model, ids = model_and_ids
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    dense = model(ids, attention_mask=mask).logits
    cosa_hf.register(budget=0.1, delta=0.05)
    model.set_attn_implementation("cosa")
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[:, :-5], dense[:, :-5],
                               rtol=1e-9, atol=1e-9)


def tiny_llama_of_head_dim(head_dim, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=4 * head_dim, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim, attn_implementation="sdpa")
    return float64_norms(transformers.LlamaForCausalLM(config).eval().double())


@pytest.mark.parametrize("head_dim", [64, 32])   # 32: CoSA has no kernel, dense SDPA runs the step
@torch.no_grad()
def test_a_chunk_after_a_cached_prefix_equals_sdpa(head_dim):
    """Chunked prefill: 20 new queries after 300 cached keys attend to all of them, causally
    from the bottom right, whichever implementation runs the step."""
    seed = torch.seed() % 2**31
    model = tiny_llama_of_head_dim(head_dim, seed)
    ids = torch.randint(512, (1, 320), generator=torch.Generator().manual_seed(seed))
    cosa_hf.register(budget=1.0, delta=0.0)
    logits = {}
    for implementation in ("sdpa", "cosa"):
        model.set_attn_implementation(implementation)
        cache = transformers.DynamicCache(config=model.config)
        model(ids[:, :300], cache=cache)
        logits[implementation] = model(ids[:, 300:], cache=cache).logits
    torch.testing.assert_close(logits["cosa"], logits["sdpa"], rtol=1e-9, atol=1e-9)
    assert hasattr(model.model.layers[0].self_attn, "cosa_plan") == (head_dim == 64)


@torch.no_grad()
def test_a_static_cache_s_empty_slots_stay_out_of_attention(model_and_ids):
    """A static cache hands attention all max_cache_len slots, most of them empty: prefill and
    decode attend to the filled ones only, as SDPA does."""
    model, ids = model_and_ids
    cosa_hf.register(budget=1.0, delta=0.0)
    logits = {}
    for implementation in ("sdpa", "cosa"):
        model.set_attn_implementation(implementation)
        cache = transformers.StaticCache(config=model.config, max_cache_len=512)
        prefill = model(ids[:1, :300], cache=cache).logits
        logits[implementation] = (prefill, model(ids[:1, 300:301], cache=cache).logits)
    for got, expected in zip(logits["cosa"], logits["sdpa"]):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@torch.no_grad()
def test_capture_qkv_records_what_attention_read(model_and_ids):
    model, ids = model_and_ids
    attention_inputs = []
    hooks = [layer.self_attn.o_proj.register_forward_hook(lambda m, args, out: attention_inputs.append(args[0]))
             for layer in model.model.layers]
    for bad in (ids, ids[0]):
        with pytest.raises(ValueError, match=rf"capture_qkv takes one sequence, input_ids \[1, n\], got shape "
                                             rf"\({', '.join(map(str, bad.shape))},?\)"):
            cosa_hf.capture_qkv(model, bad)
    captured = cosa_hf.capture_qkv(model, ids[:1])
    for hook in hooks:
        hook.remove()
    assert model.config._attn_implementation == "sdpa", "the model's implementation is restored"
    assert len(captured) == 2
    for (q, k, v), o_proj_input in zip(captured, attention_inputs):
        assert q.shape == (333, 4, 64) and k.shape == v.shape == (333, 2, 64)
        o, _ = dense_attention(q.double(), k.double(), v.double(), causal=True, sm_scale=64 ** -0.5)
        torch.testing.assert_close(o.reshape(1, 333, 256), o_proj_input.double(), rtol=1e-5, atol=1e-5)


FAMILIES = {   # head_dim 64 (hidden 256 / 4 heads): a head_dim the kernel has
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 64}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_other_families_prefill_through_cosa(family):
    """Same attention signature as Llama: every layer's prefill goes through a CoSA plan,
    and at full budget without skipping the logits equal SDPA's."""
    config_name, model_name, extra = FAMILIES[family]
    seed = torch.seed() % 2**31
    print(f"seed={seed}")
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        attn_implementation="sdpa", **extra)
    model = float64_norms(getattr(transformers, model_name)(config).eval().double())
    ids = torch.randint(512, (1, 300), generator=torch.Generator().manual_seed(seed))
    dense = model(ids).logits
    cosa_hf.register(budget=1.0, delta=0.0)
    model.set_attn_implementation("cosa")
    torch.testing.assert_close(model(ids).logits, dense, rtol=1e-9, atol=1e-9)
    for layer in model.model.layers:
        assert layer.self_attn.cosa_plan.stats().density_stage2 == 1.0, "the layer ran through CoSA"


@pytest.mark.parametrize("module_causal,call_causal", [(False, None), (True, False), (False, False)])
@torch.no_grad()
def test_attention_that_is_not_causal_stays_so(module_causal, call_causal):
    """An encoder's module (is_causal False) or a call's is_causal=False, no mask: every query
    sees every key, as SDPA computes it."""
    module = torch.nn.Module()
    module.is_causal = module_causal
    q, k, v = torch.randn(2, 4, 200, 64).double(), torch.randn(2, 2, 230, 64).double(), torch.randn(2, 2, 230, 64).double()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)).transpose(1, 2)
    cosa_hf.register(budget=1.0, delta=0.0)
    kwargs = {} if call_causal is None else {"is_causal": call_causal}
    o, _ = cosa_hf.cosa_attention_forward(module, q, k, v, None, scaling=64 ** -0.5, **kwargs)
    assert module.cosa_plan.causal is False, "the step ran through CoSA"
    torch.testing.assert_close(o, expected, rtol=1e-9, atol=1e-9)


@torch.no_grad()
def test_a_head_dim_cosa_lacks_runs_dense_sdpa():
    torch.manual_seed(torch.seed() % 2**31)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      attn_implementation="sdpa")
    model = float64_norms(transformers.LlamaForCausalLM(config).eval().double())
    ids = torch.randint(512, (1, 300))
    dense = model(ids).logits
    cosa_hf.register(budget=0.25, delta=0.05)
    model.set_attn_implementation("cosa")
    torch.testing.assert_close(model(ids).logits, dense, rtol=1e-9, atol=1e-9)
    assert not hasattr(model.model.layers[0].self_attn, "cosa_plan"), "no layer planned CoSA"


def test_register_checks_its_options_before_any_forward():
    cosa_hf.register(budget=0.5, delta=0.1)
    for options, error, match in (({"budget": 2.0}, ValueError, r"budget must be in \(0, 1\], got 2"),
                                  ({"proxy": "none"}, ValueError, "proxy must be one of"),
                                  ({"causal": False}, TypeError, r"register: causal cannot be set for every layer")):
        with pytest.raises(error, match=match):
            cosa_hf.register(**options)
    assert cosa_hf._options == {"budget": 0.5, "delta": 0.1}, "a refused call keeps the options"


@torch.no_grad()
def test_attention_sinks_raise():
    """gpt-oss passes its per-head sink logits as s_aux; dropping them would change every output."""
    config = transformers.GptOssConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(config).eval()
    cosa_hf.register(budget=1.0, delta=0.0)
    model.set_attn_implementation("cosa")
    with pytest.raises(NotImplementedError, match="attention sinks"):
        model(torch.randint(512, (1, 300)))


def _planned(model) -> bool:
    return any(hasattr(module, "cosa_plan") for module in model.modules())


@pytest.mark.parametrize("family", ["falcon_alibi", "t5_encoder"])
@torch.no_grad()
def test_a_bias_on_the_logits_runs_dense(family):
    """Falcon's ALiBi goes onto the causal mask (transformers asks for one: allow_is_causal_skip
    False), T5's relative-position bias comes as position_bias: both change every logit, so the
    step runs SDPA, and equals it."""
    seed = torch.seed() % 2**31
    print(f"seed={seed}")
    torch.manual_seed(seed)
    if family == "falcon_alibi":
        config = transformers.FalconConfig(vocab_size=512, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                                           alibi=True, new_decoder_architecture=False, multi_query=False,
                                           attn_implementation="sdpa")
        model, output = transformers.FalconForCausalLM(config), "logits"
    else:
        config = transformers.T5Config(vocab_size=512, d_model=128, d_kv=64, num_heads=2, num_layers=1, d_ff=256,
                                       attn_implementation="sdpa")
        model, output = transformers.T5EncoderModel(config), "last_hidden_state"
    model = model.eval().double()
    ids = torch.randint(512, (1, 300))
    dense = getattr(model(ids), output)
    cosa_hf.register(budget=0.25, delta=0.05)
    model.set_attn_implementation("cosa")
    torch.testing.assert_close(getattr(model(ids), output), dense, rtol=1e-9, atol=1e-9)
    assert not _planned(model), "no layer planned CoSA"


@torch.no_grad()
def test_a_module_called_with_another_scale_plans_again():
    module = torch.nn.Module()
    q = torch.randn(1, 4, 200, 64, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 200, 64, dtype=torch.float64)
    cosa_hf.register(budget=1.0, delta=0.0)
    for scaling in (0.125, 0.5):
        o, _ = cosa_hf.cosa_attention_forward(module, q, k, v, None, scaling=scaling)
        assert module.cosa_plan.sm_scale == scaling
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=scaling).transpose(1, 2)
        torch.testing.assert_close(o, expected, rtol=1e-9, atol=1e-9)
