"""A key block's ranking key (SPEC stage 1; docs/design.md, "Visiting order"), for both
rankers: ``cosa.proxy.order`` (torch, the definition) and the KAP kernel, which imports no
cosa.

One int64 per (head, query tile, key block): ``priority << PRIORITY_SHIFT | score code <<
BLOCK_BITS | block index``, the score code a signed int32 ordered like the score. Distinct
blocks get distinct keys, so a descending sort is the visiting order with no tie rule of its
own. An int32 ``kv_len`` bounds the block index by 2^24, well inside its bits.
"""

BLOCK_BITS = 28
PRIORITY_SHIFT = BLOCK_BITS + 32

# A block's priority, highest first: the tile's forced local blocks (the first one holding
# its diagonal, then the last), the forced sink block 0, the other candidates, and the blocks
# the tile cannot see. A block forced twice takes the higher priority.
NOT_CANDIDATE, SCORED, SINK, LOCAL_LAST, LOCAL_FIRST = range(5)
