"""Accuracy studies of CoSA on real attention (``pip install cosa[eval]``; ``python -m cosa.eval``).

``metrics`` (mass recall, IoU, errors), ``data`` (SmolLM2 and real text,
offline), ``studies`` (the studies), ``report`` (JSON and the markdown tables
in ``docs/accuracy.md``).
"""
