"""The ahead-of-time kernels (COSA_AOT_KERNELS): the wheel built with the exported KAP and
OSK kernels, installed without a compiler, examples/cpp configured against the install with
find_package(cosa) and linked, and the installed Python package loading libcosa's kernels
instead of compiling them.  The loader's fallback to the JIT is checked without any build.
The attention C API's argument checks, through ctypes.  On a GPU: the example's output
equals Python's run on the same inputs, and run's output with the loaded kernels equals
its output with the JIT-compiled ones."""

import contextlib
import ctypes
import importlib.util
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cosa
from cosa.cute_kernels import aot, kap
from cosa.cute_kernels.aot import KernelSource
from cosa.cute_kernels.osk import CONFIGS
from batch import POISON
from processes import run_checked

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "cpp"


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
    run_checked(sys.executable, "-m", "pip", "wheel", ROOT, "--no-build-isolation", "--no-deps", "-q",
                "-w", tmp / "wheel", env={**os.environ, "COSA_AOT_KERNELS": "1"})
    (wheel,) = (tmp / "wheel").glob("cosa-*.whl")
    run_checked(sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target",
                tmp / "site", wheel)
    return tmp / "site"


@pytest.fixture(scope="module")
def example(site) -> Path:
    """examples/cpp built against the installed wheel; returns the executable."""
    build = site.parent / "example"
    run_checked("cmake", "-S", EXAMPLE, "-B", build, f"-DCMAKE_PREFIX_PATH={site / 'cosa'}",
                "-DCMAKE_BUILD_TYPE=Release")
    run_checked("cmake", "--build", build)
    return build / "attention_example"


def _libcosa(site: Path) -> Path:
    return site / "cosa" / "lib" / cosa._C.LIBCOSA


def test_example_links_against_installed_wheel(site, example):
    assert example.is_file()
    # The kernels are inside libcosa; its only CUDA dependency left is the driver.
    symbols = run_checked("nm", "-D", "--defined-only", _libcosa(site))
    for kernel in aot.KERNELS:
        for config in CONFIGS:
            assert f"{aot.aot_prefix(kernel, *config)}_args_spec" in symbols
    assert "libcudart" not in run_checked("ldd", _libcosa(site))


def test_installed_wheel_loads_its_kernels(site):
    # A fresh process that imports the installed wheel's cosa: no GPU needed to load.
    script = ("from cosa.cute_kernels import aot; "
              f"print([tuple(aot.kernel_source(kernel, *config)) for kernel in aot.KERNELS for config in {CONFIGS!r}])")
    env = {name: value for name, value in os.environ.items() if name != aot.DISABLE_AOT}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    sources = run_checked(sys.executable, "-c", script, env=env)
    assert sources.strip() == repr([("aot", str(_libcosa(site)))] * len(aot.KERNELS) * len(CONFIGS))


