"""cosa._C, the remap layer, against a loop-by-loop model of docs/design.md
("Plan tensors"), and its rejection of bad page tables and order masks."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cosa import _C
import oracle

BLOCK = 128
PAGE_SIZES = (16, 32, 64, 128, 256)
TABLE_ARGS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")
ARRAYS = ("qo_lens", "kv_lens", "kv_block_indptr", "block_pages", "qtiles", "tile_order")
KV_L2_BYTES = 16 << 20  # the K and V the tile order lets one group of kv heads keep in L2


# ---------------------------------------------------------------- the model

def model_plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, page_size, num_qo_heads,
               num_kv_heads, head_dim, causal, budget, force_local, force_sink, **_):
    """The plan tables, computed the way docs/design.md states them."""
    qo_indptr, kv_indptr, kv_indices, kv_last_page_len = (
        [int(x) for x in array] for array in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len))
    batch = len(qo_indptr) - 1
    qo_lens, kv_lens = [], []
    for r in range(batch):
        pages = kv_indptr[r + 1] - kv_indptr[r]
        qo_lens.append(qo_indptr[r + 1] - qo_indptr[r])
        kv_lens.append(page_size * (pages - 1) + kv_last_page_len[r] if pages else 0)

    num_blocks = [math.ceil(kv_len / BLOCK) for kv_len in kv_lens]
    kv_block_indptr = [0]
    for n in num_blocks:
        kv_block_indptr.append(kv_block_indptr[-1] + n)

    pages_per_block = max(1, BLOCK // page_size)
    block_pages = []
    for r in range(batch):
        for j in range(num_blocks[r]):
            if page_size <= BLOCK:
                row = []
                for s in range(pages_per_block):
                    wholly_past = j * BLOCK + s * page_size >= kv_lens[r]
                    row.append(-1 if wholly_past else kv_indices[kv_indptr[r] + j * pages_per_block + s])
            else:
                row = [kv_indices[kv_indptr[r] + j * BLOCK // page_size]]
            block_pages.append(row)

    qtiles = []
    for r in range(batch):
        q_len, kv_len = qo_lens[r], kv_lens[r]
        schedule = oracle.tile_schedule(q_len, kv_len, causal, budget, force_local, force_sink)
        for i, (candidates, local, selected) in enumerate(schedule):
            first_row = i * BLOCK
            rows = min(first_row + BLOCK, q_len) - first_row
            qtiles.append([r, i, qo_indptr[r] + first_row, rows, candidates, local[0], local[-1], selected])

    # kv heads in groups whose K and V (2-byte elements) fit KV_L2_BYTES; in each, longest tiles first
    kv_head_bytes = sum(num_blocks) * BLOCK * head_dim * 2 * 2
    kv_heads_per_group = min(max(KV_L2_BYTES // max(kv_head_bytes, 1), 1), num_kv_heads)
    heads_per_group = kv_heads_per_group * (num_qo_heads // num_kv_heads)
    work = [(qtile, head) for qtile in range(len(qtiles)) for head in range(num_qo_heads)]
    tile_order = sorted(work, key=lambda item: (item[1] // heads_per_group, -qtiles[item[0]][7],
                                                item[0], item[1]))

    def table(rows, columns):
        return np.array(rows, dtype=np.int32).reshape(-1, columns)

    return {
        "qo_lens": np.array(qo_lens, dtype=np.int32),
        "kv_lens": np.array(kv_lens, dtype=np.int32),
        "kv_block_indptr": np.array(kv_block_indptr, dtype=np.int32),
        "block_pages": table(block_pages, pages_per_block),
        "qtiles": table(qtiles, 8),
        "tile_order": table(tile_order, 2),
        "k_max": max((row[7] for row in qtiles), default=0),
        "max_request_blocks": max(num_blocks, default=0),
        "pages_per_block": pages_per_block,
        "num_qo_heads": num_qo_heads,
    }


def model_resolve(model, order):
    """Physical pages of every order entry, via the model's own block table."""
    num_qtiles, num_qo_heads, k_max = order.shape
    width = model["block_pages"].shape[1]
    pages = np.full((num_qtiles, num_qo_heads, k_max, width), -1, dtype=np.int32)
    for qtile in range(num_qtiles):
        first_block = model["kv_block_indptr"][model["qtiles"][qtile][0]]
        for head in range(num_qo_heads):
            for k in range(k_max):
                block = order[qtile, head, k]
                if block >= 0:
                    pages[qtile, head, k] = model["block_pages"][first_block + block]
    return pages


