"""What the kernels read of the plan's layout (csrc/include/cosa/cosa.h, csrc/remap.hpp),
spelled out because the ahead-of-time export imports the kernels before ``cosa._C`` is built.
tests/test_kernel_compile.py compares every name with ``cosa._C``'s."""

BLOCK_SIZE = 128  # tokens per logical block (COSA_BLOCK_SIZE)
# columns of the qtiles table (COSA_QT_*)
QT_REQUEST, QT_INDEX, QT_ROW_START, QT_ROWS, QT_NUM_CANDIDATES = 0, 1, 2, 3, 4
QT_NUM_SELECTED = 7
QT_COLUMNS = 8
RANK_BLOCK_BITS = 28  # rank_base's block index bits, below the score code (kRankBlockBits)
