"""What the kernels read of the plan's layout and limits (csrc/include/cosa/cosa.h, csrc/remap.hpp),
spelled out because the ahead-of-time export imports the kernels before ``cosa._C`` is built.
tests/test_kernel_compile.py compares every name with ``cosa._C``'s."""

BLOCK_SIZE = 128  # tokens per logical block (COSA_BLOCK_SIZE)
MAX_SM_SCALE = 3.4028234663852886e38 / 1.4426950408889634  # float32 max / log2(e) (COSA_MAX_SM_SCALE)
# columns of the qtiles table (COSA_QT_*)
QT_REQUEST, QT_INDEX, QT_ROW_START, QT_ROWS, QT_NUM_CANDIDATES = 0, 1, 2, 3, 4
QT_LOCAL_FIRST, QT_LOCAL_LAST, QT_NUM_SELECTED = 5, 6, 7
QT_COLUMNS = 8
