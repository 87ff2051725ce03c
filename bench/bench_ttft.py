"""Time to first token of a Qwen3-8B-shaped model at long prompts: dense attention against CoSA.

    python bench/bench_ttft.py [--seq-lens 32768 65536 131072] [--attention fa4 sdpa cosa]
                               [--budget 0.25] [--delta 0.05] [--page-size 128] [--repeats 5]
                               [--json ttft.json]
    python bench/bench_ttft.py --quick                 # GPU smoke run: 2 layers, 4K
    python bench/bench_ttft.py --device cpu --quick    # tiny model on the CPU (cosa's reference path)

The model is built from Qwen3-8B's configuration with random weights (nothing is downloaded);
one forward over the whole prompt is the prefill, and only the last token's logits are made.
bench/README.md says what every column means.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import cosa
from cosa.paged import indptr, page_table, scatter_pages
from cosa.synthetic import rope

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import format_or_dash, load_fa4, provenance, rel_err  # noqa: E402


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Qwen3 decoder (its config.json names in the comments)."""

    num_layers: int        # num_hidden_layers
    hidden: int            # hidden_size
    num_qo_heads: int      # num_attention_heads
    num_kv_heads: int      # num_key_value_heads
    head_dim: int
    intermediate: int      # intermediate_size (SwiGLU)
    vocab: int             # vocab_size
    rope_theta: float = 1e6
    rms_eps: float = 1e-6  # rms_norm_eps


QWEN3_8B = ModelConfig(num_layers=36, hidden=4096, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate=12288, vocab=151936)
CPU_TINY = ModelConfig(num_layers=2, hidden=256, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate=512, vocab=1024)
DTYPE = torch.bfloat16
INIT_STD = 0.02            # as a real init (Qwen3's initializer_range): activations stay finite in bf16
MLP_CHUNK = 32768          # tokens per MLP step: bounds its [tokens, 2 * intermediate] activations (1.6 GB)
TARGET_SEQ, TARGET_SPEEDUP = 131072, 2.5   # issue #7: CoSA's TTFT at 128K vs the best dense
GiB = 2**30


# ----------------------------------------------------------------------------- the model

class DecoderLayer(nn.Module):
    """Pre-norm attention (GQA, per-head q/k RMSNorm, RoPE) and SwiGLU MLP; q/k/v and gate/up are
    one matrix each, as serving engines fuse them."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype):
        super().__init__()
        self.config, self.index = config, index
        q_width, kv_width = config.num_qo_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_widths = (q_width, kv_width, kv_width)
        self.input_norm = nn.RMSNorm(config.hidden, config.rms_eps, dtype=dtype)
        self.qkv = nn.Linear(config.hidden, sum(self.qkv_widths), bias=False, dtype=dtype)
        self.q_norm = nn.RMSNorm(config.head_dim, config.rms_eps, dtype=dtype)
        self.k_norm = nn.RMSNorm(config.head_dim, config.rms_eps, dtype=dtype)
        self.o_proj = nn.Linear(q_width, config.hidden, bias=False, dtype=dtype)
        self.post_norm = nn.RMSNorm(config.hidden, config.rms_eps, dtype=dtype)
        self.gate_up = nn.Linear(config.hidden, 2 * config.intermediate, bias=False, dtype=dtype)
        self.down = nn.Linear(config.intermediate, config.hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        c, n = self.config, x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).split(self.qkv_widths, dim=-1)
        q = rope(self.q_norm(q.view(n, c.num_qo_heads, c.head_dim)), positions, c.rope_theta)
        k = rope(self.k_norm(k.view(n, c.num_kv_heads, c.head_dim)), positions, c.rope_theta)
        o = attention(self.index, q, k, v.view(n, c.num_kv_heads, c.head_dim))
        x = x + self.o_proj(o.reshape(n, -1))
        for chunk in x.split(MLP_CHUNK):          # views of x, updated in place
            gate, up = self.gate_up(self.post_norm(chunk)).chunk(2, dim=-1)
            chunk += self.down(F.silu(gate) * up)
        return x


class Decoder(nn.Module):
    """A Qwen3 decoder whose attention is an argument of the forward:
    ``attention(layer, q [n, Hq, d], k [n, Hkv, d], v [n, Hkv, d]) -> o [n, Hq, d]``, causal,
    q and k after RoPE, scale 1/sqrt(d)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = DTYPE):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden, config.rms_eps, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False, dtype=dtype)   # untied, as in Qwen3-8B

    @classmethod
    def random(cls, config: ModelConfig, device: torch.device, seed: int) -> Decoder:
        """Weights ~ N(0, INIT_STD), norms 1; built on the meta device first so that no other init runs."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).requires_grad_(False)
        torch.manual_seed(seed)
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD)
        return model

    def forward(self, tokens: torch.Tensor, attention) -> torch.Tensor:
        """Prefill of one prompt ``tokens [n]``: the last token's logits, float32 ``[vocab]``."""
        x = self.embed(tokens)
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        for layer in self.layers:
            x = layer(x, positions, attention)
        # the last token only: every token's logits would be [n, vocab] (40 GB at 128K)
        return self.lm_head(self.norm(x[-1])).float()


