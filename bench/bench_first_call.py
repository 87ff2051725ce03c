"""First-call latency of ``cosa.run``: the KAP and OSK kernels compiled on first use (JIT) against
those exported ahead of time into libcosa (AOT), each in fresh Python processes.

    python bench/bench_first_call.py [--seq-len 8192] [--repeats 4] [--json out.json]

Each process imports torch and cosa (``import``), makes the inputs and the CUDA context
(untimed), then times ``cosa.plan`` (``plan``; it imports the CuTe DSL) and the first
``cosa.run`` with a synchronize (``first run``); ``first call`` is their sum.  Then ``steady``:
the median CUDA-event time of further calls (``bench_attention.time_ms``), and ``graph``: the same
calls replayed from a CUDA graph, i.e. their GPU time alone.  JIT processes run with COSA_DISABLE_AOT=1;
AOT needs a cosa built with COSA_AOT_KERNELS=1 (the ``kernel`` column says what each process
used).  bench/README.md has the details.  Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("jit", "aot")
TIMES = ("import_s", "plan_s", "first_run_s", "first_call_s", "steady_ms", "graph_ms")
GRAPH_CALLS = 10   # runs per CUDA-graph replay in ``graph ms``


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="q_len = kv_len of the one request")
    parser.add_argument("--repeats", type=int, default=4,
                        help="processes per mode, interleaved; each mode goes first in every other repeat")
    parser.add_argument("--steady", type=int, default=20, help="calls timed after 3 warm-up calls")
    parser.add_argument("--json", help="also write the per-process results and medians here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one measuring process
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.repeats < 1 or args.steady < 1:
        parser.error("need --seq-len, --repeats and --steady >= 1")
    return args


def measure(args) -> dict:
    """One process's measurements (the process is fresh: nothing is compiled or loaded yet)."""
    start = time.perf_counter()
    import torch

    import cosa
    from cosa.cute_kernels import aot
    from cosa.paged import indptr, paged_kv_cache
    import_s = time.perf_counter() - start
    from bench_attention import GraphCall, time_ms  # after the timed imports: they import torch and cosa too

    hq, hkv, head_dim, page_size, n = 32, 8, 128, 16, args.seq_len
    q, k, v = (torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16) for heads in (hq, hkv, hkv))
    cache, *page_table = paged_kv_cache(k, v, [n], page_size)
    qo_indptr = indptr([n], q.device)
    torch.cuda.synchronize()

    start = time.perf_counter()
    plan = cosa.plan(qo_indptr, *page_table, hq, hkv, head_dim, page_size)
    plan_s = time.perf_counter() - start
    cosa.run(plan, q, cache)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start

    steady_ms = time_ms(lambda: cosa.run(plan, q, cache), 3, args.steady)
    # the same runs replayed from a CUDA graph: their GPU time without the host's launches
    graph_ms = time_ms(GraphCall(lambda: cosa.run(plan, q, cache), 3, GRAPH_CALLS), 2, args.steady) / GRAPH_CALLS
    sources = {aot.kernel_source(kernel, "bfloat16", head_dim) for kernel in aot.KERNELS} if plan.uses_kernel else ()
    return {"mode": args.child, "kernel": "/".join(sorted({s.kind for s in sources})) or "reference",
            "kernel_detail": "; ".join(sorted({s.detail for s in sources})) or "cosa.run uses the torch reference",
            "import_s": import_s, "plan_s": plan_s, "first_run_s": first_call_s - plan_s,
            "first_call_s": first_call_s, "steady_ms": steady_ms, "graph_ms": graph_ms,
            "device": torch.cuda.get_device_name()}


def run_process(mode: str, args) -> dict:
    from cosa.cute_kernels.aot import DISABLE_AOT

    env = dict(os.environ)
    env.pop(DISABLE_AOT, None)
    if mode == "jit":
        env[DISABLE_AOT] = "1"
    command = [sys.executable, __file__, "--child", mode, "--seq-len", str(args.seq_len),
               "--steady", str(args.steady)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"the {mode} process failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    """Per mode: the median of every time over its processes, and the kernels they used."""
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: statistics.median(r[key] for r in mine) for key in TIMES}
        summary[mode]["kernel"] = "/".join(sorted({r["kernel"] for r in mine}))
    return summary


def format_table(summary: dict) -> str:
    lines = [f"{'mode':<5} {'kernel':<9} {'import s':>9} {'plan s':>8} {'first run s':>12} "
             f"{'first call s':>13} {'steady ms':>10} {'graph ms':>9}"]
    for mode, m in summary.items():
        lines.append(f"{mode:<5} {m['kernel']:<9} {m['import_s']:9.2f} {m['plan_s']:8.2f} "
                     f"{m['first_run_s']:12.2f} {m['first_call_s']:13.2f} {m['steady_ms']:10.3f} "
                     f"{m['graph_ms']:9.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_first_call: no CUDA GPU is available; this benchmark needs one (nothing was measured).")
        return 0
    runs = []
    for repeat in range(args.repeats):
        # the run's first process pays cold imports (disk, page cache): each mode goes first in turn
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            runs.append(run_process(mode, args))
            r = runs[-1]
            print(f"[{repeat + 1}/{args.repeats}] {mode}: kernel {r['kernel']}, first call "
                  f"{r['first_call_s']:.2f} s, steady {r['steady_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms", flush=True)
    summary = summarize(runs)
    print(f"\n{runs[0]['device']}; 1 request, q_len = kv_len = {args.seq_len}, heads 32/8, head_dim 128, "
          f"bf16, page 16, budget 0.25, delta 0.05; medians of {args.repeats} processes per mode")
    print(format_table(summary))
    unloaded = [r for r in runs if r["mode"] == "aot" and r["kernel"] != "aot"]
    if unloaded:
        print(f"note: an aot process did not load the exported kernel: {unloaded[0]['kernel_detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq_len": args.seq_len, "repeats": args.repeats, "steady_calls": args.steady,
                       "runs": runs, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
