"""Compile every configuration the OSK and KAP dispatchers can choose, on the CPU, for sm_90a.

Needs nvidia-cutlass-dsl (the ``gpu`` extra); without it this module fails to import,
on purpose: CI installs the DSL.  Kernels are compiled from fake tensors (symbolic
shapes and strides), exactly as ``osk_forward`` compiles them at runtime, so no GPU is
needed.  With apache-tvm-ffi installed the TVM-FFI host wrapper (the one used on the
GPU) is compiled; otherwise the plain one (same device code).  The fake tensors are also
checked against what the launchers pass through the plain C ABI, and ``osk_forward``'s
argument checks, which run before anything is compiled, are exercised here too, bound to a
plan (``osk.Launcher``, ``kap.Launcher``) and unbound.
"""

from __future__ import annotations

import gc
import math
import os
import re
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cosa import _C, api  # noqa: E402
from cosa.cute_kernels import aot, kap, osk, plan_layout  # noqa: E402

ROOT = Path(__file__).parents[1]


def test_configs_are_the_supported_set():
    chosen = {(dt, d) for dt in ("bfloat16", "float16") for d in (32, 64, 96, 128, 256)
              if osk.supported(d, getattr(torch, dt))}
    assert chosen == set(osk.CONFIGS) and len(chosen) == 4
    assert not osk.supported(128, torch.float32)
    assert {d for _, d in chosen} == set(api.SUPPORTED_HEAD_DIMS)  # what plan accepts


def test_the_build_exports_every_config():
    """CMakeLists.txt and csrc/attention.cpp name the exported kernels themselves (the build
    must know its outputs before the export runs): every aot.KERNELS in every osk.CONFIGS, by
    aot.py's prefix; and attention.cpp's bound on the requests KAP ranks is kap.py's."""
    prefixes = sorted(aot.aot_prefix(kernel, dt, d) for kernel in aot.KERNELS for dt, d in osk.CONFIGS)
    cmake = (ROOT / "CMakeLists.txt").read_text()
    configs, kernels = (re.search(rf"foreach\({loop} ([^)]*)\)", cmake).group(1).split()
                        for loop in ("_config", "_kernel"))
    assert sorted(f"cosa_{kernel}_{config}" for kernel in kernels for config in configs) == prefixes
    source = (ROOT / "csrc" / "attention.cpp").read_text()
    assert sorted(re.findall(r'#include "(cosa_\w+)\.h"', source)) == prefixes
    launchers = re.findall(r"^COSA_(OSK|KAP_POOL|KAP_RANK)_LAUNCHER\((\w+)\)", source, re.MULTILINE)
    assert sorted(prefix for _, prefix in launchers) == prefixes
    assert all(prefix.startswith(f"cosa_{kind.lower()}_") for kind, prefix in launchers)
    assert f"kKapMaxKeyBlocks = {kap.MAX_KEY_BLOCKS};" in source


def test_the_kernels_read_the_plan_s_layout():
    names = [name for name in vars(plan_layout) if name.isupper()]
    assert len(names) == 11
    assert {name: getattr(plan_layout, name) for name in names} == {name: getattr(_C, name) for name in names}


@pytest.mark.parametrize("dtype_name,head_dim", osk.CONFIGS)
def test_compile_config(dtype_name, head_dim):
    t0 = time.perf_counter()
    fn = osk.compile_config(dtype_name, head_dim)
    seconds = time.perf_counter() - t0
    assert fn is not None
    assert osk.compile_config(dtype_name, head_dim) is fn  # cached
    print(f"compiled OSK {dtype_name} d{head_dim} for {os.environ['CUTE_DSL_ARCH']} in {seconds:.1f} s")


def test_kap_covers_the_osk_configs_up_to_its_sort():
    for dtype_name, head_dim in osk.CONFIGS:
        assert kap.supported(head_dim, getattr(torch, dtype_name), kap.MAX_KEY_BLOCKS)
        assert not kap.supported(head_dim, getattr(torch, dtype_name), kap.MAX_KEY_BLOCKS + 1)
    assert not kap.supported(128, torch.float32, 1)


@pytest.mark.parametrize("dtype_name,head_dim", kap.CONFIGS)
def test_compile_kap_config(dtype_name, head_dim):
    t0 = time.perf_counter()
    pool, rank = kap.compile_config(dtype_name, head_dim)
    seconds = time.perf_counter() - t0
    assert pool is not None and rank is not None
    assert kap.compile_config(dtype_name, head_dim) == (pool, rank)  # cached
    print(f"compiled KAP {dtype_name} d{head_dim} for {os.environ['CUTE_DSL_ARCH']} in {seconds:.1f} s")


