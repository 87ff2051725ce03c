"""cosa.plan / cosa.run / CoSAPrefillWrapper: behaviour and every argument check."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import sys

import numpy as np
import pytest
import torch

import cosa
import cosa.cute_kernels
import oracle
from batch import fresh_generator, make_batch
from cosa import api

HQ, HKV, D, PAGE = 4, 2, 64, 16


@pytest.fixture
def batch():
    return make_batch([100, 40], [300, 40], HQ, HKV, D, PAGE, dtype=torch.bfloat16,
                      generator=fresh_generator())


def plan_args(batch):
    return [*batch.page_table(), HQ, HKV, D, PAGE]


def test_wrapper_matches_functions_and_fills_the_workspace(batch):
    workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    wrapper = cosa.CoSAPrefillWrapper(workspace, kv_layout="NHD")
    wrapper.plan(*plan_args(batch), budget=0.5, delta=0.05)
    o_wrapper, lse_wrapper = wrapper.run(batch.q, batch.cache, return_lse=True)
    assert workspace.any(), "the order mask lives in the workspace"
    plan = cosa.plan(*plan_args(batch), budget=0.5, delta=0.05)
    o, lse = cosa.run(plan, batch.q, batch.cache, return_lse=True)
    torch.testing.assert_close(o_wrapper, o, rtol=0, atol=0)
    torch.testing.assert_close(lse_wrapper, lse, rtol=0, atol=0)
    assert wrapper.stats().computed.tolist() == plan.stats().computed.tolist()
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_stats_count_blocks_per_head_and_tile(batch):
    plan = cosa.plan(*plan_args(batch), budget=0.5, delta=0.5)
    cosa.run(plan, batch.q, batch.cache)
    stats = plan.stats()
    before = stats.computed.tolist()
    assert stats.computed.shape == stats.skipped.shape == (plan.num_qtiles, HQ)
    assert (stats.computed >= 1).all(), "the first visited block is always computed"
    assert ((stats.computed + stats.skipped) == stats.selected[:, None]).all()
    assert ((stats.computed_per_head + stats.skipped_per_head) == stats.selected.sum()).all()
    assert 0 < stats.density_stage2 <= stats.density_stage1 <= 1
    skip_all = dataclasses.replace(plan, delta=1e30)
    cosa.run(skip_all, batch.q, batch.cache)
    assert (skip_all.stats().computed == 1).all(), "all but the first visited block skipped"
    assert stats.computed.tolist() == before, "a Stats is a copy, untouched by later runs"


CUDA = torch.device("cuda", 1)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_a_gpu_other_than_hopper_gets_the_reference_with_a_warning(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    sm = "sm_%d%d" % capability
    with pytest.warns(UserWarning, match=rf"needs a Hopper GPU \(sm_90\); cuda:1 is {sm}, so run uses"):
        assert api.osk_launcher(CUDA, D, torch.bfloat16, torch.bfloat16) is None
    assert api.kap_launcher(CUDA, "kap", D, torch.bfloat16, torch.bfloat16, 64) is None


def test_hopper_gets_the_kernels(monkeypatch):
    from cosa.cute_kernels import kap, osk
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: api.HOPPER)
    assert api.osk_launcher(CUDA, D, torch.bfloat16, torch.bfloat16) is osk.Launcher
    assert api.kap_launcher(CUDA, "kap", D, torch.bfloat16, torch.bfloat16, 64) is kap.Launcher


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16)])
def test_hopper_with_dtypes_the_kernel_lacks_gets_the_reference_with_a_warning(monkeypatch, q_dtype, kv_dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: api.HOPPER)
    with pytest.warns(UserWarning, match=rf"not q_data_type={q_dtype}, kv_data_type={kv_dtype}; run uses the exact"):
        assert api.osk_launcher(CUDA, D, q_dtype, kv_dtype) is None
    assert api.kap_launcher(CUDA, "kap", D, q_dtype, kv_dtype, 64) is None


def test_without_the_cute_dsl_the_reference_runs_with_a_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: api.HOPPER)
    for name in ("osk", "kap"):   # as if the DSL were missing: importing the kernels fails
        monkeypatch.delattr(cosa.cute_kernels, name, raising=False)
        monkeypatch.setitem(sys.modules, f"cosa.cute_kernels.{name}", None)
    with pytest.warns(UserWarning, match="the OSK kernel is unavailable .*; run uses the exact reference"):
        assert api.osk_launcher(CUDA, D, torch.bfloat16, torch.bfloat16) is None
    assert api.kap_launcher(CUDA, "kap", D, torch.bfloat16, torch.bfloat16, 64) is None


@pytest.mark.gpu
def test_plan_on_a_gpu_other_than_hopper_runs_the_reference(batch, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.warns(UserWarning, match="needs a Hopper GPU"):
        plan = cosa.plan(*(x.cuda() for x in plan_args(batch)[:4]), *plan_args(batch)[4:],
                         budget=1.0, delta=0.0)
    assert plan.kernel is None and plan.rank_kernel is None
    o = cosa.run(plan, batch.q.cuda(), batch.cache_on("cuda")).cpu().double()
    for r, (q, k, v) in enumerate(batch.requests):
        expected, _ = oracle.dense(q, k, v, q.shape[0], k.shape[0], True, plan.sm_scale)
        rows = slice(plan.qo_indptr_host[r], plan.qo_indptr_host[r + 1])
        # relative to the whole output, as the kernel tests check it: bf16's rounding is ~1e-3
        assert float((o[rows] - expected).norm()) <= 1e-2 * float(expected.norm()), f"request {r}"


def test_empty_batch_runs():
    batch = make_batch([0, 0], [0, 5], HQ, HKV, D, PAGE)
    plan = cosa.plan(*plan_args(batch), q_data_type=torch.float64)
    o = cosa.run(plan, batch.q, batch.cache)
    assert o.shape == (0, HQ, D) and plan.k_max == 0


def expect(error, match):
    return pytest.raises(error, match=match)


def test_run_before_plan_raises(batch):
    wrapper = cosa.CoSAPrefillWrapper(torch.empty(1024, dtype=torch.uint8))
    with expect(RuntimeError, "CoSAPrefillWrapper.run called before plan"):
        wrapper.run(batch.q, batch.cache)
    with expect(RuntimeError, "CoSAPrefillWrapper.stats called before plan"):
        wrapper.stats()


def test_stats_before_a_run_raise_instead_of_reading_the_workspace(batch):
    workspace = torch.full((1 << 16,), 7, dtype=torch.uint8)   # stale bytes, as a reused workspace holds
    wrapper = cosa.CoSAPrefillWrapper(workspace)
    wrapper.plan(*plan_args(batch), budget=0.5)
    with expect(RuntimeError, "no run has written the counts"):
        wrapper.stats()
    wrapper.run(batch.q, batch.cache)
    assert (wrapper.stats().computed >= 1).all()
    other = cosa.plan(*plan_args(batch), budget=0.5, workspace=workspace)   # the same bytes again
    with expect(RuntimeError, "no run has written the counts since this plan was made"):
        other.stats()


def test_only_the_last_plan_to_write_a_shared_workspace_has_stats(batch):
    # plans of other shapes on one workspace: each runs correctly, but the buffers hold the
    # numbers of the last one made or run, which the others must not read as theirs
    workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    first = cosa.plan(*plan_args(batch), budget=0.5, workspace=workspace)
    second = cosa.plan(*plan_args(batch), budget=1.0, causal=False, workspace=workspace)
    superseded = "another plan on the same workspace was made, run or ranked with order_mask since this plan's"
    dense = cosa.run(second, batch.q, batch.cache)
    with expect(RuntimeError, superseded):
        first.stats()
    assert second.stats().density_stage2 == 1.0
    sparse = cosa.run(first, batch.q, batch.cache)
    assert (first.stats().computed >= 1).all()
    with expect(RuntimeError, superseded):
        second.stats()
    cosa.order_mask(second, batch.q, batch.cache)  # second's order mask may lie on first's counts
    for superseded_plan in (first, second):
        with expect(RuntimeError, superseded):
            superseded_plan.stats()
    cosa.order_mask(first, batch.q, batch.cache)   # a plan's own order mask leaves its counts alone
    with expect(RuntimeError, superseded):
        first.stats()
    cosa.run(first, batch.q, batch.cache)
    counts = first.stats().computed
    cosa.order_mask(first, batch.q, batch.cache)
    assert torch.equal(first.stats().computed, counts)
    private = cosa.plan(*plan_args(batch), budget=0.5)  # no workspace: its own buffers
    torch.testing.assert_close(cosa.run(private, batch.q, batch.cache), sparse, rtol=0, atol=0)
    cosa.run(first, batch.q, batch.cache)
    assert first.stats().computed.tolist() == private.stats().computed.tolist()
    assert not torch.equal(dense, sparse)
    pool = torch.zeros(2 << 16, dtype=torch.uint8)  # two workspaces in one allocation: apart
    halves = [cosa.plan(*plan_args(batch), budget=0.5, workspace=part) for part in (pool[:1 << 16], pool[1 << 16:])]
    for half in halves:
        cosa.run(half, batch.q, batch.cache)
    assert all((half.stats().computed >= 1).all() for half in halves)
    # a slice over the first half's unused end and into the second's buffers: only the second's go
    straddling = cosa.plan(*plan_args(batch), budget=1.0, workspace=pool[(1 << 16) - 512:])
    cosa.run(straddling, batch.q, batch.cache)
    assert straddling.stats().density_stage1 == 1.0
    assert (halves[0].stats().computed >= 1).all()
    with expect(RuntimeError, superseded):
        halves[1].stats()


def test_a_dead_plan_leaves_no_workspace_entry(batch):
    # plans on workspaces of their own, each dropped after its run: run scans only live plans'
    import gc
    before = len(api._workspace_counts.get("cpu", ()))
    for _ in range(20):
        cosa.run(cosa.plan(*plan_args(batch), workspace=torch.zeros(1 << 16, dtype=torch.uint8)), batch.q,
                 batch.cache)
    gc.collect()
    assert len(api._workspace_counts.get("cpu", ())) <= before
    kept = cosa.plan(*plan_args(batch), workspace=torch.zeros(1 << 16, dtype=torch.uint8))
    cosa.run(kept, batch.q, batch.cache)
    assert (kept.stats().computed >= 1).all()


def test_a_run_that_fails_part_way_leaves_no_plan_its_bytes(monkeypatch):
    # the second plan's order mask covers the first's counts; its run fails after writing it
    batch = make_batch([600, 600], [2000, 2000], HQ, HKV, D, PAGE, dtype=torch.bfloat16,
                       generator=fresh_generator())
    workspace = torch.zeros(1 << 18, dtype=torch.uint8)
    first = cosa.plan(*plan_args(batch), budget=0.1, workspace=workspace)
    cosa.run(first, batch.q, batch.cache)
    second = cosa.plan(*plan_args(batch), budget=1.0, causal=False, workspace=workspace)
    assert second.order.data_ptr() <= first.computed.data_ptr() < second.order.data_ptr() + second.order.nbytes
    cosa.run(first, batch.q, batch.cache)
    assert (first.stats().computed >= 1).all()

    def fail(*args, **kwargs):
        raise MemoryError("out of memory, say")
    monkeypatch.setattr(api, "ordered_skip_attention", fail)
    with pytest.raises(MemoryError):
        cosa.run(second, batch.q, batch.cache)
    for plan in (first, second):
        with expect(RuntimeError, "another plan on the same workspace was made, run or ranked"):
            plan.stats()


@pytest.mark.parametrize("copy_plan", [copy.copy, copy.deepcopy, lambda plan: pickle.loads(pickle.dumps(plan))],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_copied_plan_is_the_same_plan_with_buffers_of_its_own(copy_plan):
    # an empty request and one of a single token too: their last pages are rebuilt from the plan
    batch = make_batch([100, 0, 40, 1], [300, 0, 40, 129], HQ, HKV, D, PAGE, dtype=torch.bfloat16,
                       generator=fresh_generator())
    workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    original = dataclasses.replace(cosa.plan(*plan_args(batch), budget=0.5, force_sink=False, workspace=workspace),
                                   delta=0.3)
    expected = cosa.run(original, batch.q, batch.cache)
    counts = original.stats().computed.clone()
    copied = copy_plan(original)
    assert copied.workspace_bytes is None
    for field in dataclasses.fields(api.Plan):
        mine, theirs = getattr(copied, field.name), getattr(original, field.name)
        if not isinstance(theirs, torch.Tensor):
            if field.name not in ("kernel", "rank_kernel", "workspace_bytes", "token"):
                assert mine == theirs, field.name
        elif theirs.numel():
            assert mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr(), field.name
            if field.name not in ("order", "computed", "skipped", "lse", "qbar", "kbar"):   # run's buffers
                assert torch.equal(mine, theirs), field.name
    torch.testing.assert_close(cosa.run(copied, batch.q, batch.cache), expected, rtol=0, atol=0)
    assert torch.equal(copied.stats().computed, counts)
    assert torch.equal(original.stats().computed, counts)   # still its own


def test_the_plan_keeps_the_page_table_it_was_given(batch):
    kv_indices = batch.kv_indices.clone()
    plan = cosa.plan(batch.qo_indptr, batch.kv_indptr, kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     q_data_type=torch.bfloat16)
    before = cosa.run(plan, batch.q, batch.cache)
    kv_indices.copy_(kv_indices.flip(0))   # the caller reuses its buffer for another batch
    torch.testing.assert_close(cosa.run(plan, batch.q, batch.cache), before, rtol=0, atol=0)


def test_a_workspace_slice_at_any_offset_gives_aligned_buffers(batch):
    workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    plan = cosa.plan(*plan_args(batch), budget=0.5, workspace=workspace[3:], q_data_type=torch.bfloat16)
    for buffer in (plan.order, plan.computed, plan.skipped, plan.lse, plan.qbar, plan.kbar):
        assert buffer.data_ptr() % api._ALIGN == 0
    reference_plan = cosa.plan(*plan_args(batch), budget=0.5, q_data_type=torch.bfloat16)
    torch.testing.assert_close(cosa.run(plan, batch.q, batch.cache), cosa.run(reference_plan, batch.q, batch.cache),
                               rtol=0, atol=0)


def test_workspace_checks(batch):
    with expect(TypeError, "workspace"):
        cosa.CoSAPrefillWrapper([0] * 10)
    with expect(TypeError, "workspace must be a uint8 tensor, got torch.float32"):
        cosa.CoSAPrefillWrapper(torch.empty(10, dtype=torch.float32))
    with expect(ValueError, r"workspace must be a contiguous 1-D tensor, got shape \(2, 8\)"):
        cosa.CoSAPrefillWrapper(torch.empty(2, 8, dtype=torch.uint8))
    with expect(ValueError, r"got shape \(8,\) and strides \(2,\)"):
        cosa.CoSAPrefillWrapper(torch.empty(16, dtype=torch.uint8)[::2])
    wrapper = cosa.CoSAPrefillWrapper(torch.empty(16, dtype=torch.uint8))
    with expect(ValueError, "workspace"):
        wrapper.plan(*plan_args(batch))
    with expect(ValueError, "kv_layout"):
        cosa.CoSAPrefillWrapper(torch.empty(16, dtype=torch.uint8), kv_layout="NDH")


@pytest.mark.parametrize("position,name", [(0, "qo_indptr"), (1, "kv_indptr"), (2, "kv_indices"),
                                           (3, "kv_last_page_len")])
def test_index_tensors_must_be_int32_1d_tensors(batch, position, name):
    args = plan_args(batch)
    args[position] = args[position].long()
    with expect(TypeError, name):
        cosa.plan(*args)
    args[position] = plan_args(batch)[position].tolist()
    with expect(TypeError, name):
        cosa.plan(*args)
    args[position] = plan_args(batch)[position][None]
    with expect(ValueError, name):
        cosa.plan(*args)
    args[position] = plan_args(batch)[position].to("meta")
    with expect(ValueError, name):
        cosa.plan(*args)


def corrupt(batch, name, values):
    args = plan_args(batch)
    position = ["qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"].index(name)
    args[position] = torch.tensor(values, dtype=torch.int32)
    return args


def test_page_table_content_checks(batch):
    pages = batch.kv_indptr.tolist()
    with expect(ValueError, "kv_indptr"):
        cosa.plan(*corrupt(batch, "kv_indptr", [0, pages[2], pages[1]]))
    with expect(ValueError, "qo_indptr"):
        cosa.plan(*corrupt(batch, "qo_indptr", [0, 120, 100]))
    with expect(ValueError, r"kv_indices\[0\]=-1 is negative; page ids are >= 0"):
        cosa.plan(*corrupt(batch, "kv_indices", [-1] + batch.kv_indices.tolist()[1:]))
    with expect(ValueError, "kv_last_page_len"):
        cosa.plan(*corrupt(batch, "kv_last_page_len", [PAGE + 1, 8]))
    with expect(ValueError, "kv_last_page_len"):
        cosa.plan(*corrupt(batch, "kv_last_page_len", [0, 8]))
    with expect(ValueError, "qo_indptr"):          # 200 causal queries over 40 keys
        cosa.plan(*corrupt(batch, "qo_indptr", [0, 100, 300]))


def test_page_index_beyond_the_cache_is_caught_in_run(batch):
    for page in (batch.kv_indices.tolist()[0] + 1000, 2**31 - 1):   # the plan takes any int32 id
        args = corrupt(batch, "kv_indices", [page] + batch.kv_indices.tolist()[1:])
        plan = cosa.plan(*args, q_data_type=torch.bfloat16)
        with expect(ValueError, rf"paged_kv_cache has {batch.cache.shape[0]} pages, but kv_indices refers to "
                                rf"page {page}$"):
            cosa.run(plan, batch.q, batch.cache)


def test_a_cache_must_hold_every_page_the_plan_refers_to(batch):
    plan = cosa.plan(*plan_args(batch))
    needed = int(batch.kv_indices[:int(batch.kv_indptr[-1])].max()) + 1
    whole = cosa.run(plan, batch.q, batch.cache)
    torch.testing.assert_close(cosa.run(plan, batch.q, batch.cache[:needed]), whole, rtol=0, atol=0)
    with expect(ValueError, f"paged_kv_cache has {needed - 1} pages, but kv_indices refers to page {needed - 1}"):
        cosa.run(plan, batch.q, batch.cache[:needed - 1])


def test_scalar_checks(batch):
    args = plan_args(batch)
    with expect(ValueError, "num_kv_heads must be positive and divide num_qo_heads=6"):
        cosa.plan(*args[:4], 6, 4, D, PAGE)
    with expect(ValueError, "num_kv_heads"):
        cosa.plan(*args[:4], 4, 0, D, PAGE)
    with expect(TypeError, "num_qo_heads"):
        cosa.plan(*args[:4], 4.0, 2, D, PAGE)
    with expect(TypeError, "num_qo_heads must be an int, got bool"):
        cosa.plan(*args[:4], True, 1, D, PAGE)
    with expect(ValueError, "num_qo_heads must be <= 2147483647, got 1180591620717411303424"):
        cosa.plan(*args[:4], 2**70, 2, D, PAGE)
    assert type(cosa.plan(*args[:4], np.int64(4), np.int32(2), D, PAGE).num_qo_heads) is int  # kept as ints
    with expect(ValueError, "head_dim"):
        cosa.plan(*args[:6], 96, PAGE)
    with expect(TypeError, "head_dim must be an int, got float"):
        cosa.plan(*args[:6], 64.0, PAGE)
    with expect(ValueError, "page_size"):
        cosa.plan(*args[:7], 24)
    with expect(TypeError, "page_size must be an int, got float"):
        cosa.plan(*args[:7], 16.0)
    with expect(TypeError, "budget must be a float, got str"):
        cosa.plan(*args, budget="0.25")
    with expect(ValueError, "budget"):
        cosa.plan(*args, budget=0.0)
    with expect(ValueError, "budget"):
        cosa.plan(*args, budget=1.5)
    with expect(ValueError, "delta"):
        cosa.plan(*args, delta=-0.1)
    with expect(ValueError, "delta must be a finite float >= 0, got inf"):
        cosa.plan(*args, delta=math.inf)
    with expect(TypeError, "delta must be a float, got str"):
        cosa.plan(*args, delta="0.1")
    for name in ("budget", "delta", "sm_scale"):   # ints no float holds
        with expect(ValueError, f"{name} is beyond a float's range: an int of 1329 bits"):
            cosa.plan(*args, **{name: 10**400})
    assert cosa.plan(*args, delta=np.float32(0.5), sm_scale=np.float64(0.25)).delta == 0.5  # numpy scalars are floats
    with expect(ValueError, "sm_scale"):
        cosa.plan(*args, sm_scale=0.0)
    with expect(ValueError, r"sm_scale must be in \(0, 2.359e\+38\] \(float32 logits\), got 1e\+39"):
        cosa.plan(*args, sm_scale=1e39)
    with expect(TypeError, "sm_scale must be a float, got str"):
        cosa.plan(*args, sm_scale="0.1")
    for flag in ("causal", "force_local", "force_sink"):
        with expect(TypeError, f"{flag} must be a bool, got str"):
            cosa.plan(*args, **{flag: "no"})
        assert getattr(cosa.plan(*args, **{flag: np.bool_(False)}), flag) is False   # numpy's bools are bools
    with expect(TypeError, "q_data_type"):
        cosa.plan(*args, q_data_type=torch.int8)
    with expect(TypeError, "kv_data_type must be one of"):
        cosa.plan(*args, kv_data_type=torch.int8)
    with expect(ValueError, "kv_layout"):
        cosa.plan(*args, kv_layout="nhd")


def test_run_argument_checks(batch):
    plan = cosa.plan(*plan_args(batch), q_data_type=torch.bfloat16)
    with expect(TypeError, "plan"):
        cosa.run("plan", batch.q, batch.cache)
    with expect(TypeError, "return_lse must be a bool, got str"):
        cosa.run(plan, batch.q, batch.cache, return_lse="no")
    with expect(TypeError, "q must be a torch.Tensor, got list"):
        cosa.run(plan, batch.q.tolist(), batch.cache)
    with expect(TypeError, "q is torch.float32, but the plan was made for q_data_type=torch.bfloat16"):
        cosa.run(plan, batch.q.float(), batch.cache)
    with expect(ValueError, "q must have shape"):
        cosa.run(plan, batch.q[:-1], batch.cache)
    with expect(ValueError, "q is on"):
        cosa.run(plan, batch.q.to("meta"), batch.cache)
    with expect(TypeError, "paged_kv_cache"):
        cosa.run(plan, batch.q, batch.cache.float())
    with expect(ValueError, "paged_kv_cache"):
        cosa.run(plan, batch.q, batch.cache[:, :1])
    with expect(ValueError, "paged_kv_cache"):
        cosa.run(plan, batch.q, (batch.cache[:, 0], batch.cache[:, 1, :, :1]))
    with expect(TypeError, "paged_kv_cache"):
        cosa.run(plan, batch.q, "cache")
    with expect(ValueError, "paged_kv_cache is on meta, but the plan is on cpu"):
        cosa.run(plan, batch.q, batch.cache.to("meta"))
    k, v = batch.cache[:, 0], batch.cache[:, 1]
    with expect(TypeError, r"a \(k_cache, v_cache\) tuple of tensors"):
        cosa.run(plan, batch.q, (k, "v_cache"))
    with expect(TypeError, r"a \(k_cache, v_cache\) tuple of tensors"):
        cosa.run(plan, batch.q, (k, v, v))
    with expect(ValueError, "k_cache must be 4-D"):
        cosa.run(plan, batch.q, (k[0], v[0]))
    with expect(ValueError, "k_cache and v_cache differ in dtype or device"):
        cosa.run(plan, batch.q, (k, v.half()))
    with expect(ValueError, "k_cache and v_cache differ in dtype or device"):
        cosa.run(plan, batch.q, (k, v.to("meta")))
    with expect(ValueError, "the head_dim axis must be contiguous"):
        cosa.run(plan, batch.q, batch.cache.transpose(-1, -2).contiguous().transpose(-1, -2))
    with expect(ValueError, "page_size"):        # an HND cache read as NHD
        cosa.run(plan, batch.q, batch.cache.transpose(2, 3))
    # a cache of other kv heads or head_dim would read as finite, wrong attention
    with expect(ValueError, f"paged_kv_cache has num_kv_heads={2 * HKV} .* the plan has num_kv_heads={HKV}"):
        cosa.run(plan, batch.q, torch.cat([batch.cache, batch.cache], 3))
    with expect(ValueError, f"paged_kv_cache has head_dim={D // 2} .* the plan has head_dim={D}"):
        cosa.run(plan, batch.q, batch.cache[..., :D // 2].contiguous())
    for bad_out in (torch.empty_like(batch.q[:-1]), batch.q.tolist(), torch.empty_like(batch.q, device="meta")):
        with expect(ValueError, "out must be a tensor like q"):
            cosa.run(plan, batch.q, batch.cache, out=bad_out)
    for bad_lse in (batch.q[..., 0].float().tolist(), torch.empty(batch.q.shape[:2], device="meta")):
        with expect(ValueError, "lse must be a float32 tensor of shape"):
            cosa.run(plan, batch.q, batch.cache, lse=bad_lse)
    with expect(ValueError, "lse"):
        cosa.run(plan, batch.q, batch.cache, lse=torch.empty(batch.q.shape[:2], dtype=torch.float64))
    with expect(ValueError, "lse"):
        cosa.run(plan, batch.q, batch.cache, lse=torch.empty(batch.q.shape[:1]))
    with expect(ValueError, "out's elements overlap"):
        cosa.run(plan, batch.q, batch.cache, out=torch.empty_like(batch.q[:1]).expand_as(batch.q))
    with expect(ValueError, "out's elements overlap"):
        cosa.run(plan, batch.q, batch.cache, out=batch.q.new_empty(batch.q.numel()).as_strided(batch.q.shape, (D, D, 1)))
    with expect(ValueError, "lse's elements overlap"):
        cosa.run(plan, batch.q, batch.cache, lse=torch.empty(1, HQ).expand(batch.q.shape[0], HQ))
    # outputs that share memory with an input or each other (the kernels read while they write)
    rows = batch.q.shape[0]
    q_and_more = torch.cat([batch.q, batch.q])
    with expect(ValueError, "out shares memory with q: an output must not overlap another output or an input"):
        cosa.run(plan, q_and_more[:rows], batch.cache, out=q_and_more[rows // 2:rows // 2 + rows])
    with expect(ValueError, "out shares memory with q"):
        cosa.run(plan, batch.q, batch.cache, out=batch.q)
    cache_and_more = torch.cat([batch.cache.flatten(), torch.empty(rows * HQ * D, dtype=batch.cache.dtype)])
    cache, out_start = cache_and_more[:batch.cache.numel()].view(batch.cache.shape), batch.cache.numel() - 1
    with expect(ValueError, "out shares memory with paged_kv_cache's V"):  # the last page's V ends the cache
        cosa.run(plan, batch.q, cache, out=cache_and_more[out_start:out_start + rows * HQ * D].view(batch.q.shape))
    raw = torch.empty(rows * HQ * (2 * D + 4), dtype=torch.uint8)
    out_bytes = rows * HQ * D * 2
    with expect(ValueError, "out shares memory with lse"):
        cosa.run(plan, batch.q, batch.cache, out=raw[:out_bytes].view(batch.q.dtype).view(batch.q.shape),
                 lse=raw[out_bytes - 64:out_bytes - 64 + rows * HQ * 4].view(torch.float32).view(rows, HQ))
    with expect(ValueError, "lse shares memory with plan.lse"):
        cosa.run(plan, batch.q, batch.cache, lse=plan.lse)
    # inputs in the plan's memory: the reference path writes the plan's buffers while it reads them
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    in_workspace = cosa.plan(*plan_args(batch), workspace=workspace)
    q_bytes = batch.q.numel() * batch.q.element_size()
    q_there = workspace[:q_bytes].view(batch.q.dtype).view(batch.q.shape)
    with expect(ValueError, "shares memory with q"):
        cosa.run(in_workspace, q_there, batch.cache)
    cache_there = workspace[:batch.cache.numel() * batch.cache.element_size()].view(batch.cache.dtype)
    with expect(ValueError, "shares memory with paged_kv_cache's K"):
        cosa.run(in_workspace, batch.q, cache_there.view(batch.cache.shape))
    # delta and sm_scale may be replaced on a plan; run checks them as plan does
    with expect(ValueError, "plan.delta must be a finite float >= 0, got nan"):
        cosa.run(dataclasses.replace(plan, delta=math.nan), batch.q, batch.cache)
    with expect(ValueError, r"plan.sm_scale must be in \(0, 2.359e\+38\]"):
        cosa.run(dataclasses.replace(plan, sm_scale=-1.0), batch.q, batch.cache)
    wide = torch.full((batch.q.shape[0], HQ + 1, D), float("nan"), dtype=batch.q.dtype)  # disjoint, not contiguous
    cosa.run(plan, batch.q, batch.cache, out=wide[:, 1:])
    assert not wide[:, 1:].isnan().any() and wide[:, 0].isnan().all()


def test_calibrated_delta_reaches_the_target_density():
    from cosa.calibrate import calibrate_delta
    from cosa.synthetic import structured_qkv
    g = fresh_generator()
    structured = lambda r, q_len, kv_len: structured_qkv(kv_len, HQ, HKV, D, q_len=q_len, generator=g)  # noqa: E731
    batch = make_batch([1024], [1024], HQ, HKV, D, PAGE, dtype=torch.float32, generator=g, qkv=structured)
    plan = cosa.plan(*plan_args(batch), budget=0.5, delta=0.0, q_data_type=torch.float32)
    cosa.run(plan, batch.q, batch.cache)
    target = 0.8 * plan.stats().density_stage2
    delta = calibrate_delta(plan, batch.q, batch.cache, target)
    assert plan.delta == 0.0, "the plan is left as it was"
    tuned = cosa.plan(*plan_args(batch), budget=0.5, delta=delta, q_data_type=torch.float32)
    cosa.run(tuned, batch.q, batch.cache)
    assert tuned.stats().density_stage2 <= target
    looser = cosa.plan(*plan_args(batch), budget=0.5, delta=delta / 1.01, q_data_type=torch.float32)
    cosa.run(looser, batch.q, batch.cache)
    assert looser.stats().density_stage2 > target
    # a target that the smallest delta already meets: that delta, with no bisection
    assert calibrate_delta(plan, batch.q, batch.cache, 1.0, low=1e-6) == 1e-6
    with pytest.raises(ValueError, match="target_density 1e-06 is below the density"):
        calibrate_delta(plan, batch.q, batch.cache, 1e-6)
    with pytest.raises(ValueError, match=r"target_density must be in \(0, 1\], got 0"):
        calibrate_delta(plan, batch.q, batch.cache, 0)
    with pytest.raises(ValueError, match="need 0 < low < high < inf, got low=1.0, high=0.5"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, low=1.0, high=0.5)
    with pytest.raises(ValueError, match="need 0 < low < high < inf, got low=1e-08, high=inf"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, high=math.inf)   # inf is no delta plan takes
    with pytest.raises(TypeError, match="low must be a float, got bool"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, low=True)
    with pytest.raises(ValueError, match="target_density must be a number, got NaN"):
        calibrate_delta(plan, batch.q, batch.cache, math.nan)
    with pytest.raises(TypeError, match="target_density must be a float, got str"):
        calibrate_delta(plan, batch.q, batch.cache, "0.5")
    with pytest.raises(ValueError, match="high must be a number, got NaN"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, high=math.nan)
    with pytest.raises(TypeError, match="high must be a float, got NoneType"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, high=None)
    with pytest.raises(TypeError, match="plan must be a cosa.Plan"):
        calibrate_delta("plan", batch.q, batch.cache, 0.5)
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, steps=-1)
    with pytest.raises(TypeError, match="steps must be an int, got float"):
        calibrate_delta(plan, batch.q, batch.cache, 0.5, steps=2.5)