# ---------------------------------------------------------------- inputs

# Lengths that often sit on or next to block boundaries.
lengths = st.one_of(st.integers(1, 1100),
                    st.builds(lambda k, d: BLOCK * k + d, st.integers(1, 8), st.sampled_from([-1, 0, 1])))
budgets = st.one_of(st.sampled_from([0.1, 0.25, 1 / 3, 0.5, 1.0]),
                    st.floats(0, 1, exclude_min=True), st.floats(1e-15, 1e-9))


@st.composite
def batches(draw):
    """Ragged batches: requests without keys or without queries, chunked prefill."""
    page_size = draw(st.sampled_from(PAGE_SIZES))
    causal = draw(st.booleans())
    q_lens, kv_lens = [], []
    for _ in range(draw(st.integers(0, 4))):
        kv_len = draw(st.one_of(st.just(0), lengths))
        if kv_len == 0:
            q_len = 0
        elif causal:
            q_len = draw(st.one_of(st.just(0), st.just(kv_len), st.integers(0, kv_len)))
        else:
            q_len = draw(st.one_of(st.just(0), lengths))
        q_lens.append(q_len)
        kv_lens.append(kv_len)

    num_pages = [math.ceil(kv_len / page_size) for kv_len in kv_lens]
    total_pages = sum(num_pages) + draw(st.integers(0, 3))  # pages the batch does not use
    page_ids = draw(st.permutations(range(total_pages)))
    junk = draw(st.lists(st.integers(-5, 10**6), max_size=3))  # past kv_indptr[-1]: ignored
    num_kv_heads = draw(st.integers(1, 3))
    return {
        "qo_indptr": np.cumsum([0] + q_lens).astype(np.int32),
        "kv_indptr": np.cumsum([0] + num_pages).astype(np.int32),
        "kv_indices": np.array(page_ids[:sum(num_pages)] + junk, dtype=np.int32),
        "kv_last_page_len": np.array(
            [kv - page_size * (n - 1) if n else 0 for kv, n in zip(kv_lens, num_pages)], dtype=np.int32),
        "num_pages": total_pages,
        "page_size": page_size,
        "num_qo_heads": num_kv_heads * draw(st.integers(1, 3)),
        "num_kv_heads": num_kv_heads,
        # the large ones put as few as one kv head's K and V in each L2 group of the tile order
        "head_dim": draw(st.sampled_from([64, 128, 2**12, 2**16])),
        "causal": causal,
        "budget": draw(budgets),
        "force_local": draw(st.booleans()),
        "force_sink": draw(st.booleans()),
    }


def build(case):
    scalars = {name: value for name, value in case.items() if name not in TABLE_ARGS}
    return _C.build_plan(*(case[name] for name in TABLE_ARGS), **scalars)


def assert_plans_equal(plan, expected):
    for name in ARRAYS:
        assert plan[name].dtype == np.int32, name
        assert plan[name].shape == expected[name].shape, name
        np.testing.assert_array_equal(plan[name], expected[name], err_msg=name)
    for name in ("k_max", "max_request_blocks", "pages_per_block", "num_qo_heads"):
        assert plan[name] == expected[name], name


# ---------------------------------------------------------------- against the model

@settings(max_examples=300, deadline=None)
@given(batches())
def test_build_plan_matches_model(case):
    assert_plans_equal(build(case), model_plan(**case))