def _runtime_args():
    """Tensors like those ``osk_forward`` and ``kap_order`` pass (shapes are arbitrary: only
    which extents and strides are dynamic matters): a view of a combined NHD cache for K/V."""
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    cache = torch.zeros(3, 2, 16, 2, 128, dtype=bf16)
    q = torch.zeros(5, 4, 128, dtype=bf16)
    tables = {"block_pages": torch.zeros(2, 8, dtype=i32), "kv_block_indptr": torch.zeros(3, dtype=i32),
              "qo_lens": torch.zeros(2, dtype=i32), "kv_lens": torch.zeros(2, dtype=i32),
              "qtiles": torch.zeros(2, 8, dtype=i32), "tile_order": torch.zeros(8, 2, dtype=i32),
              "order": torch.zeros(2, 4, 3, dtype=i32), "counts": torch.zeros(2, 4, dtype=i32)}
    means = torch.zeros(2, 4, 128, dtype=f32)
    osk_args = (q, cache[:, 0], cache[:, 1], torch.zeros_like(q), torch.zeros(5, 4, dtype=f32),
                tables["block_pages"], tables["kv_block_indptr"], tables["qo_lens"], tables["kv_lens"],
                tables["qtiles"], tables["tile_order"], tables["order"], tables["counts"], tables["counts"])
    pool_args = (cache[:, 0], tables["block_pages"], tables["kv_block_indptr"], tables["kv_lens"], means)
    rank_args = (q, means, means, tables["qtiles"], tables["kv_block_indptr"], tables["order"])
    return {"osk": (osk._fake_args("bfloat16"), osk_args),
            "kap pool": (kap._fake_pool_args("bfloat16"), pool_args),
            "kap rank": (kap._fake_rank_args("bfloat16"), rank_args)}


@pytest.mark.parametrize("kernel", ["osk", "kap pool", "kap rank"])
def test_plain_abi_arguments_match_the_compiled_spec(kernel):
    """The plain C ABI (the kernels libcosa exports, and the JIT path without TVM-FFI) packs
    exactly the extents and strides a tensor marks dynamic; the launchers mark theirs with
    ``_to_cute``, so those must be the ones each kernel was compiled to read (with head_dim
    static in the spec, every later stride was read from the wrong slot on the GPU)."""
    fakes, tensors = _runtime_args()[kernel]
    assert len(fakes) == len(tensors)
    for position, (fake, tensor) in enumerate(zip(fakes, tensors)):
        passed = osk._to_cute(tensor)
        assert (passed.dynamic_shapes_mask, passed.dynamic_strides_mask) == \
            (fake.dynamic_shapes_mask, fake.dynamic_strides_mask), f"argument {position}"


def test_plain_abi_descriptors_live_as_long_as_their_tensor_objects():
    # The launchers describe a plan's tensors once (osk._cute_views), not on every run; a
    # descriptor holds its tensor's memory, so the cache must not outlive the tensor object.
    t = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    view = osk._to_cute(t)
    assert osk._to_cute(t) is view
    for other in (t[:], t[1:], t[:, :2], torch.zeros_like(t), t.view(torch.float16)):
        assert osk._to_cute(other) is not view
    t.resize_(32, 4, 128)   # the same object, another geometry
    assert osk._to_cute(t) is not view
    described = len(osk._cute_views)
    buffer = np.ones((1 << 20, 8), dtype=np.float32)   # the memory behind a tensor, observable
    memory = weakref.ref(buffer)
    x = torch.from_numpy(buffer)
    del buffer
    osk._to_cute(x)
    assert len(osk._cute_views) == described + 1
    alive = weakref.ref(x)
    del x, t, view
    gc.collect()
    assert alive() is None and memory() is None, "a dropped tensor's memory is released"
    assert len(osk._cute_views) <= described - 1, "its entry went with it"


