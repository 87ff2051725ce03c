"""bench/bench_attention.py's target arithmetic on the CPU (the benchmark itself needs a GPU)."""

from __future__ import annotations

import random
import statistics
import types

import pytest
import torch

import bench_attention
from bench_attention import Row


def rows_from_costs(fixed: float, vote: float, computed_cost: float, skipped_cost: float, rng: random.Random):
    """The four runs skip_cost fits, the delta-0 pair of two masks (wider first) and their skip-all
    pair, timed exactly by t = fixed + c*computed + s*skipped, plus ``vote`` in the skip-all runs
    (the vote path's fixed cost)."""
    narrow = rng.randrange(10_000, 50_000)
    wide = narrow + rng.randrange(1_000, 50_000)
    first = rng.randrange(50, 5_000)    # blocks visited first: one per tile, the same in both masks

    def row(budget, skip_all, computed, skipped):
        name = bench_attention.skip_all_name(budget) if skip_all else bench_attention.cosa_name(budget, 0.0)
        return Row(32768, 128, name, fixed + vote * skip_all + computed_cost * computed + skipped_cost * skipped,
                   computed=computed, skipped=skipped)

    delta0 = (row(0.25, False, wide, 0), row(0.1, False, narrow, 0))
    skip_all = (row(0.25, True, first, wide - first), row(0.1, True, first, narrow - first))
    return delta0, skip_all


def test_skip_cost_recovers_the_per_block_costs_whatever_the_fixed_costs():
    rng = random.Random()
    fixed, vote, c = rng.uniform(0.0, 5.0), rng.uniform(0.0, 0.5), rng.uniform(1e-5, 1e-3)
    s = c * rng.uniform(0.05, 1.5)
    delta0, skip_all = rows_from_costs(fixed, vote, c, s, rng)
    cost = bench_attention.skip_cost(delta0, skip_all)
    assert cost.ratio == pytest.approx(s / c, rel=1e-6)
    assert cost.charged == pytest.approx(s / c + vote / (c * skip_all[0].skipped), rel=1e-6)
    # the target reads the fit from the table's rows
    (target,) = [t for t in bench_attention.evaluate_targets(list(delta0 + skip_all), [128])
                 if t.name == "skipped / computed block cost"]
    assert target.ratio == pytest.approx(s / c, rel=1e-6) and f"{cost.charged:.3f}" in target.note


@pytest.mark.parametrize("computed_cost,skipped_cost", [(1e-4, -2e-5), (-1e-4, 2e-5), (0.0, 1e-5)])
def test_skip_cost_is_none_without_positive_costs(computed_cost, skipped_cost):
    """At 8K the fit can give a negative cost (fixed costs and noise dominate): no ratio, rather
    than one that passes the target."""
    assert bench_attention.skip_cost(*rows_from_costs(0.3, 0.1, computed_cost, skipped_cost, random.Random())) is None


def timed_group(rng: random.Random):
    """Three rows to time (one a graph of several calls) around a row that was never built."""
    names = ["fa4 dense", "cosa dense", "proxy"]
    timed = [bench_attention.Timed(Row(8192, 128, name, None, note=name), call=lambda name=name: name,
                                   calls=rng.choice([1, 10])) for name in names]
    unbuilt = Row(8192, 16, "sdpa cudnn", None, note="ImportError: no cuDNN")
    return timed[:1] + [unbuilt] + timed[1:], timed, unbuilt


def test_time_in_rounds_interleaves_the_rows_and_takes_each_median_over_all_its_samples():
    rng = random.Random()
    group, timed, unbuilt = timed_group(rng)
    rounds = rng.randrange(2, 5)
    visits, drawn = [], {t.row.name: [] for t in timed}

    def sample(call):
        name = call()
        visits.append(name)
        times = [rng.uniform(0.1, 10.0) for _ in range(rng.randrange(1, 6))]
        drawn[name] += times
        return times

    rows = bench_attention.time_in_rounds(group, rounds, sample)
    assert visits == [t.row.name for t in timed] * rounds   # every row once per round, in order
    assert [r.name for r in rows] == [getattr(item, "row", item).name for item in group]
    assert rows[1] is unbuilt
    for t in timed:
        row = next(r for r in rows if r.name == t.row.name)
        assert row.ms == pytest.approx(statistics.median(drawn[t.row.name]) / t.calls, rel=1e-12)
        assert row.note == t.row.name      # the rest of the row is kept


