"""Static SASS of one compiled OSK configuration, no GPU needed: ptxas's register, spill and
wgmma-serialisation (C75xx) report, and for every loop around wgmmas (a backward branch whose
body holds HGMMA) its instruction count, its HGMMAs, its wgmma waits (WARPGROUP.DEPBAR: as
many as HGMMAs when ptxas has serialised them), its R2URs (values moved into the uniform
datapath inside the loop) and its local-memory traffic (spills).  The instruction counts in
NOTES.md come from here; a kernel variant is judged here before it costs device time.

    python bench/sass_report.py [--dtype bfloat16] [--head-dim 128] [--kernel FILE.py]
                                [--ptxas PATH] [--cuobjdump PATH] [--ptx-version 9.0] [--save DIR]
                                [--same-as FILE.py]

``--kernel``: a version of ``cute_kernels/osk.py`` (same ``compile_config``); by default this
checkout's file, the one being edited, not the installed cosa, which may lag it.  ptxas and
cuobjdump come from a CUDA 13 toolkit (or its pip wheels);
``--ptx-version`` rewrites the PTX's ``.version`` line when the DSL emits a newer one than
that ptxas reads.  ``--save DIR`` keeps the PTX, the cubin and the SASS listing.
``--same-as FILE.py``: also compile that version (say ``git show REV:cute_kernels/osk.py``)
and exit 1 unless the two SASS listings hold the same instructions at the same addresses --
the proof that a change to comments or names left the tested device code as it was.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHECKOUT_KERNEL = Path(__file__).resolve().parents[1] / "cute_kernels" / "osk.py"
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class Loop:
    start: int          # address of the branch target (the loop's first instruction)
    end: int            # address of the backward branch
    instructions: int
    hgmma: int
    waits: int          # WARPGROUP.DEPBAR
    r2ur: int
    local: int          # LDL/STL: spill traffic


def parse_sass(listing: str) -> list[tuple[int, str]]:
    """(address, instruction) pairs of a ``cuobjdump -sass`` listing."""
    out = []
    for line in listing.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def first_difference(a: list[tuple[int, str]], b: list[tuple[int, str]]) -> str | None:
    """None when two parsed listings are the same code, else where they first part."""
    for x, y in zip(a, b):
        if x != y:
            return f"{x[0]:#07x}: {x[1]}  |  {y[0]:#07x}: {y[1]}"
    if len(a) != len(b):
        return f"{len(a)} against {len(b)} instructions"
    return None


def opcode(instruction: str) -> str:
    return _PREDICATE.sub("", instruction).split()[0]


def _r2ur_and_local(ops: list[str]) -> tuple[int, int]:
    """R2UR count and LDL/STL (spill) count of a run of opcodes."""
    return ops.count("R2UR"), sum(op.startswith(("LDL", "STL")) for op in ops)


def wgmma_loops(instructions: list[tuple[int, str]]) -> list[Loop]:
    """Every backward branch whose body (target .. branch) holds an HGMMA and no EXIT, smallest
    first.  The EXIT test drops the out-of-line retry stubs of mbarrier waits, which ptxas
    places after the kernel's end and which branch back into its body."""
    position = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        m = _BRANCH_TARGET.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= address or target not in position:
            continue
        ops = [opcode(t) for _, t in instructions[position[target]:i + 1]]
        hgmma = sum(op.startswith("HGMMA") for op in ops)
        if hgmma and "EXIT" not in ops:
            waits = ops.count("WARPGROUP.DEPBAR.LE")
            loops.append(Loop(target, address, len(ops), hgmma, waits, *_r2ur_and_local(ops)))
    return sorted(loops, key=lambda loop: (loop.instructions, loop.start))


def load_variant(path: str, name: str = "osk_variant"):
    """The kernel module at ``path`` as the module ``name`` of ``cosa.cute_kernels``, so that a
    verbatim copy of osk.py (``from .aot import ...``) loads too, registered in ``sys.modules``
    first (dataclasses look their module up there while the module runs)."""
    import cosa.cute_kernels  # noqa: F401  (the parent package of the relative imports)

    spec = importlib.util.spec_from_file_location(f"cosa.cute_kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _compile_ptx(kernel: str, dtype: str, head_dim: int, dump: Path) -> Path:
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP_PTX"] = "1"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    shutil.rmtree(dump, ignore_errors=True)   # a --save directory's earlier PTX would be read instead
    dump.mkdir(parents=True)
    load_variant(kernel).compile_config(dtype, head_dim, use_tvm_ffi=False)
    ptx = sorted(dump.glob("*.ptx"))
    if not ptx:
        raise SystemExit(f"no PTX was dumped into {dump}")
    return ptx[0]


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:2])} failed:\n{result.stderr.strip()}")
    return result.stdout + result.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--kernel", default=str(CHECKOUT_KERNEL),
                        help="a version of cute_kernels/osk.py (default: this checkout's)")
    parser.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    parser.add_argument("--ptx-version", help="rewrite the PTX's .version line to this")
    parser.add_argument("--save", help="directory to keep the PTX, cubin and SASS in")
    parser.add_argument("--same-as", help="another version of osk.py: exit 1 unless its SASS is this one's")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.save) if args.save else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        ptx = _compile_ptx(args.kernel, args.dtype, args.head_dim, work / "dump")
        text = ptx.read_text()
        if args.ptx_version:
            text = re.sub(r"^\.version \S+", f".version {args.ptx_version}", text, count=1, flags=re.M)
        (work / "kernel.ptx").write_text(text)
        report = _run([args.ptxas, "-arch=sm_90a", "-v", str(work / "kernel.ptx"), "-o", str(work / "kernel.cubin")])
        listing = _run([args.cuobjdump, "-sass", str(work / "kernel.cubin")])
        (work / "kernel.sass").write_text(listing)
        if args.same_as:
            # its own process: the DSL reads its dump directory once
            _run([sys.executable, __file__, "--kernel", args.same_as, "--dtype", args.dtype,
                  "--head-dim", str(args.head_dim), "--ptxas", args.ptxas, "--cuobjdump", args.cuobjdump,
                  "--save", str(work / "same_as")] + (["--ptx-version", args.ptx_version] if args.ptx_version else []))
            other = parse_sass((work / "same_as" / "kernel.sass").read_text())

    print(f"OSK {args.dtype} d{args.head_dim} ({args.kernel}), sm_90a")
    for line in report.splitlines():
        if re.search(r"Used \d+ registers|spill|C75\d\d", line):
            print("  " + re.sub(r"in the function '.*'", "", line.replace("ptxas info    : ", "")).strip())
    instructions = parse_sass(listing)
    r2ur, local = _r2ur_and_local([opcode(t) for _, t in instructions])
    print(f"  {len(instructions)} instructions, {r2ur} R2UR, {local} LDL/STL")
    print(f"  {'loop':>17} {'instructions':>12} {'HGMMA':>6} {'waits':>5} {'R2UR':>5} {'LDL/STL':>7}")
    for loop in wgmma_loops(instructions):
        print(f"  {loop.start:#07x}-{loop.end:#07x} {loop.instructions:12d} {loop.hgmma:6d} {loop.waits:5d} "
              f"{loop.r2ur:5d} {loop.local:7d}")
    if args.same_as:
        difference = first_difference(instructions, other)
        print(f"  SASS {'identical to' if difference is None else 'differs from'} {args.same_as}"
              + ("" if difference is None else f": {difference}"))
        return 0 if difference is None else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