def _forward_args(**change):
    """``osk_forward``'s arguments for one 128-row tile of 4 heads (CPU tensors: every case
    below is rejected before a kernel is compiled or launched), with ``change`` applied."""
    bf16, i32 = torch.bfloat16, torch.int32
    args = {"q": torch.zeros(128, 4, 128, dtype=bf16), "k_cache": torch.zeros(8, 16, 2, 128, dtype=bf16),
            "v_cache": torch.zeros(8, 16, 2, 128, dtype=bf16), "block_pages": torch.zeros(1, 8, dtype=i32),
            "kv_block_indptr": torch.tensor([0, 1], dtype=i32), "qo_lens": torch.tensor([128], dtype=i32),
            "kv_lens": torch.tensor([128], dtype=i32), "qtiles": torch.zeros(1, 8, dtype=i32),
            "tile_order": torch.zeros(4, 2, dtype=i32), "order": torch.zeros(1, 4, 1, dtype=i32),
            "o": torch.zeros(128, 4, 128, dtype=bf16), "lse": torch.zeros(128, 4),
            "computed": torch.zeros(1, 4, dtype=i32), "skipped": torch.zeros(1, 4, dtype=i32)}
    args.update(change)
    return args


_SHARED_Q = torch.zeros(128, 4, 128, dtype=torch.bfloat16)
_SHARED_COUNTS = torch.zeros(1, 4, dtype=torch.int32)
_SHARED_WORDS = torch.zeros(128 * 4 * 64)  # o's bytes, in which lse starts


@pytest.mark.parametrize("change,error,match", [
    ({"order": torch.zeros(1, 4, 0, dtype=torch.int32)}, ValueError, r"k_max=0 .* a plan with tiles"),
    ({"block_pages": torch.zeros(0, 8, dtype=torch.int32)}, ValueError, r"block_pages 0 key blocks"),
    ({"q": torch.zeros(128, 4, 96, dtype=torch.bfloat16)}, ValueError, r"no kernel for head_dim=96"),
    ({"q": torch.zeros(128, 512, dtype=torch.bfloat16)}, ValueError,
     r"osk_forward: q must be 3-D and k_cache 4-D, got shapes \[128, 512\] and \[8, 16, 2, 128\]"),
    ({"k_cache": torch.zeros(8, 16, 256, dtype=torch.bfloat16)}, ValueError, r"q must be 3-D and k_cache 4-D"),
    ({"k_cache": torch.zeros(8, 8, 2, 128, dtype=torch.bfloat16)}, ValueError, r"page_size must be .* got 8"),
    ({"o": torch.zeros(128, 4, 128, dtype=torch.float16)}, TypeError, r"o must have dtype torch.bfloat16"),
    ({"q": torch.zeros(128, 128, 4, dtype=torch.bfloat16).transpose(1, 2)}, ValueError, r"q needs a contiguous"),
    ({"v_cache": torch.zeros(8 * 16 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 16, 2, 128)}, ValueError,
     r"v_cache needs a contiguous, 16-byte aligned"),
    # what the kernel indexes by the plan's extents, unchecked on the device
    ({"o": torch.zeros(1, 4, 128, dtype=torch.bfloat16)}, ValueError, r"o must have shape \[128, 4, 128\]"),
    ({"lse": torch.zeros(128, 4, dtype=torch.float16)}, TypeError, r"lse must have dtype torch.float32"),
    ({"lse": torch.zeros(1, 4)}, ValueError, r"lse must have shape \[128, 4\]"),
    ({"computed": torch.zeros(1, 4, dtype=torch.int64)}, TypeError, r"computed must have dtype torch.int32"),
    ({"skipped": torch.zeros(4, dtype=torch.int32)}, ValueError, r"skipped must have shape \[1, 4\]"),
    ({"block_pages": torch.zeros(1, 8, dtype=torch.int64)}, TypeError, r"block_pages must have dtype torch.int32"),
    ({"block_pages": torch.zeros(1, 4, dtype=torch.int32)}, ValueError, r"block_pages must have shape \[\*, 8\]"),
    ({"order": torch.zeros(1, 4, dtype=torch.int32)}, ValueError, r"order must have shape \[1, 4, \*\]"),
    ({"qtiles": torch.zeros(1, 4, dtype=torch.int32)}, ValueError, r"qtiles must have shape \[1, 8\]"),
    ({"tile_order": torch.zeros(4, 2)}, TypeError, r"tile_order must have dtype torch.int32"),
    ({"kv_block_indptr": torch.tensor([0], dtype=torch.int32)}, ValueError, r"kv_block_indptr must have shape \[2\]"),
    ({"k_cache": torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)}, ValueError,
     r"k_cache must be \[8, 16, 2, 128\] \(pages, page size, kv heads, head_dim\) in the NHD view, got "
     r"\[8, 16, 2, 64\]"),
    ({"v_cache": torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)}, ValueError, r"v_cache must be \[8, 16, 2, 128\]"),
    ({"k_cache": torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16),
      "v_cache": torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)}, ValueError, r"8 kv heads must divide q's 4"),
    ({"o": torch.zeros(1, 4, 128, dtype=torch.bfloat16).expand(128, 4, 128)}, ValueError, r"o's elements overlap"),
    ({"lse": torch.zeros(4, 128).t()}, ValueError, r"osk_forward: lse must have a contiguous last dim"),
    ({"computed": torch.zeros(4, 2, dtype=torch.int32)[:, :1].t()}, ValueError, r"computed must have a contiguous last dim"),
    # the tables' extents come from the tables: their ranks first
    ({"qtiles": torch.tensor(0, dtype=torch.int32)}, ValueError, r"osk_forward: qtiles must be 2-D, got shape \[\]"),
    ({"kv_lens": torch.tensor(128, dtype=torch.int32)}, ValueError, r"osk_forward: kv_lens must be 1-D"),
    ({"causal": "False"}, TypeError, r"osk_forward: causal must be a bool, got str"),
    # outputs written while the inputs are read
    ({"q": _SHARED_Q, "o": _SHARED_Q}, ValueError, r"osk_forward: o shares memory with q: an output must not overlap"),
    ({"computed": _SHARED_COUNTS, "skipped": _SHARED_COUNTS}, ValueError, r"computed shares memory with skipped"),
    ({"lse": _SHARED_WORDS[4:4 + 128 * 4].view(128, 4), "o": _SHARED_WORDS.view(torch.bfloat16).view(128, 4, 128)},
     ValueError, r"osk_forward: o shares memory with lse"),
])
def test_osk_forward_rejects(change, error, match):
    with pytest.raises(error, match=match):
        osk.osk_forward(**_forward_args(**change), sm_scale=1.0, log_delta=-math.inf)


