"""The ahead-of-time kernels (COSA_AOT_KERNELS): libcosa built with the exported OSK
kernels, installed, and examples/cpp configured against the install with
find_package(cosa) and linked; on a GPU the example's output is compared with
Python's run on the same inputs."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "cpp"


def _run(*command, env=None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _require_toolchain():
    # The export needs the CuTe DSL, the link the CUDA toolkit (cudart_static): CI
    # without a CUDA toolkit skips; a GPU machine or a dev box with one runs it.
    for tool in ("cmake", os.environ.get("CXX", "c++"), "nvcc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl is not installed")


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """Builds libcosa with the kernels (about 15 s of export on one core), installs it
    and builds the example against the install; returns the example's path."""
    _require_toolchain()
    tmp = tmp_path_factory.mktemp("aot")
    _run("cmake", "-S", ROOT, "-B", tmp / "lib", "-DCOSA_AOT_KERNELS=ON",
         "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}")
    _run("cmake", "--build", tmp / "lib", "-j2")
    _run("cmake", "--install", tmp / "lib", "--prefix", tmp / "prefix")
    _run("cmake", "-S", EXAMPLE, "-B", tmp / "example", f"-DCMAKE_PREFIX_PATH={tmp / 'prefix'}",
         "-DCMAKE_BUILD_TYPE=Release")
    _run("cmake", "--build", tmp / "example")
    return tmp / "example" / "attention_example"


def test_example_links_against_aot_install(example):
    assert example.is_file()
    # The kernels are inside libcosa; its only CUDA dependency left is the driver.
    libcosa = example.parents[1] / "prefix" / "lib" / "libcosa.so"
    symbols = _run("nm", "-D", "--defined-only", libcosa)
    for config in ("bf16_d64", "bf16_d128", "fp16_d64", "fp16_d128"):
        assert f"cosa_osk_{config}_args_spec" in symbols
    assert "libcudart" not in _run("ldd", libcosa)


def _inputs():
    """The example's inputs (attention_example.cpp: value, kQoLens, ...), regenerated."""
    import torch

    hq, hkv, d, page_size = 4, 2, 128, 16
    qo_lens, kv_lens = [300, 200], [300, 456]
    pages = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages)

    def value(n, salt):
        x = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(salt * 40503)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(2246822519)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(13)
        return torch.from_numpy((x % np.uint64(2048)).astype(np.float32) / 1024.0 - 1.0)

    total_q = sum(qo_lens)
    q = value(total_q * hq * d, 1).view(total_q, hq, d).to(torch.bfloat16)
    cache = value(num_pages * 2 * page_size * hkv * d, 2).view(num_pages, 2, page_size, hkv, d).to(torch.bfloat16)
    qo_indptr = torch.tensor(np.cumsum([0] + qo_lens), dtype=torch.int32)
    kv_indptr = torch.tensor(np.cumsum([0] + pages), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    kv_indices = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32)
    return q, cache, (qo_indptr, kv_indptr, kv_indices, last), dict(num_qo_heads=hq, num_kv_heads=hkv,
                                                                    head_dim=d, page_size=page_size)


@pytest.mark.gpu
def test_example_matches_python_run(example, tmp_path):
    import torch

    import cosa

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "o.f32"
    assert "all checks passed" in _run(example, out)
    q, cache, table, shapes = _inputs()
    plan = cosa.plan(*(t.cuda() for t in table), **shapes, causal=True, budget=1.0, delta=0.0)
    expected = cosa.run(plan, q.cuda(), cache.cuda()).float().cpu()
    got = torch.from_numpy(np.fromfile(out, dtype=np.float32)).view_as(expected)
    # Same inputs, same kernel; the visiting orders differ (the example's is fixed,
    # run's is KAP's), so only the float summation order may differ.
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)
