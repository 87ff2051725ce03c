"""CoSA against dense and block-sparse attention on one GPU: one command, a table, targets, JSON.

    python bench/bench_attention.py [--seq-lens 8192 32768 131072] [--page-sizes 16 128]
                                    [--json out.json] [--quick]

Workload: batch 1, 32 query heads, 8 kv heads, head_dim 128, bf16, causal prefill
(q_len = kv_len), structured inputs (cosa.synthetic.structured_qkv). bench/README.md says
what every row, column and target means.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import cosa
from cosa.paged import indptr, paged_kv_cache
from cosa.synthetic import structured_qkv

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BLOCK = 128
BLOCK_FLOPS = 4 * BLOCK * BLOCK * HEAD_DIM        # QK^T and PV of one 128x128 block, one head
BUDGETS = (0.25, 0.1)
SKIP_FIT_BUDGETS = tuple(sorted(BUDGETS, reverse=True))   # the skip-cost fit's two masks, the wider first
DELTAS = (0.0, 0.05)
B2 = 0.10                  # stage-2 density of the calibrated row (the paper's b2)
B2_TOLERANCE = 0.005       # how far from B2 the timed row's density may be for its target to count
B2_BUDGET = 0.25
SKIP_ALL_DELTA = 1e30      # threshold ln(1e30/kv_len) > any logit gain: all but the first block skip
REFERENCE_MAX_SEQ = 8192   # longest sequence timed when cosa.run falls back to the torch reference
GRAPH_MS = 2.0             # a CUDA-graph replay holds calls for at least this long (its launch: ~0.5%)
MAX_GRAPH_CALLS = 10       # ... and at most this many

FA4_DENSE, SDPA, FA4_PAGED = "fa4 dense", "sdpa cudnn", "fa4 dense paged"
DENSE_PEERS = (FA4_DENSE, SDPA)
COSA_DENSE, COSA_B2 = "cosa dense", f"cosa b={B2_BUDGET} b2={B2:.2f}"
PROXY = "proxy"


def fa4_block_sparse_name(budget: float) -> str:
    return f"fa4 block-sparse b={budget}"


def cosa_name(budget: float, delta: float) -> str:
    return f"cosa b={budget} d={delta:g}"


def skip_all_name(budget: float) -> str:
    return f"cosa b={budget} skip-all"


KERNEL_ROW = "cosa kernel"   # rows of the kernel alone: they run no proxy


def cosa_kernel_name(budget: float) -> str:
    """The kernel alone on the stage-1 mask of budget ``budget`` (delta 0), timed without the proxy."""
    return f"{KERNEL_ROW} b={budget} d=0"


def cosa_rows(b2_delta: float | None) -> dict[str, tuple[float, float | None]]:
    """(budget, delta) of every CoSA row, by name, in table order; the b2 row's delta is the
    calibrated one (None: calibration failed)."""
    rows = {COSA_DENSE: (1.0, 0.0)}
    rows |= {cosa_name(budget, delta): (budget, delta) for budget in BUDGETS for delta in DELTAS}
    rows[COSA_B2] = (B2_BUDGET, b2_delta)
    rows |= {skip_all_name(budget): (budget, SKIP_ALL_DELTA) for budget in BUDGETS}
    return rows


@dataclass
class Row:
    seq: int
    page: int | None              # None: contiguous K/V
    name: str
    ms: float | None              # None: not measured (see note)
    flops: float | None = None    # of the computed blocks (dense peers: exact causal count)
    density1: float | None = None
    density2: float | None = None
    computed: int | None = None   # (query tile, head, key block) triples computed
    skipped: int | None = None    # ... and skipped by stage 2
    delta: float | None = None
    note: str = ""
    tflops: float | None = None       # the rest is filled by finish_rows
    speedup: float | None = None
    proxy_share: float | None = None


@dataclass
class Target:
    name: str
    where: str
    ratio: float | None
    need: float
    at_least: bool                # ratio >= need, else ratio <= need
    note: str = ""

    @property
    def status(self) -> str:
        if self.ratio is None:
            return "n/a"
        return "PASS" if (self.ratio >= self.need if self.at_least else self.ratio <= self.need) else "MISS"


# ----------------------------------------------------------------------------- derived columns

def finish_rows(rows: list[Row]) -> None:
    """TFLOP/s, speedup over the best dense peer, and the proxy's share (see README)."""
    best = {}
    for row in rows:
        if row.name in DENSE_PEERS and row.ms is not None:
            best[row.seq] = min(best.get(row.seq, math.inf), row.ms)
    proxy = {(row.seq, row.page): row.ms for row in rows if row.name == PROXY and row.ms is not None}
    for row in rows:
        if row.ms is None:
            continue
        if row.flops is not None:
            row.tflops = row.flops / row.ms / 1e9
        if row.seq in best and row.name != PROXY:
            row.speedup = best[row.seq] / row.ms
        proxy_ms = proxy.get((row.seq, row.page))
        if proxy_ms is not None and row.name.startswith("cosa") and not row.name.startswith(KERNEL_ROW):
            row.proxy_share = proxy_ms / row.ms   # of a whole run
        elif proxy_ms is not None and row.name == PROXY and row.seq in best:
            row.proxy_share = proxy_ms / best[row.seq]


