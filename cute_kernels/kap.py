"""KAP on the GPU: the order mask of SPEC stage 1 for a whole ragged batch in two launches.

The torch path (``cosa.proxy.order`` + ``cosa.proxy.kap``) stays the definition and the
CPU path; this module computes the same mask, fp32 throughout.

Entry points
------------
``supported(head_dim, dtype, num_key_blocks) -> bool``
    Whether the kernels cover the configuration: the OSK configurations (head_dim 64 or
    128, fp16/bf16) and requests of at most ``MAX_KEY_BLOCKS`` key blocks.

``Launcher(block_pages, kv_block_indptr, kv_lens, qtiles, qbar, kbar, order, *, force_local,
force_sink, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout="NHD")(q, k_cache)``
    The kernels bound to a plan's tables and buffers (as ``osk.Launcher``); a call launches
    as ``kap_order``.  Binding reads the longest request off ``kv_block_indptr`` (a sync: it
    sizes the sort, so it is not taken on trust); the calls neither sync nor allocate.

``kap_order(q, k_cache, block_pages, kv_block_indptr, kv_lens, qtiles, qbar, kbar, order, *,
force_local, force_sink, kv_layout="NHD") -> None``
    Writes ``order`` [num_qtiles, Hq, k_max] int32 in place on the current torch stream of
    q's device (and the pooled means ``qbar`` [num_qtiles, Hq, D], ``kbar`` [num_kv_blocks,
    Hkv, D] float32, which the caller provides).  It binds a ``Launcher`` for the call, and so
    syncs: to capture KAP in a CUDA graph, bind a ``Launcher`` first and capture its calls (no
    host sync, no allocation, once compiled).  ``q``, ``k_cache`` and the int32 plan tensors are as for
    ``osk.osk_forward``; ``force_local`` and ``force_sink`` are the plan's.  Imports no
    torch (``osk._launch`` does, when called), so that ``aot.py`` exports the kernels
    without it.

Kernels
-------
Two launches, the second a programmatic dependent of the first: its CTAs start on the SMs
the first grid's CTAs leave, without waiting for that grid to end, and take q's means (most
of the bytes the proxy reads, which do not depend on the first) before they wait for it.
They do not run beside the first grid's CTAs: at 8K tokens no ``KAPRank`` CTA starts before
``KAPPool``'s first CTAs exit (bench/NOTES.md, session 20).

``KAPPool``, one CTA of 128 threads per (key block, kv head): the mean of the block's
valid rows, read straight from the paged cache through ``block_pages`` as OSK reads
them, written to ``kbar``.  Each CTA first lets ``KAPRank`` launch.

``KAPRank``, one CTA of 256 threads per (query tile, kv head) for the query heads of
that kv head, so that each ``kbar`` row is read from L2 once per group.  Each CTA first
lets the OSK launch that follows it in ``cosa.run`` start (its CTAs set up and read the
plan until this grid has completed):

- the means of the tile's rows of q for each of those heads, written to ``qbar``; they
  need only q, so they come before the CTA waits for ``KAPPool``'s grid, whose last CTAs
  may still be running;
- scores: 8 lanes per key block j < n (n = the tile's candidates) each dot a slice of
  ``qbar[h]`` with ``kbar[j]`` and reduce by shuffles; the score becomes the ranking
  key of ``rank_key``, in shared memory (``_unscored_key`` and ``_score_code`` are
  ``cosa.proxy.order``'s ``unscored_keys`` and, for float32, ``_score_code``);
- a bitonic sort, descending, of each head's keys padded with INT64_MIN to
  ``width = max(8, next power of two of n)``, all heads of a pass at once.  Each thread
  holds 8 keys whose indices differ in three bits and runs up to three compare-exchange
  steps in registers per round trip through shared memory; the key array is swizzled
  (``_slot``) so that every round is free of bank conflicts;
- ``order[tile, h, :num_selected]`` = block index of the first keys, -1 after.

A block mean (``BlockMean``) is summed in fp32 from 16-byte loads, a row per
``head_dim / 8`` threads, the row groups' partial sums added up in shared memory.

Limit: the keys of one pass fill at most ``KEY_SLOTS`` int64 slots (32 KB of shared
memory; with the rest, 44 KB a CTA, so that with 64 registers a thread four fit an SM and
an 8K-token batch of tiles is resident at once), or, in a batch with a request of more
than ``KEY_SLOTS`` key blocks, ``MAX_KEY_BLOCKS`` (128 KB, one CTA an SM); so a request may
have at most ``MAX_KEY_BLOCKS`` key blocks (2M tokens). The heads of a group are ranked in
passes of ``min(group, 8, slots / width)`` heads.  ``cosa.plan`` uses the torch path for
longer requests.

Compile-time specialisation: both kernels per (dtype, head_dim); everything else is
runtime.  Like OSK's, loaded from libcosa when it carries them (``aot.py``), else compiled
from fake tensors on first use and cached in-process.
"""