def test_export_without_an_output_directory_says_how_to_call_it():
    result = subprocess.run([sys.executable, "-m", "cosa.cute_kernels.aot"], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (1, "usage: python -m cosa.cute_kernels.aot OUT_DIR\n")


def test_loader_compiles_when_disabled(monkeypatch):
    monkeypatch.setenv(aot.DISABLE_AOT, "1")  # wins over a libcosa with the kernels
    monkeypatch.setattr(cosa._C, "has_kernels", lambda: True)
    assert aot.load_kernel("kap_rank", "bfloat16", 128) == (None, KernelSource("jit", f"{aot.DISABLE_AOT}=1"))


@pytest.fixture
def loader(monkeypatch):
    """aot's loader asking afresh (its answers are cached per configuration)."""
    monkeypatch.delenv(aot.DISABLE_AOT, raising=False)
    aot._load.cache_clear()
    yield aot
    aot._load.cache_clear()


def test_loader_reports_a_libcosa_built_without_kernels(loader, monkeypatch):
    monkeypatch.setattr(cosa._C, "has_kernels", lambda: False)
    assert loader.load_kernel("kap_pool", "float16", 64) == \
        (None, KernelSource("jit", f"{aot.libcosa_path()} was built without the kernels (COSA_AOT_KERNELS)"))


@pytest.mark.parametrize("kernel,scalars", [("osk", (0.125, -2.5, 4, 4, 1, 7)), ("kap_pool", (3,)),
                                            ("kap_rank", (9, 0, 1))])
def test_loaded_kernel_passes_libcosa_its_words_scalars_and_stream(loader, monkeypatch, kernel, scalars):
    calls = []
    monkeypatch.setattr(cosa._C, "has_kernels", lambda: True)
    monkeypatch.setattr(cosa._C, f"launch_{kernel}", lambda *args: calls.append(args))
    launcher, source = loader.load_kernel(kernel, "float16", 64)
    assert source == KernelSource("aot", str(aot.libcosa_path()))
    words, stream = [random.randrange(2**40) for _ in range(16)], random.randrange(1, 2**48)
    launcher(words, scalars, stream)
    assert calls == [("float16", 64, words, *scalars, stream)]


def test_tensor_words_are_each_tensors_address_extents_and_strides():
    """Eight words a tensor, as cosa._C takes them: the address, four extents and three strides
    (all but the last dim's), 0 past the tensor's dims."""
    tensors = [torch.empty(5, 6, 7, 8)[:, 1:5:2], torch.empty(9, 8, dtype=torch.int32), torch.empty(3),
               torch.empty(4, 5, 6, dtype=torch.bfloat16).transpose(0, 1)]
    random.shuffle(tensors)
    words = []
    for t in tensors:
        padding = [0] * (4 - t.dim())
        words += [t.data_ptr(), *t.shape, *padding, *t.stride()[:-1], *padding]
    assert aot.tensor_words(tensors) == words


@pytest.mark.parametrize("kernel,count,scalars", [("osk", 14, (0.125, 0.0, 4, 4, 1, 1)), ("kap_pool", 5, (4,)),
                                                  ("kap_rank", 6, (3, 1, 1))])
def test_libcosa_launchers_refuse_what_they_cannot_describe(kernel, count, scalars):
    # checked by cosa._C before libcosa is asked to launch, built with the kernels or not
    launch = getattr(cosa._C, f"launch_{kernel}")
    with pytest.raises(ValueError, match=f"tensors must hold {8 * count} words \\({count} tensors\\), got 8"):
        launch("bfloat16", 128, [0] * 8, *scalars, 0)
    words = [0] * (8 * count)
    words[8 * (count - 1) + 2] = 2**31
    with pytest.raises(ValueError, match=f"tensor {count - 1} has extent 2147483648, outside int32"):
        launch("bfloat16", 128, words, *scalars, 0)
    with pytest.raises(ValueError, match="dtype must be 'bfloat16' or 'float16', got 'float32'"):
        launch("float32", 128, [0] * (8 * count), *scalars, 0)


def test_libcosa_launchers_refuse_another_head_dim_or_say_there_are_no_kernels():
    message = ("OSK kernel: no kernel for dtype 0 and head_dim 96" if cosa._C.has_kernels()
               else "libcosa was built without the kernels")
    with pytest.raises((ValueError, RuntimeError), match=message):
        cosa._C.launch_osk("bfloat16", 96, [0] * (8 * 14), 0.125, 0.0, 4, 4, 1, 1, 0)


def test_launchers_take_all_their_kernels_from_libcosa_or_compile_all(monkeypatch):
    # KAP's two kernels are one pair: one missing from libcosa compiles both, never a mix
    exported = {"kap_pool": "pool from libcosa", "kap_rank": "rank from libcosa"}
    aot_source, jit_source = KernelSource("aot", "libcosa"), KernelSource("jit", "not exported")
    monkeypatch.setattr(aot, "load_kernel", lambda kernel, *config: (
        (exported[kernel], aot_source) if kernel in exported else (None, jit_source)))
    compiled = ("pool compiled", "rank compiled")
    assert aot.load_or_compile(("kap_pool", "kap_rank"), "float16", 64, lambda: compiled) == \
        (("pool from libcosa", "rank from libcosa"), aot_source)
    del exported["kap_rank"]
    assert aot.load_or_compile(("kap_pool", "kap_rank"), "float16", 64, lambda: compiled) == (compiled, jit_source)


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


@pytest.fixture
def gpu_with_wheel_kernels(site, monkeypatch):
    """osk_forward launches the kernels of the installed cosa's libcosa, which are those of the
    wheel built here (the example's library) when both are built from this tree."""
    if not cosa._C.has_kernels():
        pytest.skip("the installed cosa was built without the kernels (COSA_AOT_KERNELS=1 pip install .)")
    monkeypatch.delenv(aot.DISABLE_AOT, raising=False)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("budget,delta", [(1.0, 0.0), (0.3, 0.05)])
def test_example_matches_python_run(example, gpu_with_wheel_kernels, tmp_path, budget, delta):
    # Both stages in both: KAP's order mask, then OSK, from the same libcosa on the same
    # inputs, so the same bits (the example checks budget 1 against dense attention itself).
    out = tmp_path / "o.f32"
    printed = run_checked(example, out, str(budget), str(delta))
    assert "all checks passed" in printed if budget == 1.0 else "o written" in printed
    assert "graph replay on new q equals the eager run" in printed
    q, cache, table, shapes = _inputs()
    plan = cosa.plan(*(t.cuda() for t in table), **shapes, causal=True, budget=budget, delta=delta)
    expected = cosa.run(plan, q.cuda(), cache.cuda()).float().cpu()
    assert {aot.kernel_source(kernel, "bfloat16", 128).kind for kernel in aot.KERNELS} == {"aot"}
    assert plan.rank_kernel is not None  # Python's order mask comes from the KAP kernels too
    assert plan.stats().density_stage1 < 1 or budget == 1.0
    got = torch.from_numpy(np.fromfile(out, dtype=np.float32)).view_as(expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("dtype,head_dim,device", [
    (torch.bfloat16, 128, "cuda:0"), (torch.float16, 64, "cuda:0"),
    # the plain C ABI launches on the current device: run must make it the tensors'
    pytest.param(torch.bfloat16, 128, "cuda:1",
                 marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")),
])
def test_run_with_loaded_kernel_equals_jit(gpu_with_wheel_kernels, monkeypatch, dtype, head_dim, device):
    q, cache, table, shapes = _inputs()
    q, cache = (x[..., :head_dim].to(dtype).contiguous().to(device) for x in (q, cache))
    plan = cosa.plan(*(t.to(device) for t in table), **{**shapes, "head_dim": head_dim}, q_data_type=dtype,
                     budget=0.5, delta=0.05)
    name = str(dtype).removeprefix("torch.")
    results = {}
    for kind in ("aot", "jit"):
        if kind == "jit":
            monkeypatch.setenv(aot.DISABLE_AOT, "1")
        # poisoned, so that an element neither kernel writes cannot compare equal
        o, lse = torch.full_like(q, math.nan), torch.full(q.shape[:2], math.nan, device=device)
        plan.computed.fill_(POISON)
        plan.skipped.fill_(POISON)
        with torch.cuda.device(0):
            cosa.run(plan, q, cache, out=o, lse=lse)
        stats = plan.stats()
        assert not o.isnan().any() and not lse.isnan().any()
        assert (stats.computed >= 1).all() and (stats.skipped >= 0).all()
        results[kind] = (o, lse, stats.computed, stats.skipped)
        assert {aot.kernel_source(kernel, name, head_dim).kind for kernel in aot.KERNELS} == {kind}
    # the same kernel source and options; only the host ABI differs (plain C against TVM-FFI)
    for loaded, compiled in zip(results["aot"], results["jit"]):
        torch.testing.assert_close(loaded, compiled, rtol=0, atol=0)


# ---------------------------------------------------------------- the attention C API's checks
# cosa.h's structs as ctypes lays them out: C's rules, field by field.
_i32p, _i64 = ctypes.POINTER(ctypes.c_int32), ctypes.c_int64


class _RemapArgs(ctypes.Structure):
    _fields_ = [("qo_indptr", _i32p), ("qo_indptr_size", _i64), ("kv_indptr", _i32p), ("kv_indptr_size", _i64),
                ("kv_indices", _i32p), ("kv_indices_size", _i64), ("kv_last_page_len", _i32p),
                ("kv_last_page_len_size", _i64), ("num_pages", _i64), ("page_size", ctypes.c_int32),
                ("num_qo_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("causal", ctypes.c_bool), ("budget", ctypes.c_double), ("force_local", ctypes.c_bool),
                ("force_sink", ctypes.c_bool)]


class _PlanArgs(ctypes.Structure):
    _fields_ = [("remap", _RemapArgs), ("dtype", ctypes.c_int32), ("sm_scale", ctypes.c_double),
                ("delta", ctypes.c_double), ("proxy", ctypes.c_int32)]


class _RunArgs(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("q_strides", _i64 * 2), ("k_cache", ctypes.c_void_p),
                ("k_strides", _i64 * 3), ("v_cache", ctypes.c_void_p), ("v_strides", _i64 * 3),
                ("order", ctypes.c_void_p), ("o", ctypes.c_void_p), ("o_strides", _i64 * 2),
                ("lse", ctypes.c_void_p), ("computed", ctypes.c_void_p), ("skipped", ctypes.c_void_p)]


_INVALID_ARGUMENT = 1


class _CApi:
    """libcosa's attention functions, and plan arguments for one request of ``tokens``
    tokens (q_len = kv_len, page size 128, 4 query / 2 kv heads, head_dim 128, bf16)."""

    def __init__(self, library: Path):
        self.lib = ctypes.CDLL(str(library))
        self.lib.cosa_last_error.restype = ctypes.c_char_p
        self.lib.cosa_plan_create.argtypes = [ctypes.POINTER(_PlanArgs), ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cosa_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(_RunArgs), ctypes.c_void_p]
        self.lib.cosa_plan_destroy.argtypes = [ctypes.c_void_p]
        self.lib.cosa_plan_remap.argtypes = [ctypes.c_void_p]
        self.lib.cosa_plan_remap.restype = ctypes.c_void_p
        self.lib.cosa_has_kernels.restype = ctypes.c_bool
        self.lib.cosa_remap_plan_create.argtypes = [ctypes.POINTER(_RemapArgs), ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cosa_remap_plan_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cosa_remap_resolve_order.argtypes = [ctypes.c_void_p, _i32p, _i64, _i32p, _i64]
        self.lib.cosa_remap_plan_destroy.argtypes = [ctypes.c_void_p]

    def plan_args(self, tokens: int, **changes) -> _PlanArgs:
        pages = -(-tokens // 128)
        # kept with the plan arguments, which point into them
        self.page_table = [np.array(a, dtype=np.int32) for a in ([0, tokens], [0, pages], range(pages),
                                                                 [tokens - 128 * (pages - 1)])]
        pointers = [a.ctypes.data_as(_i32p) for a in self.page_table]
        remap = _RemapArgs(pointers[0], 2, pointers[1], 2, pointers[2], pages, pointers[3], 1, pages, 128, 4, 2,
                           128, True, 0.25, True, True)
        args = _PlanArgs(remap, 0, 128 ** -0.5, 0.05)  # COSA_DTYPE_BFLOAT16
        for name, value in changes.items():
            setattr(args.remap if hasattr(args.remap, name) else args, name, value)
        return args

    def create(self, args: _PlanArgs) -> tuple[int, ctypes.c_void_p]:
        plan = ctypes.c_void_p()
        return self.lib.cosa_plan_create(ctypes.byref(args), ctypes.byref(plan)), plan

    def error(self) -> str:
        return self.lib.cosa_last_error().decode()

    @contextlib.contextmanager
    def plan(self, args: _PlanArgs):
        """The plan ``args`` make (which must succeed), destroyed on exit."""
        status, plan = self.create(args)
        assert status == 0, self.error()
        try:
            yield plan
        finally:
            self.lib.cosa_plan_destroy(plan)

    @staticmethod
    def run_args(q: torch.Tensor, cache: torch.Tensor, o: torch.Tensor) -> _RunArgs:
        """cosa_run's operands: q and o [tokens, 4, 128], a combined NHD cache [pages, 2, 128, 2,
        128]; no order (KAP's), lse or counts (the plan's scratch)."""
        k, v = cache[:, 0], cache[:, 1]
        return _RunArgs(q.data_ptr(), q.stride()[:2], k.data_ptr(), k.stride()[:3], v.data_ptr(), v.stride()[:3],
                        None, o.data_ptr(), o.stride()[:2], None, None, None)

    def run(self, plan, args: _RunArgs, stream: int | None = None) -> int:
        """cosa_run's status."""
        return self.lib.cosa_run(plan, ctypes.byref(args), stream)


@pytest.fixture(scope="module")
def c_api(site) -> _CApi:
    return _CApi(_libcosa(site))


BAD_PLAN_ARGS = {
    "head_dim": ({"head_dim": 96}, "head_dim must be 64 or 128, got 96"),
    "dtype": ({"dtype": 7}, "dtype must be COSA_DTYPE_BFLOAT16 or COSA_DTYPE_FLOAT16, got 7"),
    "sm_scale": ({"sm_scale": float("nan")}, "sm_scale must be in (0, "),
    "sm_scale beyond float32": ({"sm_scale": 1e39}, "sm_scale must be in (0, 2.358"),
    "delta": ({"delta": -1e-9}, "delta must be finite and >= 0, got -1e-09"),
    "proxy": ({"proxy": 2}, "proxy must be COSA_PROXY_KAP or COSA_PROXY_CALLER, got 2"),
    "page table": ({"kv_last_page_len_size": 2}, "kv_last_page_len must have B = 1 entries"),
    "num_pages": ({"num_pages": 2**31}, "num_pages must fit in int32, got 2147483648"),
    # what a C caller alone can pass: the sizes of the arrays it points to
    "negative size": ({"kv_indices_size": -1}, "kv_indices has a negative size: -1"),
    "null array": ({"kv_indices": None}, "kv_indices is null but has size 8"),
}


@pytest.mark.parametrize("changes, message", BAD_PLAN_ARGS.values(), ids=BAD_PLAN_ARGS.keys())
def test_plan_create_rejects_bad_arguments_naming_them(changes, message):
    # checked before any CUDA call and before the kernels are needed: the installed package's
    # libcosa answers, built with the kernels or not, with or without a GPU
    c_api = _CApi(aot.libcosa_path())
    status, plan = c_api.create(c_api.plan_args(1000, **changes))
    assert (status, plan.value) == (_INVALID_ARGUMENT, None)
    assert c_api.error().startswith(message)


class _RemapPlanSizes(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("batch_size", "num_qo_heads", "num_kv_blocks", "pages_per_block",
                                                    "num_qtiles", "num_tiles", "k_max")]


def test_c_api_refuses_null_pointers_and_wrong_sizes():
    # the installed package's libcosa, built with the kernels or not, with or without a GPU
    c_api = _CApi(aot.libcosa_path())
    lib, plan = c_api.lib, ctypes.c_void_p()
    args = c_api.plan_args(1000)
    for call, message in (
            (lambda: lib.cosa_plan_create(None, ctypes.byref(plan)), "args must not be NULL"),
            (lambda: lib.cosa_plan_create(ctypes.byref(args), None), "out must not be NULL"),
            (lambda: lib.cosa_run(None, ctypes.byref(_RunArgs()), None), "plan must not be NULL"),
            (lambda: lib.cosa_remap_plan_create(None, ctypes.byref(plan)), "args must not be NULL"),
            (lambda: lib.cosa_remap_plan_create(ctypes.byref(args.remap), None), "out must not be NULL"),
            (lambda: lib.cosa_remap_plan_info(None, ctypes.byref(_RemapPlanSizes())), "plan must not be NULL"),
            (lambda: lib.cosa_remap_resolve_order(None, None, 0, None, 0), "plan must not be NULL")):
        assert call() == _INVALID_ARGUMENT
        assert c_api.error().startswith(message), c_api.error()
    assert lib.cosa_remap_plan_create(ctypes.byref(args.remap), ctypes.byref(plan)) == 0, c_api.error()
    try:
        sizes = _RemapPlanSizes()
        assert lib.cosa_remap_plan_info(plan, None) == _INVALID_ARGUMENT
        assert c_api.error().startswith("out must not be NULL")
        assert lib.cosa_remap_plan_info(plan, ctypes.byref(sizes)) == 0
        entries = sizes.num_qtiles * sizes.num_qo_heads * sizes.k_max
        order = np.full(entries + 1, -1, dtype=np.int32)
        out_pages = np.empty(entries * sizes.pages_per_block + 1, dtype=np.int32)
        resolve = lambda order_size, out_size: lib.cosa_remap_resolve_order(  # noqa: E731
            plan, order.ctypes.data_as(_i32p), order_size, out_pages.ctypes.data_as(_i32p), out_size)
        assert resolve(entries + 1, entries * sizes.pages_per_block) == _INVALID_ARGUMENT
        assert c_api.error().startswith(f"order must have num_qtiles*num_qo_heads*k_max = {sizes.num_qtiles}*"
                                        f"{sizes.num_qo_heads}*{sizes.k_max} = {entries} entries, got {entries + 1}")
        assert resolve(entries, entries * sizes.pages_per_block + 1) == _INVALID_ARGUMENT
        assert c_api.error().startswith(f"out_pages must have order's {entries} entries * pages_per_block "
                                        f"{sizes.pages_per_block}")
        assert resolve(-1, 0) == _INVALID_ARGUMENT
        assert c_api.error().startswith("order has a negative size: -1")
    finally:
        lib.cosa_remap_plan_destroy(plan)


def test_plan_create_refuses_device_arrays_beyond_int64_words(c_api):
    # No query rows, so heads up to int32's limit pass the remap's checks; KAP's key means
    # (key blocks x kv heads x head_dim) then overflow: 8193 requests of 2048 256-token pages
    batch, pages = 8193, 2048
    table = [np.zeros(batch + 1, np.int32), (np.arange(batch + 1) * pages).astype(np.int32),
             np.zeros(batch * pages, np.int32), np.full(batch, 256, np.int32)]
    pointers = [a.ctypes.data_as(_i32p) for a in table]
    heads = 2**31 - 1
    remap = _RemapArgs(pointers[0], batch + 1, pointers[1], batch + 1, pointers[2], batch * pages, pointers[3], batch,
                       1, 256, heads, heads, 128, True, 0.25, True, True)
    status, plan = c_api.create(_PlanArgs(remap, 0, 128 ** -0.5, 0.0))
    assert (status, plan.value) == (_INVALID_ARGUMENT, None)  # before any CUDA call, GPU or not
    assert c_api.error() == (f"num_qo_heads={heads} and num_kv_heads={heads} over {batch * pages * 2} key blocks "
                             f"give the plan more than {2**63 // 8 - 1} words")


def test_libcosa_is_named_by_its_minor_version_and_installed_once():
    # 0.x: another minor may change the ABI, so a program linked against one fails to load
    # another's libcosa; and the wheel ships no second copy in place of the libcosa.so link
    library = aot.libcosa_path()
    major, minor = cosa.__version__.split(".")[:2]
    assert library.name == f"libcosa.so.{major}.{minor}"
    assert f"Library soname: [{library.name}]" in run_checked("readelf", "-d", library)
    assert [path.name for path in library.parent.glob("libcosa*")] == [library.name]


def test_plan_create_without_the_kernels_says_so():
    library = aot.libcosa_path()
    c_api = _CApi(library)
    if c_api.lib.cosa_has_kernels():
        pytest.skip("the installed cosa was built with the kernels")
    status, plan = c_api.create(c_api.plan_args(1000))
    assert (status, plan.value) == (3, None)   # COSA_ERROR_UNSUPPORTED
    assert c_api.error() == "libcosa was built without the kernels (configure with -DCOSA_AOT_KERNELS=ON)"


@pytest.mark.gpu
@pytest.mark.hopper
def test_run_rejects_bad_operands_and_a_missing_order_it_cannot_rank(c_api):
    # One request of MAX_KEY_BLOCKS + 1 key blocks (2M tokens): more than KAP ranks, so the
    # caller must pass the order.
    # Every case fails before a launch, but the operands are real, in case one did not.
    tokens = 128 * (kap.MAX_KEY_BLOCKS + 1)
    with c_api.plan(c_api.plan_args(tokens)) as plan:
        q = torch.zeros(tokens, 4, 128, dtype=torch.bfloat16, device="cuda")
        o = torch.empty_like(q)
        cache = torch.zeros(tokens // 128, 2, 128, 2, 128, dtype=torch.bfloat16, device="cuda")
        sizes = _RemapPlanSizes()
        assert c_api.lib.cosa_remap_plan_info(c_api.lib.cosa_plan_remap(plan), ctypes.byref(sizes)) == 0
        lse, counts, order = (torch.zeros(n, dtype=dtype, device="cuda") for n, dtype in (
            (tokens * 4, torch.float32), (tokens, torch.int32),
            (sizes.num_qtiles * sizes.num_qo_heads * sizes.k_max, torch.int32)))   # the plan's order mask
        args = c_api.run_args(q, cache, o)
        cases = {
            f"order must not be NULL: the longest request has {kap.MAX_KEY_BLOCKS + 1} key blocks": {},
            "q must be 16-byte aligned": {"q": q.data_ptr() + 2},
            "k_cache strides must be positive multiples of 8, got stride[1]=4":
                {"k_strides": (cache.stride(0), 4, 128)},
            # the last page 2^32 elements (2^29 16-byte units) past the first: beyond the TMA's int32
            "v_cache's last page and kv head start more than 2147483646 16-byte units past its first":
                {"v_strides": (1 << 32, 256, 128)},
            "o must not be NULL": {"o": None},
            f"o strides {{512, 8}} make its [{tokens}, 4, 128] elements overlap": {"o_strides": (512, 8)},
            "lse must be 4-byte aligned": {"lse": lse.data_ptr() + 2},
            "o shares memory with q: an output must not overlap another output or an input": {"o": q.data_ptr()},
            "o shares memory with lse": {"lse": o.data_ptr() + o.numel()},   # o's second half
            "computed shares memory with skipped": {"computed": counts.data_ptr(), "skipped": counts.data_ptr()},
            "computed shares memory with order": {"order": order.data_ptr(), "computed": order.data_ptr() + 4},
        }
        for message, changes in cases.items():
            bad = _RunArgs.from_buffer_copy(args)
            for name, value in changes.items():
                setattr(bad, name, value)
            assert c_api.run(plan, bad) == _INVALID_ARGUMENT, message
            assert c_api.error().startswith(message)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_run_refuses_a_plan_made_on_another_device(c_api):
    # a plan's tables and scratch live on the device current at cosa_plan_create
    tokens = 1000
    with torch.cuda.device(0), c_api.plan(c_api.plan_args(tokens)) as plan, torch.cuda.device(1):
        q = torch.zeros(tokens, 4, 128, dtype=torch.bfloat16, device="cuda:1")
        o = torch.full_like(q, float("nan"))
        cache = torch.zeros(-(-tokens // 128), 2, 128, 2, 128, dtype=torch.bfloat16, device="cuda:1")
        assert c_api.run(plan, c_api.run_args(q, cache, o)) == _INVALID_ARGUMENT
        assert c_api.error() == "plan was created on device 0, the current device is 1"
        assert o.isnan().all()


@pytest.mark.gpu
@pytest.mark.hopper
def test_a_caller_proxy_plan_runs_the_callers_order_and_needs_one(c_api):
    tokens = 3000
    with c_api.plan(c_api.plan_args(tokens, proxy=1)) as plan:   # COSA_PROXY_CALLER
        q = torch.randn(tokens, 4, 128, device="cuda").to(torch.bfloat16)
        cache = torch.randn(-(-tokens // 128), 2, 128, 2, 128, device="cuda").to(torch.bfloat16)
        o = torch.full_like(q, float("nan"))
        args = c_api.run_args(q, cache, o)
        assert c_api.run(plan, args) == _INVALID_ARGUMENT
        assert c_api.error() == "order must not be NULL: the plan was created with proxy COSA_PROXY_CALLER"
        python_plan = cosa.plan(*(torch.from_numpy(a).cuda() for a in c_api.page_table), 4, 2, 128, 128,
                                budget=0.25, delta=0.05)
        order = cosa.order_mask(python_plan, q, cache).clone()
        args.order = order.data_ptr()
        assert c_api.run(plan, args, torch.cuda.current_stream().cuda_stream) == 0, c_api.error()
        torch.testing.assert_close(o, cosa.run(python_plan, q, cache), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.hopper
def test_a_caller_proxy_plan_leaves_out_kaps_scratch(c_api):
    # 1M tokens of 4 query and 2 kv heads: KAP's order mask and means are about 160 MB
    tokens = 1 << 20
    sizes = _RemapPlanSizes()
    allocated = {}
    for proxy in (0, 1):   # COSA_PROXY_KAP, COSA_PROXY_CALLER
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        with c_api.plan(c_api.plan_args(tokens, proxy=proxy)) as plan:
            allocated[proxy] = free - torch.cuda.mem_get_info()[0]
            assert c_api.lib.cosa_remap_plan_info(c_api.lib.cosa_plan_remap(plan), ctypes.byref(sizes)) == 0
    scratch = 4 * (sizes.num_tiles * sizes.k_max + sizes.num_qtiles * 4 * 128 + sizes.num_kv_blocks * 2 * 128)
    assert allocated[0] - allocated[1] >= 0.9 * scratch and allocated[1] < scratch / 4, (allocated, scratch)


@pytest.mark.gpu
@pytest.mark.hopper
def test_run_without_query_rows_reads_and_writes_nothing(c_api):
    # an empty batch's tensors may be NULL (an empty CUDA tensor's data_ptr() is 0)
    args = c_api.plan_args(1000)
    c_api.page_table[0][1] = 0   # no query rows: qo_indptr [0, 0]
    with c_api.plan(args) as plan:
        assert c_api.run(plan, _RunArgs()) == 0, c_api.error()


@pytest.mark.gpu
@pytest.mark.hopper
def test_run_ranks_past_the_small_sort_as_python_does(c_api):
    # KEY_SLOTS + 10 key blocks: cosa_run's own order mask (NULL order) from KAPRank's larger
    # shared memory, then OSK; bitwise Python's run of the same kernels, over NaN
    tokens = 128 * (kap.KEY_SLOTS + 10)
    with c_api.plan(c_api.plan_args(tokens)) as plan:
        q = torch.randn(tokens, 4, 128, device="cuda").to(torch.bfloat16)
        cache = torch.randn(tokens // 128, 2, 128, 2, 128, device="cuda").to(torch.bfloat16)
        o = torch.full_like(q, float("nan"))
        assert c_api.run(plan, c_api.run_args(q, cache, o), torch.cuda.current_stream().cuda_stream) == 0, \
            c_api.error()
        python_plan = cosa.plan(*(torch.from_numpy(a).cuda() for a in c_api.page_table), 4, 2, 128, 128,
                                budget=0.25, delta=0.05)
        assert python_plan.rank_kernel is not None
        torch.testing.assert_close(o, cosa.run(python_plan, q, cache), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("force_local,force_sink", [(True, False), (False, True), (False, False)])
def test_run_forces_the_blocks_the_plan_says_as_python_does(c_api, force_local, force_sink):
    # cosa_run's own order mask with some forced blocks off: bitwise Python's run
    tokens = 3000
    flags = {"force_local": force_local, "force_sink": force_sink}
    with c_api.plan(c_api.plan_args(tokens, budget=0.1, **flags)) as plan:
        q = torch.randn(tokens, 4, 128, device="cuda").to(torch.bfloat16)
        cache = torch.randn(-(-tokens // 128), 2, 128, 2, 128, device="cuda").to(torch.bfloat16)
        o = torch.full_like(q, float("nan"))
        assert c_api.run(plan, c_api.run_args(q, cache, o), torch.cuda.current_stream().cuda_stream) == 0, \
            c_api.error()
        python_plan = cosa.plan(*(torch.from_numpy(a).cuda() for a in c_api.page_table), 4, 2, 128, 128,
                                budget=0.1, delta=0.05, **flags)
        torch.testing.assert_close(o, cosa.run(python_plan, q, cache), rtol=0, atol=0)


# Run in a fresh process, so that cosa_run loads its kernels' modules inside the capture (they
# load on first use): the first cosa_run is captured in a CUDA graph under torch's global
# capture mode, replayed, and must equal an eager run on the same inputs, written over NaN.
_FIRST_RUN_IN_A_GRAPH = """
import sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from test_aot import _CApi

c_api, tokens = _CApi(Path(sys.argv[2])), 1000
status, plan = c_api.create(c_api.plan_args(tokens))   # budget 0.25: KAP's kernels, then OSK's
assert status == 0, c_api.error()   # the plan is freed at the process's exit
q = torch.randn(tokens, 4, 128, device="cuda").to(torch.bfloat16)
cache = torch.randn(-(-tokens // 128), 2, 128, 2, 128, device="cuda").to(torch.bfloat16)

def run(o):
    assert c_api.run(plan, c_api.run_args(q, cache, o), torch.cuda.current_stream().cuda_stream) == 0, c_api.error()

replayed, eager = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    run(replayed)
graph.replay()
run(eager)
torch.cuda.synchronize()
assert not eager.isnan().any()
torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
"""


@pytest.mark.gpu
@pytest.mark.hopper
def test_first_run_can_be_captured_in_a_cuda_graph(site):
    run_checked(sys.executable, "-c", _FIRST_RUN_IN_A_GRAPH, Path(__file__).parent, _libcosa(site))