def find(rows: list[Row], seq: int, page: int | None, name: str) -> Row | None:
    return next((r for r in rows if (r.seq, r.page, r.name) == (seq, page, name) and r.ms is not None),
                None)


@dataclass
class SkipCost:
    ratio: float         # an extra skipped block's cost over an extra computed one's
    charged: float       # the same with the vote path's fixed costs charged to the skipped blocks


def skip_cost(delta0: tuple[Row, Row], skip_all: tuple[Row, Row]) -> SkipCost | None:
    """A skipped block's cost over a computed one's, from two masks (a wider and a narrower
    budget), each run at delta 0 and with all but its first visited block skipped.  Fitting
    t = o + c*computed + s*skipped, c is the delta-0 runs' difference in time over their difference
    in computed blocks, and s the skip-all runs' difference (less c for any difference in computed
    blocks) over their difference in skipped blocks, so that what does not grow with the blocks
    (the proxy, the launch, each tile's set-up and its switch to the vote path) drops out.
    ``charged`` takes o from the delta-0 runs instead, which charges the vote path's fixed costs
    to the skipped blocks (this benchmark's measure until bench/NOTES.md's session 50).  None
    where the runs are not two masks each at both deltas (a skip-all run's blocks are not its
    delta-0 run's, or the wider mask does not add blocks), or where the fit gives no positive
    costs: fixed costs and noise then outweigh the blocks, and there is no per-block cost."""
    (wide, narrow), (wide_skip, narrow_skip) = delta0, skip_all
    if any(s.computed + s.skipped != d.computed for d, s in zip(delta0, skip_all)):
        return None
    if wide.computed <= narrow.computed or wide_skip.skipped <= narrow_skip.skipped:
        return None
    c = (wide.ms - narrow.ms) / (wide.computed - narrow.computed)
    s = ((wide_skip.ms - narrow_skip.ms) - c * (wide_skip.computed - narrow_skip.computed)) / \
        (wide_skip.skipped - narrow_skip.skipped)
    if c <= 0 or s <= 0:
        return None
    o = wide.ms - c * wide.computed
    return SkipCost(s / c, (wide_skip.ms - o - c * wide_skip.computed) / wide_skip.skipped / c)


def evaluate_targets(rows: list[Row], page_sizes) -> list[Target]:
    seqs = sorted({r.seq for r in rows})
    targets = []

    def speed(peer: Row | None, cosa_row: Row | None) -> float | None:
        """Above 1, CoSA is faster than the peer."""
        return peer.ms / cosa_row.ms if peer and cosa_row else None

    for seq in (32768, 131072):
        for page in page_sizes:
            peer, run = find(rows, seq, None, FA4_DENSE), find(rows, seq, page, COSA_DENSE)
            targets.append(Target("cosa dense / fa4 dense speed", f"{seq} p{page}", speed(peer, run), 0.95, True))
    for seq in seqs:
        for page in page_sizes:
            for budget in BUDGETS:
                peer = find(rows, seq, None, fa4_block_sparse_name(budget))
                kernel = find(rows, seq, page, cosa_kernel_name(budget))
                run = find(rows, seq, page, cosa_name(budget, 0.0))
                ratio, note = speed(peer, kernel), f"whole run {speed(peer, run):.3f}" if peer and run else ""
                if peer and kernel and peer.computed != kernel.computed:   # FA4's mask is the first page size's
                    ratio, note = None, f"block counts differ: {kernel.computed} against fa4's {peer.computed}"
                targets.append(Target(f"cosa kernel / fa4 block-sparse b={budget} speed", f"{seq} p{page}",
                                      ratio, 1.0, True, note))
    for seq in seqs:
        for page in page_sizes:
            delta0 = [find(rows, seq, page, cosa_name(budget, 0.0)) for budget in SKIP_FIT_BUDGETS]
            skip_all = [find(rows, seq, page, skip_all_name(budget)) for budget in SKIP_FIT_BUDGETS]
            cost = skip_cost(delta0, skip_all) if all(delta0 + skip_all) else None
            targets.append(Target("skipped / computed block cost", f"{seq} p{page}", cost and cost.ratio, 0.5,
                                  False, f"fixed costs charged to skipped blocks {cost.charged:.3f}" if cost else ""))
    for page in page_sizes:
        b2_row = find(rows, 131072, page, COSA_B2)
        ratio, note = speed(find(rows, 131072, None, FA4_DENSE), b2_row), ""
        if b2_row and abs(b2_row.density2 - B2) > B2_TOLERANCE:   # a delta calibrated on another input
            ratio, note = None, f"density after stage 2 {b2_row.density2:.3f}, not {B2}"
        targets.append(Target(f"run b={B2_BUDGET} b2={B2:.2f} speedup over fa4 dense", f"131072 p{page}",
                              ratio, 5.5, True, note))
    for seq, limit in ((131072, 0.01), (8192, 0.03)):
        for page in page_sizes:
            proxy = find(rows, seq, page, PROXY)
            targets.append(Target("proxy / best dense time", f"{seq} p{page}",
                                  proxy.proxy_share if proxy else None, limit, False))
    return targets


