"""Every benchmark script, run without a GPU (as in CI), says so and exits 0."""

from __future__ import annotations

import pytest
import torch

import bench_attention
import bench_first_call
import bench_osk_ab
import bench_read_floor
import bench_ttft


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
@pytest.mark.parametrize("script,argv", [(bench_attention, []), (bench_first_call, []), (bench_osk_ab, ["base.py"]),
                                         (bench_read_floor, []), (bench_ttft, [])])
def test_without_a_gpu_it_says_so_and_exits_0(script, argv, capsys):
    assert script.main(argv) == 0
    assert f"{script.__name__}: no CUDA GPU is available; this benchmark needs one" in capsys.readouterr().out