def test_compile_config_refuses_a_configuration_without_kernels():
    for compile_config in (osk.compile_config, kap.compile_config):
        for dtype_name, head_dim in (("float32", 128), ("bfloat16", 96)):
            with pytest.raises(ValueError, match=rf"no kernel for dtype_name='{dtype_name}' and head_dim={head_dim}"):
                compile_config(dtype_name, head_dim)


def test_osk_forward_takes_a_plan_without_tiles(monkeypatch):
    # numpy gives empty tables strides (0, 0): no stride to check, nothing to launch
    monkeypatch.setattr(osk, "_launch", lambda *args: pytest.fail("launched without tiles"))
    empty = {name: torch.from_numpy(np.zeros(shape, np.int32)) for name, shape in (
        ("qtiles", (0, 8)), ("tile_order", (0, 2)), ("order", (0, 4, 0)), ("computed", (0, 4)), ("skipped", (0, 4)))}
    assert empty["qtiles"].stride() == (0, 0)
    osk.osk_forward(**_forward_args(q=torch.zeros(0, 4, 128, dtype=torch.bfloat16),
                                    o=torch.zeros(0, 4, 128, dtype=torch.bfloat16), lse=torch.zeros(0, 4), **empty),
                    sm_scale=1.0, log_delta=-math.inf)


def test_osk_forward_rejects_a_scale_the_kernel_cannot_use():
    # beyond MAX_SM_SCALE, sm_scale * log2(e) is an infinite float32 and every logit inf or nan
    for sm_scale in (0.0, -1.0, math.nan, math.inf, math.nextafter(plan_layout.MAX_SM_SCALE, math.inf)):
        with pytest.raises(ValueError, match=r"sm_scale must be in \(0, 2.359e\+38\] \(float32 logits\)"):
            osk.osk_forward(**_forward_args(), sm_scale=sm_scale, log_delta=-math.inf)
    for log_delta in (math.nan, math.inf):
        with pytest.raises(ValueError, match=r"log_delta must be ln\(delta\) for a finite delta >= 0"):
            osk.osk_forward(**_forward_args(), sm_scale=1.0, log_delta=log_delta)
    for name in ("sm_scale", "log_delta"):
        with pytest.raises(TypeError, match=rf"osk_forward: {name} must be a float, got NoneType"):
            osk.osk_forward(**_forward_args(), **{"sm_scale": 1.0, "log_delta": -math.inf, name: None})


