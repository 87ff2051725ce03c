"""The kernels ahead of time: exported when libcosa is built, loaded by the launchers.

Export, run by the build when COSA_AOT_KERNELS is on (from the source root)::

    python -m cute_kernels.aot OUT_DIR

writes, for every kernel of ``KERNELS`` in every configuration of ``osk.CONFIGS``,
``OUT_DIR/<prefix>.h`` (the DSL's C header: argument structs, the module load and the launch
wrapper) and ``OUT_DIR/<prefix>.o`` (position-independent host code with the cubin
embedded), ``prefix`` from ``aot_prefix``.  The objects are linked into libcosa.  It needs
the CuTe DSL only: no GPU and no torch.

Load: when the installed libcosa carries the kernels, ``osk.Launcher`` and ``kap.Launcher``
take them from it instead of compiling on first use, and launch them through libcosa's own
launchers (``csrc/kernels.hpp``, bound in ``cosa._C``), so that the C API and Python run the very same
binaries with the same host code, at a third of the host time the DSL's generic argument
packing took (bench/NOTES.md, session 36).  Otherwise (a default build,
``COSA_DISABLE_AOT=1``) the kernels are compiled as before.  ``kernel_source`` says which,
and why.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple, get_args

DISABLE_AOT = "COSA_DISABLE_AOT"  # set (not "0"): always compile, even when libcosa has the kernels

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
# What is exported in every configuration: OSK, and KAP's two kernels (kap.compile_config's pair)
Kernel = Literal["osk", "kap_pool", "kap_rank"]
KERNELS = get_args(Kernel)


def aot_prefix(kernel: Kernel, dtype_name: str, head_dim: int) -> str:
    """Symbol prefix of one exported kernel (csrc/attention.cpp spells the same names)."""
    return f"cosa_{kernel}_{_SHORT[dtype_name]}_d{head_dim}"


class KernelSource(NamedTuple):
    """Where a launcher takes one kernel of one configuration from."""

    kind: Literal["aot", "jit"]  # loaded from libcosa, or compiled on first use
    detail: str                  # the library it is loaded from, or why it is compiled instead


def load_kernel(kernel: Kernel, dtype_name: str, head_dim: int) -> tuple[Callable | None, KernelSource]:
    """libcosa's launcher of ``kernel`` for the configuration (None: compile it) and its source.

    The launcher is called as ``launcher(words, scalars, stream)``: the kernel's torch tensors in
    its order as ``tensor_words`` packs them, its scalars, and the address of a CUDA stream of
    the current device.
    """
    switch = os.environ.get(DISABLE_AOT, "")
    if switch not in ("", "0"):  # read on every call, so a test can flip it
        return None, KernelSource("jit", f"{DISABLE_AOT}={switch}")
    return _load(kernel, dtype_name, head_dim)


def load_or_compile(kernels: tuple[Kernel, ...], dtype_name: str, head_dim: int,
                    compile: Callable[[], tuple]) -> tuple[tuple, KernelSource]:
    """The configuration's ``kernels`` as libcosa exports them, if it carries them all, or else
    ``compile()``'s (the same kernels, compiled); and where they come from."""
    loaded = [load_kernel(kernel, dtype_name, head_dim) for kernel in kernels]
    for kernel, source in loaded:
        if kernel is None:
            return compile(), source
    return tuple(kernel for kernel, _ in loaded), loaded[0][1]


def kernel_source(kernel: Kernel, dtype_name: str, head_dim: int) -> KernelSource:
    """Whether the launcher loads ``kernel`` of the configuration from libcosa or compiles it."""
    return load_kernel(kernel, dtype_name, head_dim)[1]


def libcosa_path() -> Path:
    """The libcosa that ``cosa._C`` loads, in the package's lib/ (beside this cosa/cute_kernels)."""
    from .. import _C   # here: the build runs this file as cute_kernels.aot, outside the package

    return Path(__file__).resolve().parents[1] / "lib" / _C.LIBCOSA


@functools.cache
def _load(kernel: Kernel, dtype_name: str, head_dim: int) -> tuple[Callable | None, KernelSource]:
    from .. import _C

    if not _C.has_kernels():
        return None, KernelSource("jit", f"{libcosa_path()} was built without the kernels (COSA_AOT_KERNELS)")
    launch = getattr(_C, f"launch_{kernel}")

    def launcher(words: list[int], scalars, stream: int) -> None:
        launch(dtype_name, head_dim, words, *scalars, stream)
    return launcher, KernelSource("aot", str(libcosa_path()))


def tensor_words(tensors) -> list[int]:
    """Torch tensors as libcosa's launchers take them (``cosa._C``), eight words each: the
    address, four extents and the strides of all but the last dim, 0 past the tensor's dims."""
    words = []
    for t in tensors:
        padding = (0,) * (4 - t.dim())
        words += (t.data_ptr(), *t.shape, *padding, *t.stride()[:-1], *padding)
    return words


def main(out_dir: str) -> None:
    from . import kap, osk  # here: osk imports this module, and kernel_source works without the DSL

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for dtype_name, head_dim in osk.CONFIGS:
        start = time.perf_counter()
        # The plain C ABI (no TVM-FFI): what libcosa's launchers (csrc/kernels.hpp) call.
        pool, rank = kap.compile_config(dtype_name, head_dim, use_tvm_ffi=False)
        compiled = {"osk": osk.compile_config(dtype_name, head_dim, use_tvm_ffi=False),
                    "kap_pool": pool, "kap_rank": rank}
        for kernel in KERNELS:
            prefix = aot_prefix(kernel, dtype_name, head_dim)
            compiled[kernel].export_to_c(str(out), prefix, prefix)
        print(f"{dtype_name} d{head_dim}: {', '.join(KERNELS)} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {__spec__.name} OUT_DIR")  # relative imports: -m only
    main(sys.argv[1])