def test_time_in_rounds_reports_a_row_that_fails_and_times_the_others():
    rng = random.Random()
    group, timed, _ = timed_group(rng)
    rounds, failing_round = 3, rng.randrange(3)
    broken = rng.choice(timed).row.name
    visits = []

    def sample(call):
        name = call()
        visits.append(name)
        if name == broken and visits.count(name) == failing_round + 1:
            raise RuntimeError("CUDA error: an illegal memory access\nmore")
        return [rng.uniform(0.1, 10.0)]

    rows = bench_attention.time_in_rounds(group, rounds, sample)
    assert visits.count(broken) == failing_round + 1         # not called again once it failed
    for row in rows:
        if row.name == broken:
            assert row.ms is None and row.note == "RuntimeError: CUDA error: an illegal memory access"
        elif row.name != "sdpa cudnn":
            assert row.ms is not None and visits.count(row.name) == rounds


def test_settle_calls_fill_the_settling_time_at_the_warm_up_rate():
    rng = random.Random()
    calls, settle = rng.randrange(3, 10), rng.uniform(0.2, 0.5)
    per_call = rng.uniform(1e-4, settle / calls)  # a warm-up shorter than the settling time
    extra = bench_attention.settle_calls(calls * per_call, calls, settle)
    assert (calls + extra) * per_call >= settle > (calls + extra - 1) * per_call
    assert bench_attention.settle_calls(settle + per_call, calls, settle) == 0   # warm-up already long enough
    assert bench_attention.settle_calls(calls * per_call, calls, 0.0) == 0       # --settle 0: the old warm-up


@pytest.mark.parametrize("option", [["--settle", "-0.1"], ["--settle", "nan"], ["--warmup", "2"], ["--repeats", "4"]])
def test_parse_args_rejects_too_little_warm_up_or_timing(option, capsys):
    with pytest.raises(SystemExit):
        bench_attention.parse_args(option)
    assert "need --warmup >= 3, --repeats >= 5, --rounds >= 1 and --settle >= 0" in capsys.readouterr().err


def test_cosa_rows_give_every_row_its_budget_and_delta_once():
    b2_delta = random.uniform(1e-3, 1e3)
    rows = bench_attention.cosa_rows(b2_delta)
    grid = [(budget, delta) for budget in bench_attention.BUDGETS for delta in bench_attention.DELTAS]
    assert list(rows) == ([bench_attention.COSA_DENSE] + [bench_attention.cosa_name(*bd) for bd in grid]
                          + [bench_attention.COSA_B2]
                          + [bench_attention.skip_all_name(budget) for budget in bench_attention.BUDGETS])
    assert rows[bench_attention.COSA_DENSE] == (1.0, 0.0)
    assert all(rows[bench_attention.cosa_name(*bd)] == bd for bd in grid)
    assert rows[bench_attention.COSA_B2] == (bench_attention.B2_BUDGET, b2_delta)
    assert all(rows[bench_attention.skip_all_name(budget)] == (budget, bench_attention.SKIP_ALL_DELTA)
               for budget in bench_attention.BUDGETS)
    assert bench_attention.cosa_rows(None)[bench_attention.COSA_B2] == (bench_attention.B2_BUDGET, None)


