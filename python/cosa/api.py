"""FlashInfer-style API: ``plan`` once per batch shape, ``run`` per forward.

``plan`` does the host work (argument checks, the C++ remap layer's block
table and tile schedule, buffer carving); ``run`` computes the proxy's order
mask and the attention. On a CUDA device with a kernel for the configuration
``run`` launches the OSK kernel (and, for the KAP proxy, the fused KAP kernels
for the order mask); otherwise it executes the torch proxy and the exact reference.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import _C
from .blocks import num_blocks
from .checks import as_float, byte_span, check_apart, check_bool, check_int, check_tensor
from .paged import cache_geometry, check_kv_layout, gather_pages, split_kv_cache
from .proxy import check_proxy, proxy_order
from .reference import ordered_skip_attention

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_ALIGN = 256  # byte alignment of every buffer carved from a workspace
HOPPER = (9, 0)  # the compute capability the kernels are built for (sm_90a)
# Plans cut from one workspace share its buffers. Per device: the workspace bytes of each plan
# whose counts are still its own there, with its token (made, which marks them unwritten, or
# run), so that stats() refuses another plan's numbers. A write drops every entry it overlaps.
_workspace_counts: dict[str, list[tuple[int, int, int]]] = {}
_plan_tokens = itertools.count(1)


@dataclass(frozen=True)
class Stats:
    """Block counts of one ``run``: per query tile (candidates, selected) or per (query tile,
    query head) (computed, skipped), and summed."""

    candidates: torch.Tensor  # [num_qtiles] key blocks a tile may see
    selected: torch.Tensor    # [num_qtiles] blocks stage 1 lists (same for every head)
    computed: torch.Tensor    # [num_qtiles, num_qo_heads] blocks the kernel computed
    skipped: torch.Tensor     # [num_qtiles, num_qo_heads] blocks stage 2 skipped

    @property
    def computed_per_head(self) -> torch.Tensor:
        return self.computed.sum(0)

    @property
    def skipped_per_head(self) -> torch.Tensor:
        return self.skipped.sum(0)

    @property
    def density_stage1(self) -> float:
        """Selected blocks over candidate blocks."""
        return float(self.selected.sum()) / max(1, int(self.candidates.sum()))

    @property
    def density_stage2(self) -> float:
        """Computed blocks over candidate blocks, all heads."""
        return float(self.computed.sum()) / max(1, int(self.candidates.sum()) * self.computed.shape[1])


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything ``run`` needs that depends on the batch shape only. Built by :func:`plan`.

    The fields record what ``plan`` was called with. ``delta``, ``sm_scale`` and the launcher
    ``kernel`` are read by each ``run``, so a ``dataclasses.replace`` of them takes effect
    (``calibrate_delta`` replaces delta, ``bench/bench_osk_ab.py`` the kernel, with a callable
    that takes ``(q, k_cache, v_cache, out, lse, *, sm_scale, log_delta)`` and launches on this
    plan's tables, as ``osk.Launcher`` does); the others shaped the plan's tables
    (``budget``, ``force_local`` and ``force_sink`` the selection and ranking, ``causal`` the
    candidates, ``proxy`` whether the KAP kernel ranks) or are bound into its launchers with
    them (``kv_layout``, ``causal``, the tables themselves), so change them through ``plan``.

    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give ``plan`` of the same page table and
    options (delta and sm_scale as they are now) on the same device, with buffers of its own
    (no workspace) and the plan's own launchers."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_layout: str
    causal: bool
    budget: float
    delta: float
    sm_scale: float
    force_local: bool
    force_sink: bool
    proxy: str               # stage-1 scorer, a key of cosa.proxy.PROXIES
    q_data_type: torch.dtype
    kv_data_type: torch.dtype
    device: torch.device
    # host copies, so that run never synchronises
    qo_indptr_host: tuple[int, ...]
    kv_indptr_host: tuple[int, ...]
    kv_lens_host: tuple[int, ...]
    qtile_indptr_host: tuple[int, ...]
    min_num_pages: int
    k_max: int
    # device tensors (int32)
    kv_indices: torch.Tensor
    qo_lens: torch.Tensor
    kv_lens: torch.Tensor
    kv_block_indptr: torch.Tensor
    block_pages: torch.Tensor
    qtiles: torch.Tensor
    tile_order: torch.Tensor
    # buffers written by run
    order: torch.Tensor      # [num_qtiles, num_qo_heads, k_max]
    computed: torch.Tensor   # [num_qtiles, num_qo_heads]
    skipped: torch.Tensor    # [num_qtiles, num_qo_heads]
    lse: torch.Tensor        # [total_q, num_qo_heads] float32 scratch, when no LSE is wanted
    # float32 means the KAP kernel pools into, [num_qtiles, num_qo_heads, head_dim] and
    # [num_kv_blocks, num_kv_heads, head_dim]; without rank_kernel they have no rows
    qbar: torch.Tensor
    kbar: torch.Tensor
    # the OSK kernel bound to this plan's tables (cute_kernels.osk.Launcher), or None where run
    # executes the exact reference
    kernel: Callable | None
    # the fused KAP kernels bound to them (cute_kernels.kap.Launcher), or None where run ranks
    # with the torch proxies
    rank_kernel: Callable | None
    # with a workspace: the device and byte range the plan's buffers take of it (_workspace_counts)
    workspace_bytes: tuple[str, int, int] | None = None
    token: int = 0

    def __reduce__(self):
        # copy, deepcopy and pickle: the plan of the same batch and options on the same device,
        # with buffers of its own. A field-by-field copy would keep the launchers' packed
        # addresses, the byte spans and the workspace entry of this plan: its runs would write
        # this plan's buffers, freed or not.
        pages = [end - start for start, end in zip(self.kv_indptr_host, self.kv_indptr_host[1:])]
        last_page_len = [kv_len - self.page_size * (n - 1) if n else 0 for kv_len, n in zip(self.kv_lens_host, pages)]
        page_table = (self.qo_indptr_host, self.kv_indptr_host, self.kv_indices.tolist(), last_page_len)
        options = {name: getattr(self, name) for name in (
            "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "causal", "budget", "delta", "sm_scale",
            "q_data_type", "kv_data_type", "kv_layout", "force_local", "force_sink", "proxy")}
        return _replan, (page_table, str(self.device), options)

    @functools.cached_property
    def tensor_spans(self) -> tuple:
        """The byte spans of the plan's tensors (``checks.byte_span``), which run's outputs
        must not meet; kept, as the tensors never change."""
        return tuple(byte_span(f"plan.{field.name}", getattr(self, field.name)) for field in dataclasses.fields(self)
                     if isinstance(getattr(self, field.name), torch.Tensor))

    @property
    def uses_kernel(self) -> bool:
        return self.kernel is not None

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens_host)

    @property
    def total_q(self) -> int:
        return self.qo_indptr_host[-1]

    @property
    def num_qtiles(self) -> int:
        return self.qtiles.shape[0]

    def stats(self) -> Stats:
        """Statistics of the latest ``run`` with this plan (synchronises). A copy: later
        runs leave it as it is. Raises before the first run (``plan`` marks the counts
        unwritten with -1)."""
        def copy(x: torch.Tensor) -> torch.Tensor:
            return x.to("cpu", copy=True)
        if not _holds_its_counts(self):
            raise RuntimeError("plan.stats(): another plan on the same workspace was made, run or ranked "
                               "with order_mask since this plan's latest run, and its numbers replaced this plan's")
        computed, skipped = copy(self.computed), copy(self.skipped)
        if (computed < 0).any() or (skipped < 0).any():
            raise RuntimeError("plan.stats(): no run has written the counts since this plan was made")
        return Stats(candidates=copy(self.qtiles[:, _C.QT_NUM_CANDIDATES]),
                     selected=copy(self.qtiles[:, _C.QT_NUM_SELECTED]), computed=computed, skipped=skipped)


def _check_index_tensor(name: str, x, device: torch.device | None = None) -> torch.Tensor:
    check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, but kv_indices is on {device}")
    return x


def _carve(workspace: torch.Tensor | None, device: torch.device,
           buffers: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[torch.Tensor], tuple | None]:
    """Tensors of the given shapes and dtypes, cut from ``workspace`` or freshly allocated; and
    with a workspace, the device and byte range they take of it (``Plan.workspace_bytes``)."""
    if workspace is None:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in buffers], None
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in buffers]
    offset = -workspace.data_ptr() % _ALIGN   # every buffer starts _ALIGN-aligned, whatever the slice
    needed = offset + sum(-(-size // _ALIGN) * _ALIGN for size in sizes)
    if workspace.numel() < needed:
        raise ValueError(f"workspace holds {workspace.numel()} bytes, this plan needs {needed}")
    used = (str(device), workspace.data_ptr() + offset, workspace.data_ptr() + needed)
    carved = []
    for (shape, dtype), size in zip(buffers, sizes):
        carved.append(workspace[offset:offset + size].view(dtype).view(shape))
        offset += -(-size // _ALIGN) * _ALIGN
    return carved, used


def check_workspace(workspace) -> torch.Tensor:
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
    if workspace.dtype != torch.uint8:
        raise TypeError(f"workspace must be a uint8 tensor, got {workspace.dtype}")
    if workspace.dim() != 1 or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous 1-D tensor, got shape {tuple(workspace.shape)} "
                         f"and strides {workspace.stride()}")
    return workspace


def _check_plan_options(num_qo_heads, num_kv_heads, head_dim, page_size, budget, delta, sm_scale,
                        q_data_type, kv_data_type, kv_layout, proxy, causal, force_local, force_sink) -> tuple:
    """Checks plan's scalar arguments (the page table's content and budget's range are the C++
    layer's); returns ``(num_qo_heads, num_kv_heads, head_dim, page_size, budget, delta,
    sm_scale, causal, force_local, force_sink)`` as ints, floats and bools."""
    check_kv_layout(kv_layout)
    check_proxy(proxy)
    num_qo_heads = check_int("num_qo_heads", num_qo_heads)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads)  # that it divides num_qo_heads: _C.build_plan
    head_dim = check_int("head_dim", head_dim)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    page_size = check_int("page_size", page_size)
    for name, dtype in (("q_data_type", q_data_type), ("kv_data_type", kv_data_type)):
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be one of {SUPPORTED_DTYPES}, got {dtype}")
    budget = as_float("budget", budget)
    delta = _check_delta("delta", delta)
    causal, force_local, force_sink = (check_bool("causal", causal), check_bool("force_local", force_local),
                                       check_bool("force_sink", force_sink))
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else _check_sm_scale("sm_scale", sm_scale)
    return num_qo_heads, num_kv_heads, head_dim, page_size, budget, delta, sm_scale, causal, force_local, force_sink


# delta and sm_scale are checked by plan and, since a Plan's may be replaced, by each run
def _check_delta(name: str, delta) -> float:
    value = as_float(name, delta)
    if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite float >= 0, got {delta!r}")
    return value


def _check_sm_scale(name: str, sm_scale) -> float:
    value = as_float(name, sm_scale)
    if not 0 < value <= _C.MAX_SM_SCALE:
        raise ValueError(f"{name} must be in (0, {_C.MAX_SM_SCALE:.4g}] (float32 logits), got {sm_scale!r}")
    return value


def _replan(page_table, device: str, options: dict) -> Plan:
    """``Plan.__reduce__``'s inverse."""
    return plan(*(torch.tensor(a, dtype=torch.int32, device=device) for a in page_table), **options)