# ----------------------------------------------------------------------------- output

def format_or_dash(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


TABLE_HEADER = (f"{'seq':>6} {'page':>4} {'row':<23} {'ms':>9} {'TFLOP/s':>7} {'dens1':>5} {'dens2':>5} "
                f"{'speedup':>7} {'proxy%':>6}  note")


def format_row(row: Row) -> str:
    share = None if row.proxy_share is None else 100 * row.proxy_share
    return (f"{row.seq:>6} {format_or_dash(row.page, 'd'):>4} {row.name:<23} {format_or_dash(row.ms, '.3f'):>9} "
            f"{format_or_dash(row.tflops, '.0f'):>7} {format_or_dash(row.density1, '.3f'):>5} {format_or_dash(row.density2, '.3f'):>5} "
            f"{format_or_dash(row.speedup, '.2f'):>7} {format_or_dash(share, '.2f'):>6}  {row.note}").rstrip()


def format_table(rows: list[Row]) -> str:
    ordered = sorted(rows, key=lambda r: (r.seq, r.page or 0))   # stable: measuring order within a group
    return "\n".join([TABLE_HEADER] + [format_row(r) for r in ordered])


def format_targets(targets: list[Target]) -> str:
    lines = [f"{'target':<45} {'where':<11} {'ratio':>7} {'need':>8}  status"]
    for t in targets:
        need = f"{'>=' if t.at_least else '<='}{t.need:g}"
        note = f"  ({t.note})" if t.note else ""
        lines.append(f"{t.name:<45} {t.where:<11} {format_or_dash(t.ratio, '.3f'):>7} {need:>8}  {t.status}{note}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- measuring

def settle_calls(elapsed_s: float, calls: int, settle_s: float) -> int:
    """Further back-to-back calls that bring ``calls`` calls, which took ``elapsed_s`` seconds, to
    at least ``settle_s`` seconds."""
    if calls < 1 or elapsed_s >= settle_s:
        return 0
    per_call = max(elapsed_s / calls, 1e-6)  # no call launches in less than a microsecond
    return math.ceil((settle_s - elapsed_s) / per_call)


def time_samples(fn, warmup: int, repeats: int, settle_s: float = 0.0) -> list[float]:
    """CUDA-event times in ms of ``repeats`` back-to-back calls of ``fn``, after ``warmup`` calls
    and then as many more as fill ``settle_s`` seconds: under load the H200's clock follows the
    power the work draws, mostly within 0.1-0.2 s but not wholly, so a row timed soon after
    another carries some of the clock that row left (bench/NOTES.md, sessions 18 and 24).  L2
    is not flushed between calls."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    for _ in range(settle_calls(time.perf_counter() - start, warmup, settle_s)):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_ms(fn, warmup: int, repeats: int) -> float:
    """The median of ``time_samples``."""
    return statistics.median(time_samples(fn, warmup, repeats))


class GraphCall:
    """``calls`` calls of ``fn`` captured in one CUDA graph, after ``warmup`` eager calls; calling
    it replays them.  A replay times work shorter than its own launch from Python, which
    back-to-back eager calls would not.  It holds ``fn``, and so the tensors the graph reads and
    writes (a plan made inside a row's builder would otherwise be freed, and the replays would
    run on reused memory)."""

    def __init__(self, fn, warmup: int, calls: int):
        for _ in range(warmup):
            fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture needs a warm-up off the default stream
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.fn, self.graph = fn, torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(calls):
                fn()

    def __call__(self) -> None:
        self.graph.replay()


@dataclass
class Timed:
    """A row waiting for its time: ``call`` is what is timed, and it runs the row's work ``calls``
    times (a graph replay).  ``replayable``: the work can be captured in a CUDA graph."""
    row: Row
    call: Callable[[], object]
    calls: int = 1
    replayable: bool = True


def replayed(fn, warmup: int) -> tuple[GraphCall, int]:
    """``fn`` replayed from a CUDA graph of enough calls that a replay lasts ``GRAPH_MS``, and that
    number of calls: the GPU's time alone.  Eager calls back to back time the host's launch work
    instead wherever it takes longer than the GPU's (at 8K, Python's checks and three launches of
    ~0.2 ms against a sparse run's ~0.2 ms); a server captures its prefill or runs ahead of the GPU."""
    per_call = time_ms(fn, warmup, 3)
    calls = min(MAX_GRAPH_CALLS, max(1, math.ceil(GRAPH_MS / per_call)))
    return GraphCall(fn, 0, calls), calls


def as_graph(timed: Timed, warmup: int) -> Timed:
    """``timed`` with its call replayed from a CUDA graph (``replayed``)."""
    graph, calls = replayed(timed.call, warmup)
    return Timed(timed.row, graph, timed.calls * calls)


class Unavailable(RuntimeError):
    """A peer that is not installed: its rows say so, without a traceback."""


def failure_row(seq: int, page: int | None, name: str, error: Exception) -> Row:
    """A row that says why it was not measured (with the traceback on stderr, unless the peer is
    simply not installed)."""
    if not isinstance(error, Unavailable):
        traceback.print_exception(error, file=sys.stderr)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    message = (str(error).splitlines() or [""])[0][:100]
    return Row(seq, page, name, None, note=f"{type(error).__name__}: {message}")


def time_in_rounds(group: list[Timed | Row], rounds: int, sample) -> list[Row]:
    """The group's rows with their times.  Each of ``rounds`` rounds takes ``sample(call)`` (a list
    of times in ms) of every row once, in order, so that peers and CoSA rows see the same spread
    of clock and power state, which drift during a run (a row timed in one stretch would carry
    that stretch's drift alone); a row's time is the median over all its samples, per call.  A
    row whose call raises becomes one that says why."""
    timed = [i for i, item in enumerate(group) if isinstance(item, Timed)]
    samples: dict[int, list[float]] = {i: [] for i in timed}
    failed: dict[int, Row] = {}
    for _ in range(rounds):
        for i in timed:
            if i not in failed:
                item = group[i]
                try:
                    samples[i] += sample(item.call)
                except Exception as error:  # noqa: BLE001 - one broken row does not end the run
                    failed[i] = failure_row(item.row.seq, item.row.page, item.row.name, error)
    rows = []
    for i, item in enumerate(group):
        if isinstance(item, Row):
            rows.append(item)
        elif i in failed:
            rows.append(failed[i])
        else:
            rows.append(dataclasses.replace(item.row, ms=statistics.median(samples[i]) / item.calls))
    return rows


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def dense_causal_flops(seq: int) -> float:
    return 4.0 * NUM_QO_HEADS * HEAD_DIM * seq * (seq + 1) / 2


def block_flops(computed: int, diagonals: int) -> float:
    """FLOPs of ``computed`` (query tile, head, key block) triples of a causal problem, of which
    ``diagonals`` are the tiles' diagonal blocks, each counted as the 129/256 of its pairs that the
    causal mask leaves (whole 128-row tiles: the benchmark's lengths are multiples of 128)."""
    return (computed - diagonals * (BLOCK - 1) / (2 * BLOCK)) * BLOCK_FLOPS


def plan_diagonals(plan_: cosa.Plan) -> int:
    """The diagonal blocks a plan computes: every (query tile, head) visits its own first and
    never skips it."""
    return plan_.qtiles.shape[0] * plan_.num_qo_heads


@dataclass
class Paged:
    """One request's K/V in a shuffled paged cache, ``(k_cache, v_cache)`` NHD, and its page table."""

    page_size: int
    cache: tuple[torch.Tensor, torch.Tensor]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor          # logical page -> physical page, int32
    kv_last_page_len: torch.Tensor

    @classmethod
    def build(cls, k: torch.Tensor, v: torch.Tensor, page_size: int, generator: torch.Generator):
        seq = k.shape[0]
        cache, kv_indptr, kv_indices, kv_last_page_len = paged_kv_cache(k, v, [seq], page_size, combined=False,
                                                                        generator=generator)
        return cls(page_size, cache, indptr([seq], k.device), kv_indptr, kv_indices, kv_last_page_len)

    def plan(self, budget: float, delta: float) -> cosa.Plan:
        head_dim = self.cache[0].shape[-1]   # HEAD_DIM here; bench_osk_ab.py also plans head_dim 64
        return cosa.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len,
                         NUM_QO_HEADS, NUM_KV_HEADS, head_dim, self.page_size, causal=True,
                         budget=budget, delta=delta, q_data_type=DTYPE)


def load_fa4():
    """``(flash_attn.cute.interface, block_sparsity, version)``, or ``(None, None, why not)``."""
    try:
        from importlib.metadata import version

        from flash_attn.cute import block_sparsity, interface
        return interface, block_sparsity, version("flash-attn-4")
    except Exception as error:  # noqa: BLE001 - any failure just makes the FA4 rows say so
        return None, None, f"{type(error).__name__}: {error}"


def fa4_block_sparse_tensors(block_sparsity, plan_: cosa.Plan):
    """CoSA's stage-1 blocks as FA4's block lists (block size 128x128, what FA4's SM90 tile is
    at head_dim 128): the diagonal block in the "mask" list (causal masking applies), every
    other block in the "full" list (no masking, as FA4 would be used). FA4 visits each list
    from its last entry down. Per-head lists turn FA4's pack-GQA off."""
    order = plan_.order.permute(1, 0, 2)                                    # [heads, tiles, k_max]
    tile = plan_.qtiles[:, cosa._C.QT_INDEX]                                # q_len == kv_len: tile i's diagonal is block i
    listed = order >= 0
    diagonal = listed & (order == tile[None, :, None])
    padding = torch.iinfo(torch.int32).max

    def packed(keep):   # counts, and ascending block indices packed left (0 past the count)
        idx = torch.where(keep, order, padding).sort(-1).values
        return keep.sum(-1)[None].int().contiguous(), torch.where(idx == padding, 0, idx)[None].int().contiguous()

    mask_cnt, mask_idx = packed(diagonal)
    full_cnt, full_idx = packed(listed & ~diagonal)
    return block_sparsity.BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, full_block_cnt=full_cnt,
        full_block_idx=full_idx, block_size=(BLOCK, BLOCK))


