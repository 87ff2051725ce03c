"""cosa: CoSA block-sparse attention for long-context prefill (KAP proxy + OSK kernel).

    plan_ = cosa.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                      num_qo_heads, num_kv_heads, head_dim, page_size)
    o = cosa.run(plan_, q, paged_kv_cache)

See the project's ``SPEC.md`` (beside a developer checkout, not shipped) for what is computed
and ``docs/design.md`` for where.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .api import CoSAPrefillWrapper, Plan, Stats, order_mask, plan, run
from .calibrate import calibrate_delta
from .merge import merge_states

try:
    __version__ = version("cosa")      # defined once, in csrc/include/cosa/cosa.h
except PackageNotFoundError:           # imported from a source tree
    __version__ = "unknown"
__all__ = ["CoSAPrefillWrapper", "Plan", "Stats", "calibrate_delta", "cmake_prefix_path",
           "merge_states", "order_mask", "plan", "run"]


def cmake_prefix_path() -> str:
    """Directory to put on ``CMAKE_PREFIX_PATH`` so that ``find_package(cosa)`` finds libcosa."""
    return str(Path(__file__).resolve().parent)