def plan(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
         kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
         page_size: int, *, causal: bool = True, budget: float = 0.25, delta: float = 0.05,
         sm_scale: float | None = None, q_data_type: torch.dtype = torch.bfloat16,
         kv_data_type: torch.dtype | None = None, kv_layout: str = "NHD",
         force_local: bool = True, force_sink: bool = True, proxy: str = "kap",
         workspace: torch.Tensor | None = None) -> Plan:
    """Host work for one batch shape; see ``SPEC.md``. Index tensors are int32.

    The plan lives on ``kv_indices``'s device (or the workspace's, when one is
    given). ``budget`` is the stage-1 fraction ``b1`` of candidate key blocks,
    ``delta`` the stage-2 knob (0 turns skipping off), ``proxy`` the stage-1
    scorer (``cosa.proxy.PROXIES``; CoSA's own is ``"kap"``).

    Without ``workspace`` the plan allocates its buffers (order mask, counts, scratch);
    with one it cuts them from it, so plans made on one workspace share them: any of
    them runs correctly, but only the plan made or run last on the workspace (or on
    any slice overlapping it) has ``stats()``, which ``order_mask`` with another plan
    takes away too; the others' raise (a CUDA graph's replays count as the run it
    captured). The plans keep the workspace's memory alive; it must not be resized
    (``resize_``) while they live, as the kernels keep the addresses it had.
    """
    kv_data_type = kv_data_type or q_data_type
    (num_qo_heads, num_kv_heads, head_dim, page_size, budget, delta, sm_scale, causal, force_local,
     force_sink) = _check_plan_options(num_qo_heads, num_kv_heads, head_dim, page_size, budget, delta, sm_scale,
                                       q_data_type, kv_data_type, kv_layout, proxy, causal, force_local, force_sink)
    _check_index_tensor("kv_indices", kv_indices)
    device = kv_indices.device if workspace is None else check_workspace(workspace).device
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_last_page_len", kv_last_page_len)):
        _check_index_tensor(name, x, kv_indices.device)

    host = {name: x.cpu().numpy() for name, x in (
        ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
        ("kv_last_page_len", kv_last_page_len))}
    # Page ids are checked against the cache in run; the plan does not see it, so every int32 id
    # is in range here.
    tables = _C.build_plan(host["qo_indptr"], host["kv_indptr"], host["kv_indices"],
                           host["kv_last_page_len"], num_pages=2**31, page_size=page_size,
                           num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           causal=causal, budget=budget,
                           force_local=force_local, force_sink=force_sink)
    used_pages = host["kv_indices"][:host["kv_indptr"][-1]]
    k_max = tables["k_max"]
    num_qtiles = tables["qtiles"].shape[0]
    qtile_indptr = np.concatenate([[0], np.cumsum([num_blocks(n) for n in tables["qo_lens"]])])

    bind_osk = osk_launcher(device, head_dim, q_data_type, kv_data_type)
    bind_kap = kap_launcher(device, proxy, head_dim, q_data_type, kv_data_type, tables["max_request_blocks"])
    pooled_tiles, pooled_blocks = (num_qtiles, tables["block_pages"].shape[0]) if bind_kap else (0, 0)
    (order, computed, skipped, lse, qbar, kbar), workspace_bytes = _carve(workspace, device, [
        ((num_qtiles, num_qo_heads, k_max), torch.int32), ((num_qtiles, num_qo_heads), torch.int32),
        ((num_qtiles, num_qo_heads), torch.int32),
        ((int(host["qo_indptr"][-1]), num_qo_heads), torch.float32),
        ((pooled_tiles, num_qo_heads, head_dim), torch.float32),
        ((pooled_blocks, num_kv_heads, head_dim), torch.float32)])

    on_device = {name: torch.from_numpy(tables[name]).to(device) for name in (
        "qo_lens", "kv_lens", "kv_block_indptr", "block_pages", "qtiles", "tile_order")}
    # the launchers check the tables and buffers once, bound to them; each run checks its operands
    operands = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    page_size=page_size, dtype=q_data_type, kv_layout=kv_layout)
    kernel = rank_kernel = None
    if bind_osk:
        kernel = bind_osk(*(on_device[name] for name in (
            "block_pages", "kv_block_indptr", "qo_lens", "kv_lens", "qtiles", "tile_order")),
            order, computed, skipped, causal=causal, **operands)
    if bind_kap:
        rank_kernel = bind_kap(*(on_device[name] for name in (
            "block_pages", "kv_block_indptr", "kv_lens", "qtiles")), qbar, kbar, order,
            force_local=force_local, force_sink=force_sink, **operands)

    new_plan = Plan(
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, kv_layout=kv_layout, causal=causal, budget=budget,
        delta=delta, sm_scale=sm_scale, force_local=force_local,
        force_sink=force_sink, proxy=proxy, q_data_type=q_data_type,
        kv_data_type=kv_data_type, device=device,
        qo_indptr_host=tuple(int(x) for x in host["qo_indptr"]),
        kv_indptr_host=tuple(int(x) for x in host["kv_indptr"]),
        kv_lens_host=tuple(int(x) for x in tables["kv_lens"]),
        qtile_indptr_host=tuple(int(x) for x in qtile_indptr),
        min_num_pages=int(used_pages.max()) + 1 if used_pages.size else 0,
        # a copy, as block_pages is: the plan does not follow later edits of the caller's page table
        k_max=k_max, kv_indices=torch.from_numpy(used_pages).to(device, copy=True), **on_device,
        order=order, computed=computed, skipped=skipped, lse=lse, qbar=qbar, kbar=kbar,
        kernel=kernel, rank_kernel=rank_kernel, workspace_bytes=workspace_bytes, token=next(_plan_tokens))
    _release_workspace(new_plan)
    computed.fill_(-1)   # unwritten until a run: stats() refuses them
    skipped.fill_(-1)
    _claim_workspace(new_plan)
    if workspace_bytes is not None:   # its entry goes with its buffers (copies of the plan share them)
        weakref.finalize(computed, _forget_workspace, workspace_bytes, new_plan.token)
    return new_plan