from __future__ import annotations

import threading

import cuda.bindings.driver as cuda

# osk first: it sets the DSL's target architecture before the DSL is imported
from .osk import (CONFIGS, _HAVE_TVM_FFI, _Operands, _check_config, _check_flags, _check_shapes,
                  _check_tiles_have_blocks, _check_vector_rows, _cutlass_dtype, _dtype_name, _fake_tensor,
                  _launch, _BoundTensors, _plan_tables, _row_offset)
from .osk import supported as _osk_supported
from .aot import load_or_compile
from .plan_layout import (BLOCK_SIZE, QT_LOCAL_FIRST, QT_LOCAL_LAST, QT_NUM_CANDIDATES, QT_NUM_SELECTED,
                          QT_REQUEST, QT_ROW_START, QT_ROWS)
from .rank_key import BLOCK_BITS, LOCAL_FIRST, LOCAL_LAST, PRIORITY_SHIFT, SCORED, SINK

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64, const_expr  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402

__all__ = ["supported", "kap_order", "Launcher", "compile_config", "CONFIGS", "MAX_KEY_BLOCKS"]

KEY_SLOTS = 4096               # int64 key slots of KAPRank's shared memory: 32 KB ...
MAX_KEY_BLOCKS = 16384         # ... or, where a request is longer, 128 KB (2M tokens)
POOL_THREADS = 128
VEC = 8                        # fp16/bf16 elements per 16-byte load
RANK_THREADS = 256
LANES_PER_BLOCK = 8            # lanes that share one key block's dot product
MAX_PASS_HEADS = 8             # qbar rows staged in shared memory per pass
SORT_BITS = 3                  # index bits a thread's keys span in one sort round
INT64_MIN = -(1 << 63)


def supported(head_dim: int, dtype, num_key_blocks: int) -> bool:
    """True when the kernels cover this head_dim and dtype and requests of
    ``num_key_blocks`` key blocks (see the module docstring for the limit)."""
    return _osk_supported(head_dim, dtype) and num_key_blocks <= MAX_KEY_BLOCKS


