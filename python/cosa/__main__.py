"""Demo: a ragged batch in a paged cache, CoSA against dense attention.

    python -m cosa            # on the GPU if there is one, else the exact reference on the CPU
"""

from __future__ import annotations

import argparse
import time

import torch

from . import plan, run
from .paged import indptr, paged_kv_cache
from .reference import dense_attention
from .synthetic import structured_qkv


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cosa", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 2500])
    parser.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("QO", "KV"))
    parser.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(args.seed)
    num_qo_heads, num_kv_heads = args.heads
    requests = [structured_qkv(n, num_qo_heads, num_kv_heads, args.head_dim, generator=generator, dtype=dtype)
                for n in args.seq_lens]
    q, k, v = (torch.cat(x).to(device) for x in zip(*requests))     # ragged: one request after the other
    cache, kv_indptr, kv_indices, last = paged_kv_cache(k, v, args.seq_lens, args.page_size, generator=generator)
    qo_indptr = indptr(args.seq_lens, device)

    plan_ = plan(qo_indptr, kv_indptr, kv_indices, last, num_qo_heads, num_kv_heads, args.head_dim,
                 args.page_size, budget=args.budget, delta=args.delta, q_data_type=dtype)
    run(plan_, q, cache)             # the first call on a GPU compiles the kernel
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    o = run(plan_, q, cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stats = plan_.stats()

    errors = []
    for r in range(len(args.seq_lens)):
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))      # q_len == kv_len: the same rows of q, k, v
        if rows.start == rows.stop:
            errors.append("-")  # an empty request: nothing to compare
            continue
        dense, _ = dense_attention(q[rows], k[rows], v[rows], causal=True, sm_scale=plan_.sm_scale)
        errors.append(f"{((o[rows].float() - dense.float()).norm() / dense.float().norm()).item():.2e}")

    path = "OSK kernel" if plan_.uses_kernel else "exact reference"
    print(f"cosa demo on {device.type} ({path}): requests {args.seq_lens}, heads {num_qo_heads}/{num_kv_heads}, "
          f"head_dim {args.head_dim}, page_size {args.page_size}, {dtype}")
    print(f"budget {args.budget}, delta {args.delta}: run took {elapsed * 1e3:.1f} ms")
    print(f"density after stage 1: {stats.density_stage1:.3f}   after stage 2: {stats.density_stage2:.3f}")
    print("relative error against dense attention per request: "
          + ", ".join(errors))


if __name__ == "__main__":
    main()
