"""bench/sass_report.py's listing parser and loop finder on synthetic cuobjdump listings (the
report itself needs ptxas and cuobjdump)."""

from __future__ import annotations

import random
from pathlib import Path

from sass_report import Loop, first_difference, load_variant, parse_sass, wgmma_loops

FILLER = ("FADD R4, R4, R5", "@P0 IMAD R6, R7, R8, R9", "UIADD3 UR4, UR4, 0x1, URZ", "FMNMX R2, R2, R3, !PT")


class Listing:
    """Instructions at consecutive addresses, written as cuobjdump prints them."""

    def __init__(self):
        self.lines: list[str] = []

    @property
    def address(self) -> int:
        return 0x10 * len(self.lines)

    def add(self, text: str) -> int:
        address = self.address
        self.lines.append(f"        /*{address:04x}*/                   {text} ;   /* 0x000fe20000000f00 */")
        return address

    def filler(self, rng: random.Random, n: int) -> None:
        for _ in range(n):
            self.add(rng.choice(FILLER))


def test_loops_around_wgmmas_are_found_and_counted():
    rng = random.Random()
    listing = Listing()
    listing.lines.append("        code for sm_90a")
    listing.filler(rng, rng.randrange(1, 20))
    # a loop with no wgmma: not reported
    top = listing.add("LDS R0, [R1]")
    listing.filler(rng, rng.randrange(1, 20))
    listing.add(f"@P1 BRA {top:#x}")
    # the wgmma loop
    start = listing.add("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R13+UR7+0x10], R16")
    listing.add("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT")
    hgmma, waits, r2ur, local = 1, 0, 0, 0
    body = rng.randrange(20, 200)
    for _ in range(body):
        kind = rng.random()
        if kind < 0.1:
            listing.add("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24")
            hgmma += 1
        elif kind < 0.15:
            listing.add("WARPGROUP.DEPBAR.LE gsb0, 0x0")
            waits += 1
        elif kind < 0.2:
            listing.add("R2UR UR18, R196")
            r2ur += 1
        elif kind < 0.25:
            listing.add(rng.choice(("STL [R1+0x8], R3", "LDL.LU R3, [R1+0x8]", "@!P0 STL.64 [R1], R4")))
            local += 1
        else:
            listing.add(rng.choice(FILLER))
    listing.add("@P2 BRA 0x9990")  # a forward branch inside the body
    end = listing.add(f"@!P3 BRA {start:#x}")
    listing.filler(rng, rng.randrange(1, 20))
    listing.add("EXIT")
    # an mbarrier wait's retry stub after the end, branching back into the body: not a loop
    listing.add("SYNCS.PHASECHK.TRANS64 P0, [R13+UR7+0x10], R16")
    listing.add(f"@!P0 BRA {start + 0x10:#x}")
    listing.add(f"BRA {top:#x}")

    instructions = parse_sass("\n".join(listing.lines))
    assert len(instructions) == len(listing.lines) - 1
    assert wgmma_loops(instructions) == [Loop(start, end, body + 4, hgmma, waits, r2ur, local)]


def test_parse_sass_reads_addresses_and_strips_encodings():
    text = ("        /*0be0*/                   R2UR UR19, R197 ;          /* 0x00000000c51372ca */\n"
            "                                                              /* 0x000fe200000e0000 */\n"
            "        /*0bf0*/                   @!P0 BRA 0x252d0 ;         /* 0x0000000000009947 */")
    assert parse_sass(text) == [(0xBE0, "R2UR UR19, R197"), (0xBF0, "@!P0 BRA 0x252d0")]


def test_a_kernel_variant_with_a_dataclass_loads(tmp_path):
    """--kernel FILE: osk.py defines a dataclass under postponed annotations, which looks its
    module up in sys.modules."""
    variant = tmp_path / "variant.py"
    variant.write_text("from __future__ import annotations\n\nfrom dataclasses import dataclass\n\n\n"
                       "@dataclass(frozen=True)\nclass Rows:\n"
                       "    n: int\n\n\ndef compile_config(dtype, head_dim, use_tvm_ffi=False):\n"
                       "    return Rows(head_dim)\n")
    assert load_variant(str(variant)).compile_config("bfloat16", 128).n == 128


