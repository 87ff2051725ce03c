"""The accuracy studies. Each returns a list of flat records (one per layer/cell and setting).

- :func:`captured_attention_study`: on real Q/K/V of every layer, per budget and
  proxy the IoU of the stage-1 mask with the oracle top-K mask and its mass
  recall (the ``oracle`` proxy's recall is the ceiling at that budget); for KAP
  per delta the output error, the mass recall of the computed blocks and both
  densities; the visiting-order ablation; FlexPrefill's cumulative threshold at
  the budget it picks.
- :func:`needle_study`: pass-key retrieval with the model's prefill through CoSA.
- :func:`long_context_study`: structured 32K-128K inputs with a planted far needle.
"""

from __future__ import annotations

import math

import torch

from .. import _C
from ..api import Plan, plan, run
from ..blocks import num_blocks
from ..paged import to_pages, uniform_page_table
from ..proxy import PROXIES, cumulative_threshold_counts, is_forced, proxy_order
from ..proxy.flexprefill import flexprefill_scores
from ..proxy.oracle import attention_block_mass
from ..reference import dense_attention, ordered_skip_attention
from ..synthetic import structured_qkv
from .metrics import iou, mass_recall, order_to_mask, relative_error, top_k_mask

ORDERINGS = ("descending", "ascending", "random")


def _contiguous_plan(q, k, **options):
    """The plan for one request's contiguous ``q``, ``k`` laid out by ``to_pages(x, 128)``."""
    return plan(*uniform_page_table(1, q.shape[0], k.shape[0], 128, q.device), q.shape[1], k.shape[1],
                q.shape[2], 128, q_data_type=q.dtype, **options)


def reorder_scored_blocks(order: torch.Tensor, plan_: Plan, ordering: str,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """``order``, ``plan_``'s order mask, with its forced prefix kept and the scored blocks
    after it in ``ordering``: ``descending`` (as listed), ``ascending`` (reversed) or ``random``."""
    if ordering == "descending":
        return order
    selected = plan_.qtiles[:, _C.QT_NUM_SELECTED, None, None].long()
    forced = is_forced(plan_.qtiles, num_blocks(max(plan_.kv_lens_host, default=0)), force_local=plan_.force_local,
                       force_sink=plan_.force_sink)
    forced = forced.sum(-1)[:, None, None].clamp(max=selected)
    position = torch.arange(order.shape[-1], device=order.device).expand(order.shape)
    scored = (position >= forced) & (position < selected)
    if ordering == "ascending":
        key = torch.where(scored, forced + selected - 1 - position, position).double()
    else:
        noise = torch.rand(order.shape, generator=generator, dtype=torch.float64).to(order.device)
        key = torch.where(scored, forced + noise * (selected - forced), position.double())
    return order.gather(-1, key.argsort(-1))


def _per_head(**values):
    return {name: [round(float(x), 6) for x in value] for name, value in values.items()}


@torch.no_grad()
def captured_attention_study(layers, budgets, deltas, *, proxies=tuple(PROXIES), ordering_deltas=(0.05,),
                             ordering_budgets=(0.25,), gammas=(0.9, 0.95), seed=0, progress=print):
    """``layers``: ``(layer index, (q, k, v))`` with ``q [n, hq, d]``, ``k, v [n, hkv, d]`` post-RoPE."""
    records = []
    generator = torch.Generator().manual_seed(seed)
    for layer, (q, k, v) in layers:
        sm_scale = q.shape[-1] ** -0.5
        mass = attention_block_mass(q, k, causal=True, sm_scale=sm_scale)
        dense = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=sm_scale, enable_gqa=True).transpose(0, 1)
        kv_blocks = mass.shape[-1]
        base = {"layer": layer}
        for budget in budgets:
            plan_ = _contiguous_plan(q, k, budget=budget)
            candidates = plan_.qtiles[:, _C.QT_NUM_CANDIDATES].double()
            for proxy in proxies:
                order = torch.empty_like(plan_.order)
                proxy_order(q, k, plan_.qtiles, order, force_local=plan_.force_local,
                            force_sink=plan_.force_sink, proxy=proxy, sm_scale=sm_scale)
                selected = order_to_mask(order, kv_blocks)
                oracle = top_k_mask(mass, selected.sum(-1))
                records.append({"study": "proxy", **base, "budget": budget, "proxy": proxy,
                                **_per_head(iou=iou(selected, oracle), recall_stage1=mass_recall(mass, selected))})
                if proxy != "kap":
                    continue
                for ordering in ORDERINGS:
                    if ordering != "descending" and budget not in ordering_budgets:
                        continue
                    visit_order = reorder_scored_blocks(order, plan_, ordering, generator)
                    # the ablation compares orders at equal delta, so descending runs its deltas too
                    ablation_deltas = ordering_deltas if budget in ordering_budgets else ()
                    for delta in sorted({*deltas, *ablation_deltas}) if ordering == "descending" else ablation_deltas:
                        visited = torch.zeros(order.shape, dtype=torch.bool, device=order.device)
                        o, _, computed, skipped = ordered_skip_attention(
                            q, k, v, visit_order, causal=True, sm_scale=sm_scale, delta=delta, visited=visited)
                        records.append({
                            "study": "fidelity" if ordering == "descending" else "ordering", **base,
                            "budget": budget, "delta": delta, "ordering": ordering, **_per_head(
                                error=relative_error(o, dense),
                                recall=mass_recall(mass, order_to_mask(visit_order, kv_blocks, visited)),
                                density_stage1=selected.sum(-1).double().sum(0) / candidates.sum(),
                                density_stage2=computed.double().sum(0) / candidates.sum(),
                                skip_rate=skipped.double().sum(0) / (computed + skipped).double().sum(0))})
        probabilities = flexprefill_scores(q, k, plan_.qtiles, causal=True, sm_scale=sm_scale).transpose(0, 1)
        for gamma in gammas:
            counts = cumulative_threshold_counts(probabilities, gamma)
            chosen = top_k_mask(probabilities, counts)
            records.append({"study": "flexprefill_threshold", **base, "gamma": gamma, **_per_head(
                density=counts.double().sum(0) / candidates.sum(),
                iou=iou(chosen, top_k_mask(mass, counts)), recall_stage1=mass_recall(mass, chosen))})
        progress(f"layer {layer} done")
    return records