class BlockMean:
    """The mean of the first ``num_rows`` rows of a 128-row block with ``threads`` threads:
    each thread sums VEC columns of ``sweeps`` rows, a row per ``head_dim / VEC`` threads;
    the row groups' partial sums are added up in shared memory."""

    def __init__(self, dtype, head_dim: int, threads: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.row_threads = head_dim // VEC            # threads covering one row
        self.row_step = threads // self.row_threads   # rows one sweep of the CTA covers
        self.sweeps = BLOCK_SIZE // self.row_step

    def partial_layout(self):
        return cute.make_layout((self.head_dim, self.row_step))

    @cute.jit
    def rows(self, tidx, num_rows):
        """Block rows this thread reads, one per sweep.  Rows past the block's end are
        clamped to its last row: every load is in bounds and issued unconditionally, and
        ``__call__`` leaves them out of the sum."""
        first_row = tidx // self.row_threads
        rows = cute.make_rmem_tensor((self.sweeps,), Int32)
        for m in cutlass.range_constexpr(self.sweeps):
            rows[m] = cutlass.min(first_row + m * self.row_step, num_rows - 1)
        return rows

    @cute.jit
    def __call__(self, mX, row_offset, num_rows, partial):
        """The mean's column ``tidx`` (in threads ``tidx < head_dim``), sweep ``m``'s row at
        ``mX.iterator + row_offset[m]``."""
        tidx, _, _ = cute.arch.thread_idx()
        first_row = tidx // self.row_threads
        column = (tidx % self.row_threads) * VEC
        values = cute.make_rmem_tensor((VEC, self.sweeps), self.dtype)
        for m in cutlass.range_constexpr(self.sweeps):
            src = cute.make_ptr(self.dtype, (mX.iterator + (row_offset[m] + Int64(column))).toint(),
                                cute.AddressSpace.gmem, assumed_align=16)
            cute.autovec_copy(cute.make_tensor(src, cute.make_layout(VEC)), values[None, m])
        total = cute.make_rmem_tensor((VEC,), Float32)
        total.fill(0.0)
        for m in cutlass.range_constexpr(self.sweeps):
            if first_row + m * self.row_step < num_rows:
                total.store(total.load() + values[None, m].load().to(Float32))
        cute.autovec_copy(total, cute.local_tile(partial[None, first_row], (VEC,), (column // VEC,)))
        cute.arch.barrier()
        column_sum = Float32(0.0)
        if tidx < self.head_dim:
            for r in cutlass.range_constexpr(self.row_step):
                column_sum = column_sum + partial[tidx, r]
        return column_sum / Float32(num_rows)


class KAPPool:
    """Means of the valid rows of the key blocks -> kbar."""

    def __init__(self, dtype, head_dim: int):
        self.mean = BlockMean(dtype, head_dim, POOL_THREADS)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mBlockPages: cute.Tensor, mKvBlockIndptr: cute.Tensor,
                 mKvLens: cute.Tensor, mKbar: cute.Tensor, page_shift: Int32, stream: cuda.CUstream):
        self.kernel(mK, mBlockPages, mKvBlockIndptr, mKvLens, mKbar, page_shift).launch(
            grid=[mKbar.shape[0], mKbar.shape[1], 1], block=[POOL_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mBlockPages: cute.Tensor, mKvBlockIndptr: cute.Tensor,
               mKvLens: cute.Tensor, mKbar: cute.Tensor, page_shift: Int32):
        # KAPRank may launch once every CTA of this grid has: its CTAs take the SMs ours leave
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        block, kv_head, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate_tensor(Float32, self.mean.partial_layout(), byte_alignment=16)
        request = self._request_of(mKvBlockIndptr, mKvLens.shape[0], block)
        first_key = (block - mKvBlockIndptr[request]) * BLOCK_SIZE
        num_rows = cutlass.min(BLOCK_SIZE, mKvLens[request] - first_key)
        page_mask = (Int32(1) << page_shift) - 1
        rows = self.mean.rows(tidx, num_rows)
        row_offset = cute.make_rmem_tensor((self.mean.sweeps,), Int64)
        for m in cutlass.range_constexpr(self.mean.sweeps):
            key = first_key + rows[m]
            page = mBlockPages[block, (key >> page_shift) - (first_key >> page_shift)]
            row_offset[m] = (Int64(page) * mK.stride[0] + Int64(key & page_mask) * mK.stride[1]
                             + Int64(kv_head) * mK.stride[2])
        mean = self.mean(mK, row_offset, num_rows, partial)
        if tidx < self.mean.head_dim:
            mKbar[block, kv_head, tidx] = mean

    @cute.jit
    def _request_of(self, mKvBlockIndptr, num_requests, block):
        """The request whose key blocks hold ``block``: the last r with indptr[r] <= block."""
        lo = Int32(0)
        hi = num_requests
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mKvBlockIndptr[mid] <= block:
                lo = mid
            else:
                hi = mid
        return lo


class KAPRank:
    """q's tile means, scores, ranking keys and the bitonic sort: one CTA per (query tile,
    kv head)."""

    def __init__(self, dtype, head_dim: int):
        self.head_dim = head_dim
        self.mean = BlockMean(dtype, head_dim, RANK_THREADS)
        self.lane_chunks = head_dim // (4 * LANES_PER_BLOCK)   # float4 chunks per lane

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQbar: cute.Tensor, mKbar: cute.Tensor,
                 mQtiles: cute.Tensor, mKvBlockIndptr: cute.Tensor, mOrder: cute.Tensor,
                 max_request_blocks: Int32, force_local: Int32, force_sink: Int32, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            qbar: cute.struct.Align[cute.struct.MemRange[Float32, MAX_PASS_HEADS * self.head_dim], 16]
            partial: cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(self.mean.partial_layout())], 16]
            # last: a launch for longer requests extends it past the struct (_key_slots)
            keys: cute.struct.Align[cute.struct.MemRange[Int64, KEY_SLOTS], 128]

        extra_keys = _key_slots(max_request_blocks) - KEY_SLOTS
        self.kernel(mQ, mQbar, mKbar, mQtiles, mKvBlockIndptr, mOrder, max_request_blocks, force_local,
                    force_sink, SharedStorage).launch(
            grid=[mQtiles.shape[0], mKbar.shape[1], 1], block=[RANK_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes() + extra_keys * 8, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQbar: cute.Tensor, mKbar: cute.Tensor,
               mQtiles: cute.Tensor, mKvBlockIndptr: cute.Tensor, mOrder: cute.Tensor,
               max_request_blocks: Int32, force_local: Int32, force_sink: Int32,
               SharedStorage: cutlass.Constexpr):
        # OSK may launch as soon as every CTA of this grid has: its CTAs set up meanwhile
        cute.arch.griddepcontrol_launch_dependents()
        D = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        bid_x, kv_head, _ = cute.arch.block_idx()
        # a request's later tiles see more key blocks: launch them first
        tile = mQtiles.shape[0] - 1 - bid_x
        num_candidates = mQtiles[tile, QT_NUM_CANDIDATES]
        num_selected = mQtiles[tile, QT_NUM_SELECTED]
        first_block = mKvBlockIndptr[mQtiles[tile, QT_REQUEST]]
        group = mQbar.shape[1] // mKbar.shape[1]
        k_max = mOrder.shape[2]

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        key_slots = _key_slots(max_request_blocks)
        keys = storage.keys.get_tensor(cute.make_layout(key_slots))
        sQbar = storage.qbar.get_tensor(cute.make_layout((D, MAX_PASS_HEADS)))
        partial = storage.partial.get_tensor(self.mean.partial_layout())

        log_width = cutlass.max(
            SORT_BITS, 32 - Int32(cute.arch.clz(Int32(cutlass.max(num_candidates, 1) - 1))))
        width = Int32(1) << log_width
        pass_heads = cutlass.min(cutlass.min(group, MAX_PASS_HEADS), key_slots >> log_width)

        # q's means first: they do not depend on KAPPool, whose last CTAs may still run.  Those
        # of the first pass's heads go straight to shared memory as well.
        row_start = mQtiles[tile, QT_ROW_START]
        num_rows = mQtiles[tile, QT_ROWS]
        rows = self.mean.rows(tidx, num_rows)
        row_offset = cute.make_rmem_tensor((self.mean.sweeps,), Int64)
        for h in cutlass.range(group, unroll=1):
            head = kv_head * group + h
            for m in cutlass.range_constexpr(self.mean.sweeps):
                row_offset[m] = _row_offset(mQ, row_start + rows[m], head)
            cute.arch.barrier()  # the previous head's partial sums have been read
            mean = self.mean(mQ, row_offset, num_rows, partial)
            if tidx < D:
                mQbar[tile, head, tidx] = mean
                if h < pass_heads:
                    sQbar[tidx, h] = mean
        cute.arch.griddepcontrol_wait()  # KAPPool's kbar is complete and visible

        for head0 in cutlass.range(0, group, pass_heads, unroll=1):
            heads = cutlass.min(pass_heads, group - head0)
            first_head = kv_head * group + head0
            # the first pass: its q means are in shared memory; a later one: the previous
            # pass has read its keys and qbar rows
            cute.arch.barrier()
            if head0 > 0:
                for i in cutlass.range(tidx, heads * D, RANK_THREADS, unroll=1):
                    sQbar[i % D, i // D] = mQbar[tile, first_head + i // D, i % D]
            for i in cutlass.range(tidx, heads * width, RANK_THREADS, unroll=1):
                if (i & (width - 1)) >= num_candidates:
                    keys[_slot(i)] = Int64(INT64_MIN)
            cute.arch.barrier()
            self._score(mKbar, mQtiles, sQbar, keys, tile, kv_head, first_block, num_candidates,
                        heads, width, force_local, force_sink)
            cute.arch.barrier()
            self._sort(keys, heads * width, log_width)
            for h in cutlass.range(heads, unroll=1):
                for s in cutlass.range(tidx, k_max, RANK_THREADS, unroll=1):
                    block = Int32(-1)
                    if s < num_selected:
                        block = Int32(keys[_slot(h * width + s)] & ((1 << BLOCK_BITS) - 1))
                    mOrder[tile, first_head + h, s] = block

    @cute.jit
    def _score(self, mKbar, mQtiles, sQbar, keys, tile, kv_head, first_block, num_candidates,
               heads, width, force_local, force_sink):
        """keys[h * width + j] = ranking key of block j for the pass's head h, j < n."""
        tidx, _, _ = cute.arch.thread_idx()
        local_first = mQtiles[tile, QT_LOCAL_FIRST]
        local_last = mQtiles[tile, QT_LOCAL_LAST]
        lane = tidx % LANES_PER_BLOCK
        # this lane's columns of kbar[j] and qbar[h]: float4 chunks lane, lane + 8, ...
        k_part = cute.make_rmem_tensor((4, self.lane_chunks), Float32)
        q_part = cute.make_rmem_tensor((4, self.lane_chunks), Float32)
        # the bound is uniform over the warp: every lane takes part in the shuffles
        for j0 in cutlass.range(0, num_candidates, RANK_THREADS // LANES_PER_BLOCK, unroll=1):
            j = j0 + tidx // LANES_PER_BLOCK
            valid = j < num_candidates
            base = Int64(0)
            if valid:
                base = _unscored_key(j, local_first, local_last, force_local, force_sink)
                for c in cutlass.range_constexpr(self.lane_chunks):
                    cute.autovec_copy(
                        cute.local_tile(mKbar[first_block + j, kv_head, None], (4,), (lane + c * LANES_PER_BLOCK,)),
                        k_part[None, c])
            else:
                k_part.fill(0.0)
            for h in cutlass.range(heads, unroll=1):
                for c in cutlass.range_constexpr(self.lane_chunks):
                    cute.autovec_copy(
                        cute.local_tile(sQbar[None, h], (4,), (lane + c * LANES_PER_BLOCK,)), q_part[None, c])
                score = Float32(0.0)
                for i in cutlass.range_constexpr(4 * self.lane_chunks):
                    score = score + q_part[i] * k_part[i]
                for offset in (4, 2, 1):
                    score = score + cute.arch.shuffle_sync_bfly(score, offset=offset)
                if valid and lane == 0:
                    keys[_slot(h * width + j)] = base + (Int64(_score_code(score)) << BLOCK_BITS)

    @cute.jit
    def _sort(self, keys, size, log_width):
        """Sorts each ``2**log_width`` segment of ``keys[:size]`` descending (bitonic). Round
        trips through shared memory: per merge size ``2**p`` the strides ``2**(p-1) .. 1``
        in groups of SORT_BITS, each group run in registers on 8 keys per thread."""
        tidx, _, _ = cute.arch.thread_idx()
        width_mask = (Int32(1) << log_width) - 1
        x = cute.make_rmem_tensor((1 << SORT_BITS,), Int64)
        for p in cutlass.range(1, log_width + 1, unroll=1):
            merge = Int32(1) << p
            for round_ in cutlass.range((p + SORT_BITS - 1) // SORT_BITS, unroll=1):
                top = p - 1 - SORT_BITS * round_           # highest stride bit of the round
                low = cutlass.max(top - (SORT_BITS - 1), 0)  # the thread's keys differ in bits low..low+2
                low_mask = (Int32(1) << low) - 1
                for g in cutlass.range(tidx, size >> SORT_BITS, RANK_THREADS, unroll=1):
                    first = ((g & ~low_mask) << SORT_BITS) | (g & low_mask)
                    for r in cutlass.range_constexpr(1 << SORT_BITS):
                        x[r] = keys[_slot(first | (r << low))]
                    for bit in cutlass.range_constexpr(SORT_BITS - 1, -1, -1):
                        if low + bit <= top:
                            for r in cutlass.range_constexpr(1 << SORT_BITS):
                                if const_expr(not r & (1 << bit)):
                                    # descending where the index's merge bit is clear (always
                                    # in the last merge, where the whole segment is one run)
                                    descending = ((first | (r << low)) & merge & width_mask) == 0
                                    a, b = x[r], x[r | (1 << bit)]
                                    swap = (a < b) == descending
                                    x[r] = cutlass.select_(swap, b, a)
                                    x[r | (1 << bit)] = cutlass.select_(swap, a, b)
                    for r in cutlass.range_constexpr(1 << SORT_BITS):
                        keys[_slot(first | (r << low))] = x[r]
                cute.arch.barrier()


@cute.jit
def _key_slots(max_request_blocks):
    """KAPRank's int64 key slots for requests of at most ``max_request_blocks`` key blocks:
    KEY_SLOTS, or for longer requests MAX_KEY_BLOCKS, whose 128 KB leave
    an SM room for one CTA instead of four."""
    return cutlass.select_(max_request_blocks > KEY_SLOTS, Int32(MAX_KEY_BLOCKS), Int32(KEY_SLOTS))


@cute.jit
def _slot(i):
    """Shared-memory slot of key ``i``: the low 4 bits XOR the next 4, so that the 8-byte keys
    a warp touches in any sort round spread evenly over the banks."""
    return i ^ ((i >> 4) & 15)


@cute.jit
def _unscored_key(j, local_first, local_last, force_local, force_sink):
    """``cosa.proxy.order.unscored_keys`` of candidate block ``j``: its priority and index."""
    priority = Int64(SCORED)
    if force_sink != 0 and j == 0:
        priority = Int64(SINK)
    if force_local != 0 and j == local_last:
        priority = Int64(LOCAL_LAST)
    if force_local != 0 and j == local_first:
        priority = Int64(LOCAL_FIRST)
    return (priority << PRIORITY_SHIFT) | Int64(j)


@cute.jit
def _score_code(score: Float32):
    """``cosa.proxy.order._score_code`` for float32: the bits of |s|, negated for s < 0."""
    magnitude = Int32(llvm.bitcast(Int32.mlir_type, score.ir_value())) & 0x7FFFFFFF
    code = magnitude
    if score < 0:
        code = -magnitude
    return code


# ---------------------------------------------------------------------------
# compilation and launch
# ---------------------------------------------------------------------------
_cache: dict = {}
_lock = threading.Lock()


def _fake_pool_args(dtype_name: str):
    k = _fake_tensor(_cutlass_dtype(dtype_name), 4, vectorized=True)
    return (k, _fake_tensor(Int32, 2), _fake_tensor(Int32, 1), _fake_tensor(Int32, 1), _fake_means())


def _fake_rank_args(dtype_name: str):
    q = _fake_tensor(_cutlass_dtype(dtype_name), 3, vectorized=True)
    return (q, _fake_means(), _fake_means(), _fake_tensor(Int32, 2), _fake_tensor(Int32, 1),
            _fake_tensor(Int32, 3))


def _fake_means():
    """qbar / kbar: [rows, heads, head_dim] float32, 16-byte aligned rows."""
    return _fake_tensor(Float32, 3, vectorized=True)


def _compiled(key, build):
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            fn = _cache[key] = build()
    return fn


def compile_config(dtype_name: str, head_dim: int, use_tvm_ffi: bool | None = None):
    """The compiled ``(pool, rank)`` kernels for one configuration (cached in-process)."""
    _check_config(dtype_name, head_dim)
    use_tvm_ffi = _HAVE_TVM_FFI if use_tvm_ffi is None else bool(use_tvm_ffi)
    options = "--enable-tvm-ffi" if use_tvm_ffi else ""

    def stream():
        return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)

    pool = _compiled(("pool", dtype_name, head_dim, use_tvm_ffi), lambda: cute.compile(
        KAPPool(_cutlass_dtype(dtype_name), head_dim), *_fake_pool_args(dtype_name),
        Int32(4), stream(), options=options))
    rank = _compiled(("rank", dtype_name, head_dim, use_tvm_ffi), lambda: cute.compile(
        KAPRank(_cutlass_dtype(dtype_name), head_dim), *_fake_rank_args(dtype_name), Int32(1), Int32(1),
        Int32(1), stream(), options=options))
    return pool, rank


_WHO = "kap_order"  # what KAP's errors start with, bound or not


class Launcher:
    """The KAP kernels bound to one plan: the plan's tables, the means and the order mask they
    write, and the operands' extents are checked once, here; each call checks q and the cache
    and launches (``osk.Launcher`` does the same for OSK)."""

    def __init__(self, block_pages, kv_block_indptr, kv_lens, qtiles, qbar, kbar, order, *,
                 force_local: bool, force_sink: bool, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, dtype, kv_layout: str = "NHD"):
        import torch

        from ..checks import byte_span, check_apart  # like torch, imported when a launch needs it

        self.operands = _Operands(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout)
        self.operands.check(_WHO)   # head_dim and dtype: OSK's configurations are KAP's
        _check_flags(_WHO, force_local=force_local, force_sink=force_sink)
        plan_tables = _plan_tables(_WHO, self.operands, block_pages, kv_block_indptr, kv_lens, qtiles, order)
        nq = qtiles.shape[0]
        _check_shapes(_WHO, {
            **plan_tables,
            "qbar": (qbar, torch.float32, (nq, num_qo_heads, head_dim)),
            "kbar": (kbar, torch.float32, (block_pages.shape[0], num_kv_heads, head_dim))})
        _check_tiles_have_blocks(_WHO, qtiles, order, block_pages)
        _check_vector_rows(_WHO, "qbar", qbar)   # compiled for 16-byte rows (_fake_means)
        _check_vector_rows(_WHO, "kbar", kbar)
        outputs = {"qbar": qbar, "kbar": kbar, "order": order}
        check_apart(outputs, {"block_pages": block_pages, "kv_block_indptr": kv_block_indptr, "kv_lens": kv_lens,
                              "qtiles": qtiles}, who=_WHO)
        # The key slots each CTA takes: a request longer than they hold would stall the sort, so
        # they come from the table itself (one sync, at bind time), not from the caller.
        max_request_blocks = int(kv_block_indptr.diff().max()) if kv_block_indptr.numel() > 1 else 0
        if max_request_blocks > MAX_KEY_BLOCKS:
            raise ValueError(f"{_WHO}: kv_block_indptr has a request of {max_request_blocks} key blocks, more "
                             f"than the kernels rank ({MAX_KEY_BLOCKS})")
        self.num_qtiles = nq
        self._pool_bound = _BoundTensors(block_pages, kv_block_indptr, kv_lens, kbar)
        self._rank_bound = _BoundTensors(qbar, kbar, qtiles, kv_block_indptr, order)
        self._rank_scalars = (max_request_blocks, int(force_local), int(force_sink))
        self._output_spans = tuple(byte_span(name, t) for name, t in outputs.items())

    def __call__(self, q, k_cache) -> None:
        from ..checks import check_apart

        (k,) = self.operands.views(_WHO, q, {"k_cache": k_cache}, {})
        check_apart({}, {"q": q, "k_cache": k_cache}, who=_WHO, checked_outputs=self._output_spans)
        if self.num_qtiles == 0:  # nothing to rank
            return
        name, D = _dtype_name(self.operands.dtype), self.operands.head_dim
        (pool, rank), source = load_or_compile(("kap_pool", "kap_rank"), name, D, lambda: compile_config(name, D))
        _launch(pool, source, (k,), self._pool_bound, (self.operands.page_shift,))
        _launch(rank, source, (q,), self._rank_bound, self._rank_scalars)


def kap_order(q, k_cache, block_pages, kv_block_indptr, kv_lens, qtiles, qbar, kbar, order, *,
              force_local: bool, force_sink: bool, kv_layout: str = "NHD") -> None:
    """Launch the two KAP kernels (see the module docstring for the contract): a ``Launcher``
    bound to these tables for one call."""
    operands = _Operands.of(_WHO, q, k_cache, kv_layout)
    Launcher(block_pages, kv_block_indptr, kv_lens, qtiles, qbar, kbar, order, force_local=force_local,
             force_sink=force_sink, **operands._asdict())(q, k_cache)