def test_fa4_block_sparse_row_counts_the_blocks_its_lists_hold_over_the_candidates():
    """The FA4 block-sparse row reads its density from CoSA's stage-1 mask before any run, and it
    agrees with the density stats() reports once a run (delta 0) has computed that mask."""
    import cosa
    from cosa.paged import indptr, paged_kv_cache
    from cosa.synthetic import structured_qkv

    seq, page = 5 * 128 + random.randrange(1, 128), 16
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = structured_qkv(seq, 4, 2, 64, generator=generator, dtype=torch.bfloat16)
    cache, *table = paged_kv_cache(k, v, [seq], page, combined=False, generator=generator)
    plan_ = cosa.plan(indptr([seq], q.device), *table, 4, 2, 64, page, causal=True, budget=0.4, delta=0.0,
                      q_data_type=torch.bfloat16)
    cosa.order_mask(plan_, q, cache)
    blocks = bench_attention.fa4_block_sparse_tensors(
        types.SimpleNamespace(BlockSparseTensorsTorch=types.SimpleNamespace), plan_)
    row = bench_attention.fa4_block_sparse_row(seq, plan_, blocks)

    listed = int((plan_.order >= 0).sum())
    assert row.computed == listed
    assert row.flops == bench_attention.block_flops(listed, bench_attention.plan_diagonals(plan_))
    cosa.run(plan_, q, cache)
    assert row.density1 == row.density2 == pytest.approx(plan_.stats().density_stage1)
    assert 0 < row.density1 < 1


@pytest.mark.parametrize("same_mask", [True, False])
def test_kernel_targets_take_the_kernel_row_on_fa4s_mask(same_mask):
    """FA4 block-sparse against the kernel alone (neither runs a proxy), n/a where the two rows'
    blocks differ; the whole run's ratio goes in the note."""
    seq, page, budget = 32768, 16, bench_attention.BUDGETS[0]
    fa4_ms, dense_ms, kernel_ms = random.uniform(1.0, 2.0), random.uniform(4.0, 5.0), random.uniform(0.8, 2.2)
    run_ms = kernel_ms + random.uniform(0.05, 0.2)
    blocks = random.randrange(1000, 2000)
    rows = [Row(seq, None, bench_attention.FA4_DENSE, dense_ms),
            Row(seq, page, bench_attention.COSA_DENSE, 0.99 * dense_ms),
            Row(seq, None, bench_attention.fa4_block_sparse_name(budget), fa4_ms, computed=blocks),
            Row(seq, page, bench_attention.cosa_name(budget, 0.0), run_ms, computed=blocks),
            Row(seq, page, bench_attention.cosa_kernel_name(budget), kernel_ms,
                computed=blocks if same_mask else blocks + 1)]
    targets = {t.name: t for t in bench_attention.evaluate_targets(rows, [page]) if t.where == f"{seq} p{page}"}
    assert targets["cosa dense / fa4 dense speed"].ratio == pytest.approx(1 / 0.99)
    sparse = targets[f"cosa kernel / fa4 block-sparse b={budget} speed"]
    if same_mask:
        assert sparse.ratio == pytest.approx(fa4_ms / kernel_ms) and sparse.note == f"whole run {fa4_ms / run_ms:.3f}"
    else:
        assert sparse.ratio is None and sparse.status == "n/a" and sparse.note.startswith("block counts differ")


@pytest.mark.parametrize("density2,counts", [(0.1, True), (0.1049, True), (0.106, False), (0.09, False)])
def test_b2_target_counts_only_a_row_at_the_target_density(density2, counts):
    dense_ms, b2_ms = random.uniform(150.0, 250.0), random.uniform(30.0, 50.0)
    rows = [Row(131072, None, bench_attention.FA4_DENSE, dense_ms),
            Row(131072, 128, bench_attention.COSA_B2, b2_ms, density2=density2)]
    (target,) = [t for t in bench_attention.evaluate_targets(rows, [128]) if t.name.startswith("run b=")]
    assert target.ratio == (pytest.approx(dense_ms / b2_ms) if counts else None)


@pytest.mark.parametrize("which", [0, 1])
def test_skip_cost_needs_each_skip_all_run_on_its_delta0_mask(which):
    """A skip-all run must list its delta-0 run's blocks: otherwise no common block costs."""
    delta0, skip_all = rows_from_costs(0.3, 0.1, 1e-4, 5e-5, random.Random())
    skip_all[which].skipped -= 1
    assert bench_attention.skip_cost(delta0, skip_all) is None


