"""The ahead-of-time kernels (COSA_AOT_KERNELS): the wheel built with the exported OSK
kernels, installed without a compiler, examples/cpp configured against the install with
find_package(cosa) and linked, and the installed Python package loading libcosa's kernels
instead of compiling them.  The loader's fallback to the JIT is checked without any build.
On a GPU: the example's output equals Python's run on the same inputs, and run's output
with the loaded kernel equals its output with the JIT-compiled one."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cosa
from cosa import _C
from cosa.cute_kernels import aot
from cosa.cute_kernels.aot import KernelSource
from cosa.cute_kernels.osk import CONFIGS

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "cpp"

sys.path.insert(0, str(ROOT / "bench"))
import bench_first_call  # noqa: E402


def _run(*command, env=None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _require_toolchain():
    # The export needs the CuTe DSL, the link the CUDA toolkit (cudart_static), the wheel
    # scikit-build-core and pybind11 (no build isolation: nothing is downloaded). CI
    # without a CUDA toolkit skips; a GPU machine or a dev box with one runs it.
    for tool in ("cmake", os.environ.get("CXX", "c++"), "nvcc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    for module in ("cutlass", "scikit_build_core", "pybind11"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Builds the wheel with the kernels (about 30 s on two cores, 12 s of it the export)
    and installs it, without its dependencies, into a fresh directory; returns that."""
    _require_toolchain()
    tmp = tmp_path_factory.mktemp("aot")
    _run(sys.executable, "-m", "pip", "wheel", ROOT, "--no-build-isolation", "--no-deps", "-q",
         "-w", tmp / "wheel", env={**os.environ, "COSA_AOT_KERNELS": "1"})
    (wheel,) = (tmp / "wheel").glob("cosa-*.whl")
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target",
         tmp / "site", wheel)
    return tmp / "site"


@pytest.fixture(scope="module")
def example(site) -> Path:
    """examples/cpp built against the installed wheel; returns the executable."""
    build = site.parent / "example"
    _run("cmake", "-S", EXAMPLE, "-B", build, f"-DCMAKE_PREFIX_PATH={site / 'cosa'}",
         "-DCMAKE_BUILD_TYPE=Release")
    _run("cmake", "--build", build)
    return build / "attention_example"


def _libcosa(site: Path) -> Path:
    return site / "cosa" / "lib" / "libcosa.so"


def test_example_links_against_installed_wheel(site, example):
    assert example.is_file()
    # The kernels are inside libcosa; its only CUDA dependency left is the driver.
    symbols = _run("nm", "-D", "--defined-only", _libcosa(site))
    for config in CONFIGS:
        assert f"{aot.aot_prefix(*config)}_args_spec" in symbols
    assert "libcudart" not in _run("ldd", _libcosa(site))


def test_installed_wheel_loads_its_kernels(site):
    # A fresh process that imports the installed wheel's cosa: no GPU needed to load.
    script = ("from cosa.cute_kernels import aot; "
              f"print([tuple(aot.kernel_source(*config)) for config in {CONFIGS!r}])")
    env = {name: value for name, value in os.environ.items() if name != aot.DISABLE_AOT}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    sources = _run(sys.executable, "-c", script, env=env)
    assert sources.strip() == repr([("aot", str(_libcosa(site)))] * len(CONFIGS))


def test_loader_compiles_without_a_libcosa_or_when_disabled(tmp_path, monkeypatch):
    monkeypatch.delenv(aot.DISABLE_AOT, raising=False)
    missing = tmp_path / "libcosa.so"
    assert aot.load_kernel("bfloat16", 128, library=missing) == \
        (None, KernelSource("jit", f"no libcosa at {missing}"))
    monkeypatch.setenv(aot.DISABLE_AOT, "1")  # wins over any libcosa
    assert aot.kernel_source("bfloat16", 128) == KernelSource("jit", f"{aot.DISABLE_AOT}=1")


def test_loader_reports_a_libcosa_built_without_kernels(monkeypatch):
    monkeypatch.delenv(aot.DISABLE_AOT, raising=False)
    library = Path(cosa.cmake_prefix_path()) / "lib" / "libcosa.so"
    kernel, source = aot.load_kernel("float16", 64, library=library)
    if source.kind == "aot":
        pytest.skip("the installed cosa was built with the kernels")
    assert kernel is None
    assert source == KernelSource("jit", f"{library} was built without the kernels (COSA_AOT_KERNELS)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_bench_first_call_without_a_gpu_says_so_and_exits_0(capsys):
    assert bench_first_call.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def _inputs():
    """The example's inputs (attention_example.cpp: value, kQoLens, ...), regenerated."""
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


def _example_order(plan) -> torch.Tensor:
    """The example's visiting order: local blocks ascending, the sink block 0, the rest descending."""
    order = torch.full(tuple(plan.order.shape), -1, dtype=torch.int32)
    for tile, row in enumerate(plan.qtiles.tolist()):
        first, last = row[_C.QT_LOCAL_FIRST], row[_C.QT_LOCAL_LAST]
        visit = [*range(first, last + 1), *([0] if first > 0 else []), *range(first - 1, 0, -1)]
        order[tile, :, :len(visit)] = torch.tensor(visit, dtype=torch.int32)
    return order.to(plan.order.device)


@pytest.fixture
def gpu_with_wheel_kernels(site, monkeypatch):
    """osk_forward loads its kernels from the wheel's libcosa (the example's library)."""
    monkeypatch.delenv(aot.DISABLE_AOT, raising=False)
    monkeypatch.setattr(aot, "LIBCOSA", _libcosa(site))


@pytest.mark.gpu
def test_example_matches_python_run(example, gpu_with_wheel_kernels, tmp_path, monkeypatch):
    out = tmp_path / "o.f32"
    assert "all checks passed" in _run(example, out)
    q, cache, table, shapes = _inputs()
    plan = cosa.plan(*(t.cuda() for t in table), **shapes, causal=True, budget=1.0, delta=0.0)
    # run with the example's visiting order in place of the proxy's: the same kernel on the
    # same inputs, so the same bits.
    monkeypatch.setattr(cosa.api, "_rank", lambda plan_, q_, k_: plan_.order.copy_(_example_order(plan_)))
    expected = cosa.run(plan, q.cuda(), cache.cuda()).float().cpu()
    assert aot.kernel_source("bfloat16", 128).kind == "aot"
    got = torch.from_numpy(np.fromfile(out, dtype=np.float32)).view_as(expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_run_with_loaded_kernel_equals_jit(gpu_with_wheel_kernels, monkeypatch, dtype, head_dim):
    q, cache, table, shapes = _inputs()
    q, cache = (x[..., :head_dim].to(dtype).contiguous().cuda() for x in (q, cache))
    plan = cosa.plan(*(t.cuda() for t in table), **{**shapes, "head_dim": head_dim}, q_data_type=dtype,
                     budget=0.5, delta=0.05)
    name = str(dtype).removeprefix("torch.")
    results = {}
    for kind in ("aot", "jit"):
        if kind == "jit":
            monkeypatch.setenv(aot.DISABLE_AOT, "1")
        o, lse = cosa.run(plan, q, cache, return_lse=True)
        stats = plan.stats()
        results[kind] = (o, lse, stats.computed, stats.skipped)
        assert aot.kernel_source(name, head_dim).kind == kind
    # the same kernel source and options; only the host ABI differs (plain C against TVM-FFI)
    for loaded, compiled in zip(results["aot"], results["jit"]):
        torch.testing.assert_close(loaded, compiled, rtol=0, atol=0)