def test_osk_forward_rejects_an_unknown_kv_layout():
    with pytest.raises(ValueError, match=r"osk_forward: kv_layout must be one of \('NHD', 'HND'\), got 'NDH'"):
        osk.osk_forward(**_forward_args(), sm_scale=1.0, log_delta=-math.inf, kv_layout="NDH")


_SHARED_MEANS = torch.zeros(4 * 128)


def _kap_args(**change):
    """``kap.kap_order``'s arguments for one 128-row tile of 4 heads over one key block (CPU
    tensors: every case below is rejected before a kernel is compiled or launched)."""
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    args = {"q": torch.zeros(128, 4, 128, dtype=bf16), "k_cache": torch.zeros(8, 16, 2, 128, dtype=bf16),
            "block_pages": torch.zeros(1, 8, dtype=i32), "kv_block_indptr": torch.tensor([0, 1], dtype=i32),
            "kv_lens": torch.tensor([128], dtype=i32), "qtiles": torch.zeros(1, 8, dtype=i32),
            "qbar": torch.zeros(1, 4, 128, dtype=f32), "kbar": torch.zeros(1, 2, 128, dtype=f32),
            "order": torch.zeros(1, 4, 1, dtype=i32), "force_local": True, "force_sink": True}
    args.update(change)
    return args


@pytest.mark.parametrize("change,error,match", [
    ({"q": torch.zeros(128, 4, 96, dtype=torch.bfloat16)}, ValueError, r"no kernel for head_dim=96"),
    ({"q": torch.zeros(128, 512, dtype=torch.bfloat16)}, ValueError,
     r"kap_order: q must be 3-D and k_cache 4-D, got shapes \[128, 512\] and \[8, 16, 2, 128\]"),
    ({"kv_block_indptr": torch.tensor([0, kap.MAX_KEY_BLOCKS + 1], dtype=torch.int32)}, ValueError,
     rf"kv_block_indptr has a request of {kap.MAX_KEY_BLOCKS + 1} key blocks, more than the kernels rank "
     rf"\({kap.MAX_KEY_BLOCKS}\)"),
    *(({name: bad}, TypeError, rf"kap_order: {name} must be a bool, got {type(bad).__name__}")
      for name in ("force_local", "force_sink") for bad in (None, "no", 1)),
    ({"k_cache": torch.zeros(8, 8, 2, 128, dtype=torch.bfloat16)}, ValueError, r"page_size must be .* got 8"),
    ({"k_cache": torch.zeros(8, 16, 2, 128, dtype=torch.float16)}, TypeError,
     r"k_cache must have dtype torch.bfloat16"),
    ({"k_cache": torch.zeros(8 * 16 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 16, 2, 128)}, ValueError,
     r"k_cache needs a contiguous, 16-byte aligned"),
    ({"qbar": torch.zeros(1, 4, 128, dtype=torch.bfloat16)}, TypeError, r"qbar must have dtype torch.float32"),
    ({"qbar": torch.zeros(4 * 128 + 1)[1:].view(1, 4, 128)}, ValueError, r"qbar needs a contiguous, 16-byte aligned"),
    ({"kbar": torch.zeros(2, 2, 128)}, ValueError, r"kbar must have shape \[1, 2, 128\]"),
    ({"order": torch.zeros(1, 4, 1, dtype=torch.int64)}, TypeError, r"order must have dtype torch.int32"),
    ({"k_cache": torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)}, ValueError, r"k_cache must be \[8, 16, 2, 128\]"),
    ({"order": torch.zeros(1, 1, 1, dtype=torch.int32).expand(1, 4, 1)}, ValueError, r"kap_order: order's elements overlap"),
    ({"qbar": _SHARED_MEANS.view(1, 4, 128), "kbar": _SHARED_MEANS[256:].view(1, 2, 128)}, ValueError,
     r"kap_order: qbar shares memory with kbar"),
])
def test_kap_order_rejects(change, error, match):
    with pytest.raises(error, match=match):
        kap.kap_order(**_kap_args(**change))


def test_kap_order_rejects_an_unknown_kv_layout():
    with pytest.raises(ValueError, match=r"kap_order: kv_layout must be one of \('NHD', 'HND'\), got 'NDH'"):
        kap.kap_order(**_kap_args(), kv_layout="NDH")