@torch.no_grad()
def needle_study(model, tokenizer, lengths, depths, plan_options, *, seed=0, max_new_tokens=8, progress=print):
    """Per (length, depth): does greedy decoding after a CoSA prefill find the pass key, as dense does?"""
    from ..integrations import transformers as cosa_hf
    from .data import passkey_prompt, passkeys
    cosa_hf.register(**plan_options)
    keys = passkeys(seed)
    records = []
    for length in lengths:
        for depth in depths:
            passkey = next(keys)
            ids = passkey_prompt(tokenizer, length, depth, passkey).to(model.device)
            found = {}
            for name in ("sdpa", cosa_hf.NAME):
                with cosa_hf.attention_implementation(model, name):
                    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=max_new_tokens, do_sample=False)
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                found[name] = (str(passkey) in answer, answer.strip())
            density = [layer.self_attn.cosa_plan.stats() for layer in model.model.layers]
            records.append({"study": "needle", "length": ids.shape[1], "depth": depth, "passkey": passkey,
                            "dense_found": found["sdpa"][0], "cosa_found": found[cosa_hf.NAME][0],
                            "dense_answer": found["sdpa"][1], "cosa_answer": found[cosa_hf.NAME][1],
                            "density_stage1": sum(s.density_stage1 for s in density) / len(density),
                            "density_stage2": sum(s.density_stage2 for s in density) / len(density),
                            **{f"{key}_plan": value for key, value in plan_options.items()}})
            progress(f"needle {records[-1]}")
    return records


@torch.no_grad()
def long_context_study(lengths, plan_options, *, heads=(32, 8), head_dim=128, needle_distance=0.9,
                       needle_tokens=(1, 32), checked_rows=128, seed=0, device=None, progress=print):
    """Structured inputs (RoPE, sinks, local windows, topics) with a needle planted far back:
    ``needle_tokens`` keys (one token, or a sentence) that the last ``checked_rows`` queries
    match strongly, holding a distinctive value. Records how much of the needle's value each
    output keeps, CoSA against dense."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(seed)
    num_qo_heads, num_kv_heads = heads
    group = num_qo_heads // num_kv_heads
    records = []
    for length in lengths:
        for tokens in needle_tokens:
            q, k, v = structured_qkv(length, num_qo_heads, num_kv_heads, head_dim, generator=generator)
            needle = slice(int(length * (1 - needle_distance)), int(length * (1 - needle_distance)) + tokens)
            direction = torch.randn(num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
            direction = direction / direction.norm(dim=-1, keepdim=True)
            value = torch.randn(num_kv_heads, head_dim, generator=generator, dtype=torch.float64)
            gain = math.sqrt(30.0 * math.sqrt(head_dim))                 # ~30 nats above the rest
            k[needle] = (gain * direction).float()
            v[needle] = value.float()
            q[-checked_rows:] += (gain * direction).repeat_interleave(group, 0).float()
            q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
            plan_ = _contiguous_plan(q, k, **plan_options)
            o = run(plan_, q, (to_pages(k, 128), to_pages(v, 128)))[-checked_rows:]
            dense, _ = dense_attention(q[-checked_rows:], k, v, causal=True, sm_scale=head_dim ** -0.5)
            needle_value = value.to(device).float().repeat_interleave(group, 0)[None]
            kept = lambda out: torch.nn.functional.cosine_similarity(out.float(), needle_value, dim=-1)  # noqa: E731
            stats = plan_.stats()
            records.append({"study": "long_context", "length": length, "needle_tokens": tokens,
                            "needle_at": needle.start, "device": device.type,
                            "kernel": plan_.uses_kernel,
                            "cosine_cosa": round(float(kept(o).mean()), 4),
                            "cosine_dense": round(float(kept(dense).mean()), 4),
                            "error": round(float(relative_error(o, dense).mean()), 6),
                            "density_stage1": stats.density_stage1, "density_stage2": stats.density_stage2,
                            **plan_options})
            progress(f"long context {records[-1]}")
    return records