@settings(max_examples=150, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_resolve_order_matches_model(case, rng):
    plan = build(case)
    qtiles = plan["qtiles"].tolist()
    order = np.full((len(qtiles), case["num_qo_heads"], plan["k_max"]), -1, dtype=np.int32)
    for qtile, row in enumerate(qtiles):
        for head in range(case["num_qo_heads"]):
            selected = row[_C.QT_NUM_SELECTED]
            order[qtile, head, :selected] = rng.sample(range(row[_C.QT_NUM_CANDIDATES]), selected)

    pages = _C.resolve_order(plan, order)

    assert pages.dtype == np.int32
    np.testing.assert_array_equal(pages, model_resolve(model_plan(**case), order))


def test_qtile_columns_match_the_design():
    names = ["REQUEST", "INDEX", "ROW_START", "ROWS", "NUM_CANDIDATES", "LOCAL_FIRST", "LOCAL_LAST",
             "NUM_SELECTED"]
    assert [getattr(_C, f"QT_{name}") for name in names] == list(range(8))
    assert _C.QT_COLUMNS == 8 and _C.BLOCK_SIZE == BLOCK and _C.PAGE_SIZES == PAGE_SIZES


def test_budget_epsilon_keeps_exact_products_exact():
    # 0.55 * 100 is 55.00000000000001 in binary; the design selects 55 blocks, not 56.
    case = valid_case(qo_indptr=[0, 128, 128, 128], kv_indptr=[0, 50, 50, 50],
                      kv_indices=list(range(50)), kv_last_page_len=[256, 0, 0], num_pages=50,
                      page_size=256, causal=False, budget=0.55, force_local=False, force_sink=False)
    qtiles = build(case)["qtiles"]
    assert qtiles[0, _C.QT_NUM_CANDIDATES] == 100 and qtiles[0, _C.QT_NUM_SELECTED] == 55


def test_empty_batch():
    plan = _C.build_plan([0], [0], [], [], num_pages=0, page_size=16, num_qo_heads=4, num_kv_heads=2,
                         head_dim=64, causal=True, budget=0.5, force_local=True, force_sink=True)
    assert plan["k_max"] == 0
    assert [plan[name].shape for name in ARRAYS] == [(0,), (0,), (1,), (0, 8), (0, 8), (0, 2)]
    assert plan["max_request_blocks"] == 0
    assert _C.resolve_order(plan, np.zeros((0, 4, 0), np.int32)).shape == (0, 4, 0, 8)


def test_tile_order_groups_kv_heads_to_fit_l2():
    # 4 requests of 512 keys: one kv head's K and V is 2048 keys * head_dim * 4 bytes.
    case = valid_case(qo_indptr=[0, 512, 1024, 1536, 2048], kv_indptr=[0, 4, 8, 12, 16],
                      kv_indices=list(range(16)), kv_last_page_len=[128] * 4, num_pages=16,
                      page_size=128, num_qo_heads=8, num_kv_heads=4)
    for head_dim, heads_per_group in ((64, 8), (1024, 4), (2048, 2), (2**16, 2)):
        heads = build(dict(case, head_dim=head_dim))["tile_order"][:, 1]
        # every query head of a group is scheduled before any head of the next group
        group_of = heads // heads_per_group
        assert (np.diff(group_of) >= 0).all() and len(set(group_of)) == 8 // heads_per_group, head_dim


def test_tables_are_writable_contiguous_arrays():  # what torch.from_numpy wants
    plan = build(valid_case())
    assert all(plan[name].flags.writeable and plan[name].flags.c_contiguous for name in ARRAYS)


@pytest.mark.parametrize("convert", [
    pytest.param(lambda a: [int(x) for x in a], id="list"),
    pytest.param(lambda a: np.asarray(a, dtype=np.int64), id="int64"),
    pytest.param(lambda a: np.asarray(a, dtype=np.uint16), id="uint16"),
    pytest.param(lambda a: np.repeat(np.asarray(a, dtype=np.int32), 2)[::2], id="strided"),
    pytest.param(lambda a: torch.tensor(a, dtype=torch.int32), id="torch"),
])
def test_integer_inputs_of_any_kind_give_the_same_plan(convert):
    case = valid_case()
    converted = dict(case, **{name: convert(case[name]) for name in TABLE_ARGS})
    assert_plans_equal(build(converted), build(case))


# ---------------------------------------------------------------- rejected inputs

def valid_case(**changes):
    """Three requests: 100 rows over 128 keys, 200 rows over 256 keys, nothing."""
    case = {
        "qo_indptr": [0, 100, 300, 300],
        "kv_indptr": [0, 8, 24, 24],
        "kv_indices": list(range(24)),
        "kv_last_page_len": [16, 16, 0],
        "num_pages": 24, "page_size": 16, "num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 64,
        "causal": True, "budget": 0.5,
        "force_local": True, "force_sink": True,
    }
    case.update(changes)
    return {k: np.asarray(v, dtype=np.int32) if isinstance(v, list) else v for k, v in case.items()}


BAD_PLAN_ARGS = {
    "qo_indptr empty": (dict(qo_indptr=[]), "qo_indptr must have B+1 >= 1 entries"),
    "qo_indptr start": (dict(qo_indptr=[1, 100, 300, 300]), "qo_indptr[0] must be 0, got 1"),
    "qo_indptr decreasing": (dict(qo_indptr=[0, 300, 100, 300]),
                             "qo_indptr must be non-decreasing: qo_indptr[1]=300 > qo_indptr[2]=100"),
    "kv_indptr size": (dict(kv_indptr=[0, 8, 24]), "kv_indptr must have B+1 = 4 entries"),
    "kv_indptr start": (dict(kv_indptr=[-1, 8, 24, 24]), "kv_indptr[0] must be 0, got -1"),
    "kv_indptr decreasing": (dict(kv_indptr=[0, 8, 4, 24]),
                             "kv_indptr must be non-decreasing: kv_indptr[1]=8 > kv_indptr[2]=4"),
    "kv_indptr huge": (dict(kv_indptr=[0, 8, 24, 2**31 - 1]), "kv_indices must have at least kv_indptr[3]="),
    "kv_indices short": (dict(kv_indices=list(range(23))), "kv_indices must have at least kv_indptr[3]=24"),
    "kv_indices negative": (dict(kv_indices=[-3] + list(range(1, 24))),
                            "kv_indices[0]=-3 is negative; page ids are >= 0"),
    "kv_indices too large": (dict(kv_indices=list(range(23)) + [24]),
                             "kv_indices[23]=24 is out of range [0, num_pages=24)"),
    "kv_last_page_len size": (dict(kv_last_page_len=[16, 16]), "kv_last_page_len must have B = 3 entries"),
    "kv_last_page_len zero": (dict(kv_last_page_len=[0, 16, 0]), "kv_last_page_len[0]=0 must be in [1, page_size=16]"),
    "kv_last_page_len large": (dict(kv_last_page_len=[16, 17, 0]), "kv_last_page_len[1]=17 must be in [1, page_size=16]"),
    "kv_last_page_len no pages": (dict(kv_last_page_len=[16, 16, 1]),
                                  "kv_last_page_len[2]=1 must be 0 for a request without pages"),
    "causal q_len > kv_len": (dict(qo_indptr=[0, 129, 300, 300]), "qo_indptr: request 0 has q_len=129 > kv_len=128"),
    "q_len without keys": (dict(qo_indptr=[0, 100, 300, 310], causal=False),
                           "qo_indptr: request 2 has q_len=10 but no keys"),
    "page_size 8": (dict(page_size=8), "page_size must be one of 16, 32, 64, 128, 256, got 8"),
    "page_size 512": (dict(page_size=512), "page_size must be one of"),
    "page_size negative": (dict(page_size=-16), "page_size must be one of"),
    "page_size huge": (dict(page_size=2**62), "page_size must be one of"),
    "num_qo_heads zero": (dict(num_qo_heads=0), "num_qo_heads must be in [1, 2147483647], got 0"),
    "num_qo_heads huge": (dict(num_qo_heads=2**40), "num_qo_heads must be in [1, 2147483647]"),
    "num_qo_heads overflow": (dict(num_qo_heads=2**31 - 1),
                              "qo_indptr, num_qo_heads and budget: 3 query tiles x num_qo_heads=2147483647"),
    "num_kv_heads zero": (dict(num_kv_heads=0), "num_kv_heads must be positive and divide num_qo_heads=2, got 0"),
    "num_kv_heads not dividing": (dict(num_qo_heads=6, num_kv_heads=4),
                                  "num_kv_heads must be positive and divide num_qo_heads=6, got 4"),
    "head_dim zero": (dict(head_dim=0), "head_dim must be in [1, 65536], got 0"),
    "head_dim huge": (dict(head_dim=2**17), "head_dim must be in [1, 65536], got 131072"),
    "num_pages negative": (dict(num_pages=-1), "num_pages must be >= 0, got -1"),
    "budget zero": (dict(budget=0.0), "budget must be in (0, 1], got 0"),
    "budget negative": (dict(budget=-0.5), "budget must be in (0, 1], got -0.5"),
    "budget above one": (dict(budget=1.0000001), "budget must be in (0, 1], got 1.0000001"),
    "budget nan": (dict(budget=math.nan), "budget must be in (0, 1], got nan"),
}


@pytest.mark.parametrize("changes, message", BAD_PLAN_ARGS.values(), ids=BAD_PLAN_ARGS.keys())
def test_bad_page_table_is_rejected_naming_the_argument(changes, message):
    with pytest.raises(ValueError) as error:
        build(valid_case(**changes))
    assert str(error.value).startswith(message)


def test_kv_len_beyond_int32_is_rejected():
    pages = 2**31 // 256 + 1  # 256-row pages: kv_len = 2**31 + 256
    with pytest.raises(ValueError, match=r"^kv_indptr: request 0 has 8388609 pages, so kv_len=2147483904 exceeds"):
        _C.build_plan([0, 0], [0, pages], np.zeros(pages, np.int32), [256], num_pages=1,
                      page_size=256, num_qo_heads=1, num_kv_heads=1, head_dim=64, causal=True,
                      budget=1.0, force_local=True, force_sink=True)


BAD_DTYPES = {
    "float indices": ("kv_indices", np.arange(24, dtype=np.float32), TypeError, "integer dtype"),
    "float list": ("qo_indptr", [0.0, 100.0, 300.0, 300.0], TypeError, "integer dtype"),
    "bool": ("kv_last_page_len", np.array([True, True, False]), TypeError, "integer dtype"),
    "string": ("kv_indptr", "0, 8, 24, 24", TypeError, "integer dtype"),
    "None": ("kv_indices", None, TypeError, "integer dtype"),
    "2-D": ("kv_indices", np.arange(24, dtype=np.int32).reshape(4, 6), ValueError, "must be 1-D"),
    "beyond int32": ("kv_indices", np.r_[np.arange(23), 2**40], ValueError,
                     r"\[23\]=1099511627776 does not fit in int32"),
    "uint64 beyond int64": ("kv_indptr", np.array([0, 8, 24, 2**64 - 1], np.uint64), ValueError,
                            r"\[3\]=18446744073709551615 does not fit"),
}


@pytest.mark.parametrize("name, value, error, message", BAD_DTYPES.values(), ids=BAD_DTYPES.keys())
def test_bad_array_is_rejected_naming_the_argument(name, value, error, message):
    case = valid_case()
    case[name] = value
    with pytest.raises(error, match=rf"^{name}\b.*{message}"):
        build(case)


def test_inputs_are_not_modified():
    case = valid_case()
    before = {name: value.copy() for name, value in case.items() if isinstance(value, np.ndarray)}
    build(case)
    for name, value in before.items():
        np.testing.assert_array_equal(case[name], value)


# ---------------------------------------------------------------- bad order masks

def plan_and_order():
    """valid_case's plan and a valid order mask: tile 0 selects 1 of 1 block, tiles 1 and 2
    (request 1) 2 of 2."""
    plan = build(valid_case())
    qtiles = plan["qtiles"]
    order = np.full((len(qtiles), 2, plan["k_max"]), -1, dtype=np.int32)
    for qtile, row in enumerate(qtiles):
        order[qtile, :, :row[_C.QT_NUM_SELECTED]] = np.arange(row[_C.QT_NUM_SELECTED])[::-1]
    return plan, order


def test_plan_and_order_fixture_is_valid():
    plan, order = plan_and_order()
    assert order.shape == (3, 2, 2)  # request 0: one tile; request 1: two
    assert _C.resolve_order(plan, order).shape == (3, 2, 2, 8)


BAD_ORDERS = {
    "out of range": ((0, 1, 0), 1, ValueError, r"^order\[0, 1, 0\]=1 is not a candidate block of query tile 0"),
    "negative": ((1, 0, 1), -1, ValueError, r"^order\[1, 0, 1\]=-1 is not a candidate block"),
    "repeated": ((2, 1, 1), 1, ValueError, r"^order\[2, 1, 1\]=1 repeats a block"),
}


@pytest.mark.parametrize("where, value, error, message", BAD_ORDERS.values(), ids=BAD_ORDERS.keys())
def test_bad_order_entry_is_rejected(where, value, error, message):
    plan, order = plan_and_order()
    order[where] = value
    with pytest.raises(error, match=message):
        _C.resolve_order(plan, order)


def test_padding_must_be_minus_one():
    plan, order = plan_and_order()
    order[0, 0, 1] = 0
    with pytest.raises(ValueError, match=r"^order\[0, 0, 1\]=0 must be -1: query tile 0 selects 1 blocks"):
        _C.resolve_order(plan, order)


@pytest.mark.parametrize("order, error, message", [
    (np.zeros((3, 2, 3), np.int32), ValueError, r"^order must have shape \(num_qtiles, num_qo_heads, k_max\) = \(3, 2, 2\)"),
    (np.zeros(12, np.int32), ValueError, r"^order must be 3-D"),
    (np.zeros((3, 2, 2), np.float64), TypeError, r"^order must have an integer dtype"),
], ids=["shape", "flat", "float"])
def test_order_of_wrong_shape_or_dtype_is_rejected(order, error, message):
    plan, _ = plan_and_order()
    with pytest.raises(error, match=message):
        _C.resolve_order(plan, order)


@pytest.mark.parametrize("column, value, message", [
    (_C.QT_REQUEST, 3, r"^plan: qtiles\[1\] has request 3 outside \[0, 3\)"),
    (_C.QT_NUM_CANDIDATES, 5, r"^plan: qtiles\[1\] has 5 candidates from key block 1"),
    (_C.QT_NUM_SELECTED, 3, r"^plan: qtiles\[1\] selects 3 blocks"),
], ids=["request", "candidates", "selected"])
def test_inconsistent_plan_is_rejected(column, value, message):
    plan, order = plan_and_order()
    plan["qtiles"][1, column] = value
    with pytest.raises(ValueError, match=message):
        _C.resolve_order(plan, order)


@pytest.mark.parametrize("changes, error, message", [
    ({"num_qo_heads": 0}, ValueError, r"^plan: num_qo_heads=0 and pages_per_block=8 must be >= 1 and k_max=2 >= 0"),
    ({"k_max": 2**31}, TypeError, r"^plan.k_max must be an int32 integer"),
    ({"k_max": "2"}, TypeError, r"^plan.k_max must be an int32 integer"),
    ({"kv_block_indptr": np.zeros(0, np.int32)}, ValueError, r"^plan: kv_block_indptr is empty"),
    ({"qtiles": np.zeros((3, 7), np.int32)}, ValueError, r"^plan: qtiles must have 8 columns and block_pages 1..8, "
                                                         r"got shapes \(3, 7\) and \(\d+, 8\)"),
    ({"block_pages": np.zeros((3, 9), np.int32)}, ValueError, r"^plan: qtiles must have 8 columns and block_pages 1..8"),
    ({"qtiles": [[0] * 8, [0] * 7]}, TypeError, r"^plan.qtiles must be an integer array, got list"),
], ids=["heads", "k_max range", "k_max type", "indptr", "qtiles columns", "block_pages columns", "ragged"])
def test_plan_fields_of_the_wrong_kind_are_rejected(changes, error, message):
    plan, order = plan_and_order()
    plan.update(changes)
    if changes.get("num_qo_heads") == 0:
        order = order[:, :0]   # a shape that agrees with the bad head count, so the plan check decides
    with pytest.raises(error, match=message):
        _C.resolve_order(plan, order)


def test_resolve_order_accepts_an_object_with_the_plan_fields():
    plan, order = plan_and_order()

    class Plan:  # like cosa.Plan: tensors as attributes
        pass

    holder = Plan()
    for name in ("qtiles", "block_pages", "kv_block_indptr"):
        setattr(holder, name, torch.from_numpy(plan[name]))
    holder.k_max, holder.num_qo_heads = plan["k_max"], plan["num_qo_heads"]
    np.testing.assert_array_equal(_C.resolve_order(holder, torch.from_numpy(order)),
                                  _C.resolve_order(plan, order))