# ----------------------------------------------------------------------------- attention

class Fa4Attention:
    """Dense causal FlashAttention-4 (``flash_attn.cute.flash_attn_func``) on contiguous K/V."""

    name = "fa4 dense"
    note = ""

    def __init__(self, flash_attn_func):
        self.flash_attn_func = flash_attn_func

    def __call__(self, layer, q, k, v):
        return self.flash_attn_func(q[None], k[None], v[None], causal=True)[0][0]


class SdpaAttention:
    """Dense causal ``F.scaled_dot_product_attention``: the cuDNN backend on a GPU, torch's choice on the CPU."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.name = "sdpa cudnn" if cuda else "sdpa"
        self.backend = (lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)) if cuda else contextlib.nullcontext
        self.repeat_kv = False
        self.note = ""

    def __call__(self, layer, q, k, v):
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))       # [1, heads, n, d] views
        with self.backend():
            if not self.repeat_kv:
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                except RuntimeError:     # a cuDNN without GQA: repeat the K/V heads in every call, as a model must
                    self.repeat_kv, self.note = True, "K/V heads repeated in every call: cuDNN refused GQA"
            group = q.shape[1] // k.shape[1]
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                               is_causal=True)
        return o[0].transpose(0, 1)


class CosaAttention:
    """CoSA as a serving engine runs it: each layer writes its K/V into its own paged cache (one
    shuffled page table for all layers), then ``cosa.run``; one plan per prompt length, shared by
    every layer. The caches of all layers stay allocated: that is what a server holds for decoding."""

    def __init__(self, config: ModelConfig, seq: int, page_size: int, budget: float, delta: float,
                 device: torch.device, generator: torch.Generator):
        self.name = f"cosa b={budget:g} d={delta:g}"
        kv_indptr, self.pages, last_page_len = page_table([seq], page_size, device, shuffle=True,
                                                          generator=generator)
        self.plan = cosa.plan(indptr([seq], device), kv_indptr, self.pages, last_page_len, config.num_qo_heads,
                              config.num_kv_heads, config.head_dim, page_size, causal=True, budget=budget,
                              delta=delta, q_data_type=DTYPE)
        self.note = "OSK kernel" if self.plan.uses_kernel else "cosa's torch reference (no OSK kernel)"
        # [layer, page, K or V, row, kv head, d]: each layer's cache one NHD tensor, as in FlashInfer
        self.cache = torch.zeros(config.num_layers, self.pages.shape[0], 2, page_size, config.num_kv_heads,
                                 config.head_dim, dtype=DTYPE, device=device)
        # the plan's statistics hold the latest layer's only; each layer's are copied here, without a sync
        self.computed = self.plan.computed.new_zeros((config.num_layers, *self.plan.computed.shape))
        self.skipped = torch.zeros_like(self.computed)

    def __call__(self, layer, q, k, v):
        cache = self.cache[layer]
        scatter_pages(cache[:, 0], "NHD", self.pages, k)
        scatter_pages(cache[:, 1], "NHD", self.pages, v)
        o = cosa.run(self.plan, q, cache)
        self.computed[layer].copy_(self.plan.computed)
        self.skipped[layer].copy_(self.plan.skipped)
        return o

    @property
    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def layer_stats(self) -> list[cosa.Stats]:
        """Each layer's statistics in the latest forward."""
        latest = self.plan.stats()
        return [dataclasses.replace(latest, computed=c, skipped=s)
                for c, s in zip(self.computed.cpu(), self.skipped.cpu())]


