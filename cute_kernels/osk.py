"""OSK: the ordered-skip block-sparse attention kernel (SPEC stage 2), CuTe DSL, SM90.

Entry points
------------
``supported(head_dim, dtype) -> bool``
    Whether a kernel exists for the configuration (head_dim 64 or 128; fp16/bf16).

``Launcher(block_pages, kv_block_indptr, qo_lens, kv_lens, qtiles, tile_order, order,
computed, skipped, *, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
kv_layout="NHD", causal=True)(q, k_cache, v_cache, o, lse, *, sm_scale, log_delta)``
    The kernel bound to a plan's tables and counters (``cosa.plan`` binds one per plan),
    which it checks once; a call checks its operands and launches as ``osk_forward``.

``osk_forward(q, k_cache, v_cache, block_pages, kv_block_indptr, qo_lens,
kv_lens, qtiles, tile_order, order, o, lse, computed, skipped, *, sm_scale,
log_delta, kv_layout="NHD", causal=True) -> None``
    Launches the kernel on the current torch stream of q's device; writes ``o``, ``lse``,
    ``computed`` and ``skipped`` in place; no host sync and no allocation, so it
    is CUDA-graph capturable once compiled (tests/test_cuda_graph.py).  Every
    (qtile, head) listed in ``tile_order`` is written (rows of a tile with no
    computed key: o = 0, lse = -inf).  A programmatic dependent launch: its CTAs may
    start while the kernel before it (in ``cosa.run`` the proxy's ``KAPRank``) ends, and
    read the plan tables (complete before that kernel started) until it has completed
    (``griddepcontrol.wait``).

    - ``q``: [total_q, Hq, D] fp16/bf16, last dim contiguous.
    - ``k_cache``, ``v_cache``: [num_pages, page_size, Hkv, D] (``kv_layout="NHD"``)
      or [num_pages, Hkv, page_size, D] (``"HND"``), q's dtype, last dim
      contiguous, other strides arbitrary multiples of 8 elements (views of a
      combined [num_pages, 2, ...] cache are fine).  ``page_size`` a power of
      two in 16..256 (what the plan accepts).
    - int32 plan tensors (docs/design.md): ``block_pages`` [num_kv_blocks,
      pages_per_block], ``kv_block_indptr`` [B+1], ``qo_lens`` [B], ``kv_lens``
      [B], ``qtiles`` [num_qtiles, 8], ``tile_order`` [num_tiles, 2] (qtile,
      head), ``order`` [num_qtiles, Hq, k_max] (logical key blocks in visiting
      order; only the first ``qtiles[:, 7]`` entries are read).  A plan with a tile
      has k_max >= 1 and a key block (every query row has a key and every tile
      selects one), which the kernel's tensor arguments need.
    - outputs: ``o`` [total_q, Hq, D] (q's dtype), ``lse`` [total_q, Hq] float32
      (natural log of the softmax denominator of the scaled logits; ``-inf`` and
      o = 0 for a row that computed no visible key), ``computed`` and
      ``skipped`` [num_qtiles, Hq] int32 (blocks computed / skipped by stage 2).
    - ``sm_scale``: logit scale, at most ``MAX_SM_SCALE``; ``log_delta``: ln(delta), ``-inf``
      for delta=0 (stage 2 off).  The kernel's threshold is ``log_delta - ln(kv_len)``.

Kernel
------
One CTA of three warp groups (384 threads) owns one work tile = (128-row query tile,
query head):

- warp group 0, the producer (register budget lowered with ``setmaxnreg``): warp 3
  loads Q with one TMA (a TILE_M-row box; rows past a request's end read the next
  request's q or zeros, and never reach an output), then walks the tile's order and, per
  logical key block j, loads K_j by TMA straight from the paged cache into a 2-stage
  ring of 128B-swizzled smem buffers completed by transaction-count mbarriers
  (``PipelineTmaAsync``): one 128-row box when a page holds whole blocks (page size >=
  128: a slice of one page), else 128/16 boxes of 16 rows (several pages per block;
  every page size is a multiple of 16, so a box never crosses a page).  A swizzled box
  is at most 128 bytes wide, so the buffers keep each 8-row group's 64-column chunks side
  by side (both wgmma operand layouts allow it): a box of whole 8-row groups is then one
  TMA instruction (``_cache_box_view``), not one per chunk.  The order entry
  and the block's page indices are read before the ring slot is acquired, so that their
  latency hides under that wait.  Warp 2 loads V_j the same way (into a 3-stage ring:
  the turns below free V_{j-1} one block late), but once the consumers vote in lockstep
  (stage 2, below) only for the blocks the vote computes (decisions reach it through a
  small smem ring, ``PipelineAsync``): a skipped block there costs no V traffic.  TMA
  cannot zero-fill keys past kv_len inside a page, so for a partial last block the
  consumers zero those V rows in smem before PV (masked K columns are overwritten with
  -inf).  Warps 0 and 1 bring into L2 the Q box and the first block's K and V of the
  tile one wave ahead (``bid + %nsmid``), which would otherwise come from DRAM while its
  SM waits;
- warp groups 1 and 2, the consumers, own query rows 0-63 and 64-127.  Per block:
  S = Q K_j^T with ``wgmma`` (SS), masking, with stage 2 the row max and the vote, and,
  unless the tile skips the block, the online softmax and O += P V_j with ``wgmma`` (P
  from registers, V from smem, MN-major), PV of a computed block issued one block late.
  The groups start by taking turns on the tensor cores, as FA3 does: the GEMMs [QK_j,
  PV_{j-1}] of one run under the other's softmax (two named barriers), and each group
  issues PV_{j-1} together with QK_j, waiting for V_{j-1} between the two, where the wait
  hides under QK_j instead of lengthening the softmax path.  P alternates between two
  register buffers, so that P_j is written while PV_{j-1} still reads P_{j-1}: the
  softmax never waits for PV_{j-1} (only a redo, below, rescales O), and V_{j-1} is freed
  after the wait that QK_{j+1} needs anyway.  The turns' softmax needs no block max: P
  is taken against the reference as it stands, and kept, with no rescale of O, when no
  thread's sum of a row's P over the block exceeds ``STALE_SUM_MAX`` (then no P does);
  otherwise the warp redoes the block exactly (max, rescale).
  With delta = 0 (no vote, no skip) the groups take turns to the end.  With stage 2 they
  take turns while neither knows of a skip, which covers most of the blocks a tile
  computes: group 1, half a turn behind, has group 0's vote on a block when it takes its
  own, so it knows the decision before its softmax; group 0 takes its softmax first, keeps
  the block's row sums aside, and reads the decision in its next turn, before PV.
  Once both know of a skip, at the top of a pair of blocks, the next block's QK goes in
  the last turn and the groups vote in lockstep from there (the vote loop), where skip
  streaks are: the vote holds the groups together on skipped blocks anyway.  The vote
  loop computes S in two 64-key halves: the next block's low half is issued right
  before this block's vote, so that it runs under the vote (the K block behind it is
  waited for first; past the last block it reads a stale stage and is discarded), and
  its high half as soon as this block's S is dead, before the loop top (after a skipped
  block with no PV pending, right behind the low half, without waiting for it).  That loop
  knows each computed block's max before its softmax, so it keeps P's reference (and O
  unrescaled) while no P of the block would exceed 2^8 against it.  The skip rule reads
  the exact running max, kept beside the reference.  In both schedules the reference may
  lag the running max: P, the sums and O are taken against it, and the LSE adds it back.

Skip rule (SPEC stage 2): after S = sm_scale * Q K_j^T (masked), per row
``mloc = rowmax(S)``; the tile skips block j iff it is not the first visited
block and ``max over valid rows (mloc - m) < thr``, where a row whose block
logits are all masked contributes ``-inf``.  One decision per tile, but only the
warps that would skip wait for it: a consumer warp ORs its threads' tests (``vote.any``),
each on the maxima of its own elements of its rows (in the vote loop the quad's shuffles
that make them the rows' maxima run only for a computed block, whose softmax needs them);
a warp with a row that computes knows the tile computes, so it marks the block in shared
memory, arrives on the block's named barrier and goes on, while a warp whose rows all
skip syncs on that barrier and then reads the mark (group 0 in the turns reads it a
turn later).  A block skipped in the vote loop does no exp, no PV and loads no V.

Compile-time specialisation: (dtype, head_dim) only.  Page size (as a shift), all
strides, NHD/HND (a permuted view), causal, the GQA group, batch shape and scalars
are runtime, so four compiled kernels (``CONFIGS``) cover every supported input.
They are compiled once per configuration from fake tensors (``compile_config``; a
few seconds each on one CPU core) and cached in-process, or, when the installed libcosa
was built with them (``COSA_AOT_KERNELS``), loaded from it instead (``aot.py``).  History of the kernel
(earlier variants, measurements, what is still to do): bench/NOTES.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import NamedTuple

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32, Int32, Int64, const_expr  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.experimental.primitives import nvvm_wrapper as nvvm_x  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from .aot import load_or_compile, tensor_words  # noqa: E402
from .plan_layout import (BLOCK_SIZE, MAX_SM_SCALE, QT_COLUMNS, QT_INDEX, QT_NUM_SELECTED,  # noqa: E402
                          QT_REQUEST, QT_ROW_START, QT_ROWS)

__all__ = ["supported", "osk_forward", "Launcher", "compile_config", "CONFIGS", "OSKForward"]

HEAD_DIMS = (64, 128)
_DTYPE_NAMES = ("bfloat16", "float16")
CONFIGS = [(dt, d) for dt in _DTYPE_NAMES for d in HEAD_DIMS]

# a query tile and a key block are the plan's logical blocks: the plan's tiles and block table
# count in them
TILE_M = TILE_N = BLOCK_SIZE
NUM_CONSUMER_THREADS = 256
NUM_PRODUCER_THREADS = 128
NUM_THREADS = NUM_CONSUMER_THREADS + NUM_PRODUCER_THREADS
NUM_CONSUMER_WARPS = NUM_CONSUMER_THREADS // 32
LOG2_E = 1.4426950408889634
# P may be taken against a reference below the running max while it stays at most this (2^8,
# far inside bf16's and fp16's range), so that O needs no rescale.  The turns, whose softmax
# takes no block max, keep a block while each thread's row sum over it stays at most this, and
# otherwise redo its softmax exactly; the vote loop knows the block max and tests it.
STALE_SUM_MAX = 256.0
BAR_EPILOGUE = 2
BAR_VFIX = 3
BAR_SCHED = 4  # 4, 5: consumer warp group 0's / 1's turn on the tensor cores
BAR_VOTE = 8  # 8 to 8 + VOTE_SLOTS - 1: the stage-2 vote on block it, by it % VOTE_SLOTS
BAR_DECIDED = 12  # 12 to 12 + VOTE_SLOTS - 1: group 1 has the decision on block it (stage-2 turns)
BOX = 16  # TMA box rows when a block spans pages: the smallest supported page size
# The furthest 16-byte unit of a cache at which a page or kv head may start: the TMA's
# coordinate there is an int32, and the mode's extent (one more) one too (_cache_box_view)
MAX_BOX_UNITS = 2**31 - 2
BLOCK_SHIFT = TILE_N.bit_length() - 1  # log2(TILE_N): pages of at least 2^BLOCK_SHIFT rows hold whole blocks
K_STAGES = 2  # K blocks in flight (smem ring)
V_STAGES = 3  # the turns free V(j-1) only after QK(j+1): one stage more than K
DECISION_SLOTS = 4  # stage-2 decisions in flight from the consumers to the V producer warp
NOT_YET = 1 << 30  # a block index not known yet (the V warp's first block after the turns)
# A computing warp runs ahead of the vote's waiters only as far as the K ring lets it: it gets
# K(j + k_stages + 1) once every consumer warp has released K(j + 1), after its vote on block j.
# So with more slots than K stages a vote slot is reused only once all warps are done with it
VOTE_SLOTS = 4
# A warp runs on SM sub-partition (SMSP) warp % 4 and shares its issue slots with one warp of
# each consumer group.  A skipped block's vote waits for the slowest consumer warp: with the
# loaders on SMSPs 0 and 1, consumer group 0 and its warp 0 (which also posts the decisions)
# reached it last, and on SMSPs 3 and 2 skip-all runs take 2-11% less time (bench/NOTES.md,
# session 8)
K_PRODUCER_WARP = 3
V_PRODUCER_WARP = 2
PRODUCER_REGS = 40  # 232 / 40: no spills with P(j-1) live next to S(j) and O
CONSUMER_REGS = 232


@dataclass(frozen=True)
class TileRows:
    """A consumer thread's rows of its tile, as masking, the vote and the online softmax see
    them (``row_ref``, ``row_max``, ``row_sum``, ``mloc``: register tensors they update in
    place)."""

    tScS_mn: cute.Tensor  # (row, column) in the tile of each S element, row/column view
    row_ref: cute.Tensor  # what P, row_sum and O are taken against (the LSE adds it back): the
    #                       running max of the scaled logits or, by STALE_SUM_MAX, below it
    row_max: cute.Tensor  # the exact running max (kept with stage 2 on, for the skip rule)
    row_sum: cute.Tensor  # running softmax denominator
    mloc: cute.Tensor     # the current block's row max (unscaled)
    kv_len: Int32
    rows: Int32           # valid rows of the tile
    diag0: Int32          # key index of the tile's first row's diagonal
    causal: Int32
    sm_scale: Float32
    scale_log2: Float32   # sm_scale * log2(e)
    thr: Float32          # stage-2 threshold, -inf with stage 2 off


@dataclass(frozen=True)
class QSource:
    """Q as its TMA reads it: the atom, the (row, d, head) view of q and the smem buffer."""

    tma: cute.CopyAtom
    m_rows: cute.Tensor
    smem: cute.Tensor


@dataclass(frozen=True)
class PagedSource:
    """K or V as its TMA reads it from the paged cache: the atoms and (page row, d, kv head,
    page) views of its two boxes (a whole TILE_N-row block, for pages that hold whole blocks,
    and BOX rows), the smem ring it lands in, and the page geometry."""

    tma_block: cute.CopyAtom
    m_block: cute.Tensor
    tma_box: cute.CopyAtom
    m_box: cute.Tensor
    smem: cute.Tensor
    page_shift: Int32
    page_units: Int32  # a page's and a kv head's offsets in the views' last mode (16-byte units)
    head_units: Int32

    @property
    def page_mask(self):
        """The bits of a key index below its page's first key."""
        return (Int32(1) << self.page_shift) - 1


