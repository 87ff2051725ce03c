"""Two versions of the OSK kernel against each other on bench_attention.py's workload: whether
their outputs are bitwise equal, the ratio of their times, and each one's skip-cost fit.

    python bench/bench_osk_ab.py BASE.py [--new NEW.py] [--seq-lens 32768 131072]
                                 [--page-sizes 16 128] [--head-dim 128] [--json out.json]

``BASE.py`` and ``NEW.py`` are versions of ``cute_kernels/osk.py``; a verbatim copy loads
(``git show REV:cute_kernels/osk.py > base.py``). ``NEW`` defaults to the installed kernel. Each
version is compiled from its file (``COSA_DISABLE_AOT`` is set), even where libcosa carries the
kernels, whose exported OSK would otherwise stand in for both.

Rows, per sequence length and page size: ``cosa dense``, then ``bench_attention.py``'s rows for
budgets 0.25 and 0.1, each at delta 0 (the block-sparse target's masks) and skip-all (with them,
the skip-cost fit's four), then stage 2 at budget 0.25 (b2 = 0.10 with its calibrated delta,
delta 0.05). Each row is one plan. A version runs it as ``cosa.run`` with the plan's kernel
swapped for the version's ``osk_forward`` on the plan's tables (``bound``: every version takes
them so; each call re-checks the plan, the same host work for both, which the default lengths
hide under the GPU's), so a row's time includes the proxy, as in ``bench_attention.py``, and the
skip-cost fit is the one that benchmark's target uses, each version's with its own block counts
(the table shows the new version's). Where calibration cannot reach b2 on the input, that row is left out.

Checks. Each version's first call writes into outputs poisoned with NaN (o, lse) and -1 (the
counts). The ``bitwise`` column then reads ``equal``, ``differs``, or ``unwritten`` (poison left).

Timing. ``--rounds`` rounds; each takes every row in turn, and each row's two versions one after
the other, with ``time_samples`` (warm-up, ``--settle`` seconds at the row's own clock, then
``--repeats`` timed calls), so that both versions see the same drift of clock and power. Which
version goes first alternates from round to round. A time is the median of all its calls. Calls
are eager, each binding the version to the plan's tables anew, unless ``--graphs`` replays them
from CUDA graphs, as ``bench_attention.py`` times: eager rows whose GPU time is not well above the
host's, as at 8K, compare host work too, and their times scatter by several percent.
Both versions run the same code for ``cosa dense`` unless the dense loop changed, so its ratio
shows this A/B's noise; so does a run with the same file on both sides. Without a GPU it says
so and exits 0. bench/NOTES.md logs what each kernel version measured this way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import cosa
from cosa.synthetic import structured_qkv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import (B2, B2_BUDGET, COSA_B2, COSA_DENSE, DTYPE, NUM_KV_HEADS, NUM_QO_HEADS,  # noqa: E402
                             SKIP_FIT_BUDGETS, Paged, Row, cosa_name, cosa_rows, provenance, replayed, skip_all_name,
                             skip_cost, time_samples)
from sass_report import load_variant  # noqa: E402

VERSIONS = ("base", "new")
COSA_D05 = cosa_name(B2_BUDGET, 0.05)
DELTA0 = tuple(cosa_name(budget, 0.0) for budget in SKIP_FIT_BUDGETS)
SKIP_ALL = tuple(skip_all_name(budget) for budget in SKIP_FIT_BUDGETS)
ROWS = (COSA_DENSE, *DELTA0, *SKIP_ALL, COSA_B2, COSA_D05)  # of bench_attention.py's


def compare(base: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> str:
    """``unwritten`` if either version left poison (NaN in a floating tensor, -1 in a count),
    else ``equal`` if every tensor matches bit for bit, else ``differs``."""
    def poisoned(t: torch.Tensor) -> bool:
        return bool(t.isnan().any()) if t.is_floating_point() else bool((t == -1).any())

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t

    if any(poisoned(t) for t in base + new):
        return "unwritten"
    return "equal" if all(torch.equal(bits(a), bits(b)) for a, b in zip(base, new)) else "differs"


@dataclass
class Result:
    seq: int
    page: int
    head_dim: int
    name: str
    computed: dict[str, int]  # by version, as the time
    skipped: dict[str, int]
    bitwise: str
    ms: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.ms["new"] / self.ms["base"]


def skip_costs(results: list[Result]) -> dict[str, float | None]:
    """Each version's skipped / computed block cost, fitted as bench_attention.py's target does."""
    by_name = {r.name: r for r in results}
    if not all(name in by_name for name in DELTA0 + SKIP_ALL):
        return {version: None for version in VERSIONS}

    def rows(version, names):
        return [Row(r.seq, r.page, r.name, r.ms[version], computed=r.computed[version], skipped=r.skipped[version])
                for r in (by_name[name] for name in names)]
    costs = {version: skip_cost(rows(version, DELTA0), rows(version, SKIP_ALL)) for version in VERSIONS}
    return {version: cost and cost.ratio for version, cost in costs.items()}


def bound(osk_forward, plan: cosa.Plan):
    """A version's ``osk_forward`` as ``plan``'s kernel (``cosa.Plan.kernel``): launched on the
    plan's tables and counters."""
    def kernel(q, k_cache, v_cache, out, lse, *, sm_scale: float, log_delta: float) -> None:
        osk_forward(q, k_cache, v_cache, plan.block_pages, plan.kv_block_indptr, plan.qo_lens, plan.kv_lens,
                    plan.qtiles, plan.tile_order, plan.order, out, lse, plan.computed, plan.skipped,
                    sm_scale=sm_scale, log_delta=log_delta, kv_layout=plan.kv_layout, causal=plan.causal)
    return kernel