def test_skip_cost_needs_the_wider_mask_first():
    delta0, skip_all = rows_from_costs(0.3, 0.1, 1e-4, 5e-5, random.Random())
    assert bench_attention.skip_cost(delta0[::-1], skip_all[::-1]) is None


def test_block_flops_count_the_causal_pairs_of_a_dense_run():
    """Every block of a causal seq x seq run, diagonals at 129/256, is the exact causal count."""
    tiles = random.randrange(1, 2000)
    seq, heads = tiles * bench_attention.BLOCK, bench_attention.NUM_QO_HEADS
    blocks = tiles * (tiles + 1) // 2 * heads
    flops = bench_attention.block_flops(blocks, tiles * heads)
    assert flops == pytest.approx(bench_attention.dense_causal_flops(seq), rel=1e-12)


def test_git_checkout_names_the_commit_and_whether_tracked_files_changed(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))   # not a checkout around tmp_path

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()
    assert bench_attention.git_checkout(tmp_path) == (None, None)
    git("init", "-q")
    (tmp_path / "kernel.py").write_text(str(random.random()))
    git("add", "kernel.py")
    git("commit", "-qm", "a")
    head = git("rev-parse", "HEAD")
    (tmp_path / "untracked.txt").write_text("not part of the code measured")
    assert bench_attention.git_checkout(tmp_path) == (head, False)
    (tmp_path / "kernel.py").write_text("changed")
    assert bench_attention.git_checkout(tmp_path) == (head, True)


def test_provenance_names_the_commit_and_where_the_kernel_comes_from():
    from pathlib import Path

    record = bench_attention.provenance()
    assert (record["git_commit"], record["git_changed"]) == \
        bench_attention.git_checkout(Path(bench_attention.__file__).resolve().parent)
    assert record["osk_kernel"] in ("aot", "jit") and record["torch"] == torch.__version__
    assert record["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def test_kernel_rows_take_no_proxy_share():
    rows = [Row(8192, 128, bench_attention.PROXY, 0.04), Row(8192, 128, bench_attention.cosa_name(0.25, 0.0), 0.3),
            Row(8192, 128, bench_attention.cosa_kernel_name(0.25), 0.26)]
    bench_attention.finish_rows(rows)
    assert rows[1].proxy_share == pytest.approx(0.04 / 0.3) and rows[2].proxy_share is None


@pytest.mark.parametrize("per_call_ms,calls", [(0.3, 7), (2.0, 1), (50.0, 1), (0.01, 10)])
def test_rows_are_timed_from_graphs_of_enough_calls_unless_eager_or_not_replayable(monkeypatch, per_call_ms, calls):
    """A replay lasts GRAPH_MS (at most MAX_GRAPH_CALLS calls), its time divided by its calls;
    --eager and rows that cannot be captured keep their eager call."""
    captured = []
    monkeypatch.setattr(bench_attention, "time_ms", lambda call, warmup, repeats: per_call_ms)
    monkeypatch.setattr(bench_attention, "GraphCall", lambda call, warmup, n: captured.append((call, n)) or "graph")
    call = lambda: None  # noqa: E731
    runner = types.SimpleNamespace(args=types.SimpleNamespace(eager=False, warmup=3))
    group = []
    for replayable in (True, False):
        bench_attention.Runner.prepare(runner, group, 8192, 16, "row", lambda r=replayable: (
            bench_attention.Timed(Row(8192, 16, "row", None), call, replayable=r), None))
    assert captured == [(call, calls)]
    assert (group[0].call, group[0].calls) == ("graph", calls) and (group[1].call, group[1].calls) == (call, 1)
    runner.args.eager = True
    bench_attention.Runner.prepare(runner, group, 8192, 16, "row", lambda: (
        bench_attention.Timed(Row(8192, 16, "row", None), call), None))
    assert (group[2].call, group[2].calls) == (call, 1) and len(captured) == 1