@dataclass(frozen=True)
class PlanTables:
    """The plan's tables, as the kernel reads them (csrc/remap.hpp's ``Plan`` builds them)."""

    mBlockPages: cute.Tensor     # each logical key block's physical pages
    mKvBlockIndptr: cute.Tensor  # a request's first row of mBlockPages
    mQoLens: cute.Tensor
    mKvLens: cute.Tensor
    mQtiles: cute.Tensor         # a query tile's request, first row, rows, index and listed blocks
    mTileOrder: cute.Tensor      # (query tile, head) of each work tile, in launch order
    mOrder: cute.Tensor          # the order mask: blocks to visit, highest proxy score first


@dataclass(frozen=True)
class TileWalk:
    """What a consumer's walk over the tile's blocks uses: the first block's helper, every
    block taken in turns (both loops' turns; their two call sites alternate P's buffers) and
    the vote loop."""

    pipe_k: pipeline.PipelineTmaAsync
    pipe_v: pipeline.PipelineTmaAsync
    wg: Int32             # this consumer warp group (0 or 1)
    tiled_mma_qk: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    s_shape: tuple        # S's register shape
    tiled_mma_pv: cute.TiledMma
    acc_O: cute.Tensor
    acc_O_mn: cute.Tensor  # acc_O's row/column view
    tOrVt: cute.Tensor
    corr: cute.Tensor     # per-row rescale of O, written by the softmax that raises the reference
    plan: PlanTables
    qt: Int32
    head: Int32
    num_sel: Int32
    tiled_copy_o: cute.TiledCopy
    sV: cute.Tensor
    ctid: Int32
    sVote: cute.Tensor       # the stage-2 votes' marks (``_vote``)
    sDecision: cute.Tensor   # the stage-2 decisions for the V warp (1 = skipped), by ``pipe_decision``
    pipe_decision: pipeline.PipelineAsync
    block_sum: cute.Tensor   # a block's row sums, kept aside until it is known computed (stage-2 turns)


@dataclass(frozen=True)
class QKHalves:
    """QK in two 64-key halves, as the vote loop issues it: the next block's low half runs under
    the vote."""

    tiled_mma: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK_lo: cute.Tensor
    tSrK_hi: cute.Tensor
    layout: cute.Layout   # one half of S's register layout


def _reduce_by_threes(values: list, op):
    """op (cutlass.max or cutlass.min) over traced values, as a tree of op(op(a, b), c), each of
    which ptxas fuses into one three-input instruction."""
    while len(values) > 1:
        triples = [op(op(a, b), c) for a, b, c in zip(values[0::3], values[1::3], values[2::3])]
        values = triples + values[3 * len(triples):]
        if len(values) == 2:
            values = [op(values[0], values[1])]
    return values[0]


def _mn_layout(acc_layout):
    """Accumulator ((2,2[,V]),M,N) -> ((2,M),(2[,V],N)) row/column view layout."""
    cm = cute.make_layout(acc_layout.shape)
    s0, d0 = cm.shape[0], cm.stride[0]
    if const_expr(cute.rank(s0) == 3):
        mn = cute.make_layout(
            ((s0[1], cm.shape[1]), (s0[0], s0[2], cm.shape[2])),
            stride=((d0[1], cm.stride[1]), (d0[0], d0[2], cm.stride[2])),
        )
    else:
        mn = cute.make_layout(
            ((s0[1], cm.shape[1]), (s0[0], cm.shape[2])),
            stride=((d0[1], cm.stride[1]), (d0[0], cm.stride[2])),
        )
    return cute.composition(acc_layout, mn)


def _row_offset(mX, row, head):
    """Element offset of (row, head) in a [rows, heads, D] tensor (q, o)."""
    return Int64(row) * mX.stride[0] + Int64(head) * mX.stride[1]


