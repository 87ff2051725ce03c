"""The floor under the proxy's time: how long one kernel on this GPU takes to read the bytes the
proxy reads (q and K of ``bench_attention.py``'s workload), against torch's own reduction over
the same bytes.

    python bench/bench_read_floor.py [--seq-lens 8192 32768 131072] [--json floor.json]

Rows, per sequence length, all timed as ``bench_attention.py`` times its proxy row (GPU time of
10 calls captured in one CUDA graph, a replay's median, rounds interleaved, every row settled
at its own clock first):

- ``read once``: a CuTe-DSL kernel that reads every byte once, one CTA of 256 threads per
  32 KB, each thread's eight 16-byte loads issued before any is summed;
- ``torch sum``: ``torch.sum`` over the same bytes as float32.

Without a GPU it says so and exits 0.  bench/NOTES.md (session 19) compares the floor with the
proxy and with the proxy-share targets.
"""

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import (DTYPE, HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, GraphCall, provenance,  # noqa: E402
                             time_samples)

THREADS = 256
LOADS = 8                 # 16-byte loads a thread issues before it sums
FLOATS_PER_LOAD = 4
GRAPH_CALLS = 10


def proxy_bytes(seq: int) -> int:
    """The bytes of q and K the proxy reads at ``seq`` tokens."""
    return seq * (NUM_QO_HEADS + NUM_KV_HEADS) * HEAD_DIM * DTYPE.itemsize


@dataclass
class Row:
    seq: int
    name: str
    megabytes: float
    us: float

    @property
    def terabytes_per_s(self) -> float:
        return self.megabytes / self.us


def read_once_kernel():
    """The ``read once`` kernel, for ``cute.compile`` with ``(x, sink, stream)``: ``x`` a 1-D
    float32 tensor whose size is a multiple of 4, ``sink`` one float32 (written only if the sum
    is exactly -1, so that no load is dead and nothing else is stored)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    class ReadOnce:
        @cute.jit
        def __call__(self, mX: cute.Tensor, mSink: cute.Tensor, stream: cuda.CUstream):
            chunk = THREADS * LOADS * FLOATS_PER_LOAD
            self.kernel(mX, mSink).launch(grid=[(mX.shape[0] + chunk - 1) // chunk, 1, 1],
                                          block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mSink: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            last = mX.shape[0] // FLOATS_PER_LOAD - 1
            values = cute.make_rmem_tensor((FLOATS_PER_LOAD, LOADS), Float32)
            for u in cutlass.range_constexpr(LOADS):
                load = cutlass.min((bid * LOADS + u) * THREADS + tidx, last)
                cute.autovec_copy(cute.local_tile(mX, (FLOATS_PER_LOAD,), (load,)), values[None, u])
            total = Float32(0.0)
            for u in cutlass.range_constexpr(LOADS):
                for f in cutlass.range_constexpr(FLOATS_PER_LOAD):
                    total = total + values[f, u]
            if total == Float32(-1.0):
                mSink[0] = total

    return ReadOnce()


def measure(seqs, rounds: int, repeats: int, settle_s: float) -> list[Row]:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    def stream():
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)

    kernel, rows = read_once_kernel(), []
    for seq in seqs:
        nbytes = proxy_bytes(seq)
        x = torch.randn(nbytes // 4, dtype=torch.float32, device="cuda")
        sink = torch.zeros(1, dtype=torch.float32, device="cuda")
        tx, tsink = from_dlpack(x, assumed_align=16), from_dlpack(sink)
        compiled = cute.compile(kernel, tx, tsink, stream())  # for this size: a second or so
        calls = {"read once": lambda: compiled(tx, tsink, stream()), "torch sum": lambda: x.sum()}
        graphs = {name: GraphCall(call, 2, GRAPH_CALLS) for name, call in calls.items()}
        samples = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, graph in graphs.items():
                samples[name] += time_samples(graph, 1, repeats, settle_s)
        for name, times in samples.items():
            rows.append(Row(seq, name, nbytes / 1e6, statistics.median(times) * 1e3 / GRAPH_CALLS))
            print(f"{seq:>7} {name:>10} {nbytes / 1e6:9.1f} MB {rows[-1].us:9.2f} us "
                  f"{rows[-1].terabytes_per_s:6.2f} TB/s", flush=True)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settle", type=float, default=0.3, help="seconds each row runs before it is timed")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if any(seq < 1 for seq in args.seq_lens) or args.rounds < 1 or args.repeats < 1 or not args.settle >= 0:
        parser.error("--seq-lens, --rounds and --repeats must be positive and --settle at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_read_floor: no CUDA GPU is available; this benchmark needs one (nothing was measured).")
        return 0
    print(f"{'seq':>7} {'row':>10} {'bytes':>12} {'time':>12} {'rate':>11}")
    rows = measure(args.seq_lens, args.rounds, args.repeats, args.settle)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": dict(vars(args), **provenance()),
             "rows": [dict(asdict(row), terabytes_per_s=row.terabytes_per_s) for row in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
