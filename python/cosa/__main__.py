"""Demo: a ragged batch in a paged cache, CoSA against dense attention.

    python -m cosa            # on the GPU if there is one, else the exact reference on the CPU
"""

from __future__ import annotations

import argparse
import time

import torch

from . import plan, run
from .reference import dense_attention
from .synthetic import structured_qkv


def paged_batch(seq_lens, q_lens, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, device,
                generator):
    """Queries and a shuffled NHD page cache holding the structured keys and values of each request."""
    qs, pages_of, caches = [], [], []
    next_page = 0
    for seq_len, q_len in zip(seq_lens, q_lens):
        q, k, v = structured_qkv(seq_len, num_qo_heads, num_kv_heads, head_dim, q_len=q_len,
                                 generator=generator, dtype=dtype)
        pages = -(-seq_len // page_size)
        padded = torch.zeros(pages * page_size, 2, num_kv_heads, head_dim, dtype=dtype)
        padded[:seq_len, 0], padded[:seq_len, 1] = k, v
        caches.append(padded.view(pages, page_size, 2, num_kv_heads, head_dim).transpose(1, 2))
        pages_of.append(list(range(next_page, next_page + pages)))
        qs.append(q)
        next_page += pages
    permutation = torch.randperm(next_page, generator=generator)
    cache = torch.empty(next_page, 2, page_size, num_kv_heads, head_dim, dtype=dtype)
    cache[permutation] = torch.cat(caches)
    kv_indices = torch.cat([permutation[p] for p in map(torch.tensor, pages_of)]).int()
    kv_indptr = torch.tensor([0] + [len(p) for p in pages_of]).cumsum(0).int()
    qo_indptr = torch.tensor([0] + list(q_lens)).cumsum(0).int()
    last = torch.tensor([(s - 1) % page_size + 1 for s in seq_lens]).int()
    return (torch.cat(qs).to(device), cache.to(device), qo_indptr.to(device), kv_indptr.to(device),
            kv_indices.to(device), last.to(device))


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
    q, cache, qo_indptr, kv_indptr, kv_indices, last = paged_batch(
        args.seq_lens, args.seq_lens, num_qo_heads, num_kv_heads, args.head_dim, args.page_size,
        dtype, device, generator)

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
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        pages = kv_indices[int(kv_indptr[r]):int(kv_indptr[r + 1])]
        kv = cache[pages].transpose(1, 2).reshape(-1, 2, num_kv_heads, args.head_dim)[:args.seq_lens[r]]
        dense, _ = dense_attention(q[rows], kv[:, 0], kv[:, 1], causal=True, sm_scale=plan_.sm_scale)
        errors.append(((o[rows].float() - dense.float()).norm() / dense.float().norm()).item())

    path = "OSK kernel" if plan_.uses_kernel else "exact reference"
    print(f"cosa demo on {device.type} ({path}): requests {args.seq_lens}, heads {num_qo_heads}/{num_kv_heads}, "
          f"head_dim {args.head_dim}, page_size {args.page_size}, {dtype}")
    print(f"budget {args.budget}, delta {args.delta}: run took {elapsed * 1e3:.1f} ms")
    print(f"density after stage 1: {stats.density_stage1:.3f}   after stage 2: {stats.density_stage2:.3f}")
    print("relative error against dense attention per request: "
          + ", ".join(f"{e:.2e}" for e in errors))


if __name__ == "__main__":
    main()