def _cache_box_view(mX, chunk: int):
    """A (page, page row, kv head, d) cache as its TMA boxes read it, and a page's and a kv
    head's offsets in the view's last mode: (column in a chunk, row in an 8-row group, chunk,
    8-row group, 16-byte unit), in which a box of 8-row groups (``_box_modes``) lands each
    group's chunks side by side.  Those are four of the TMA's five modes, so the page and the
    kv head share the last, as whole 16-byte units (every stride is), which caps how far into
    the cache they start (``MAX_BOX_UNITS``, checked by ``Launcher``)."""
    unit = 128 // mX.element_type.width
    pages, page_rows, heads, d = mX.shape
    page_stride, row_stride, head_stride, _ = mX.stride
    units = ((pages - 1) * page_stride + (heads - 1) * head_stride) // unit + 1
    layout = cute.make_layout((chunk, 8, d // chunk, page_rows // 8, Int32(units)),
                              stride=(1, row_stride, chunk, 8 * row_stride, unit))
    return cute.make_tensor(mX.iterator, layout), Int32(page_stride // unit), Int32(head_stride // unit)


def _frgA_layout(acc_layout):
    """SM90 accumulator ((2,2,N/8),M,N') -> A-operand fragment ((2,2,2),M,(N/16,N'))."""
    lay = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((lay.shape[0][0], lay.shape[0][1], lay.shape[0][2][0]), lay.shape[1],
         (lay.shape[0][2][1], lay.shape[2])),
        stride=((lay.stride[0][0], lay.stride[0][1], lay.stride[0][2][0]), lay.stride[1],
                (lay.stride[0][2][1], lay.stride[2])),
    )


class OSKForward:
    """The kernel for one (dtype, head_dim): a producer warp group (Q, K and V by TMA) and two
    wgmma consumer warp groups; one CTA per work tile."""

    def __init__(self, dtype, head_dim: int, k_stages: int = K_STAGES, v_stages: int = V_STAGES):
        self.dtype = dtype
        self.head_dim = head_dim
        self.chunk = 1024 // dtype.width  # columns in 128 bytes, the swizzle atom's width
        assert k_stages < VOTE_SLOTS, "a vote slot would be reused while a warp still reads it"
        self.k_stages = k_stages
        self.v_stages = v_stages

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mBlockPages: cute.Tensor,
        mKvBlockIndptr: cute.Tensor,
        mQoLens: cute.Tensor,
        mKvLens: cute.Tensor,
        mQtiles: cute.Tensor,
        mTileOrder: cute.Tensor,
        mOrder: cute.Tensor,
        mComputed: cute.Tensor,
        mSkipped: cute.Tensor,
        sm_scale: Float32,
        log_delta: Float32,
        page_shift: Int32,
        group: Int32,
        causal: Int32,
        num_tiles: Int32,
        stream: cuda.CUstream,
    ):
        dtype = self.dtype
        D = self.head_dim
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, D), dtype
        )
        sQ_layout = cute.tile_to_shape(atom, (TILE_M, D), (0, 1))
        # K and V: the atoms (8 rows x one chunk) tiled along d first, so that a box of 8-row
        # groups is contiguous in smem, all its chunks included (``_box_modes``)
        sK_layout = cute.tile_to_shape(atom, (TILE_N, D, self.k_stages), (1, 0, 2))
        sV_layout = cute.tile_to_shape(atom, (TILE_N, D, self.v_stages), (1, 0, 2))

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.k_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.v_stages]
            mbar_decision: cute.struct.MemRange[cutlass.Int64, 2 * DECISION_SLOTS]
            # not first: Q's TMA completing on the storage's base address makes ptxas keep that
            # base, which every other barrier is addressed from, in an ordinary register, and
            # move it into a uniform one at each use in the block loops (bench/NOTES.md session 17)
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            decision: cute.struct.MemRange[Int32, DECISION_SLOTS]
            vote: cute.struct.MemRange[Int32, VOTE_SLOTS]  # the last block each slot saw computed
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]

        copy_elems = 128 // dtype.width
        thr_per_row = 64 // copy_elems
        v_layout = cute.make_layout((1, copy_elems))
        atom_store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        tiled_copy_o = cute.make_tiled_copy_tv(
            atom_store,
            cute.make_layout((NUM_CONSUMER_THREADS // thr_per_row, thr_per_row), stride=(thr_per_row, 1)),
            v_layout,
        )
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(TILE_M // 64, 1, 1), tiler_mn=(64, TILE_N),
        )
        # QK in two 64-key halves (the vote loop): the next block's low half runs under the vote
        tiled_mma_qk_half = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(TILE_M // 64, 1, 1), tiler_mn=(64, TILE_N // 2),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(TILE_M // 64, 1, 1), tiler_mn=(64, D),
            a_source=warpgroup.OperandSource.RMEM,
        )
        # Two TMA boxes per cache: the whole block (TILE_N rows x D of one page) when a page
        # holds whole blocks, else BOX rows (BOX = 16 divides every page size), TILE_N / BOX
        # boxes per block.
        stage_layout = cute.select(sK_layout, mode=[0, 1])
        op = cpasync.CopyBulkTensorTileG2SOp()
        # Q: one TILE_M-row box of (row, d, head); rows past a request's end are read too (they
        # belong to the next request, or are zero past total_q) and never reach an output
        tma_atom_Q, mQ_rows = cpasync.make_tiled_tma_atom(
            op, cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1])), sQ_layout, (TILE_M, D))
        tma, units = [], []
        for mX in (mK, mV):
            view, page_units, head_units = _cache_box_view(mX, self.chunk)
            units.extend((page_units, head_units))
            for rows in (TILE_N, BOX):
                box = self._box_modes(rows)
                tma.extend(cpasync.make_tiled_tma_atom(
                    op, view, cute.composition(cute.composition(stage_layout, (rows, D)), box), box.shape))
        tma_atom_K_block, mK_block, tma_atom_K_box, mK_box, tma_atom_V_block, mV_block, tma_atom_V_box, mV_box = tma
        self.kernel(
            mQ_rows, mK_block, mK_box, mV_block, mV_box, mO, mLSE, mBlockPages, mKvBlockIndptr, mQoLens,
            mKvLens, mQtiles, mTileOrder, mOrder, mComputed, mSkipped,
            sm_scale, sm_scale * LOG2_E, log_delta, page_shift, *units, group, causal,
            sQ_layout, sK_layout, sV_layout, tiled_copy_o, tiled_mma_qk, tiled_mma_qk_half,
            tiled_mma_pv,
            tma_atom_Q, tma_atom_K_block, tma_atom_K_box, tma_atom_V_block, tma_atom_V_box, SharedStorage,
        ).launch(
            grid=[num_tiles, 1, 1],
            block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=True,
        )

    # ------------------------------------------------------------------ producer
    @cute.jit
    def _q_box(self, src: QSource, row_start: Int32, head: Int32):
        """Q's TMA partitions (smem, gmem) of the tile's TILE_M rows from ``row_start``, one head."""
        gQ = cute.local_tile(cute.domain_offset((row_start, 0, 0), src.m_rows)[None, None, head],
                             (TILE_M, self.head_dim), (0, 0))
        tQsQ, tQgQ = cpasync.tma_partition(src.tma, 0, cute.make_layout(1), cute.group_modes(src.smem, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        return tQsQ, tQgQ

    @cute.jit
    def _work_tile(self, plan: PlanTables, t):
        """Work tile ``t``'s query tile, head, request, first row and row count."""
        qt = plan.mTileOrder[t, 0]
        head = plan.mTileOrder[t, 1]
        return qt, head, plan.mQtiles[qt, QT_REQUEST], plan.mQtiles[qt, QT_ROW_START], plan.mQtiles[qt, QT_ROWS]

    @cute.jit
    def _listed_block(self, mOrder, qt, head, it, num_sel):
        """Entry ``it`` of the tile's order, 0 past its end.  Loops read it one block ahead,
        so that the load's latency hides under a block's work."""
        j = Int32(0)
        if it < num_sel:
            j = mOrder[qt, head, it]
        return j

    @cute.jit
    def _block_pages(self, mBlockPages, blk: Int32, jstart: Int32, kv_len: Int32, page_shift: Int32):
        """The physical pages logical block ``blk`` (key rows jstart..jstart+127) is read
        from: pages[0] alone when a page holds whole blocks (one box), else one page per
        BOX rows.  A box wholly past kv_len reads page 0 instead (finite or not, those keys
        are masked and their V rows zeroed by the consumers), so every stage receives
        exactly TILE_N * D elements and the transaction count is static.  Loaded before the
        ring slot is acquired, so that the loads' latency hides under that wait."""
        pages = cute.make_rmem_tensor((TILE_N // BOX,), Int32)
        pages.fill(0)
        if page_shift >= BLOCK_SHIFT:
            pages[0] = mBlockPages[blk, 0]
        else:
            pbase = jstart >> page_shift
            for i in cutlass.range_constexpr(TILE_N // BOX):
                g = jstart + i * BOX
                if g < kv_len:
                    pages[i] = mBlockPages[blk, (g >> page_shift) - pbase]
        return pages

    @cute.jit
    def _box_views(self, src: PagedSource, kv_head):
        """The source's boxes, (box modes, box in page, 16-byte unit): TILE_N rows and BOX rows;
        and the kv head's offset in the units."""
        g_block = cute.local_tile(src.m_block, self._box_modes(TILE_N).shape, (0, 0, 0, None, None))
        g_box = cute.local_tile(src.m_box, self._box_modes(BOX).shape, (0, 0, 0, None, None))
        return g_block, g_box, kv_head * src.head_units

    @cute.jit
    def _loader_views(self, src: PagedSource, kv_head):
        """A loader warp's setup: its TMA descriptors prefetched, and ``_box_views``."""
        cpasync.prefetch_descriptor(src.tma_block)
        cpasync.prefetch_descriptor(src.tma_box)
        return self._box_views(src, kv_head)

    def _box_modes(self, rows: int):
        """A TMA box of ``rows`` rows in ``_cache_box_view``'s modes (column in a chunk, row in an
        8-row group, chunk, 8-row group, 1), onto its (rows, D) tile's index."""
        c = self.chunk
        return cute.make_layout((c, 8, self.head_dim // c, rows // 8, 1), stride=(rows, 1, c * rows, 8, 0))

    def _staged_box(self, s_tile, rows: int):
        """A (rows, D, stage) smem tile in ``_box_modes``: ((box modes), stage)."""
        return cute.composition(cute.group_modes(s_tile, 0, 2),
                                (self._box_modes(rows), cute.make_layout(s_tile.shape[2])))

    @cute.jit
    def _tma_block(self, src: PagedSource, views, pages, jstart: Int32, stage, mbar, prefetch: cutlass.Constexpr):
        """The TMA of one logical key block (``views`` from ``_box_views``, pages from
        ``_block_pages``): one TILE_N-row box when a page holds whole blocks, else TILE_N / BOX
        boxes of BOX rows; into ring stage ``stage``, completing on ``mbar``, or with
        ``prefetch`` into L2 only."""
        g_block, g_box, head_units = views
        tma_block, tma_box, sX, page_mask = src.tma_block, src.tma_box, src.smem, src.page_mask
        if src.page_shift >= BLOCK_SHIFT:
            tS, tG = cpasync.tma_partition(
                tma_block, 0, cute.make_layout(1), self._staged_box(sX, TILE_N),
                cute.group_modes(g_block, 0, 5))
            tile = tG[None, (jstart & page_mask) >> BLOCK_SHIFT, pages[0] * src.page_units + head_units]
            if const_expr(prefetch):
                cute.prefetch(tma_block, tile)
            else:
                cute.copy(tma_block, tile, tS[None, stage], tma_bar_ptr=mbar)
        else:
            for i in cutlass.range_constexpr(TILE_N // BOX):
                g = jstart + i * BOX
                s_box = cute.local_tile(sX, (BOX, self.head_dim), (i, 0, None))
                tS, tG = cpasync.tma_partition(
                    tma_box, 0, cute.make_layout(1), self._staged_box(s_box, BOX),
                    cute.group_modes(g_box, 0, 5))
                tile = tG[None, (g & page_mask) // BOX, pages[i] * src.page_units + head_units]
                if const_expr(prefetch):
                    cute.prefetch(tma_box, tile)
                else:
                    cute.copy(tma_box, tile, tS[None, stage], tma_bar_ptr=mbar)

    @cute.jit
    def _load_block(self, pipe, state, src: PagedSource, views, pages, jstart: Int32):
        """Acquire the ring slot of ``state`` and load one logical key block into it."""
        pipe.producer_acquire(state)
        self._tma_block(src, views, pages, jstart, state.index, pipe.producer_get_barrier(state), prefetch=False)

    @cute.jit
    def _prefetch_next_wave(self, plan: PlanTables, q_src: QSource, k_src: PagedSource, v_src: PagedSource,
                            bid: Int32, group: Int32, tidx: Int32):
        """Producer warps 0 and 1 (otherwise idle) bring into L2 what the tile one wave ahead
        waits for first: its Q box and its first block's K (warp 0) and V (warp 1).
        With one CTA an SM, that tile's CTA starts as soon as one CTA of this wave ends, and
        its Q and first block otherwise come from DRAM while the whole SM waits (%nsmid bounds
        the SM count)."""
        nb = bid + cute.arch.nsmid()
        if nb < plan.mTileOrder.shape[0]:
            qt, head, req, row_start, _ = self._work_tile(plan, nb)
            if tidx % 32 == 0:
                j = plan.mOrder[qt, head, 0]
                pages = self._block_pages(plan.mBlockPages, plan.mKvBlockIndptr[req] + j, j * TILE_N,
                                          plan.mKvLens[req], k_src.page_shift)
                if tidx == 0:
                    _, tQgQ = self._q_box(q_src, row_start, head)
                    cute.prefetch(q_src.tma, tQgQ)
                    self._tma_block(k_src, self._box_views(k_src, head // group), pages, j * TILE_N, None, None,
                                    prefetch=True)
                else:
                    self._tma_block(v_src, self._box_views(v_src, head // group), pages, j * TILE_N, None, None,
                                    prefetch=True)

    @cute.jit
    def _wait_v(self, pipe_v, st, tiled_copy_o, sV, ctid, valid_rows):
        """Wait for V of a computed block and make it ready for PV (tail rows zeroed)."""
        pipe_v.consumer_wait(st)
        if valid_rows < TILE_N:
            self._zero_v_tail(tiled_copy_o, sV, st.index, ctid, valid_rows)

    def _sched_wait(self, wg):
        """Wait for warp group wg's turn on the tensor cores (ping-pong)."""
        cute.arch.barrier(barrier_id=BAR_SCHED + wg, number_of_threads=NUM_CONSUMER_THREADS)

    def _sched_arrive(self, wg):
        """Warp group wg's GEMMs are issued: hand the turn to the other group."""
        cute.arch.barrier_arrive(barrier_id=BAR_SCHED + 1 - wg, number_of_threads=NUM_CONSUMER_THREADS)

    @cute.jit
    def _zero_v_tail(self, tiled_copy_o, sV, stage, ctid, valid_rows):
        """Zero the rows >= valid_rows of V stage `stage` (TMA loaded whole boxes: keys past
        kv_len may hold anything, and 0 * NaN = NaN in the PV GEMM)."""
        thr = tiled_copy_o.get_slice(ctid)
        tVs = thr.partition_D(sV[None, None, stage])
        tVc = thr.partition_D(cute.make_identity_tensor((TILE_N, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(tVs, mode=[1])):
            if tVc[0, m, 0][0] >= valid_rows:
                tVs[None, m, None].fill(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_VFIX, number_of_threads=NUM_CONSUMER_THREADS)

    # ------------------------------------------------------------------ consumer
    def _k_state(self, b):
        """Consumer pipeline state of the b-th K block (stage b % S, phase (b // S) & 1)."""
        return pipeline.PipelineState(self.k_stages, b, b % self.k_stages, (b // self.k_stages) & 1)

    def _decision_state(self, b, producer: cutlass.Constexpr):
        """State of the stage-2 decision on block b >= 1 in the ring from the consumers (the
        producer side) to the V warp, as ``advance()`` from the ring's start reaches it."""
        n = b - 1
        phase = (n // DECISION_SLOTS) & 1
        if const_expr(producer):
            phase = phase ^ 1  # a producer starts on the ring's empty phase
        return pipeline.PipelineState(DECISION_SLOTS, n, n % DECISION_SLOTS, phase)

    def _v_state(self, b):
        """Consumer pipeline state of the b-th V block loaded (every visited block while the
        groups take turns, then every computed one)."""
        return pipeline.PipelineState(self.v_stages, b, b % self.v_stages, (b // self.v_stages) & 1)

    @cute.jit
    def _issue_qk(self, tiled_mma, tSrQ, tSrK, stage, acc_S):
        """acc_S = Q K^T for K stage `stage`: the whole block (tiled_mma_qk) or 64 of its keys
        (tiled_mma_qk_half with the low or high half's tSrK)."""
        warpgroup.fence()
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        mma_atom.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
            cute.gemm(mma_atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, tiled_mma_pv, acc_O, tOrP, tOrVt, stage):
        warpgroup.fence()
        pv_atom = cute.make_mma_atom(tiled_mma_pv.op)
        pv_atom.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(pv_atom, acc_O, tOrP[None, None, k], tOrVt[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _needs_mask(self, t: TileRows, jstart):
        """Whether block jstart crosses kv_len or the diagonal of the tile's first row (uniform
        over the tile): only such a block is masked."""
        return (jstart + TILE_N > t.kv_len) or (t.causal != 0 and jstart + TILE_N - 1 > t.diag0)

    @cute.jit
    def _mask_row(self, t: TileRows, acc_S_mn, r: cutlass.Constexpr, jstart):
        """S = -inf in row r for keys past kv_len and, with causal, past the row's diagonal.  A
        select per key, not a branch: a store under ``if`` makes LLVM re-select every element
        of the row at every key (466 FSEL a row where 32 do, bench/NOTES.md session 12)."""
        lim = t.kv_len - jstart
        if t.causal != 0:
            lim = cutlass.min(lim, t.diag0 + t.tScS_mn[r, 0][0] + 1 - jstart)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            acc_S_mn[r, c] = Float32(cutlass.select_(t.tScS_mn[0, c][1] >= lim, -Float32.inf, acc_S_mn[r, c]))

    @cute.jit
    def _mask(self, t: TileRows, acc_S, jstart):
        """S = -inf at the masked keys of block jstart, every row (only a block that needs it)."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, _mn_layout(acc_S.layout))
        need_mask = self._needs_mask(t, jstart)
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            if need_mask:
                self._mask_row(t, acc_S_mn, r, jstart)

    @cute.jit
    def _block_max(self, t: TileRows, acc_S):
        """Store the per-row maxima of masked S in mloc."""
        self._thread_max(t, acc_S)
        self._quad_max(t)

    @cute.jit
    def _thread_max(self, t: TileRows, acc_S):
        """mloc = this thread's maxima of its rows of masked S (``_row_max_bits``); returns its
        best gain over the running max.  The warp's vote on it equals the vote on the rows'
        maxima (the row max is one of its four threads' maxima, and x * sm_scale - m is
        monotone in x)."""
        acc_bits_mn = cute.make_tensor(cute.recast_tensor(acc_S, Int32).iterator, _mn_layout(acc_S.layout))
        want = -Float32.inf
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            mx = self._row_max_bits(acc_bits_mn, r)
            t.mloc[r] = mx
            d = -Float32.inf
            if mx != -Float32.inf:
                d = mx * t.sm_scale - t.row_max[r]
            if t.tScS_mn[r, 0][0] < t.rows:
                want = cute.arch.fmax(want, d)
        return want

    @cute.jit
    def _row_max_bits(self, acc_bits_mn, r: cutlass.Constexpr):
        """The largest float32 of row r of this thread's S, found among their bit patterns read
        as int32, which ptxas reduces three at a time (VIMNMX3: half the instructions of the
        float maximum, bit-exact; bench/NOTES.md, session 22).  While one value is >= +0 the
        largest pattern is the largest float.  Negative floats order inversely to their
        patterns, so where all are negative (a fully masked row's -inf included) the smallest
        pattern is the largest float."""
        row = [acc_bits_mn[r, c] for c in range(cute.size(acc_bits_mn, mode=[1]))]
        bits = cute.make_rmem_tensor((1,), Int32)
        bits[0] = _reduce_by_threes(row, cutlass.max)
        if bits[0] < 0:
            bits[0] = _reduce_by_threes(row, cutlass.min)
        return cute.recast_tensor(bits, Float32)[0]

    @cute.jit
    def _quad_max(self, t: TileRows):
        """mloc: the threads' maxima -> the rows' (a row's keys are spread over a quad)."""
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            mx = cute.arch.fmax(t.mloc[r], cute.arch.shuffle_sync_bfly(t.mloc[r], offset=2))
            t.mloc[r] = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))

    @cute.jit
    def _vote(self, t: TileRows, want, it, sVote, waits=True):
        """The tile-wide stage-2 decision on block ``it`` (after the first): whether the tile
        computes it, as far as this warp knows.  A warp with a row that computes knows the
        answer: it marks the block in sVote, arrives on the block's barrier and goes on.  A
        warp whose rows all skip waits, until every consumer warp has voted, then reads the
        mark; with ``waits`` false (group 0 in the stage-2 turns, which reads the decision a
        turn later, ``_decided``) it arrives instead and returns its own vote.  The first
        block is never skipped, and with delta = 0 no block is, so the delta = 0 loop has no
        barrier coupling the two groups."""
        slot = it % VOTE_SLOTS
        computes = cute.arch.vote_any_sync(want >= t.thr)
        if computes:
            if cute.arch.lane_idx() == 0:
                sVote[slot] = it  # every computing warp writes the same value
            nvvm_x.barrier_cta_arrive(BAR_VOTE + slot, thread_count=NUM_CONSUMER_THREADS)
        elif waits:
            nvvm_x.barrier_cta_sync(BAR_VOTE + slot, thread_count=NUM_CONSUMER_THREADS)
            computes = sVote[slot] == it
        else:
            nvvm_x.barrier_cta_arrive(BAR_VOTE + slot, thread_count=NUM_CONSUMER_THREADS)
        return computes

    @cute.jit
    def _softmax(self, t: TileRows, acc_S, corr, block_sum=None):
        """Online-softmax update of row_ref/row_sum to the block's max; S -> P in place;
        writes into corr the per-row factor by which O must be rescaled.  Given ``block_sum``,
        the block's row sums go there and row_sum is only rescaled (``_count_block`` adds
        them once the tile computes the block)."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, _mn_layout(acc_S.layout))
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            m_prev = t.row_ref[r]
            m_new = cute.arch.fmax(m_prev, t.mloc[r] * t.sm_scale)
            m_use = m_new
            if m_new == -Float32.inf:
                m_use = Float32(0.0)
            c = cute.math.exp2((m_prev - m_use) * LOG2_E, fastmath=True)
            p = self._p_row(t, acc_S_mn, r, m_use)
            acc_S_mn[r, None] = p
            if const_expr(block_sum is None):
                t.row_sum[r] = t.row_sum[r] * c + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            else:
                t.row_sum[r] = t.row_sum[r] * c
                block_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            t.row_ref[r] = m_new
            corr[r] = c

    @cute.jit
    def _p_row(self, t: TileRows, acc_S_mn, r: cutlass.Constexpr, m_ref):
        """P of row r against the reference m_ref: exp(sm_scale * S - m_ref), S unscaled."""
        return cute.math.exp2(acc_S_mn[r, None].load() * t.scale_log2 - m_ref * LOG2_E, fastmath=True)

    @cute.jit
    def _softmax_lagged(self, t: TileRows, acc_S, corr):
        """The vote loop's softmax of a computed block, whose max (mloc) is known: raises the
        exact running max, and keeps the reference (O needing no rescale) when no thread of the
        warp has a P above STALE_SUM_MAX against it; otherwise _softmax.  Returns whether O
        must be rescaled by corr (uniform over the warp)."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, _mn_layout(acc_S.layout))
        ok = cutlass.Boolean(True)
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            t.row_max[r] = cute.arch.fmax(t.row_max[r], t.mloc[r] * t.sm_scale)
            log2_p_max = t.mloc[r] * t.scale_log2 - t.row_ref[r] * LOG2_E
            ok = ok and log2_p_max <= math.log2(STALE_SUM_MAX)  # false for NaN (no reference yet)
        kept = cute.arch.vote_all_sync(ok)
        if kept:
            for r in cutlass.range_constexpr(cute.size(t.mloc)):
                p = self._p_row(t, acc_S_mn, r, t.row_ref[r])
                acc_S_mn[r, None] = p
                t.row_sum[r] = t.row_sum[r] + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        else:
            self._softmax(t, acc_S, corr)
        return not kept

    @cute.jit
    def _softmax_stale(self, t: TileRows, acc_S, rP_mn, block_sum):
        """The turns' softmax of masked S without the block's max: P against the reference
        (row_ref) as it stands, into rP_mn (a buffer no wgmma in flight reads), and its row
        sums into block_sum.  P may be kept -- O needing no rescale -- when every thread of the
        warp sums each of its rows to at most STALE_SUM_MAX; otherwise the caller redoes the
        block exactly.  Returns whether it may (uniform over the warp); row_sum is the
        caller's to update."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, _mn_layout(acc_S.layout))
        ok = cutlass.Boolean(True)
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            m_ref = t.row_ref[r]
            limit = Float32(STALE_SUM_MAX)
            if m_ref == -Float32.inf:  # no visible key yet: only an all-masked row may pass
                m_ref = Float32(0.0)
                limit = Float32(0.0)
            p = self._p_row(t, acc_S_mn, r, m_ref)
            block_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            ok = ok and block_sum[r] <= limit  # false for NaN
            rP_mn[r, None] = p.to(rP_mn.element_type)
        return cute.arch.vote_all_sync(ok)

    @cute.jit
    def _add_row_sums(self, t: TileRows, block_sum):
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            t.row_sum[r] = t.row_sum[r] + block_sum[r]

    @cute.jit
    def _count_block(self, t: TileRows, block_sum):
        """A block taken in the stage-2 turns turns out computed: its row sums, which its
        softmax left aside, join row_sum, and its max (mloc) the exact running max."""
        self._add_row_sums(t, block_sum)
        for r in cutlass.range_constexpr(cute.size(t.mloc)):
            t.row_max[r] = cute.arch.fmax(t.row_max[r], t.mloc[r] * t.sm_scale)

    @cute.jit
    def _first_block(self, walk: TileWalk, t: TileRows, rP):
        """The tile's first listed block, never skipped: QK in the group's first turn, mask,
        max, softmax (O = 0: no rescale) and P into ``rP``.  Returns the block's first key and
        the block listed next."""
        acc_S, kst = self._turn_qk(walk, Int32(0))
        self._sched_arrive(walk.wg)
        warpgroup.wait_group(0)
        walk.pipe_k.consumer_release(kst)
        jstart = walk.plan.mOrder[walk.qt, walk.head, 0] * TILE_N
        j_next = self._listed_block(walk.plan.mOrder, walk.qt, walk.head, Int32(1), walk.num_sel)
        self._mask(t, acc_S, jstart)
        self._block_max(t, acc_S)
        self._softmax(t, acc_S, walk.corr)
        rP.store(acc_S.load().to(self.dtype))
        return jstart, j_next

    @cute.jit
    def _turn_qk(self, walk: TileWalk, it):
        """Block ``it``'s turn, up to its PV: K(it) and the turn waited for, QK(it) issued.
        Returns S and K(it)'s state."""
        kst = self._k_state(it)
        walk.pipe_k.consumer_wait(kst)
        self._sched_wait(walk.wg)
        acc_S = cute.make_rmem_tensor(walk.s_shape, Float32)
        self._issue_qk(walk.tiled_mma_qk, walk.tSrQ, walk.tSrK, kst.index, acc_S)
        return acc_S, kst

    @cute.jit
    def _turn_end(self, walk: TileWalk, it, kst):
        """Block ``it``'s turn handed on once its GEMMs are issued; then QK(it) waited for, and
        PV(it-2) before it, so that K(it) and V(it-2) are free."""
        self._sched_arrive(walk.wg)
        warpgroup.wait_group(1)
        walk.pipe_k.consumer_release(kst)
        if it >= 2:
            walk.pipe_v.consumer_release(self._v_state(it - 2))

    @cute.jit
    def _turn_block(self, walk: TileWalk, t: TileRows, it, j_next, tOrP_prev, rP_new):
        """Block ``it`` of the delta = 0 loop: QK(it) with PV(it-1) from tOrP_prev in one turn,
        then P(it) into the other buffer, rP_new.  Returns the block listed after the next."""
        jstart = j_next * TILE_N
        j_next = self._listed_block(walk.plan.mOrder, walk.qt, walk.head, it + 1, walk.num_sel)
        v_prev = self._v_state(it - 1)
        acc_S, kst = self._turn_qk(walk, it)
        walk.pipe_v.consumer_wait(v_prev)
        self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP_prev, walk.tOrVt, v_prev.index)
        self._turn_end(walk, it, kst)
        self._mask(t, acc_S, jstart)
        block_sum = cute.make_rmem_tensor((cute.size(t.mloc),), Float32)
        if self._softmax_stale(t, acc_S, cute.make_tensor(rP_new.iterator, _mn_layout(rP_new.layout)), block_sum):
            self._add_row_sums(t, block_sum)
        else:
            self._block_max(t, acc_S)
            self._softmax(t, acc_S, walk.corr)
            warpgroup.wait_group(0)  # PV(it-1) done: O may be rescaled
            self._rescale_o(walk.acc_O_mn, walk.corr)
            rP_new.store(acc_S.load().to(rP_new.element_type))
        if t.kv_len - jstart < TILE_N:
            self._wait_v(walk.pipe_v, self._v_state(it), walk.tiled_copy_o, walk.sV, walk.ctid, t.kv_len - jstart)
        return j_next

    @cute.jit
    def _stage2_turn_block(self, walk: TileWalk, t: TileRows, it, j_next, tOrP_prev, rP_new, computes_prev,
                           computed):
        """Block ``it`` in turns with stage 2 on: ``_turn_block``'s schedule, the skip rule
        decided one step late for group 0.  Group 1 runs half a turn behind: it has group 0's
        vote on the block when it takes its own, so it knows the decision before its softmax
        (taken only for a computed block), posts it to the V warp and to group 0
        (BAR_DECIDED).  Group 0 takes its softmax before the decision, keeps the block's row
        sums aside (``walk.block_sum``) and reads the decision in its next turn, under
        QK(it+1), before PV(it) (``_decided``).  A redo rescales O and the sums and raises the
        reference, which holds whether or not the block is then computed.  Returns the block
        listed after the next, the decision on ``it`` (group 0: its own vote, until
        ``_decided``), the computed count, the decision on ``it - 1`` (now known to both
        groups) and the block's first key."""
        jstart = j_next * TILE_N
        j_next = self._listed_block(walk.plan.mOrder, walk.qt, walk.head, it + 1, walk.num_sel)
        v_prev = self._v_state(it - 1)
        acc_S, kst = self._turn_qk(walk, it)
        if walk.wg == 0 and it >= 2:
            computes_prev, computed = self._decided(t, it - 1, walk, computed)
        walk.pipe_v.consumer_wait(v_prev)
        if computes_prev:
            self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP_prev, walk.tOrVt, v_prev.index)
        else:
            warpgroup.commit_group()  # an empty group: _turn_end's wait counts as with PV
        self._turn_end(walk, it, kst)
        self._mask(t, acc_S, jstart)
        want = self._thread_max(t, acc_S)
        self._quad_max(t)
        computes = self._vote(t, want, it, walk.sVote, waits=walk.wg == 1)
        if walk.wg == 1:
            if walk.ctid == NUM_CONSUMER_THREADS // 2:
                d_state = self._decision_state(it, producer=True)
                walk.pipe_decision.producer_acquire(d_state)
                walk.sDecision[d_state.index] = Int32(not computes)
                walk.pipe_decision.producer_commit(d_state)
            nvvm_x.barrier_cta_arrive(BAR_DECIDED + it % VOTE_SLOTS, thread_count=NUM_CONSUMER_THREADS)
        if walk.wg == 0 or computes:
            if not self._softmax_stale(t, acc_S, cute.make_tensor(rP_new.iterator, _mn_layout(rP_new.layout)),
                                       walk.block_sum):
                self._softmax(t, acc_S, walk.corr, walk.block_sum)
                warpgroup.wait_group(0)  # PV(it-1) done: O may be rescaled
                self._rescale_o(walk.acc_O_mn, walk.corr)
                rP_new.store(acc_S.load().to(rP_new.element_type))
            if walk.wg == 1:
                computed = computed + 1
                self._count_block(t, walk.block_sum)
        if t.kv_len - jstart < TILE_N:
            self._wait_v(walk.pipe_v, self._v_state(it), walk.tiled_copy_o, walk.sV, walk.ctid, t.kv_len - jstart)
        return j_next, computes, computed, computes_prev, jstart

    @cute.jit
    def _decided(self, t: TileRows, b, walk: TileWalk, computed):
        """Group 0 in the stage-2 turns, before PV(b): wait until group 1 has the decision on
        block b, read it, and count a computed block (mloc still holds b's maxima)."""
        slot = b % VOTE_SLOTS
        nvvm_x.barrier_cta_sync(BAR_DECIDED + slot, thread_count=NUM_CONSUMER_THREADS)
        computes = walk.sVote[slot] == b
        if computes:
            computed = computed + 1
            self._count_block(t, walk.block_sum)
        return computes, computed

    @cute.jit
    def _last_turn(self, walk: TileWalk, t: TileRows, tOrP, tOrP_alt, computes_last, computed,
                   stage2: cutlass.Constexpr):
        """The turns' end, past the last block: a turn for its PV alone.  Returns the computed
        count."""
        self._sched_wait(walk.wg)
        return self._close_turns(walk, t, walk.num_sel - 1, computes_last, computed, stage2, tOrP, tOrP_alt)

    @cute.jit
    def _close_turns(self, walk: TileWalk, t: TileRows, b, computes_b, computed, stage2: cutlass.Constexpr,
                     tOrP, tOrP_alt=None):
        """The turns' last turn, after the caller's wait for it (and the QK it issues there, if
        any): PV of block b unless the tile skips it (``stage2``: group 0 reads that decision
        here), the turn handed on, every GEMM waited for, and V(b-1) and V(b) freed.  b's P is
        in tOrP where b is even, else in tOrP_alt (None where b is known to be even).  Returns
        the computed count."""
        v_last = self._v_state(b)
        if const_expr(stage2):
            if walk.wg == 0 and b >= 1:
                computes_b, computed = self._decided(t, b, walk, computed)
        walk.pipe_v.consumer_wait(v_last)
        if computes_b:
            if const_expr(tOrP_alt is None):
                self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP, walk.tOrVt, v_last.index)
            else:
                if b % 2 == 0:
                    self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP, walk.tOrVt, v_last.index)
                else:
                    self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP_alt, walk.tOrVt, v_last.index)
        if walk.wg == 0:  # group 1's last wait needs it; group 0 has no wait left
            self._sched_arrive(walk.wg)
        warpgroup.wait_group(0)
        if b >= 1:
            walk.pipe_v.consumer_release(self._v_state(b - 1))
        walk.pipe_v.consumer_release(v_last)
        return computed

    @cute.jit
    def _vote_loop(self, walk: TileWalk, t: TileRows, halves: QKHalves, first_vote, j_next,
                   jstart_prev, computes_prev, computed, rP, tOrP):
        """Stage 2 from block E = ``first_vote`` on, after the turns (``jstart_prev``: block
        E-1's first key, ``computes_prev``: the decision on it).  The switch keeps the tensor
        cores busy: block E's QK goes in the last turn, in the vote loop's two halves, with
        PV(E-1) if the tile computes block E-1 (its P is in rP: E is odd; ``_close_turns``).
        Then the vote loop from E, S(E) done, no PV pending.  Returns the computed count."""
        acc_S = cute.make_rmem_tensor(walk.s_shape, Float32)
        acc_lo = cute.make_tensor(acc_S.iterator, halves.layout)
        acc_hi = cute.make_tensor(acc_S.iterator + cute.size(halves.layout), halves.layout)
        acc_next = cute.make_rmem_tensor(halves.layout.shape, Float32)
        kst = self._k_state(first_vote)
        walk.pipe_k.consumer_wait(kst)
        self._sched_wait(walk.wg)
        self._issue_qk(halves.tiled_mma, halves.tSrQ, halves.tSrK_lo, kst.index, acc_next)
        self._issue_qk(halves.tiled_mma, halves.tSrQ, halves.tSrK_hi, kst.index, acc_hi)
        computed = self._close_turns(walk, t, first_vote - 1, computes_prev, computed, True, tOrP)
        acc_lo.store(acc_next.load())
        # The vote holds the groups together on skipped blocks.  The vote on block j is posted
        # to the V producer, which loads V only for computed blocks; PV of the last computed
        # block (pending, always j - 1) is issued after the vote on j -- its V had QK(j) and the
        # vote to arrive -- and runs under softmax(j).  V stages count every block before E,
        # then computed blocks only
        v_shift = first_vote - computed
        pending = cutlass.Boolean(False)
        jstart_pending = jstart_prev
        d_state = self._decision_state(first_vote, producer=True)
        for it in cutlass.range(first_vote, walk.num_sel, unroll=1):
            jstart = j_next * TILE_N
            j_next = self._listed_block(walk.plan.mOrder, walk.qt, walk.head, it + 1, walk.num_sel)
            kst = self._k_state(it)
            v_pending = self._v_state(computed + v_shift - 1)
            warpgroup.wait_group(0)  # the high half, issued at the end of the last trip
            walk.pipe_k.consumer_release(kst)
            self._mask(t, acc_S, jstart)
            want = self._thread_max(t, acc_S)
            # the next block's low half runs under the vote (issued on every path, past the last
            # block on a stale stage whose result is never read)
            knext = self._k_state(it + 1)
            if it + 1 < walk.num_sel:
                walk.pipe_k.consumer_wait(knext)
            self._issue_qk(halves.tiled_mma, halves.tSrQ, halves.tSrK_lo, knext.index, acc_next)
            skip = not self._vote(t, want, it, walk.sVote)
            if walk.ctid == 0:
                walk.pipe_decision.producer_acquire(d_state)
                walk.sDecision[d_state.index] = Int32(skip)
                walk.pipe_decision.producer_commit(d_state)
            d_state.advance()
            # The next block's high half, as soon as S is dead (past the last block on a stale
            # stage, like the low half).  A skipped block with no PV pending has only the low
            # half in flight: the high half queues behind it, so that the tensor cores go on
            # from one to the other, and only the low half is waited for
            if skip and not pending:
                self._issue_qk(halves.tiled_mma, halves.tSrQ, halves.tSrK_hi, knext.index, acc_hi)
                warpgroup.wait_group(1)
            else:
                if pending:
                    self._wait_v(walk.pipe_v, v_pending, walk.tiled_copy_o, walk.sV, walk.ctid,
                                 t.kv_len - jstart_pending)
                    self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP, walk.tOrVt, v_pending.index)
                rescale = cutlass.Boolean(False)
                if not skip:
                    self._quad_max(t)
                    rescale = self._softmax_lagged(t, acc_S, walk.corr)
                # PV(j-1) and the next low half done: O may be rescaled, P and V(j-1) reused
                # (waited on both paths, so that ptxas sees O's readers ordered after it and
                # does not serialise the wgmmas)
                warpgroup.wait_group(0)
                if pending:
                    walk.pipe_v.consumer_release(v_pending)
                if skip:
                    pending = cutlass.Boolean(False)
                else:
                    pending = cutlass.Boolean(True)
                    computed = computed + 1
                    jstart_pending = jstart
                    if rescale:
                        self._rescale_o(walk.acc_O_mn, walk.corr)
                    rP.store(acc_S.load().to(self.dtype))
                self._issue_qk(halves.tiled_mma, halves.tSrQ, halves.tSrK_hi, knext.index, acc_hi)
            acc_lo.store(acc_next.load())
        warpgroup.wait_group(0)  # the high half issued past the last block
        if pending:
            v_pending = self._v_state(computed + v_shift - 1)
            self._wait_v(walk.pipe_v, v_pending, walk.tiled_copy_o, walk.sV, walk.ctid, t.kv_len - jstart_pending)
            self._issue_pv(walk.tiled_mma_pv, walk.acc_O, tOrP, walk.tOrVt, v_pending.index)
            warpgroup.wait_group(0)
            walk.pipe_v.consumer_release(v_pending)
        return computed

    @cute.jit
    def _rescale_o(self, acc_O_mn, corr):
        for r in cutlass.range_constexpr(cute.size(corr)):
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr[r]

    # -------------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        mQ_rows: cute.Tensor,
        mK_block: cute.Tensor,
        mK_box: cute.Tensor,
        mV_block: cute.Tensor,
        mV_box: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mBlockPages: cute.Tensor,
        mKvBlockIndptr: cute.Tensor,
        mQoLens: cute.Tensor,
        mKvLens: cute.Tensor,
        mQtiles: cute.Tensor,
        mTileOrder: cute.Tensor,
        mOrder: cute.Tensor,
        mComputed: cute.Tensor,
        mSkipped: cute.Tensor,
        sm_scale: Float32,
        scale_log2: Float32,
        log_delta: Float32,
        page_shift: Int32,
        k_page_units: Int32,
        k_head_units: Int32,
        v_page_units: Int32,
        v_head_units: Int32,
        group: Int32,
        causal: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_copy_o: cute.TiledCopy,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_qk_half: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_Q,
        tma_atom_K_block,
        tma_atom_K_box,
        tma_atom_V_block,
        tma_atom_V_box,
        SharedStorage: cutlass.Constexpr,
    ):
        D = self.head_dim
        dtype = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        plan = PlanTables(mBlockPages, mKvBlockIndptr, mQoLens, mKvLens, mQtiles, mTileOrder, mOrder)
        qt, head, req, row_start, rows = self._work_tile(plan, bid)
        q_index = plan.mQtiles[qt, QT_INDEX]
        num_sel = plan.mQtiles[qt, QT_NUM_SELECTED]
        q_len = plan.mQoLens[req]
        kv_len = plan.mKvLens[req]
        blk_base = plan.mKvBlockIndptr[req]
        kv_head = head // group

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sDecision = storage.decision.get_tensor(cute.make_layout((DECISION_SLOTS,)))
        sVote = storage.vote.get_tensor(cute.make_layout((VOTE_SLOTS,)))
        if tidx < VOTE_SLOTS:
            sVote[tidx] = Int32(-1)  # no block computed yet (ordered by the barrier below)

        tma_bytes = TILE_N * D * (dtype.width // 8)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_CONSUMER_WARPS)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=one,
            consumer_group=consumer_warps, tx_count=TILE_M * D * (dtype.width // 8), defer_sync=True,
        )
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.k_stages, producer_group=one,
            consumer_group=consumer_warps, tx_count=tma_bytes, defer_sync=True,
        )
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.v_stages, producer_group=one,
            consumer_group=consumer_warps, tx_count=tma_bytes, defer_sync=True,
        )
        # stage-2 decisions, one consumer thread -> the V warp (1 = skipped)
        pipe_decision = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_decision.data_ptr(), num_stages=DECISION_SLOTS,
            producer_group=one, consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        # Launched as a programmatic dependent: so far only the plan was read; the kernel before
        # (in cosa.run the proxy, which writes the order) may still be running
        cute.arch.griddepcontrol_wait()
        if warp_idx < 4:
            # ================================================= producer warp group
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            k_src = PagedSource(tma_atom_K_block, mK_block, tma_atom_K_box, mK_box, sK, page_shift, k_page_units,
                                k_head_units)
            v_src = PagedSource(tma_atom_V_block, mV_block, tma_atom_V_box, mV_box, sV, page_shift, v_page_units,
                                v_head_units)
            q_src = QSource(tma_atom_Q, mQ_rows, sQ)
            if warp_idx == K_PRODUCER_WARP:
                # Q, then K of every block in the tile's order
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                pipe_q.producer_acquire(q_state)
                tQsQ, tQgQ = self._q_box(q_src, row_start, head)
                cute.copy(q_src.tma, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                k_views = self._loader_views(k_src, kv_head)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.k_stages)
                j_next = self._listed_block(plan.mOrder, qt, head, Int32(0), num_sel)
                for it in cutlass.range(num_sel, unroll=1):
                    j = j_next
                    j_next = self._listed_block(plan.mOrder, qt, head, it + 1, num_sel)
                    pages = self._block_pages(plan.mBlockPages, blk_base + j, j * TILE_N, kv_len, page_shift)
                    self._load_block(pipe_k, k_state, k_src, k_views, pages, j * TILE_N)
                    k_state.advance()
            elif warp_idx == V_PRODUCER_WARP:
                # V of the blocks the consumers may compute.  With stage 2 on they take turns
                # up to block E - 1 (E: the first odd block two or more past the first skip) and
                # PV each of those blocks they compute in the next turn, so V of every block
                # before E is loaded; from E on a block's V is loaded only once the vote has
                # decided to compute it.  Until E is known, the decision on block it - 2 is read
                # when V(it) is due: known by then in the turns, so the read does not wait.
                v_views = self._loader_views(v_src, kv_head)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.v_stages)
                j_next = self._listed_block(plan.mOrder, qt, head, Int32(0), num_sel)
                first_vote = Int32(NOT_YET)  # E
                n_read = Int32(1)  # the block whose decision is read next
                for it in cutlass.range(num_sel, unroll=1):
                    j = j_next
                    j_next = self._listed_block(plan.mOrder, qt, head, it + 1, num_sel)
                    pages = self._block_pages(plan.mBlockPages, blk_base + j, j * TILE_N, kv_len, page_shift)
                    needed = cutlass.Boolean(True)
                    if log_delta != -Float32.inf:
                        if first_vote == NOT_YET and it >= 3:
                            d_state = self._decision_state(n_read, producer=False)
                            pipe_decision.consumer_wait(d_state)
                            if sDecision[d_state.index] != 0:
                                first_vote = (n_read + 2) | 1
                            pipe_decision.consumer_release(d_state)
                            n_read = n_read + 1
                        if it >= first_vote:
                            for _ in cutlass.range_constexpr(3):  # the decisions up to block it
                                if n_read <= it:
                                    d_state = self._decision_state(n_read, producer=False)
                                    pipe_decision.consumer_wait(d_state)
                                    needed = sDecision[d_state.index] == 0
                                    pipe_decision.consumer_release(d_state)
                                    n_read = n_read + 1
                    if needed:
                        self._load_block(pipe_v, v_state, v_src, v_views, pages, j * TILE_N)
                        v_state.advance()
            else:
                self._prefetch_next_wave(plan, q_src, k_src, v_src, bid, group, tidx)
        else:
            # ================================================ consumer warp groups
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - NUM_PRODUCER_THREADS
            # from the warp-uniform warp_idx: a warp group's Q descriptors then live in uniform
            # registers instead of being moved there before every wgmma
            cwarp = warp_idx - NUM_PRODUCER_THREADS // 32
            wg = cwarp // 4
            diag0 = kv_len - q_len + q_index * TILE_M
            thr = log_delta - cute.math.log(Float32(cutlass.max(kv_len, 1)))

            thr_mma_qk = tiled_mma_qk.get_slice(ctid)
            wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
            wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
            tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
            tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
            wg_mma_half = tiled_mma_qk_half.get_slice(wg * 128)
            sK_halves = cute.flat_divide(sK, (TILE_N // 2, D))
            halves = QKHalves(
                tiled_mma_qk_half, wg_mma_half.make_fragment_A(wg_mma_half.partition_A(sQ)),
                wg_mma_half.make_fragment_B(wg_mma_half.partition_B(sK_halves[None, None, 0, 0, None])),
                wg_mma_half.make_fragment_B(wg_mma_half.partition_B(sK_halves[None, None, 1, 0, None])),
                cute.make_layout(tiled_mma_qk_half.partition_shape_C((TILE_M, TILE_N // 2))))
            s_shape = tiled_mma_qk.partition_shape_C((TILE_M, TILE_N))
            sVt = cute.composition(sV, cute.make_ordered_layout((D, TILE_N, self.v_stages), order=(1, 0, 2)))
            tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
            acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((TILE_M, D)), Float32)
            acc_O.fill(0.0)
            acc_O_mn = cute.make_tensor(acc_O.iterator, _mn_layout(acc_O.layout))
            tScS_mn_full = thr_mma_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
            tScS_mn = cute.make_tensor(tScS_mn_full.iterator, _mn_layout(tScS_mn_full.layout))
            n_my_rows = cute.size(acc_O_mn, mode=[0])
            row_ref = cute.make_rmem_tensor((n_my_rows,), Float32)
            row_max = cute.make_rmem_tensor((n_my_rows,), Float32)
            row_sum = cute.make_rmem_tensor((n_my_rows,), Float32)
            row_ref.fill(-Float32.inf)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)
            mloc = cute.make_rmem_tensor((n_my_rows,), Float32)
            computed = Int32(0)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_q.consumer_wait(q_state)
            corr = cute.make_rmem_tensor((n_my_rows,), Float32)
            tile_rows = TileRows(tScS_mn, row_ref, row_max, row_sum, mloc, kv_len, rows, diag0, causal,
                                 sm_scale, scale_log2, thr)
            # P of the block whose PV is still to be issued, as the A operand of PV (taking turns,
            # the groups alternate rP with rP_alt)
            rP = cute.make_fragment_like(cute.make_rmem_tensor(s_shape, Float32), dtype)
            tOrP = cute.make_tensor(rP.iterator, _frgA_layout(rP.layout))
            rP_alt = cute.make_fragment_like(rP)
            tOrP_alt = cute.make_tensor(rP_alt.iterator, _frgA_layout(rP_alt.layout))
            walk = TileWalk(pipe_k, pipe_v, wg, tiled_mma_qk, tSrQ, tSrK, s_shape, tiled_mma_pv, acc_O, acc_O_mn,
                            tOrVt, corr, plan, qt, head, num_sel, tiled_copy_o, sV, ctid, sVote, sDecision,
                            pipe_decision, cute.make_rmem_tensor((n_my_rows,), Float32))
            if num_sel > 0:
                # The groups take turns on the tensor cores, as in FA3: the GEMMs [QK(j), PV(j-1)]
                # of one run under the other's softmax, and within a group PV(j-1) runs under
                # softmax(j).  A group waits on its own barrier before issuing its GEMMs, then
                # arrives on the other's; group 0 goes first.
                if wg == 0:  # group 0's first turn: arrive on its own barrier
                    self._sched_arrive(1)
                jstart, j_next = self._first_block(walk, tile_rows, rP)
                # V is waited for inside a turn, under QK; only a partial block's V, whose tail
                # zeroing synchronises both groups, is waited for (and zeroed) before the turn
                if kv_len - jstart < TILE_N:
                    self._wait_v(pipe_v, self._v_state(Int32(0)), tiled_copy_o, sV, ctid, kv_len - jstart)
                if thr == -Float32.inf:
                    # delta = 0: no block is skipped and no vote couples the groups, so they take
                    # turns to the end
                    for it in cutlass.range(1, num_sel, 2, unroll=1):  # odd blocks' P in rP_alt
                        j_next = self._turn_block(walk, tile_rows, it, j_next, tOrP, rP_alt)
                        if it + 1 < num_sel:
                            j_next = self._turn_block(walk, tile_rows, it + 1, j_next, tOrP_alt, rP)
                    computed = self._last_turn(walk, tile_rows, tOrP, tOrP_alt, True, num_sel, stage2=False)
                else:
                    # delta > 0.  Most blocks a tile computes come before its first skipped one
                    # (bench/NOTES.md, session 31), so the groups go on taking turns, deciding one step
                    # late (``_stage2_turn_block``), until both know of a skip: at the top of a pair
                    # of blocks, block E, the first odd block two or more past the first skip.  Then
                    # they vote in lockstep, from E on.
                    for r in cutlass.range_constexpr(n_my_rows):
                        row_max[r] = row_ref[r]  # the skip rule's running max: the first block's
                    computes_prev = cutlass.Boolean(True)  # the decision on the block taken last
                    computed = Int32(1)
                    # a skip among the blocks up to it - 2 is known to both groups
                    turns_over = Int32(0)
                    jstart_prev = jstart
                    it = Int32(1)
                    while it < num_sel and turns_over == 0:  # odd blocks' P in rP_alt
                        j_next, computes_prev, computed, computes_before, jstart_prev = self._stage2_turn_block(
                            walk, tile_rows, it, j_next, tOrP, rP_alt, computes_prev, computed)
                        turns_over = turns_over | Int32(not computes_before)
                        if it + 1 < num_sel:
                            j_next, computes_prev, computed, computes_before, jstart_prev = self._stage2_turn_block(
                                walk, tile_rows, it + 1, j_next, tOrP_alt, rP, computes_prev, computed)
                            turns_over = turns_over | Int32(not computes_before)
                        it = it + 2
                    if it >= num_sel:
                        computed = self._last_turn(walk, tile_rows, tOrP, tOrP_alt, computes_prev, computed,
                                                   stage2=True)
                    else:
                        computed = self._vote_loop(walk, tile_rows, halves, it, j_next, jstart_prev,
                                                   computes_prev, computed, rP, tOrP)

            # ---------------------------------------------------------- epilogue
            tOcO_full = tiled_mma_pv.get_slice(ctid).partition_C(cute.make_identity_tensor((TILE_M, D)))
            tOcO_mn = cute.make_tensor(tOcO_full.iterator, _mn_layout(tOcO_full.layout))
            LN2 = math.log(2.0)
            for r in cutlass.range_constexpr(n_my_rows):
                total = row_sum[r]
                total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                empty = total == 0.0 or total != total
                inv = Float32(0.0)
                lse = -Float32.inf
                if not empty:
                    inv = cute.arch.rcp_approx(total)
                    lse = row_ref[r] + cute.math.log2(total, fastmath=False) * LN2
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
                row = tOcO_mn[r, 0][0]
                if tOcO_mn[0, 0][1] == 0:
                    if row < rows:
                        mLSE[row_start + row, head] = lse
            if ctid == 0:
                mComputed[qt, head] = computed
                mSkipped[qt, head] = num_sel - computed  # every listed block is computed or skipped

            rO = cute.make_fragment_like(acc_O, dtype)
            rO.store(acc_O.load().to(dtype))
            sO = sQ  # Q is dead: every wgmma reading it has completed
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=NUM_CONSUMER_THREADS)
            s_atom_O = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)
            r2s_O = cute.make_tiled_copy_C(s_atom_O, tiled_mma_pv).get_slice(ctid)
            cute.copy(s_atom_O, r2s_O.retile(rO), r2s_O.partition_D(sO))
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=NUM_CONSUMER_THREADS)
            thr_copy_o = tiled_copy_o.get_slice(ctid)
            tOsO = thr_copy_o.partition_S(sO)
            tOrO = cute.make_fragment_like(tOsO, dtype)
            cute.autovec_copy(tOsO, tOrO)
            tOcO = thr_copy_o.partition_S(cute.make_identity_tensor((TILE_M, D)))
            for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
                r = tOcO[0, m, 0][0]
                if r < rows:
                    base = _row_offset(mO, row_start + r, head)
                    for k in cutlass.range_constexpr(cute.size(tOrO, mode=[2])):
                        col = tOcO[0, m, k][1]
                        gptr = cute.make_ptr(
                            dtype, (mO.iterator + (base + Int64(col))).toint(),
                            cute.AddressSpace.gmem, assumed_align=16,
                        )
                        cute.copy(tiled_copy_o, tOrO[None, m, k], cute.make_tensor(gptr, tOrO[None, m, k].layout))


# ---------------------------------------------------------------------------
# compilation and launch
# ---------------------------------------------------------------------------
_HAVE_TVM_FFI = importlib.util.find_spec("tvm_ffi") is not None
_cache: dict = {}
_lock = threading.Lock()


def _cutlass_dtype(name: str):
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _dtype_name(dtype) -> str | None:
    s = str(dtype).replace("torch.", "")
    return s if s in _DTYPE_NAMES else None


def supported(head_dim: int, dtype) -> bool:
    """True when a kernel exists for this head_dim and dtype (torch dtype or name)."""
    name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
    return head_dim in HEAD_DIMS and name in _DTYPE_NAMES


def _check_config(dtype_name: str, head_dim: int) -> None:
    """Refuses a configuration outside ``CONFIGS`` before anything is compiled for it."""
    if (dtype_name, head_dim) not in CONFIGS:
        raise ValueError(f"no kernel for dtype_name={dtype_name!r} and head_dim={head_dim!r}: the configurations "
                         f"are {CONFIGS}")


def _fake_tensor(dtype, rank: int, vectorized: bool = False):
    """A fake tensor to compile against: every extent dynamic, the last dim contiguous;
    ``vectorized``: 16-byte aligned rows (TMA, 128-bit copies).  Every extent, head_dim
    included (the kernels tile with their static head_dim): the plain C ABI packs exactly
    the extents a tensor marks dynamic, and ``_to_cute``'s mark_layout_dynamic (the launchers
    without TVM-FFI, and for the kernels aot.py loads) marks them all."""
    div = 128 // dtype.width if vectorized else 1
    return cute.runtime.make_fake_tensor(
        dtype, tuple(cute.sym_int() for _ in range(rank)),
        stride=tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + (1,),
        assumed_align=16 if vectorized else dtype.width // 8)


def _fake_args(dtype_name: str):
    dt = _cutlass_dtype(dtype_name)
    q, k, v, o = (_fake_tensor(dt, rank, vectorized=True) for rank in (3, 4, 4, 3))
    lse = _fake_tensor(Float32, 2)
    block_pages, qtiles, tile_order, computed, skipped = (_fake_tensor(Int32, 2) for _ in range(5))
    indptr, qo_lens, kv_lens = (_fake_tensor(Int32, 1) for _ in range(3))
    order = _fake_tensor(Int32, 3)
    return (q, k, v, o, lse, block_pages, indptr, qo_lens, kv_lens, qtiles, tile_order,
            order, computed, skipped)


def compile_config(dtype_name: str, head_dim: int, use_tvm_ffi: bool | None = None):
    """Compile (or fetch from the in-process cache) the kernel for one configuration."""
    _check_config(dtype_name, head_dim)
    if use_tvm_ffi is None:
        use_tvm_ffi = _HAVE_TVM_FFI
    key = (dtype_name, head_dim, bool(use_tvm_ffi))
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            op = OSKForward(_cutlass_dtype(dtype_name), head_dim)
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=bool(use_tvm_ffi))
            fn = cute.compile(
                op,
                *_fake_args(dtype_name),
                Float32(1.0), Float32(0.0), Int32(4), Int32(1), Int32(1), Int32(1),
                stream,
                options="--enable-tvm-ffi" if use_tvm_ffi else "",
            )
            _cache[key] = fn
    return fn


# _to_cute's descriptors, by tensor object: a plan's tensors, passed on every call, are described
# once (about 10 us a tensor, which the plain C ABI's launches pay on the host: some 25 tensors
# a run, where the DSL has no TVM-FFI).  A descriptor holds its tensor's DLPack capsule, and with it the tensor's memory, so an
# entry lives only as long as its tensor object: id(tensor) -> (tensor geometry, descriptor, weak
# reference whose callback drops the entry).
_cute_views: dict = {}   # one get or set at a time: atomic, no lock needed


def _to_cute(t):
    """A torch tensor as the plain C ABI passes it: every extent dynamic, and every stride but
    the contiguous last dim's, as ``_fake_tensor`` compiled them."""
    geometry = (t.data_ptr(), t.device, t.dtype, t.shape, t.stride())
    entry = _cute_views.get(id(t))
    if entry is not None and entry[2]() is t and entry[0] == geometry:
        return entry[1]
    from cutlass.cute.runtime import from_dlpack

    align = 16 if t.dtype.itemsize == 2 else 4
    view = from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)
    # the call would build the packed descriptor lazily, unguarded: built here, before any
    # thread shares the view
    view.__c_pointers__()
    key = id(t)
    _cute_views[key] = (geometry, view, weakref.ref(t, lambda _, key=key: _cute_views.pop(key, None)))
    return view


_WHO = "osk_forward"  # what OSK's errors start with, bound or not


class _Operands(NamedTuple):
    """What a launcher bound to a plan (``Launcher``, ``kap.Launcher``) takes of every call: q
    [*, num_qo_heads, head_dim] and caches whose NHD views are [*, page_size, num_kv_heads,
    head_dim] (HND caches are permuted), all of ``dtype``."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: object  # a torch dtype
    kv_layout: str

    @classmethod
    def of(cls, who: str, q, k_cache, kv_layout: str) -> "_Operands":
        """As ``q`` and ``k_cache`` have them: what the unbound launchers bind to."""
        from ..paged import check_kv_layout  # like torch, imported when a launch needs it

        check_kv_layout(kv_layout, f"{who}: kv_layout")
        if q.dim() != 3 or k_cache.dim() != 4:
            raise ValueError(f"{who}: q must be 3-D and k_cache 4-D, got shapes {list(q.shape)} and "
                             f"{list(k_cache.shape)}")
        _, page_size, num_kv_heads, _ = _nhd(k_cache, kv_layout).shape
        return cls(q.shape[1], num_kv_heads, q.shape[2], page_size, q.dtype, kv_layout)

    def check(self, who: str) -> None:
        """Refuses what no kernel takes."""
        from ..paged import check_kv_layout

        check_kv_layout(self.kv_layout, f"{who}: kv_layout")
        if not supported(self.head_dim, self.dtype):
            raise ValueError(f"{who}: no kernel for head_dim={self.head_dim}, dtype={self.dtype}")
        if not 16 <= self.page_size <= 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"{who}: page_size must be a power of two in 16..256, got {self.page_size}")
        if self.num_kv_heads < 1 or self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"{who}: the cache's {self.num_kv_heads} kv heads must divide q's "
                             f"{self.num_qo_heads} heads")

    @property
    def page_shift(self) -> int:
        return self.page_size.bit_length() - 1

    @property
    def pages_per_block(self) -> int:
        return max(1, BLOCK_SIZE // self.page_size)

    def views(self, who: str, q, caches: dict, outputs: dict) -> tuple:
        """Checks one call's q, ``caches`` ({name: tensor}) and the ``outputs`` of q's dtype
        (their shapes are the caller's); returns the caches' NHD views.  A contiguous last dim,
        16-byte aligned, and other strides in 16-byte steps (TMA boxes, 128-bit loads and
        stores) for every one."""
        if q.dim() != 3 or tuple(q.shape[1:]) != (self.num_qo_heads, self.head_dim):
            raise ValueError(f"{who}: q must have shape [*, {self.num_qo_heads}, {self.head_dim}], "
                             f"got {list(q.shape)}")
        pages = next(iter(caches.values())).shape[:1]  # the first cache's, which the others share
        expected = [*pages, self.page_size, self.num_kv_heads, self.head_dim]
        views = {}
        for name, cache in caches.items():
            view = _nhd(cache, self.kv_layout) if cache.dim() == 4 else cache
            if list(view.shape) != expected:
                raise ValueError(f"{who}: {name} must be {expected} (pages, page size, kv heads, head_dim) "
                                 f"in the NHD view, got {list(view.shape)}")
            views[name] = view
        for name, t in {"q": q, **views, **outputs}.items():
            if t.dtype != self.dtype:
                raise TypeError(f"{who}: {name} must have dtype {self.dtype}, got {t.dtype}")
            _check_vector_rows(who, name, t)
        return tuple(views.values())


def _nhd(cache, kv_layout: str):
    return cache.permute(0, 2, 1, 3) if kv_layout == "HND" else cache


def _check_vector_rows(who: str, name: str, t) -> None:
    """A contiguous last dim, 16-byte aligned, and other strides in 16-byte steps: what the
    kernels' TMA boxes and 128-bit loads and stores were compiled for (``_fake_tensor``)."""
    step = 16 // t.element_size()
    if t.stride(-1) != 1 or any(s % step for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise ValueError(f"{who}: {name} needs a contiguous, 16-byte aligned last dim and its other "
                         f"strides in 16-byte steps, got strides {t.stride()} at an address "
                         f"{t.data_ptr() % 16} bytes past 16")


def _check_box_reach(who: str, name: str, view) -> None:
    """The last page and kv head of an NHD ``view`` start within ``MAX_BOX_UNITS`` 16-byte
    units of its first (32 GiB): where the kernel's TMA can address them."""
    pages, _, heads, _ = view.shape
    reach = ((pages - 1) * view.stride(0) + (heads - 1) * view.stride(2)) * view.element_size() // 16
    if reach > MAX_BOX_UNITS:
        raise ValueError(f"{who}: {name}'s last page and kv head start {reach} 16-byte units past its first, "
                         f"more than the kernel's TMA addresses ({MAX_BOX_UNITS}, 32 GiB)")


def _check_tiles_have_blocks(who: str, qtiles, order, block_pages) -> None:
    """A plan with query tiles has key blocks and selects at least one, which the kernels' grids
    and loops assume (a plan without tiles launches nothing).  After ``_check_shapes``."""
    nq = qtiles.shape[0]
    if nq and (order.shape[-1] == 0 or block_pages.shape[0] == 0):
        raise ValueError(f"{who}: {nq} query tiles but order has k_max={order.shape[-1]} and block_pages "
                         f"{block_pages.shape[0]} key blocks; a plan with tiles has both >= 1")


def _check_flags(who: str, **flags) -> None:
    """Each of ``flags`` a bool: a kernel takes them as 0 or 1."""
    from ..checks import check_bool

    for name, flag in flags.items():
        check_bool(f"{who}: {name}", flag)


def _check_shapes(who: str, expected: dict) -> None:
    """``expected``: {name: (tensor, dtype, shape)}, None in a shape for any extent.  The kernels
    index every tensor by the plan's extents, unchecked on the device: a tensor of another dtype
    or shape would be read or written out of bounds."""
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype:
            raise TypeError(f"{who}: {name} must have dtype {dtype}, got {t.dtype}")
        if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
            spelled = ", ".join("*" if e is None else str(e) for e in shape)
            raise ValueError(f"{who}: {name} must have shape [{spelled}], got {list(t.shape)}")
        # compiled for a contiguous last dim (_fake_tensor); an empty or size-1 one has no stride
        if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must have a contiguous last dim, got strides {t.stride()}")


def _plan_tables(who: str, operands: _Operands, block_pages, kv_block_indptr, kv_lens, qtiles, order) -> dict:
    """The plan tables both launchers take, as ``_check_shapes`` checks them: {name: (tensor,
    dtype, shape)}.  The extents come from qtiles and kv_lens themselves, and the launchers read
    block_pages' first extent, so those three tables' ranks are checked first."""
    import torch

    for name, t, rank in (("qtiles", qtiles, 2), ("kv_lens", kv_lens, 1), ("block_pages", block_pages, 2)):
        if t.dim() != rank:
            raise ValueError(f"{who}: {name} must be {rank}-D, got shape {list(t.shape)}")
    nq, batch, i32 = qtiles.shape[0], kv_lens.shape[0], torch.int32
    return {"block_pages": (block_pages, i32, (None, operands.pages_per_block)),
            "kv_block_indptr": (kv_block_indptr, i32, (batch + 1,)), "kv_lens": (kv_lens, i32, (batch,)),
            "qtiles": (qtiles, i32, (nq, QT_COLUMNS)), "order": (order, i32, (nq, operands.num_qo_heads, None))}


class Launcher:
    """The OSK kernel bound to one plan: the arguments of ``osk_forward`` that stay from call to
    call (the plan's int32 tables, its ``computed`` and ``skipped`` counters, the operands'
    extents) are checked once, here, and each call checks the rest and launches.  ``cosa.plan``
    makes one per plan, so that an eager ``run`` does not re-check the plan (bench/NOTES.md,
    session 37).  The tables' contents are trusted, as ``osk_forward`` trusts them."""

    def __init__(self, block_pages, kv_block_indptr, qo_lens, kv_lens, qtiles, tile_order, order, computed,
                 skipped, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
                 kv_layout: str = "NHD", causal: bool = True):
        import torch

        from ..checks import byte_span, check_apart  # like torch, imported when a launch needs it

        self.operands = _Operands(num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout)
        self.operands.check(_WHO)
        _check_flags(_WHO, causal=causal)
        plan_tables = _plan_tables(_WHO, self.operands, block_pages, kv_block_indptr, kv_lens, qtiles, order)
        nq, i32 = qtiles.shape[0], torch.int32
        _check_shapes(_WHO, {
            **plan_tables,
            "qo_lens": (qo_lens, i32, tuple(kv_lens.shape)), "tile_order": (tile_order, i32, (nq * num_qo_heads, 2)),
            "computed": (computed, i32, (nq, num_qo_heads)), "skipped": (skipped, i32, (nq, num_qo_heads))})
        _check_tiles_have_blocks(_WHO, qtiles, order, block_pages)
        tables = {"block_pages": block_pages, "kv_block_indptr": kv_block_indptr, "qo_lens": qo_lens,
                  "kv_lens": kv_lens, "qtiles": qtiles, "tile_order": tile_order, "order": order}
        counters = {"computed": computed, "skipped": skipped}
        check_apart(counters, tables, who=_WHO)
        self.num_tiles = tile_order.shape[0]
        self.causal = causal
        self._bound = _BoundTensors(*tables.values(), *counters.values())  # in the kernel's order, after lse
        self._table_spans = tuple(byte_span(name, t) for name, t in tables.items())
        self._counter_spans = tuple(byte_span(name, t) for name, t in counters.items())

    def __call__(self, q, k_cache, v_cache, o, lse, *, sm_scale: float, log_delta: float) -> None:
        import torch

        from ..checks import as_float, check_apart

        sm_scale, log_delta = as_float(f"{_WHO}: sm_scale", sm_scale), as_float(f"{_WHO}: log_delta", log_delta)
        operands = self.operands
        kv_k, kv_v = operands.views(_WHO, q, {"k_cache": k_cache, "v_cache": v_cache}, {"o": o})
        _check_box_reach(_WHO, "k_cache", kv_k)
        _check_box_reach(_WHO, "v_cache", kv_v)
        _check_shapes(_WHO, {"o": (o, q.dtype, tuple(q.shape)),
                             "lse": (lse, torch.float32, (q.shape[0], operands.num_qo_heads))})
        check_apart({"o": o, "lse": lse}, {"q": q, "k_cache": k_cache, "v_cache": v_cache}, who=_WHO,
                    checked_outputs=self._counter_spans, input_spans=self._table_spans)
        if not 0 < sm_scale <= MAX_SM_SCALE:
            raise ValueError(f"{_WHO}: sm_scale must be in (0, {MAX_SM_SCALE:.4g}] (float32 logits), "
                             f"got {sm_scale!r}")
        if not -math.inf <= log_delta < math.inf:
            raise ValueError(f"{_WHO}: log_delta must be ln(delta) for a finite delta >= 0 (-inf for 0), "
                             f"got {log_delta!r}")
        if self.num_tiles == 0:
            return
        name, D = _dtype_name(operands.dtype), operands.head_dim
        (fn,), source = load_or_compile(("osk",), name, D, lambda: (compile_config(name, D),))
        scalars = (float(sm_scale), float(log_delta), operands.page_shift,
                   operands.num_qo_heads // operands.num_kv_heads, 1 if self.causal else 0, self.num_tiles)
        _launch(fn, source, (q, kv_k, kv_v, o, lse), self._bound, scalars)


def osk_forward(
    q, k_cache, v_cache, block_pages, kv_block_indptr, qo_lens, kv_lens, qtiles, tile_order,
    order, o, lse, computed, skipped, *, sm_scale: float, log_delta: float,
    kv_layout: str = "NHD", causal: bool = True,
) -> None:
    """Run the OSK kernel (see the module docstring for the contract): a ``Launcher`` bound
    to these tables for one call."""
    operands = _Operands.of(_WHO, q, k_cache, kv_layout)
    launcher = Launcher(block_pages, kv_block_indptr, qo_lens, kv_lens, qtiles, tile_order, order, computed,
                        skipped, causal=causal, **operands._asdict())
    launcher(q, k_cache, v_cache, o, lse, sm_scale=sm_scale, log_delta=log_delta)


class _BoundTensors:
    """What a bound launcher passes one kernel on every call, after the call's own tensors: the
    plan's tables and buffers, which never move (the launchers take their byte spans once,
    too).  libcosa's launchers take them as words, packed on first use: packing every tensor on
    every call was a sixth of an eager AOT run's host time (bench/NOTES.md, session 37)."""

    def __init__(self, *tensors):
        self.tensors = tensors

    @functools.cached_property
    def words(self) -> list[int]:
        return tensor_words(self.tensors)


def _launch(fn, source, tensors, bound: _BoundTensors, scalars=()) -> None:
    """Calls a kernel of ``source`` (``aot.KernelSource``) on ``tensors`` then ``bound``'s, on
    the current torch stream of the tensors' device, which need not be the current device: a
    compiled kernel through TVM-FFI (torch tensors; it switches to their device and takes its
    stream) where it was compiled with it, else through the DSL's plain C ABI (``_to_cute``'s
    descriptors and an explicit stream); libcosa's through its launcher (``aot.load_kernel``).
    The last two launch on the current device, switched to the tensors' only where it is
    another.  Entering the device took 3.4 us a launch and ``torch.cuda.current_stream``'s
    Stream object 5.2 us, so the stream's address is read as torch's own generated code reads
    it (bench/NOTES.md, session 38)."""
    import torch

    if _HAVE_TVM_FFI and source.kind == "jit":
        fn(*tensors, *bound.tensors, *scalars)
        return
    device = tensors[0].device
    with torch.cuda.device(device) if device.index != torch.cuda.current_device() else contextlib.nullcontext():
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        if source.kind == "aot":
            fn(tensor_words(tensors) + bound.words, scalars, stream)
        else:
            fn(*(_to_cute(t) for t in (*tensors, *bound.tensors)), *scalars, cuda.CUstream(stream))
