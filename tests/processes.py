"""Running a build or program from a test."""

from __future__ import annotations

import subprocess


def run_checked(*command, env=None) -> str:
    """``command``'s stdout; fails the test with the command and its output when it exits nonzero."""
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}"
    return result.stdout