def test_kap_order_takes_a_plan_without_tiles_and_refuses_tiles_without_blocks(monkeypatch):
    monkeypatch.setattr(kap, "_launch", lambda *args: pytest.fail("launched without tiles"))
    i32 = torch.int32
    kap.kap_order(**_kap_args(q=torch.zeros(0, 4, 128, dtype=torch.bfloat16), qtiles=torch.zeros(0, 8, dtype=i32),
                              qbar=torch.zeros(0, 4, 128), order=torch.zeros(0, 4, 3, dtype=i32)))
    for change, message in (({"order": torch.zeros(1, 4, 0, dtype=i32)}, r"k_max=0 and block_pages 1 key blocks"),
                            ({"block_pages": torch.zeros(0, 8, dtype=i32), "kbar": torch.zeros(0, 2, 128)},
                             r"k_max=1 and block_pages 0 key blocks")):
        with pytest.raises(ValueError, match=rf"kap_order: 1 query tiles but order has {message}; a plan with "
                                             r"tiles has both >= 1"):
            kap.kap_order(**_kap_args(**change))


def test_valid_arguments_reach_the_launch_with_the_kernel_s_configuration(monkeypatch):
    # past every check, the launchers ask for the right kernel and pass every tensor on
    calls = []
    source = aot.KernelSource("aot", "a stand-in")
    monkeypatch.setattr(aot, "load_kernel", lambda *config: calls.append(config) or (object(), source))
    monkeypatch.setattr(osk, "_launch", lambda fn, source, tensors, bound, scalars=(): calls.append(
        len(tensors) + len(bound.tensors)))
    # the extremes of sm_scale and log_delta pass: the kernel handles them
    osk.osk_forward(**_forward_args(), sm_scale=plan_layout.MAX_SM_SCALE, log_delta=-math.inf)
    assert calls == [("osk", "bfloat16", 128), 14]
    calls.clear()
    osk.osk_forward(**_forward_args(), sm_scale=1e-30, log_delta=math.log(1e30))
    assert calls == [("osk", "bfloat16", 128), 14]
    calls.clear()
    monkeypatch.setattr(kap, "_launch", lambda fn, source, tensors, bound, scalars=(): calls.append(
        len(tensors) + len(bound.tensors)))
    kap.kap_order(**_kap_args())
    assert calls == [("kap_pool", "bfloat16", 128), ("kap_rank", "bfloat16", 128), 5, 6]


def test_osk_forward_refuses_a_cache_past_its_tma_coordinates(monkeypatch):
    # The TMA addresses a cache's pages and kv heads by one int32 coordinate in 16-byte units:
    # its last page and kv head may start at most MAX_BOX_UNITS in.  Meta tensors have the
    # strides without the memory.
    launches = []
    monkeypatch.setattr(aot, "load_kernel", lambda *config: (object(), aot.KernelSource("aot", "a stand-in")))
    monkeypatch.setattr(osk, "_launch", lambda *args: launches.append(args))
    page_units = 1 << 28   # 8 pages and 2 kv heads: the last start 7 * page_units + head_units in

    def cache(head_units):
        return torch.empty(0, dtype=torch.bfloat16, device="meta").as_strided(
            (8, 16, 2, 128), (8 * page_units, 256, 8 * head_units, 1))

    furthest = osk.MAX_BOX_UNITS - 7 * page_units
    for name in ("k_cache", "v_cache"):
        osk.osk_forward(**_forward_args(**{name: cache(furthest)}), sm_scale=1.0, log_delta=-math.inf)
        assert len(launches) == 1
        launches.clear()
        with pytest.raises(ValueError, match=rf"osk_forward: {name}'s last page and kv head start {2**31 - 1} "
                                             rf"16-byte units past its first, more than the kernel's TMA addresses"):
            osk.osk_forward(**_forward_args(**{name: cache(furthest + 1)}), sm_scale=1.0, log_delta=-math.inf)
        assert not launches


def _osk_launcher(args: dict) -> osk.Launcher:
    """``_forward_args``' tables and counters bound, as ``cosa.plan`` binds a plan's."""
    return osk.Launcher(*(args[name] for name in ("block_pages", "kv_block_indptr", "qo_lens", "kv_lens", "qtiles",
                                                  "tile_order", "order", "computed", "skipped")),
                        num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)