def fa4_block_sparse_row(seq: int, plan_: cosa.Plan, blocks) -> Row:
    """FA4 block-sparse's row: the blocks its lists hold, over the plan's candidate blocks (no
    ``plan_.stats()``: the plan's mask comes from ``order_mask``, and no run wrote its counts)."""
    computed = int(blocks.mask_block_cnt.sum() + blocks.full_block_cnt.sum())
    candidates = int(plan_.qtiles[:, cosa._C.QT_NUM_CANDIDATES].sum()) * plan_.num_qo_heads
    density = computed / max(1, candidates)
    diagonals = int(blocks.mask_block_cnt.sum())   # the "mask" lists hold the diagonal blocks
    return Row(seq, None, fa4_block_sparse_name(plan_.budget), None, block_flops(computed, diagonals), density,
               density, computed)


class Runner:
    """Measures every row of one invocation, one sequence length at a time; prints each row as
    its length's rounds end."""

    def __init__(self, args):
        self.args = args
        self.rows: list[Row] = []
        self.fa4, self.block_sparsity, self.fa4_version = load_fa4()   # version, or why it is missing
        probe = torch.empty(BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        self.uses_kernel = Paged.build(probe, probe, BLOCK, torch.Generator()).plan(1.0, 0.0).uses_kernel
        self.calibration: dict[int, dict] = {}    # seq -> the b2 row's delta and its origin, or an error

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(format_row(row), flush=True)

    def prepare(self, group: list[Timed | Row], seq: int, page: int | None, name: str, build):
        """Appends what ``build()`` returns as ``(timed, output)`` to ``group``, to be timed from a
        CUDA graph unless ``--eager``, and returns the output; a failure becomes a row that says
        why, so that one broken peer does not end the run."""
        try:
            timed, out = build()
            if isinstance(timed, Timed) and timed.replayable and not self.args.eager:
                timed = as_graph(timed, self.args.warmup)
        except Exception as error:  # noqa: BLE001
            timed, out = failure_row(seq, page, name, error), None
        group.append(timed)
        return out

    # --- peers (each builder makes its first call, which compiles, and returns the row to time)

    def _fa4(self):
        if self.fa4 is None:
            raise Unavailable(f"flash_attn.cute: {self.fa4_version}")
        return self.fa4

    def fa4_dense(self, seq, q, k, v, sm_scale):
        fa4, q4, k4, v4 = self._fa4(), q[None], k[None], v[None]

        def call():
            return fa4.flash_attn_func(q4, k4, v4, softmax_scale=sm_scale, causal=True)
        out = call()[0][0]
        return Timed(Row(seq, None, FA4_DENSE, None, dense_causal_flops(seq), 1.0, 1.0), call), out

    def fa4_paged(self, seq, q, paged: Paged, sm_scale):
        fa4, q4, page_table = self._fa4(), q[None], paged.kv_indices[None]

        def call():
            return fa4.flash_attn_varlen_func(q4, *paged.cache, page_table=page_table,
                                              softmax_scale=sm_scale, causal=True)
        call()
        return Timed(Row(seq, paged.page_size, FA4_PAGED, None, dense_causal_flops(seq), 1.0, 1.0), call), None

    def fa4_block_sparse(self, seq, q, k, v, paged: Paged, budget, sm_scale):
        fa4, q4, k4, v4 = self._fa4(), q[None], k[None], v[None]
        plan_ = paged.plan(budget, 0.0)
        cosa.order_mask(plan_, q, paged.cache)
        blocks = fa4_block_sparse_tensors(self.block_sparsity, plan_)

        def call():
            return fa4.flash_attn_func(q4, k4, v4, softmax_scale=sm_scale, causal=True,
                                       block_sparse_tensors=blocks)
        out = call()[0][0]
        return Timed(fa4_block_sparse_row(seq, plan_, blocks), call), out

    def sdpa(self, seq, q, k, v, sm_scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x[None].transpose(1, 2) for x in (q, k, v))     # [1, heads, seq, d] views

        def attention(kt, vt, gqa):
            def call():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=sm_scale,
                                                          enable_gqa=gqa)
            return call
        note, call = "", attention(kt, vt, True)
        try:
            call()
        except RuntimeError:    # cuDNN without GQA: repeat the kv heads outside the timed region
            group = NUM_QO_HEADS // NUM_KV_HEADS
            call = attention(kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1), False)
            call()
            note = "K/V heads repeated: cuDNN refused GQA"
        return Timed(Row(seq, None, SDPA, None, dense_causal_flops(seq), 1.0, 1.0, note=note), call), None

    # --- cosa

    def cosa_run(self, seq, name, paged: Paged, q, budget, delta, check=None, note=""):
        """``check``: ``(name, output)`` of a peer computing the same blocks, for the note."""
        plan_ = paged.plan(budget, delta)
        out = torch.empty_like(q)

        def call():
            return cosa.run(plan_, q, paged.cache, out=out)
        call()
        stats = plan_.stats()
        computed = int(stats.computed.sum())
        if check is not None and check[1] is not None:
            note = f"err {rel_err(out, check[1]):.1e} vs {check[0]}"
        row = Row(seq, paged.page_size, name, None, block_flops(computed, plan_diagonals(plan_)),
                  stats.density_stage1, stats.density_stage2, computed, int(stats.skipped.sum()), delta, note)
        return Timed(row, call, replayable=plan_.uses_kernel), None   # the torch reference is timed eagerly

    def cosa_kernel(self, seq, paged: Paged, q, budget):
        """The OSK kernel alone on the plan's stage-1 mask at delta 0, as FA4 block-sparse is timed:
        ``cosa.run`` would add the proxy, and its programmatic-dependent launch would hide the
        kernel's start under the proxy's end (bench/NOTES.md, session 49)."""
        plan_ = paged.plan(budget, 0.0)
        if plan_.kernel is None:
            raise Unavailable("cosa.run runs the torch reference: there is no kernel to time alone")
        out = torch.empty_like(q)
        cosa.run(plan_, q, paged.cache, out=out)   # the mask, and the counts the row reports
        stats = plan_.stats()
        computed = int(stats.computed.sum())

        def call():
            return plan_.kernel(q, *paged.cache, out, plan_.lse, sm_scale=plan_.sm_scale, log_delta=-math.inf)
        call()
        row = Row(seq, paged.page_size, cosa_kernel_name(budget), None, block_flops(computed, plan_diagonals(plan_)),
                  stats.density_stage1, stats.density_stage2, computed, 0, 0.0)
        return Timed(row, call), None

    def proxy(self, seq, paged: Paged, q):
        plan_ = paged.plan(B2_BUDGET, 0.0)

        def call():
            return cosa.order_mask(plan_, q, paged.cache)
        if plan_.rank_kernel is None:  # the torch path: its host loop is part of its time
            return Timed(Row(seq, paged.page_size, PROXY, None, note="torch path"), call, replayable=False), None
        eager = time_ms(call, self.args.warmup, self.args.repeats)
        return Timed(Row(seq, paged.page_size, PROXY, None, note=f"eager call {eager:.3f} ms"), call), None

    def calibrate(self, seqs, paged: Paged, q, origin: str) -> None:
        """The b2 row's delta (stage-2 density B2 at budget B2_BUDGET) on ``q``, for ``seqs``; untimed."""
        try:
            delta = cosa.calibrate_delta(paged.plan(B2_BUDGET, 0.0), q, paged.cache, B2)
            entry = {"delta": delta, "calibrated_on": origin}
            print(f"delta for b2={B2} at budget {B2_BUDGET}: {delta:.3e}, calibrated on {origin}", flush=True)
        except Exception as error:  # noqa: BLE001 - only the b2 row needs it
            entry = {"error": f"{type(error).__name__}: {error}"}
        for seq in seqs:
            self.calibration[seq] = entry

    def calibrate_on_sample(self, length: int) -> None:
        """--calibrate-len: one delta, from a separate sample of ``length`` tokens, for every length."""
        if not self.uses_kernel and length > REFERENCE_MAX_SEQ:
            self.calibration = {seq: {"error": f"the torch reference is too slow to calibrate on {length}"}
                                for seq in self.args.seq_lens}
            return
        generator = torch.Generator().manual_seed(self.args.seed + 1_000_003 + length)
        q, k, v = structured_qkv(length, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, generator=generator,
                                 dtype=DTYPE, device="cuda")
        paged = Paged.build(k, v, max(self.args.page_sizes), generator)
        self.calibrate(self.args.seq_lens, paged, q, f"a sample of {length}")

    # --- one sequence length

    def measure(self, seq: int) -> None:
        """Builds every row of ``seq`` (peers, then per page size the paged peer, the proxy, the
        block-sparse peers and CoSA's rows), then times them all in rounds (``time_in_rounds``)."""
        generator = torch.Generator().manual_seed(self.args.seed + seq)
        q, k, v = structured_qkv(seq, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, generator=generator,
                                 dtype=DTYPE, device="cuda")
        sm_scale = 1.0 / math.sqrt(HEAD_DIM)
        group: list[Timed | Row] = []
        fa4_dense_out = self.prepare(group, seq, None, FA4_DENSE, lambda: self.fa4_dense(seq, q, k, v, sm_scale))
        self.prepare(group, seq, None, SDPA, lambda: self.sdpa(seq, q, k, v, sm_scale))
        fa4_sparse_out = {}
        for page in self.args.page_sizes:
            paged = Paged.build(k, v, page, generator)
            self.prepare(group, seq, page, FA4_PAGED, lambda: self.fa4_paged(seq, q, paged, sm_scale))
            self.prepare(group, seq, page, PROXY, lambda: self.proxy(seq, paged, q))
            for budget in BUDGETS:
                if budget not in fa4_sparse_out:   # the stage-1 mask depends on q and k, not on pages
                    fa4_sparse_out[budget] = self.prepare(
                        group, seq, None, fa4_block_sparse_name(budget),
                        lambda: self.fa4_block_sparse(seq, q, k, v, paged, budget, sm_scale))
            self.prepare_cosa(group, seq, paged, q, fa4_dense_out, fa4_sparse_out)
        sample = lambda call: time_samples(call, self.args.warmup, self.args.repeats, self.args.settle)  # noqa: E731
        for row in time_in_rounds(group, self.args.rounds, sample):
            self.add(row)

    def prepare_cosa(self, group, seq, paged: Paged, q, fa4_dense_out, fa4_sparse_out) -> None:
        page = paged.page_size
        if not self.uses_kernel and seq > REFERENCE_MAX_SEQ:
            group += [Row(seq, page, name, None, note="skipped: cosa.run runs the torch reference")
                      for name in cosa_rows(None)]
            return
        if seq not in self.calibration:
            self.calibrate([seq], paged, q, "this input")
        calibration = self.calibration[seq]
        # peers computing the same blocks, for the error note
        checks = {COSA_DENSE: (FA4_DENSE, fa4_dense_out)}
        checks |= {cosa_name(budget, 0.0): (fa4_block_sparse_name(budget), fa4_sparse_out.get(budget))
                   for budget in BUDGETS}
        notes = {skip_all_name(budget): f"delta {SKIP_ALL_DELTA:g}" for budget in BUDGETS}
        if "delta" in calibration:
            notes[COSA_B2] = f"delta {calibration['delta']:.2e} (calibrated on {calibration['calibrated_on']})"
        for name, (budget, delta) in cosa_rows(calibration.get("delta")).items():
            if delta is None:
                group.append(Row(seq, page, name, None, note=f"no delta: {calibration['error']}"))
                continue
            self.prepare(group, seq, page, name, lambda name=name, budget=budget, delta=delta: self.cosa_run(
                seq, name, paged, q, budget, delta, checks.get(name), notes.get(name, "")))
        for budget in BUDGETS:
            self.prepare(group, seq, page, cosa_kernel_name(budget),
                         lambda budget=budget: self.cosa_kernel(seq, paged, q, budget))


