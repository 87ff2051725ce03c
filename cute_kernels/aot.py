"""Ahead-of-time export of the OSK kernels, run by the build when COSA_AOT_KERNELS is on.

    python cute_kernels/aot.py OUT_DIR

writes, for every configuration of ``osk.CONFIGS``, ``OUT_DIR/<prefix>.h`` (the DSL's C
header: argument structs, the module load and the launch wrapper) and ``OUT_DIR/<prefix>.o``
(position-independent host code with the cubin embedded), ``prefix`` from ``aot_prefix``.
The objects are linked into libcosa.  It needs the CuTe DSL only: no GPU and no torch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__:
    from . import osk
else:  # run as a script by the build, from the source tree
    import osk


_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def aot_prefix(dtype_name: str, head_dim: int) -> str:
    """Symbol prefix of one exported configuration (csrc/attention.cpp spells the same names)."""
    return f"cosa_osk_{_SHORT[dtype_name]}_d{head_dim}"


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for dtype_name, head_dim in osk.CONFIGS:
        start = time.perf_counter()
        prefix = aot_prefix(dtype_name, head_dim)
        # The plain C ABI (no TVM-FFI): what a C caller and cute.runtime.load_module use.
        osk.compile_config(dtype_name, head_dim, use_tvm_ffi=False).export_to_c(str(out), prefix, prefix)
        print(f"{prefix}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