def test_a_bound_launcher_checks_each_call_against_its_plan():
    args = _forward_args()
    launcher = _osk_launcher(args)
    call = {name: args[name] for name in ("q", "k_cache", "v_cache", "o", "lse")}
    for change, error, match in (
            ({"q": torch.zeros(128, 8, 128, dtype=torch.bfloat16)}, ValueError,
             r"osk_forward: q must have shape \[\*, 4, 128\], got \[128, 8, 128\]"),
            ({"v_cache": torch.zeros(8, 32, 2, 128, dtype=torch.bfloat16)}, ValueError,
             r"osk_forward: v_cache must be \[8, 16, 2, 128\] .* got \[8, 32, 2, 128\]"),
            ({"q": torch.zeros(128, 4, 128, dtype=torch.float16)}, TypeError,
             r"osk_forward: q must have dtype torch.bfloat16, got torch.float16")):
        with pytest.raises(error, match=match):
            launcher(**{**call, **change}, sm_scale=1.0, log_delta=-math.inf)


def test_a_bound_launcher_keeps_each_call_apart_from_the_plan_s_memory():
    # lse over one of the plan's tables, q under one of its counters: checked at each call
    memory, q = torch.zeros(1024), torch.zeros(128, 4, 128, dtype=torch.bfloat16)
    args = _forward_args(qtiles=memory[100:108].view(torch.int32).view(1, 8),
                         computed=q.view(-1)[:8].view(torch.int32).view(1, 4))
    launcher = _osk_launcher(args)
    call = {name: args[name] for name in ("q", "k_cache", "v_cache", "o", "lse")}
    with pytest.raises(ValueError, match=r"osk_forward: lse shares memory with qtiles"):
        launcher(**{**call, "lse": memory[:512].view(128, 4)}, sm_scale=1.0, log_delta=-math.inf)
    with pytest.raises(ValueError, match=r"osk_forward: computed shares memory with q"):
        launcher(**{**call, "q": q}, sm_scale=1.0, log_delta=-math.inf)
    with pytest.raises(ValueError, match=r"kap_order: kbar shares memory with q"):
        kap.kap_order(**_kap_args(q=q, kbar=q.view(-1)[:512].view(torch.float32).view(1, 2, 128)))


def test_a_launcher_refuses_outputs_in_the_plan_s_tables_when_bound():
    order = torch.zeros(1, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"osk_forward: computed shares memory with order"):
        _osk_launcher(_forward_args(order=order, computed=order.view(-1)[:4].view(1, 4)))
    qbar = torch.zeros(1, 4, 128)
    with pytest.raises(ValueError, match=r"kap_order: qbar shares memory with qtiles"):
        kap.kap_order(**_kap_args(qbar=qbar, qtiles=qbar.view(-1)[:8].view(torch.int32).view(1, 8)))


def _record_launches(monkeypatch, record) -> None:
    """Plans bind the kernels' launchers, as on a Hopper GPU, with libcosa's kernels (stand-ins
    named after them), and each launch calls ``record(fn, tensors, bound, scalars)`` instead."""
    monkeypatch.setattr(api, "osk_launcher", lambda *config: osk.Launcher)
    monkeypatch.setattr(api, "kap_launcher", lambda *config: kap.Launcher)
    monkeypatch.setattr(aot, "load_kernel", lambda *config: (config[0], aot.KernelSource("aot", "a stand-in")))
    for module in (osk, kap):
        monkeypatch.setattr(module, "_launch", lambda fn, source, tensors, bound, scalars=(): record(
            fn, tensors, bound, scalars))