def measure(kernels: dict, seq: int, page: int, head_dim: int, args) -> list[Result]:
    """Both versions on every row of one (sequence length, page size), timed in rounds."""
    generator = torch.Generator().manual_seed(args.seed + seq)
    q, k, v = structured_qkv(seq, NUM_QO_HEADS, NUM_KV_HEADS, head_dim, generator=generator, dtype=DTYPE,
                             device="cuda")
    paged = Paged.build(k, v, page, generator)
    try:
        b2_delta = cosa.calibrate_delta(paged.plan(B2_BUDGET, 0.0), q, paged.cache, B2)
    except ValueError as error:   # b2 out of reach on this input: the other rows still compare
        print(f"{seq} tokens, page {page}: no {COSA_B2} row: {error}")
        b2_delta = None
    calls, checked = {}, {}
    settings = cosa_rows(b2_delta)
    for name in (name for name in ROWS if settings[name][1] is not None):
        plan_ = paged.plan(*settings[name])
        outputs = {}
        for version, kernel in kernels.items():
            versioned = dataclasses.replace(plan_, kernel=bound(kernel, plan_))
            out, lse = torch.full_like(q, math.nan), torch.full_like(plan_.lse, math.nan)
            plan_.computed.fill_(-1)
            plan_.skipped.fill_(-1)
            calls[name, version] = lambda p=versioned, out=out, lse=lse: cosa.run(p, q, paged.cache, out=out, lse=lse)
            calls[name, version]()
            outputs[version] = (out, lse, plan_.computed.clone(), plan_.skipped.clone())
        checked[name] = ({version: int(computed.sum()) for version, (*_, computed, _) in outputs.items()},
                         {version: int(skipped.sum()) for version, (*_, skipped) in outputs.items()},
                         compare(outputs["base"], outputs["new"]))
    ms = time_in_rounds(calls, args)
    return [Result(seq, page, head_dim, name, *checked[name], {version: ms[name, version] for version in VERSIONS})
            for name in checked]


