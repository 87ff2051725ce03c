"""The installed C API, used as a downstream C/C++ project would: tests/cpp is
configured with find_package(cosa) against the installed package, built and run."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import cosa

EXAMPLE = Path(__file__).parent / "cpp"


def _run(*command) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_remap_example_against_installed_package(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    for variable, default in (("CC", "cc"), ("CXX", "c++")):
        if shutil.which(os.environ.get(variable, default)) is None:
            pytest.skip(f"no {default} compiler (set {variable})")
    build = tmp_path / "build"

    _run(cmake, "-S", EXAMPLE, "-B", build, f"-DCMAKE_PREFIX_PATH={cosa.cmake_prefix_path()}",
         "-DCMAKE_BUILD_TYPE=Release")
    _run(cmake, "--build", build)
    output = _run(build / "remap_example")

    assert "rejected as expected: kv_indptr must be non-decreasing" in output
    assert "all checks passed" in output