# ----------------------------------------------------------------------------- measuring

def now(device: torch.device):
    """A point in time on the device's clock: a recorded CUDA event (read after a synchronize), or the host's."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(start, end) -> float:
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


@dataclass
class Row:
    seq: int
    attention: str
    ttft_ms: float | None = None          # median over --repeats of the whole prefill forward
    attention_ms: float | None = None     # inside the attention calls, all layers (instrumented pass)
    attention_share: float | None = None  # attention_ms over the instrumented pass's own time
    peak_gib: float | None = None         # torch.cuda.max_memory_allocated, weights included
    kv_cache_gib: float | None = None     # CoSA: the paged cache of all layers (inside peak_gib)
    density1: float | None = None         # CoSA: stage-1 / stage-2 density, mean over layers
    density2: float | None = None
    logits_err: float | None = None       # relative error of the last token's logits vs the dense reference
    speedup: float | None = None          # best dense TTFT over this row's, same length
    note: str = ""
    ttft_ms_all: list[float] = field(default_factory=list)
    attention_ms_per_layer: list[float] = field(default_factory=list)


def measure(model: Decoder, tokens: torch.Tensor, attention, row: Row, warmup: int, repeats: int,
            device: torch.device) -> torch.Tensor:
    """Fills ``row``'s times; returns the logits. Timed passes first, then one pass with marks around
    every attention call (so that the marks cost the timed passes nothing)."""
    for _ in range(warmup):                       # the first call of a kernel compiles it
        model(tokens, attention)
    passes = []
    for _ in range(repeats):
        start = now(device)
        logits = model(tokens, attention)
        passes.append((start, now(device)))
    calls = []

    def instrumented(layer, q, k, v):
        start = now(device)
        o = attention(layer, q, k, v)
        calls.append((start, now(device)))
        return o
    start = now(device)
    model(tokens, instrumented)
    end = now(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if not torch.isfinite(logits).all():
        raise FloatingPointError(f"{attention.name}: the logits are not finite")
    row.ttft_ms_all = [elapsed_ms(*p) for p in passes]
    row.ttft_ms = statistics.median(row.ttft_ms_all)
    row.attention_ms_per_layer = [elapsed_ms(*c) for c in calls]
    row.attention_ms = sum(row.attention_ms_per_layer)
    row.attention_share = row.attention_ms / elapsed_ms(start, end)
    return logits


class Runner:
    """Every (length, attention) row of one invocation; prints each as it lands."""

    def __init__(self, args, config: ModelConfig, device: torch.device, flash_attn_func):
        self.args, self.config, self.device = args, config, device
        self.flash_attn_func = flash_attn_func
        self.model = Decoder.random(config, device, args.seed)
        self.rows: list[Row] = []

    def make_attention(self, name: str, seq: int, generator: torch.Generator):
        if name == "fa4":
            return Fa4Attention(self.flash_attn_func)
        if name == "sdpa":
            return SdpaAttention(self.device)
        return CosaAttention(self.config, seq, self.args.page_size, self.args.budget, self.args.delta,
                             self.device, generator)

    def measure_length(self, seq: int) -> None:
        generator = torch.Generator().manual_seed(self.args.seed + seq)
        tokens = torch.randint(self.config.vocab, (seq,), generator=generator).to(self.device)
        reference = None                         # the logits of the first dense row
        rows = []
        for name in self.args.attention:
            row, logits = self.measure_one(seq, name, tokens, generator)
            if logits is not None and reference is not None:
                row.logits_err = rel_err(logits, reference)
            elif logits is not None and not is_cosa(row):
                reference = logits
                row.note = "; ".join(filter(None, [row.note, "logits reference"]))
            rows.append(row)
            print(format_row(row), flush=True)
        dense = best_dense(rows)
        for row in rows:
            if dense and row.ttft_ms:
                row.speedup = dense.ttft_ms / row.ttft_ms
        self.rows += rows

    def measure_one(self, seq: int, name: str, tokens: torch.Tensor, generator: torch.Generator):
        """The row of one attention at one length, and its logits; a failure becomes a row that says why."""
        cuda = self.device.type == "cuda"
        row = Row(seq, name)
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            attention = self.make_attention(name, seq, generator)
            row.attention = attention.name
            logits = measure(self.model, tokens, attention, row, self.args.warmup, self.args.repeats, self.device)
            row.note = attention.note
            if cuda:
                row.peak_gib = torch.cuda.max_memory_allocated() / GiB
            if isinstance(attention, CosaAttention):
                stats = attention.layer_stats()
                row.kv_cache_gib = attention.cache_bytes / GiB
                row.density1 = statistics.fmean(s.density_stage1 for s in stats)
                row.density2 = statistics.fmean(s.density_stage2 for s in stats)
            return row, logits
        except Exception as error:  # noqa: BLE001 - one failing attention must not end the run
            traceback.print_exc(file=sys.stderr)
            row.note = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:100]}"
            return row, None


def is_cosa(row: Row) -> bool:
    return row.attention.startswith("cosa")


def best_dense(rows: list[Row]) -> Row | None:
    """The fastest measured dense row of ``rows`` (one length): the reference of the speedups."""
    return min((r for r in rows if r.ttft_ms and not is_cosa(r)), key=lambda r: r.ttft_ms, default=None)


# ----------------------------------------------------------------------------- output

TABLE_HEADER = (f"{'seq':>6} {'attention':<20} {'TTFT ms':>9} {'attn ms':>9} {'attn%':>5} {'peak GiB':>8} "
                f"{'KV GiB':>6} {'dens1':>5} {'dens2':>5} {'speedup':>7} {'logit err':>9}  note")


def format_row(row: Row) -> str:
    share = None if row.attention_share is None else 100 * row.attention_share
    return (f"{row.seq:>6} {row.attention:<20} {format_or_dash(row.ttft_ms, '.1f'):>9} {format_or_dash(row.attention_ms, '.1f'):>9} "
            f"{format_or_dash(share, '.0f'):>5} {format_or_dash(row.peak_gib, '.1f'):>8} {format_or_dash(row.kv_cache_gib, '.1f'):>6} "
            f"{format_or_dash(row.density1, '.3f'):>5} {format_or_dash(row.density2, '.3f'):>5} {format_or_dash(row.speedup, '.2f'):>7} "
            f"{format_or_dash(row.logits_err, '.1e'):>9}  {row.note}").rstrip()


def density_bound(dense: Row, sparse: Row) -> float | None:
    """The TTFT speedup ``sparse`` would have if its attention took exactly its stage-2 density
    times ``dense``'s attention time (its blocks at the dense kernel's speed, the proxy and the
    cache writes free) and the rest of the forward were unchanged: what the density allows."""
    if not (dense.ttft_ms and dense.attention_ms and sparse.density2 is not None):
        return None
    return dense.ttft_ms / (dense.ttft_ms - dense.attention_ms * (1.0 - sparse.density2))


def target(rows: list[Row]) -> dict:
    """Issue #7's target: CoSA's TTFT speedup over the best dense attention at 128K, and the
    speedup its measured density would allow (``density_bound``)."""
    at_target = [r for r in rows if r.seq == TARGET_SEQ]
    cosa_row = next((r for r in at_target if is_cosa(r) and r.speedup), None)
    dense = best_dense(at_target)
    speedup = cosa_row.speedup if cosa_row else None
    status = "n/a" if speedup is None else "PASS" if speedup >= TARGET_SPEEDUP else "MISS"
    bound = density_bound(dense, cosa_row) if dense and cosa_row else None
    return {"seq": TARGET_SEQ, "need": TARGET_SPEEDUP, "speedup": speedup, "status": status,
            "density_bound": bound}


def write_json(path: str, runner: Runner, started: float) -> None:
    report = {
        "config": {**vars(runner.args), **provenance(runner.device), "model": dataclasses.asdict(runner.config),
                   "dtype": str(DTYPE), "wall_s": time.time() - started},
        "rows": [dataclasses.asdict(r) for r in runner.rows],
        "target": target(runner.rows),
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


# ----------------------------------------------------------------------------- driver

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+",
                        help="prompt lengths (default 32768 65536 131072; --quick: 4096, on the CPU 512)")
    parser.add_argument("--attention", nargs="+", choices=("fa4", "sdpa", "cosa"),
                        help="in this order; the first dense one is the logits reference "
                             "(default fa4 cosa; on the CPU sdpa cosa)")
    parser.add_argument("--budget", type=float, default=0.25, help="CoSA's stage-1 budget")
    parser.add_argument("--delta", type=float, default=0.05, help="CoSA's stage-2 delta (0: no skipping)")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards per row")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per row, median reported")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 layers at 4K on the GPU; on the CPU a tiny model at 512")
    parser.add_argument("--json", help="write the configuration and every row here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu and not args.quick:
        parser.error("--device cpu runs only the tiny --quick model")
    if cpu and args.attention and "fa4" in args.attention:
        parser.error("fa4 needs a GPU")
    args.attention = args.attention or (["sdpa", "cosa"] if cpu else ["fa4", "cosa"])
    args.seq_lens = args.seq_lens or ([512] if cpu else [4096] if args.quick else [32768, 65536, 131072])
    if args.repeats < 1 or args.warmup < 0:
        parser.error("need --repeats >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_ttft: no CUDA GPU is available; this benchmark needs one (nothing was measured; "
              "--device cpu --quick runs a tiny model on the CPU).")
        return 0
    config = CPU_TINY if device.type == "cpu" else dataclasses.replace(QWEN3_8B, num_layers=2) if args.quick \
        else QWEN3_8B
    flash_attn_func, fa4_version = None, "not asked for"
    if "fa4" in args.attention:
        fa4, _, fa4_version = load_fa4()
        if fa4 is None:
            print(f"flash_attn.cute is unavailable ({fa4_version}): the dense rows use SDPA (cuDNN) instead")
            args.attention = list(dict.fromkeys("sdpa" if a == "fa4" else a for a in args.attention))
        else:
            flash_attn_func = fa4.flash_attn_func
    started = time.time()
    with torch.inference_mode():
        runner = Runner(args, config, device, flash_attn_func)
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters()) / GiB
        print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"flash_attn.cute {fa4_version}, cosa {cosa.__version__}; {config.num_layers} layers, hidden "
              f"{config.hidden}, heads {config.num_qo_heads}/{config.num_kv_heads}, {weights:.1f} GiB of bf16 "
              f"weights; warm-up {args.warmup}, median of {args.repeats}", flush=True)
        print(TABLE_HEADER, flush=True)
        for seq in args.seq_lens:
            runner.measure_length(seq)
            if args.json:
                write_json(args.json, runner, started)     # partial results survive a later failure
    goal = target(runner.rows)
    print(f"\nTTFT of one prompt, batch 1, bf16, CoSA page size {args.page_size}; {time.time() - started:.0f} s"
          + (f"; JSON in {args.json}" if args.json else ""))
    print(TABLE_HEADER)
    print("\n".join(format_row(r) for r in runner.rows))
    print(f"\ntarget: cosa TTFT speedup over the best dense at {TARGET_SEQ} >= {TARGET_SPEEDUP}: "
          f"{format_or_dash(goal['speedup'], '.2f')} {goal['status']} (its stage-2 density allows at most "
          f"{format_or_dash(goal['density_bound'], '.2f')}: attention at the dense kernel's speed per block)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