def test_a_plan_binds_the_launchers_to_its_own_tables(monkeypatch):
    # what run launches: the plan's tensors, bound at plan time, and the call's q, cache and outputs
    import cosa
    launches = []
    _record_launches(monkeypatch, lambda fn, tensors, bound, scalars: launches.append(
        (fn, (*tensors, *bound.tensors), scalars)))
    page, lens = 16, (300, 77)
    pages = [torch.randperm(40, dtype=torch.int32)[:n] for n in (-(-lens[0] // page), -(-lens[1] // page))]
    indptr = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    plan = cosa.plan(indptr, torch.tensor([0, len(pages[0]), len(pages[0]) + len(pages[1])], dtype=torch.int32),
                     torch.cat(pages), torch.tensor([(n - 1) % page + 1 for n in lens], dtype=torch.int32),
                     8, 2, 128, page, delta=0.5)
    q = torch.randn(sum(lens), 8, 128).bfloat16()
    cache = torch.randn(40, 2, page, 2, 128).bfloat16()
    out, lse = torch.empty_like(q), torch.empty(sum(lens), 8)
    cosa.run(plan, q, cache, out=out, lse=lse)
    (pool, pool_tensors, pool_scalars), (rank, rank_tensors, rank_scalars), (forward, tensors, scalars) = launches
    assert (pool, rank, forward) == ("kap_pool", "kap_rank", "osk")
    k, v = cache[:, 0], cache[:, 1]
    for launched, expected in ((pool_tensors, (k, plan.block_pages, plan.kv_block_indptr, plan.kv_lens, plan.kbar)),
                               (rank_tensors, (q, plan.qbar, plan.kbar, plan.qtiles,
                                               plan.kv_block_indptr, plan.order)),
                               (tensors, (q, k, v, out, lse, plan.block_pages, plan.kv_block_indptr, plan.qo_lens,
                                          plan.kv_lens, plan.qtiles, plan.tile_order, plan.order, plan.computed,
                                          plan.skipped))):
        assert [(t.data_ptr(), t.shape, t.stride()) for t in launched] == \
            [(t.data_ptr(), t.shape, t.stride()) for t in expected]
    assert pool_scalars == (4,)
    assert rank_scalars == (3, 1, 1)   # the longest request's key blocks, force_local, force_sink
    assert scalars == (plan.sm_scale, math.log(0.5), 4, 4, 1, plan.tile_order.shape[0])


def test_run_refuses_a_cache_that_overlaps_the_plan_s_memory_before_any_launch(monkeypatch):
    # KAP writes its means and order mask, which OSK's launcher alone cannot see meet V
    import cosa
    from cosa.paged import uniform_page_table
    launches = []
    _record_launches(monkeypatch, lambda *launch: launches.append(launch))
    workspace = torch.zeros(1 << 21, dtype=torch.uint8)
    plan = cosa.plan(*uniform_page_table(1, 300, 300, 16, "cpu"), 4, 2, 128, 16, workspace=workspace)
    q, k = torch.zeros(300, 4, 128, dtype=torch.bfloat16), torch.zeros(19, 16, 2, 128, dtype=torch.bfloat16)
    for name in ("qbar", "kbar", "order"):
        start = getattr(plan, name).data_ptr() - workspace.data_ptr()
        v = workspace[start:start + k.nbytes].view(torch.bfloat16).view(k.shape)
        with pytest.raises(ValueError, match=rf"plan.{name} shares memory with paged_kv_cache's V"):
            cosa.run(plan, q, (k, v))
    assert launches == []


def test_a_copied_plan_s_launchers_pass_libcosa_its_own_buffers(monkeypatch):
    # libcosa's launchers take packed addresses, cached after the first run: a copy packs its own
    import copy
    import cosa
    from cosa.paged import uniform_page_table
    words = []
    _record_launches(monkeypatch, lambda fn, tensors, bound, scalars: words.append(set(bound.words)))
    original = cosa.plan(*uniform_page_table(1, 300, 300, 16, "cpu"), 4, 2, 128, 16)
    q, cache = torch.zeros(300, 4, 128, dtype=torch.bfloat16), torch.zeros(19, 2, 16, 2, 128, dtype=torch.bfloat16)
    cosa.run(original, q, cache)
    copied = copy.deepcopy(original)
    cosa.run(copied, q, cache)
    theirs, mine = words[2], words[5]   # each run launches KAP's pool and rank, then OSK
    assert copied.order.data_ptr() in mine and original.order.data_ptr() not in mine
    assert original.order.data_ptr() in theirs


@pytest.mark.parametrize("workspace", [None, torch.zeros(1 << 16, dtype=torch.uint8)[3:]])
def test_a_plan_without_query_rows_binds_the_launchers_and_launches_nothing(monkeypatch, workspace):
    # empty tables and buffers, carved from a workspace or not, pass the bind; run writes nothing
    import cosa
    monkeypatch.setattr(api, "osk_launcher", lambda *config: osk.Launcher)
    monkeypatch.setattr(api, "kap_launcher", lambda *config: kap.Launcher)
    monkeypatch.setattr(aot, "load_kernel", lambda *config: pytest.fail("a kernel was asked for"))
    i32 = torch.int32
    plan = cosa.plan(torch.tensor([0, 0, 0], dtype=i32), torch.tensor([0, 0, 1], dtype=i32), torch.tensor([0], dtype=i32),
                     torch.tensor([0, 5], dtype=i32), 4, 2, 128, 16, workspace=workspace)
    assert plan.kernel is not None and plan.rank_kernel is not None and plan.k_max == 0
    o = cosa.run(plan, torch.zeros(0, 4, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 16, 2, 128, dtype=torch.bfloat16))
    assert o.shape == (0, 4, 128)
