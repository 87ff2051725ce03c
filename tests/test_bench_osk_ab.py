"""bench/bench_osk_ab.py on the CPU: its bitwise comparison, its skip-cost fit per version and its
arguments (the message without a GPU: test_bench_without_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

import bench_attention
import bench_osk_ab
from bench_osk_ab import DELTA0, SKIP_ALL, Result, compare, skip_costs


def outputs(rows: int) -> tuple[torch.Tensor, ...]:
    """o, lse and the two counts as a version writes them."""
    return (torch.randn(rows, 4, 8).to(torch.bfloat16), torch.randn(rows, 4),
            torch.randint(0, 9, (rows // 2 + 1, 4), dtype=torch.int32),
            torch.randint(0, 9, (rows // 2 + 1, 4), dtype=torch.int32))


def test_equal_outputs_compare_equal_and_one_flipped_bit_differs():
    base = outputs(random.randrange(2, 40))
    assert compare(base, tuple(t.clone() for t in base)) == "equal"
    which = random.randrange(len(base))
    changed = [t.clone() for t in base]
    flat = changed[which].view(-1)
    i = random.randrange(flat.numel())
    if changed[which].is_floating_point():
        view = flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()])
        view[i] ^= 1 << random.randrange(8)
    else:
        flat[i] += 1
    assert compare(base, tuple(changed)) == "differs"


def test_signed_zeros_are_told_apart():
    base = outputs(4)
    zeros = [t.clone() for t in base]
    zeros[1][0, 0], base[1][0, 0] = 0.0, -0.0
    assert compare(base, tuple(zeros)) == "differs"


@pytest.mark.parametrize("which", range(4))
def test_poison_left_in_either_version_reads_unwritten(which):
    base = outputs(random.randrange(2, 40))
    new = [t.clone() for t in base]
    flat = new[which].view(-1)
    flat[random.randrange(flat.numel())] = float("nan") if new[which].is_floating_point() else -1
    victim = random.choice(["base", "new"])
    pair = (tuple(new), base) if victim == "base" else (base, tuple(new))
    assert compare(*pair) == "unwritten"


def test_skip_costs_fit_each_version_as_the_benchmark_target_does():
    """Times made from t = o + c * computed + s * skipped, with each version's own block counts
    (a version that changes the skip rule computes other blocks), give back s / c for each."""
    rng = random.Random()

    def version_counts():   # each skip-all run lists its delta-0 run's blocks, as one mask does
        narrow, first = 20_000 + rng.randrange(1000), 1000 + rng.randrange(500)
        wide = narrow + 30_000 + rng.randrange(1000)
        return {DELTA0[0]: (wide, 0), DELTA0[1]: (narrow, 0),
                SKIP_ALL[0]: (first, wide - first), SKIP_ALL[1]: (first, narrow - first)}
    counts = {version: version_counts() for version in bench_osk_ab.VERSIONS}
    model = {version: (rng.uniform(0.1, 2.0), rng.uniform(1e-5, 1e-4), rng.uniform(0.2, 0.9))
             for version in bench_osk_ab.VERSIONS}   # o, c, s / c

    def by_version(name, f):
        return {version: f(version, *counts[version][name]) for version in bench_osk_ab.VERSIONS}

    def time(version, computed, skipped):
        o, c, ratio = model[version]
        return o + c * computed + ratio * c * skipped
    results = [Result(32768, 128, 128, name, by_version(name, lambda v, c, s: c), by_version(name, lambda v, c, s: s),
                      "differs", by_version(name, time))
               for name in DELTA0 + SKIP_ALL]
    costs = skip_costs(results)
    for version, (_, _, ratio) in model.items():
        assert costs[version] == pytest.approx(ratio, rel=1e-9)
    assert skip_costs(results[:3]) == {version: None for version in bench_osk_ab.VERSIONS}


LENGTHS = "sequence lengths must be positive multiples of"
TIMING = "need an even --rounds >= 2, --repeats >= 1, --settle >= 0 and --warmup >= 1"


@pytest.mark.parametrize("argv,message", [
    (["v.py", "--seq-lens", "1000"], LENGTHS + " 128"), (["v.py", "--seq-lens", "0"], LENGTHS + " 128"),
    (["v.py", "--page-sizes", "256", "--seq-lens", "384"], LENGTHS + " 256"), (["v.py", "--rounds", "0"], TIMING),
    (["v.py", "--repeats", "0"], TIMING), (["v.py", "--rounds", "3"], TIMING), (["v.py", "--warmup", "0"], TIMING),
    (["v.py", "--settle", "nan"], TIMING), (["v.py", "--head-dim", "96"], "argument --head-dim: invalid choice"),
    ([], "the following arguments are required: base")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_osk_ab.parse_args(argv)
    assert message in capsys.readouterr().err
    assert bench_osk_ab.parse_args(["v.py", "--warmup", "0", "--settle", "0"]).warmup == 0   # nothing to estimate


def test_each_version_is_compiled_from_its_file(monkeypatch):
    # Where libcosa carries the kernels, a version's launcher (through the installed aot.py)
    # would load libcosa's OSK instead, and the A/B would compare that kernel with itself.
    from types import SimpleNamespace

    from cosa.cute_kernels import aot
    monkeypatch.setenv(aot.DISABLE_AOT, "0")   # "0": the kernels may come from libcosa
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_osk_ab, "load_variant", lambda path, name: SimpleNamespace(osk_forward=path))
    monkeypatch.setattr(bench_osk_ab, "format_results", lambda group: "")
    seen = []
    monkeypatch.setattr(bench_osk_ab, "measure", lambda kernels, *rest: seen.append(
        (kernels, aot.kernel_source("osk", "bfloat16", 128))) or [])
    assert bench_osk_ab.main(["base.py", "--new", "new.py", "--seq-lens", "8192", "--page-sizes", "16"]) == 0
    (kernels, source), = seen
    assert kernels == {"base": "base.py", "new": "new.py"}
    assert source == aot.KernelSource("jit", f"{aot.DISABLE_AOT}=1")


def test_its_rows_are_bench_attentions_with_their_settings():
    settings = bench_osk_ab.cosa_rows(random.uniform(1e-3, 1e3))
    assert set(bench_osk_ab.ROWS) <= set(settings) and len(set(bench_osk_ab.ROWS)) == len(bench_osk_ab.ROWS)
    assert set(DELTA0 + SKIP_ALL) <= set(bench_osk_ab.ROWS)   # the skip-cost fit's four
    # and both masks the block-sparse target compares at delta 0
    assert {bench_osk_ab.cosa_name(budget, 0.0) for budget in bench_attention.BUDGETS} <= set(bench_osk_ab.ROWS)


def test_a_version_runs_on_the_plan_s_tables(monkeypatch):
    # run calls the plan's kernel as it calls osk.Launcher; bound passes that on to a version's
    # osk_forward with the plan's tables, counters and layout
    import dataclasses
    import math

    import cosa
    from cosa.cute_kernels import aot, osk
    launches = []
    monkeypatch.setattr(aot, "load_kernel", lambda *config: (config[0], aot.KernelSource("aot", "a stand-in")))
    monkeypatch.setattr(osk, "_launch", lambda fn, source, tensors, bound, scalars=(): launches.append(
        ((*tensors, *bound.tensors), scalars)))
    page, kv_len = 16, random.randrange(1, 400)
    pages = -(-kv_len // page)
    plan = cosa.plan(torch.tensor([0, kv_len], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
                     torch.randperm(pages, dtype=torch.int32), torch.tensor([(kv_len - 1) % page + 1], dtype=torch.int32),
                     4, 2, 128, page, kv_layout="HND", delta=0.25)
    q = torch.randn(kv_len, 4, 128).bfloat16()
    cache = torch.randn(pages, 2, 2, page, 128).bfloat16()
    out = cosa.run(dataclasses.replace(plan, kernel=bench_osk_ab.bound(osk.osk_forward, plan)), q, cache)
    (tensors, scalars), = launches
    expected = (q, cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2), out, plan.lse, plan.block_pages,
                plan.kv_block_indptr, plan.qo_lens, plan.kv_lens, plan.qtiles, plan.tile_order, plan.order,
                plan.computed, plan.skipped)
    assert [(t.data_ptr(), t.shape, t.stride()) for t in tensors] == \
        [(t.data_ptr(), t.shape, t.stride()) for t in expected]
    assert scalars == (plan.sm_scale, math.log(0.25), 4, 2, 1, plan.tile_order.shape[0])


@pytest.mark.parametrize("graphs", [False, True])
def test_rows_are_timed_in_alternating_rounds_per_call(monkeypatch, graphs):
    # each round takes every row, a row's two versions back to back, the first of them alternating
    # from round to round; a graph replay's time counts for the calls it replays
    from types import SimpleNamespace
    rng = random.Random()
    names = [f"row {i}" for i in range(rng.randrange(1, 4))]
    calls = {(name, version): SimpleNamespace(key=(name, version), calls=1)
             for name in names for version in bench_osk_ab.VERSIONS}
    per_call = {key: rng.uniform(0.1, 5.0) for key in calls}
    timed = []

    def time_samples(call, warmup, repeats, settle):
        timed.append((call.key, call.calls))
        return [per_call[call.key] * call.calls * rng.uniform(0.99, 1.01) for _ in range(repeats)]

    def replayed(call, warmup):
        calls_each = rng.randrange(2, 9)
        return SimpleNamespace(key=call.key, calls=calls_each), calls_each
    monkeypatch.setattr(bench_osk_ab, "time_samples", time_samples)
    monkeypatch.setattr(bench_osk_ab, "replayed", replayed)
    rounds = 2 * rng.randrange(1, 4)
    args = bench_osk_ab.parse_args(["v.py", "--rounds", str(rounds)] + (["--graphs"] if graphs else []))
    ms = bench_osk_ab.time_in_rounds(calls, args)
    assert ms.keys() == calls.keys()
    for key, value in ms.items():
        assert value == pytest.approx(per_call[key], rel=0.011)
    expected = [(name, version) for round_ in range(rounds) for name in names
                for version in (bench_osk_ab.VERSIONS if round_ % 2 == 0 else bench_osk_ab.VERSIONS[::-1])]
    assert [key for key, _ in timed] == expected
    assert all((calls_each > 1) == graphs for _, calls_each in timed)
