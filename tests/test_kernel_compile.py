"""Compile every configuration the OSK and KAP dispatchers can choose, on the CPU, for sm_90a.

Needs nvidia-cutlass-dsl (the ``gpu`` extra); without it this module fails to import,
on purpose: CI installs the DSL.  Kernels are compiled from fake tensors (symbolic
shapes and strides), exactly as ``osk_forward`` compiles them at runtime, so no GPU is
needed.  With apache-tvm-ffi installed the TVM-FFI host wrapper (the one used on the
GPU) is compiled; otherwise the plain one (same device code).  The fake tensors are also
checked against what the launchers pass through the plain C ABI.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cosa.cute_kernels import kap, osk  # noqa: E402


def test_configs_are_the_supported_set():
    chosen = {(dt, d) for dt in ("bfloat16", "float16") for d in (32, 64, 96, 128, 256)
              if osk.supported(d, getattr(torch, dt))}
    assert chosen == set(osk.CONFIGS) and len(chosen) == 4
    assert not osk.supported(128, torch.float32)


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
    rank_args = (q, means, means, torch.zeros(2, 6, dtype=torch.int64), tables["qtiles"],
                 tables["kv_block_indptr"], tables["order"])
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
        passed = osk._to_cute(tensor, tensor.dim() - 1)
        assert (passed.dynamic_shapes_mask, passed.dynamic_strides_mask) == \
            (fake.dynamic_shapes_mask, fake.dynamic_strides_mask), f"argument {position}"
