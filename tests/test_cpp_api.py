"""The installed C API, used as a downstream C/C++ project would: tests/cpp is
configured with find_package(cosa) against the installed package, built and run."""

import os
import shutil
from pathlib import Path

import pytest

import cosa
from processes import run_checked

EXAMPLE = Path(__file__).parent / "cpp"


def test_remap_example_against_installed_package(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    for variable, default in (("CC", "cc"), ("CXX", "c++")):
        if shutil.which(os.environ.get(variable, default)) is None:
            pytest.skip(f"no {default} compiler (set {variable})")
    build = tmp_path / "build"

    run_checked(cmake, "-S", EXAMPLE, "-B", build, f"-DCMAKE_PREFIX_PATH={cosa.cmake_prefix_path()}",
                "-DCMAKE_BUILD_TYPE=Release")
    run_checked(cmake, "--build", build)
    output = run_checked(build / "remap_example")

    assert "rejected as expected: kv_indptr must be non-decreasing" in output
    assert "all checks passed" in output
