"""Compile every configuration the OSK and KAP dispatchers can choose, on the CPU, for sm_90a.

Needs nvidia-cutlass-dsl (the ``gpu`` extra); without it this module fails to import,
on purpose: CI installs the DSL.  Kernels are compiled from fake tensors (symbolic
shapes and strides), exactly as ``osk_forward`` compiles them at runtime, so no GPU is
needed.  With apache-tvm-ffi installed the TVM-FFI host wrapper (the one used on the
GPU) is compiled; otherwise the plain one (same device code).
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