def time_in_rounds(calls: dict, args) -> dict:
    """The median time in ms of one call of each ``calls[row, version]``, over ``args.rounds`` rounds
    that each take every row in turn and, within a row, both versions, eager or (``args.graphs``)
    replayed from CUDA graphs of several calls."""
    per_replay = dict.fromkeys(calls, 1)
    if args.graphs:
        calls = dict(calls)
        for key, call in calls.items():
            calls[key], per_replay[key] = replayed(call, args.warmup)
    samples = {key: [] for key in calls}
    names = list(dict.fromkeys(name for name, _ in calls))
    for round_ in range(args.rounds):
        # with both sides the same code, the version timed second read skip-all 2-3% faster
        # (bench/NOTES.md, session 24), so the order of the two alternates from round to round
        order = VERSIONS if round_ % 2 == 0 else VERSIONS[::-1]
        for key in ((name, version) for name in names for version in order):
            samples[key] += [ms / per_replay[key] for ms in
                             time_samples(calls[key], args.warmup, args.repeats, args.settle)]
    return {key: statistics.median(times) for key, times in samples.items()}


def format_results(results: list[Result]) -> str:
    first = results[0]
    lines = [f"{first.seq} tokens, page {first.page}, head_dim {first.head_dim}",
             f"  {'row':<23} {'computed':>9} {'skipped':>9} {'bitwise':>9} {'base ms':>9} {'new ms':>9} {'new/base':>8}"]
    lines += [f"  {r.name:<23} {r.computed['new']:>9} {r.skipped['new']:>9} {r.bitwise:>9} {r.ms['base']:9.3f} "
              f"{r.ms['new']:9.3f} {r.ratio:8.3f}" for r in results]
    costs = skip_costs(results)
    lines.append("  skipped / computed: " + ", ".join(
        f"{version} {'-' if cost is None else format(cost, '.3f')}" for version, cost in costs.items()))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="a version of cute_kernels/osk.py")
    parser.add_argument("--new", help="another version (default: the installed kernel)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--rounds", type=int, default=6, help="even: each version goes first as often")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settle", type=float, default=0.4, help="seconds each row runs before it is timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graphs", action="store_true", help="replay each row's calls from a CUDA graph")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    unit = max([128] + args.page_sizes)
    if any(n <= 0 or n % unit for n in args.seq_lens):
        parser.error(f"sequence lengths must be positive multiples of {unit}")
    # each version goes first as often; a settle estimates a call's time from the warm-up's
    if args.rounds < 2 or args.rounds % 2 or args.repeats < 1 or not args.settle >= 0 or \
            args.warmup < (1 if args.settle > 0 else 0):
        parser.error("need an even --rounds >= 2, --repeats >= 1, --settle >= 0 and --warmup >= 1 (0 without "
                     "a settle)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_osk_ab: no CUDA GPU is available; this benchmark needs one (nothing was measured).")
        return 0
    from cosa.cute_kernels import aot, osk

    # Each version compiles its own file: a libcosa built with the kernels would otherwise give
    # both versions its exported kernel (a version's launcher loads through the installed aot.py).
    os.environ[aot.DISABLE_AOT] = "1"
    modules = {"base": load_variant(args.base, "osk_base"),
               "new": load_variant(args.new, "osk_new") if args.new else osk}
    kernels = {version: module.osk_forward for version, module in modules.items()}
    print(f"base {args.base}, new {args.new or 'installed'}, each compiled from its file; {args.rounds} rounds, "
          f"{'graph replays' if args.graphs else 'eager calls'}, medians of all calls")
    results = []
    with torch.no_grad():
        for seq in args.seq_lens:
            for page in args.page_sizes:
                group = measure(kernels, seq, page, args.head_dim, args)
                print(format_results(group), flush=True)
                results += group
                torch.cuda.empty_cache()
    if args.json:
        config = dict(vars(args), **provenance())
        Path(args.json).write_text(json.dumps(
            {"config": config, "results": [dict(dataclasses.asdict(r), ratio=r.ratio) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
