"""bench/bench_ttft.py on the CPU: the whole benchmark on a tiny model, CoSA at budget 1 equal to dense."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import cosa
import bench_ttft

BF16_LOGITS_ERR = 2e-2   # dense SDPA in bf16 is 9e-3 from the same model with fp32 attention


def test_cpu_quick_run_at_full_budget_matches_dense(tmp_path):
    path = tmp_path / "ttft.json"
    seed = torch.seed() % 2**31   # the model's weights and tokens
    assert bench_ttft.main(["--device", "cpu", "--quick", "--budget", "1", "--delta", "0", "--repeats", "1",
                            "--seed", str(seed), "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    config = report["config"]
    assert config["device"] == "cpu" and config["cosa"] == cosa.__version__ and "git_commit" in config
    dense, sparse = report["rows"]
    assert (dense["attention"], sparse["attention"]) == ("sdpa", "cosa b=1 d=0")
    assert sparse["density1"] == sparse["density2"] == 1.0
    assert sparse["logits_err"] < BF16_LOGITS_ERR, f"seed={seed}"
    assert sparse["kv_cache_gib"] > 0 and len(sparse["attention_ms_per_layer"]) == bench_ttft.CPU_TINY.num_layers
    for row in (dense, sparse):
        assert row["ttft_ms"] > 0 and 0 < row["attention_share"] < 1 and math.isfinite(row["speedup"])


def test_density_bound_is_the_ttft_with_attention_scaled_by_the_density():
    rng = random.Random()
    attention, rest, density = rng.uniform(1, 10), rng.uniform(1, 10), rng.uniform(0.05, 1.0)
    dense = bench_ttft.Row(131072, "fa4", ttft_ms=attention + rest, attention_ms=attention)
    sparse = bench_ttft.Row(131072, "cosa b=0.25 d=0.05", density2=density)
    bound = bench_ttft.density_bound(dense, sparse)
    assert bound == pytest.approx((attention + rest) / (rest + density * attention), rel=1e-12)
    assert bench_ttft.density_bound(dense, bench_ttft.Row(131072, "cosa", density2=1.0)) == pytest.approx(1.0)
    assert bench_ttft.density_bound(bench_ttft.Row(131072, "fa4"), sparse) is None