def _check_run_args(plan_: Plan, q, paged_kv_cache, out, lse):
    if not isinstance(plan_, Plan):
        raise TypeError(f"plan must be a cosa.Plan (from cosa.plan), got {type(plan_).__name__}")
    _check_delta("plan.delta", plan_.delta)
    _check_sm_scale("plan.sm_scale", plan_.sm_scale)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != plan_.q_data_type:
        raise TypeError(f"q is {q.dtype}, but the plan was made for q_data_type={plan_.q_data_type}")
    expected = (plan_.total_q, plan_.num_qo_heads, plan_.head_dim)
    if tuple(q.shape) != expected:
        raise ValueError(f"q must have shape {expected} (total_q, num_qo_heads, head_dim), got {tuple(q.shape)}")
    if q.device != plan_.device:
        raise ValueError(f"q is on {q.device}, but the plan is on {plan_.device}")
    k, v = split_kv_cache(paged_kv_cache)
    if k.dtype != plan_.kv_data_type:
        raise TypeError(f"paged_kv_cache is {k.dtype}, but the plan was made for kv_data_type={plan_.kv_data_type}")
    if k.device != plan_.device:
        raise ValueError(f"paged_kv_cache is on {k.device}, but the plan is on {plan_.device}")
    geometry = cache_geometry(k, plan_.kv_layout)
    for name in ("page_size", "num_kv_heads", "head_dim"):
        if getattr(geometry, name) != getattr(plan_, name):
            raise ValueError(f"paged_kv_cache has {name}={getattr(geometry, name)} in the {plan_.kv_layout} "
                             f"layout, but the plan has {name}={getattr(plan_, name)}")
    if geometry.num_pages < plan_.min_num_pages:
        raise ValueError(f"paged_kv_cache has {geometry.num_pages} pages, but kv_indices refers to page "
                         f"{plan_.min_num_pages - 1}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype \
                or out.device != q.device:
            raise ValueError(f"out must be a tensor like q: shape {tuple(q.shape)}, {q.dtype}, on {q.device}")
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != expected[:2] \
                or lse.dtype != torch.float32 or lse.device != q.device:
            raise ValueError(f"lse must be a float32 tensor of shape {expected[:2]} on {q.device}")
    outputs = {name: x for name, x in (("out", out), ("lse", lse)) if x is not None}
    inputs = {"q": q, "paged_kv_cache's K": k, "paged_kv_cache's V": v}
    # All of the plan's memory counts as written: one stage writes its buffers while the other
    # reads the inputs (KAP's means and order mask while OSK reads V), which no launcher sees
    # alone; here too before the first launch.
    check_apart(outputs, inputs, checked_outputs=plan_.tensor_spans)
    return k, v


def _requests(plan: Plan):
    """``(q_rows, qtile_rows, pages, kv_len)`` of every request with queries."""
    for request in range(plan.batch_size):
        q_rows = slice(plan.qo_indptr_host[request], plan.qo_indptr_host[request + 1])
        if q_rows.start == q_rows.stop:
            continue
        yield (q_rows, slice(plan.qtile_indptr_host[request], plan.qtile_indptr_host[request + 1]),
               plan.kv_indices[plan.kv_indptr_host[request]:plan.kv_indptr_host[request + 1]],
               plan.kv_lens_host[request])


def _holds_its_counts(plan: Plan) -> bool:
    """Whether ``plan``'s counts are its own: always without a workspace (``Plan.stats``)."""
    if plan.workspace_bytes is None:
        return True
    device, first, end = plan.workspace_bytes
    return (first, end, plan.token) in _workspace_counts.get(device, ())


def _release_workspace(plan: Plan) -> bool:
    """Before ``plan`` writes its workspace bytes: every plan whose bytes they overlap, itself
    included, loses its counts, so that a write that fails part way leaves no plan claiming what
    it wrote.  Returns whether ``plan`` held its own."""
    held = _holds_its_counts(plan)
    if plan.workspace_bytes is not None:
        device, first, end = plan.workspace_bytes
        _workspace_counts[device] = [entry for entry in _workspace_counts.get(device, ())
                                     if entry[1] <= first or end <= entry[0]]
    return held


def _forget_workspace(workspace_bytes: tuple[str, int, int], token: int) -> None:
    """Drops a dead plan's entry, so that the entries run scans are the live plans'."""
    device, first, end = workspace_bytes
    if (first, end, token) in _workspace_counts.get(device, ()):
        _workspace_counts[device].remove((first, end, token))


def _claim_workspace(plan: Plan) -> None:
    """After ``plan`` wrote its counts, or kept them: they are its own."""
    if plan.workspace_bytes is not None:
        device, first, end = plan.workspace_bytes
        _workspace_counts.setdefault(device, []).append((first, end, plan.token))


def _rank(plan: Plan, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if plan.rank_kernel is not None:
        plan.rank_kernel(q, k_cache)
        return
    for q_rows, qtile_rows, pages, kv_len in _requests(plan):
        keys = gather_pages(k_cache, plan.kv_layout, pages, kv_len)
        proxy_order(q[q_rows], keys, plan.qtiles[qtile_rows], plan.order[qtile_rows], force_local=plan.force_local,
                    force_sink=plan.force_sink, proxy=plan.proxy, causal=plan.causal, sm_scale=plan.sm_scale)


def order_mask(plan: Plan, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
    """Stage 1 alone, exactly as ``run`` does it: writes and returns ``plan.order``
    ``[num_qtiles, num_qo_heads, k_max]``, each (query tile, head)'s key blocks in
    visiting order, -1 padded."""
    k_cache, _ = _check_run_args(plan, q, paged_kv_cache, None, None)
    held = _release_workspace(plan)   # the order mask may lie where other plans' counts were
    _rank(plan, q, k_cache)
    if held:   # not where its own are
        _claim_workspace(plan)
    return plan.order


def run(plan: Plan, q: torch.Tensor, paged_kv_cache, *, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None, return_lse: bool = False):
    """CoSA attention of ``q [total_q, num_qo_heads, head_dim]`` over the paged cache.

    Returns ``o`` (q's dtype), or ``(o, lse)`` with ``return_lse=True``; ``lse``
    is float32, the natural log of each row's softmax denominator over the
    computed keys (``-inf`` for a row that computed none). Statistics of the
    call are read with ``plan.stats()``.

    ``out`` and ``lse`` are written instead of new tensors: with ``out`` given, and
    ``lse`` given or ``return_lse=False``, the kernel path allocates nothing, its
    scratch being the plan's.
    They must not overlap each other, q, the cache or the plan's memory, nor may q and
    the cache overlap the plan's memory.

    A plan's runs must not overlap one another (its scratch is shared): run it from one
    stream at a time, and from one thread. A CUDA graph that captured a run replays that
    plan's launches on its tables and buffers: keep the plan alive while the graph may
    replay, and capture again after re-planning a wrapper or a workspace.
    """
    check_bool("return_lse", return_lse)
    k_cache, v_cache = _check_run_args(plan, q, paged_kv_cache, out, lse)
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        # the kernel always writes LSE; a caller who wants it gets a tensor of their own
        lse = torch.empty_like(plan.lse) if return_lse else plan.lse
    _release_workspace(plan)
    _rank(plan, q, k_cache)
    if plan.kernel is not None:
        plan.kernel(q, k_cache, v_cache, out, lse, sm_scale=plan.sm_scale,
                    log_delta=math.log(plan.delta) if plan.delta > 0 else -math.inf)
    else:
        for q_rows, qtile_rows, pages, kv_len in _requests(plan):
            keys = gather_pages(k_cache, plan.kv_layout, pages, kv_len)
            values = gather_pages(v_cache, plan.kv_layout, pages, kv_len)
            out[q_rows], lse[q_rows], plan.computed[qtile_rows], plan.skipped[qtile_rows] = \
                ordered_skip_attention(q[q_rows], keys, values, plan.order[qtile_rows], causal=plan.causal,
                                       sm_scale=plan.sm_scale, delta=plan.delta)
    _claim_workspace(plan)
    return (out, lse) if return_lse else out


def _runs_kernels(device: torch.device) -> bool:
    """Whether the CuTe kernels run on ``device``: they are built for sm_90a, Hopper only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == HOPPER


def osk_launcher(device: torch.device, head_dim: int, q_data_type: torch.dtype,
                 kv_data_type: torch.dtype) -> Callable | None:
    """The OSK kernel's ``Launcher`` for this configuration (``plan`` binds it to its tables),
    or None: no CUDA device, and with a warning (the reference is far slower) a GPU other than
    Hopper, no CuTe DSL installed, or dtypes the kernel lacks."""
    if device.type != "cuda":
        return None
    if not _runs_kernels(device):
        major, minor = torch.cuda.get_device_capability(device)
        warnings.warn(f"cosa: the OSK kernel needs a Hopper GPU (sm_90); {device} is sm_{major}{minor}, "
                      "so run uses the exact reference", stacklevel=3)
        return None
    try:
        from .cute_kernels import osk
    except ImportError as error:
        warnings.warn(f"cosa: the OSK kernel is unavailable ({error}); run uses the exact reference",
                      stacklevel=3)
        return None
    if kv_data_type != q_data_type or not osk.supported(head_dim, q_data_type):
        warnings.warn(f"cosa: the OSK kernel takes fp16 or bf16 q and K/V of one dtype, not "
                      f"q_data_type={q_data_type}, kv_data_type={kv_data_type}; run uses the exact reference",
                      stacklevel=3)
        return None
    return osk.Launcher


def kap_launcher(device: torch.device, proxy: str, head_dim: int, q_data_type: torch.dtype,
                 kv_data_type: torch.dtype, num_key_blocks: int) -> Callable | None:
    """The fused KAP kernels' ``Launcher`` (``cute_kernels/kap.py``), or None where ``run``
    ranks with the torch proxies: another proxy, no Hopper GPU or no CuTe DSL (``osk_launcher``
    warns), a configuration the kernels lack, or a request of more key blocks than their sort
    holds."""
    if proxy != "kap" or not _runs_kernels(device) or kv_data_type != q_data_type:
        return None
    try:
        from .cute_kernels import kap
    except ImportError:
        return None
    return kap.Launcher if kap.supported(head_dim, q_data_type, num_key_blocks) else None


class CoSAPrefillWrapper:
    """FlashInfer-style wrapper: ``plan`` then ``run`` (any number of times).

    ``workspace`` is a 1-D uint8 tensor on the device the plans live on; its
    bytes hold the order mask and statistics, so ``run`` allocates none of them.
    """

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD"):
        self._workspace = check_workspace(workspace)
        self._kv_layout = check_kv_layout(kv_layout)
        self._plan: Plan | None = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim, page_size, **options) -> None:
        self._plan = plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
                          num_kv_heads, head_dim, page_size, kv_layout=self._kv_layout,
                          workspace=self._workspace, **options)

    def _planned(self, method: str) -> Plan:
        if self._plan is None:
            raise RuntimeError(f"CoSAPrefillWrapper.{method} called before plan")
        return self._plan

    def run(self, q, paged_kv_cache, **options):
        return run(self._planned("run"), q, paged_kv_cache, **options)

    def stats(self) -> Stats:
        return self._planned("stats").stats()