def test_a_verbatim_copy_of_the_kernel_module_loads(tmp_path):
    """--kernel FILE with a copy of osk.py itself (e.g. from ``git show REV:cute_kernels/osk.py``):
    its relative imports resolve against cosa.cute_kernels."""
    variant = tmp_path / "osk_copy.py"
    variant.write_text("from .aot import load_kernel\n\n\ndef compile_config(dtype, head_dim, use_tvm_ffi=False):\n"
                       "    return load_kernel\n")
    from cosa.cute_kernels.aot import load_kernel

    assert load_variant(str(variant)).compile_config("bfloat16", 128) is load_kernel


def test_first_difference_names_where_two_listings_part():
    a = [(0x10, "IADD3 R1, R2, R3"), (0x20, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ")]
    assert first_difference(a, list(a)) is None
    moved = [(0x10, "IADD3 R1, R2, R3"), (0x30, a[1][1])]
    assert first_difference(a, moved) == f"0x00020: {a[1][1]}  |  0x00030: {a[1][1]}"
    assert first_difference(a, a[:1]) == "2 against 1 instructions"


def test_two_versions_load_side_by_side_under_their_own_names(tmp_path):
    """bench_osk_ab.py loads a base and a new version in one process: neither replaces the other."""
    versions = {}
    for name, value in (("osk_base", random.randrange(100)), ("osk_new", random.randrange(100, 200))):
        path = tmp_path / f"{name}.py"
        path.write_text(f"VALUE = {value}\n")
        versions[name] = (load_variant(str(path), name), value)
    for name, (module, value) in versions.items():
        assert module.__name__ == f"cosa.cute_kernels.{name}" and module.VALUE == value


def test_the_default_kernel_is_this_checkouts_file(monkeypatch):
    """Without --kernel the report compiles the osk.py being edited, not the installed cosa
    (which may lag it)."""
    import sass_report

    compiled = []

    def record(kernel, dtype, head_dim, dump):
        compiled.append(kernel)
        raise SystemExit("recorded")

    monkeypatch.setattr(sass_report, "_compile_ptx", record)
    for argv, expected in (([], Path(__file__).resolve().parents[1] / "cute_kernels" / "osk.py"),
                           (["--kernel", "/elsewhere/osk_rev.py"], Path("/elsewhere/osk_rev.py"))):
        try:
            sass_report.main(argv)
        except SystemExit as stop:
            assert str(stop) == "recorded"
        assert Path(compiled.pop()) == expected
    assert (Path(__file__).resolve().parents[1] / "cute_kernels" / "osk.py").is_file()


def test_a_reused_save_directory_reports_the_new_compile_not_an_earlier_ptx(tmp_path, monkeypatch):
    """--save DIR run twice: the DSL's dump of the second compile is the PTX read, not whichever
    file of the first sorts first."""
    import sass_report

    for name in ("CUTE_DSL_ARCH", "CUTE_DSL_KEEP_PTX", "CUTE_DSL_DUMP_DIR"):
        monkeypatch.setenv(name, "")    # recorded, so that what _compile_ptx sets is undone after
    stamp = str(random.getrandbits(64))
    variant = tmp_path / "variant.py"
    variant.write_text("import os\nfrom pathlib import Path\n\n\ndef compile_config(dtype, head_dim, use_tvm_ffi=False):\n"
                       f"    (Path(os.environ['CUTE_DSL_DUMP_DIR']) / 'zz_kernel.ptx').write_text('{stamp}')\n")
    dump = tmp_path / "save" / "dump"
    dump.mkdir(parents=True)
    (dump / "aa_earlier_config.ptx").write_text("stale")
    assert sass_report._compile_ptx(str(variant), "bfloat16", 128, dump).read_text() == stamp
