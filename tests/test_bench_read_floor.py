"""bench/bench_read_floor.py on the CPU: the bytes it reads, its arguments and its kernel compiled
for sm_90a (the message without a GPU: test_bench_without_gpu.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
import bench_attention
import bench_read_floor


def test_proxy_bytes_are_the_benchmarks_q_and_k():
    seq = random.choice([128, 384, 1000])
    q, k, _ = bench_attention.structured_qkv(seq, bench_attention.NUM_QO_HEADS, bench_attention.NUM_KV_HEADS,
                                             bench_attention.HEAD_DIM, generator=torch.Generator().manual_seed(seq),
                                             dtype=bench_attention.DTYPE)
    assert bench_read_floor.proxy_bytes(seq) == q.nbytes + k.nbytes


@pytest.mark.parametrize("argv", [["--seq-lens", "0"], ["--rounds", "0"], ["--repeats", "0"],
                                  ["--settle", "-1"], ["--settle", "nan"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench_read_floor.parse_args(argv)
    assert "--seq-lens, --rounds and --repeats must be positive and --settle at least 0" in capsys.readouterr().err


def test_read_once_compiles_for_sm90a():
    cute = pytest.importorskip("cutlass.cute")
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import from_dlpack

    x, sink = torch.zeros(bench_read_floor.THREADS * bench_read_floor.LOADS * bench_read_floor.FLOATS_PER_LOAD * 3
                          + bench_read_floor.FLOATS_PER_LOAD), torch.zeros(1)
    compiled = cute.compile(bench_read_floor.read_once_kernel(), from_dlpack(x, assumed_align=16),
                            from_dlpack(sink), cuda.CUstream(0))
    assert compiled is not None