# ----------------------------------------------------------------------------- driver

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", help="default 8192 32768 131072 (--quick: 8192 32768)")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--json", default="bench_attention.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="8K and 32K only")
    parser.add_argument("--warmup", type=int, default=3, help="calls before each row's timed calls, every round")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of a row's own calls before its timed calls, every round (its clock settles)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row and round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all rows of a length; a row's time is the median of all its calls")
    parser.add_argument("--calibrate-len", type=int,
                        help="calibrate the b2 row's delta once on a separate sample of this many tokens "
                             "(default: on each length's own input)")
    parser.add_argument("--eager", action="store_true",
                        help="time back-to-back eager calls, the host's launch work included, instead of "
                             "CUDA-graph replays (GPU time)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seq_lens is None:
        args.seq_lens = [8192, 32768] if args.quick else [8192, 32768, 131072]
    if args.warmup < 3 or args.repeats < 5 or args.rounds < 1 or not args.settle >= 0:
        parser.error("need --warmup >= 3, --repeats >= 5, --rounds >= 1 and --settle >= 0")
    unit = max([BLOCK] + args.page_sizes)
    for n in args.seq_lens + ([args.calibrate_len] if args.calibrate_len else []):
        if n <= 0 or n % unit:
            parser.error(f"sequence lengths must be positive multiples of {unit}, got {n}")
    return args


def git_checkout(directory: Path) -> tuple[str | None, bool | None]:
    """The commit checked out at ``directory``, and whether tracked files differ from it (the code
    measured is then not that commit's); ``(None, None)`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True).stdout

    try:
        return git("rev-parse", "HEAD").strip(), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None, None


def provenance(device: torch.device | None = None) -> dict:
    """What a benchmark's JSON records of the code and machine that measured it: the checkout's
    commit and whether its tracked files were changed (None outside a git checkout), the device
    the rows ran on (by default the current GPU, None without one; ``"cpu"`` for a CPU
    ``device``), torch, CUDA, cuDNN (the SDPA peer's), the CuTe DSL and cosa, and where the OSK
    kernel comes from (``aot``: libcosa's export, ``jit``: compiled at first use)."""
    from importlib.metadata import PackageNotFoundError, version

    commit, changed = git_checkout(Path(__file__).resolve().parent)
    try:
        dsl = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        dsl = None
    try:   # a record must not end the run it describes
        from cosa.cute_kernels.aot import kernel_source
        osk_kernel = kernel_source("osk", "bfloat16", HEAD_DIM).kind
    except Exception as error:  # noqa: BLE001
        osk_kernel = f"unknown ({type(error).__name__})"
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    device_name = None if device is None else torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"git_commit": commit, "git_changed": changed, "device": device_name,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "cutlass_dsl": dsl, "cosa": cosa.__version__, "osk_kernel": osk_kernel,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_json(path: str, runner: Runner, targets: list[Target]) -> None:
    report = {
        "config": {**vars(runner.args), **provenance(), "flash_attn_4": runner.fa4_version,
                   "cosa_uses_kernel": runner.uses_kernel,
                   "heads": [NUM_QO_HEADS, NUM_KV_HEADS], "head_dim": HEAD_DIM, "dtype": str(DTYPE)},
        "calibration": runner.calibration,
        "rows": [dataclasses.asdict(r) for r in runner.rows],
        "targets": [dict(dataclasses.asdict(t), status=t.status) for t in targets],
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU is available; this benchmark needs one (nothing was measured).")
        return 0
    runner = Runner(args)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flash_attn.cute {runner.fa4_version}, "
          f"cosa {cosa.__version__}; {args.rounds} rounds of, per row, a warm-up of {args.warmup} calls and at "
          f"least {args.settle:g} s, then {args.repeats} timed calls, "
          f"{'eager' if args.eager else 'CUDA-graph replays (GPU time)'}; medians over all, L2 not flushed", flush=True)
    print(f"cosa.run uses the {'OSK kernel' if runner.uses_kernel else 'torch reference'}", flush=True)
    print(TABLE_HEADER, flush=True)
    started = time.time()
    with torch.no_grad():
        if args.calibrate_len:
            runner.calibrate_on_sample(args.calibrate_len)
        for seq in args.seq_lens:
            runner.measure(seq)
            torch.cuda.empty_cache()
            finish_rows(runner.rows)
            targets = evaluate_targets(runner.rows, args.page_sizes)
            write_json(args.json, runner, targets)      # each length: a run that dies keeps what it measured
    print(f"\nbatch 1, heads {NUM_QO_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_DIM}, bf16, causal; "
          f"{time.time() - started:.0f} s; JSON in {args.json}")
    print(format_table(runner.rows))
    print("\ntargets")
    print(format_targets(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
