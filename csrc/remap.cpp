#include "remap.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

namespace cosa {
namespace {

constexpr int64_t kBlock = COSA_BLOCK_SIZE;
// Plan values are int32 and kernels index plan arrays with int32.
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// Far above any model's; keeps the tile order's byte counts well inside int64.
constexpr int64_t kMaxHeadDim = int64_t{1} << 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <class T>
void check_span(const char* name, Span<T> span) {
    if (span.size < 0) fail(name, " has a negative size: ", span.size);
    if (span.data == nullptr && span.size > 0) fail(name, " is null but has size ", span.size);
}

void check_indptr(const char* name, Span<const int32_t> indptr) {
    if (indptr.data[0] != 0) fail(name, "[0] must be 0, got ", indptr.data[0]);
    for (int64_t i = 0; i + 1 < indptr.size; ++i) {
        if (indptr.data[i] > indptr.data[i + 1]) {
            fail(name, " must be non-decreasing: ", name, "[", i, "]=", indptr.data[i], " > ", name,
                 "[", i + 1, "]=", indptr.data[i + 1]);
        }
    }
}

void check_scalars(const PlanArgs& args) {
    if (std::find(kPageSizes.begin(), kPageSizes.end(), args.page_size) == kPageSizes.end()) {
        fail("page_size must be one of 16, 32, 64, 128, 256, got ", args.page_size);
    }
    if (args.num_qo_heads < 1 || args.num_qo_heads > kInt32Max) {
        fail("num_qo_heads must be in [1, ", kInt32Max, "], got ", args.num_qo_heads);
    }
    if (args.num_kv_heads < 1 || args.num_qo_heads % args.num_kv_heads != 0) {
        fail("num_kv_heads must be positive and divide num_qo_heads=", args.num_qo_heads, ", got ",
             args.num_kv_heads);
    }
    if (args.head_dim < 1 || args.head_dim > kMaxHeadDim) {
        fail("head_dim must be in [1, ", kMaxHeadDim, "], got ", args.head_dim);
    }
    if (args.num_pages < 0) fail("num_pages must be >= 0, got ", args.num_pages);
    if (!(args.budget > 0.0 && args.budget <= 1.0)) {  // also rejects NaN
        fail("budget must be in (0, 1], got ", repr(args.budget));
    }
}

// Checks the page table, leaving the per-request lengths in plan.qo_lens and
// plan.kv_lens.
void check_page_table(const PlanArgs& args, Plan& plan) {
    check_span("qo_indptr", args.qo_indptr);
    check_span("kv_indptr", args.kv_indptr);
    check_span("kv_indices", args.kv_indices);
    check_span("kv_last_page_len", args.kv_last_page_len);
    if (args.qo_indptr.size < 1) fail("qo_indptr must have B+1 >= 1 entries, got 0");
    const int64_t batch = args.qo_indptr.size - 1;
    if (args.kv_indptr.size != batch + 1) {
        fail("kv_indptr must have B+1 = ", batch + 1, " entries like qo_indptr, got ",
             args.kv_indptr.size);
    }
    if (args.kv_last_page_len.size != batch) {
        fail("kv_last_page_len must have B = ", batch, " entries, got ", args.kv_last_page_len.size);
    }
    check_indptr("qo_indptr", args.qo_indptr);
    check_indptr("kv_indptr", args.kv_indptr);

    const int64_t used_pages = args.kv_indptr.data[batch];
    if (args.kv_indices.size < used_pages) {
        fail("kv_indices must have at least kv_indptr[", batch, "]=", used_pages, " entries, got ",
             args.kv_indices.size);
    }
    for (int64_t i = 0; i < used_pages; ++i) {
        const int32_t page = args.kv_indices.data[i];
        // apart: Python's plan checks page ids before it sees the cache (num_pages = 2^31)
        if (page < 0) fail("kv_indices[", i, "]=", page, " is negative; page ids are >= 0");
        if (page >= args.num_pages) {
            fail("kv_indices[", i, "]=", page, " is out of range [0, num_pages=", args.num_pages, ")");
        }
    }

    plan.qo_lens.resize(static_cast<size_t>(batch));
    plan.kv_lens.resize(static_cast<size_t>(batch));
    for (int64_t r = 0; r < batch; ++r) {
        const int64_t pages = int64_t{args.kv_indptr.data[r + 1]} - args.kv_indptr.data[r];
        const int64_t last = args.kv_last_page_len.data[r];
        if (pages > 0 && (last < 1 || last > args.page_size)) {
            fail("kv_last_page_len[", r, "]=", last, " must be in [1, page_size=", args.page_size,
                 "] for a request with ", pages, " pages");
        }
        if (pages == 0 && last != 0) {
            fail("kv_last_page_len[", r, "]=", last, " must be 0 for a request without pages");
        }
        const int64_t kv_len = pages > 0 ? args.page_size * (pages - 1) + last : 0;
        if (kv_len > kInt32Max) {
            fail("kv_indptr: request ", r, " has ", pages, " pages, so kv_len=", kv_len,
                 " exceeds the int32 range");
        }
        const int64_t q_len = int64_t{args.qo_indptr.data[r + 1]} - args.qo_indptr.data[r];
        if (q_len > 0 && kv_len == 0) {
            fail("qo_indptr: request ", r, " has q_len=", q_len,
                 " but no keys (kv_len=0); every query row needs at least one key");
        }
        if (args.causal && q_len > kv_len) {
            fail("qo_indptr: request ", r, " has q_len=", q_len, " > kv_len=", kv_len,
                 ", which causal (bottom-right aligned) attention does not allow");
        }
        plan.qo_lens[static_cast<size_t>(r)] = static_cast<int32_t>(q_len);
        plan.kv_lens[static_cast<size_t>(r)] = static_cast<int32_t>(kv_len);
    }
}

void build_block_table(const PlanArgs& args, Plan& plan) {
    const int64_t batch = plan.batch_size();
    plan.kv_block_indptr.resize(static_cast<size_t>(batch + 1));
    int64_t num_blocks = 0;
    for (int64_t r = 0; r < batch; ++r) {
        num_blocks += ceil_div(plan.kv_lens[static_cast<size_t>(r)], kBlock);
        if (num_blocks * plan.pages_per_block > kInt32Max) {
            fail("kv_indptr: the batch's key blocks need more than ", kInt32Max,
                 " block_pages entries");
        }
        plan.kv_block_indptr[static_cast<size_t>(r + 1)] = static_cast<int32_t>(num_blocks);
    }

    // Slot s of block j starts at token j*128 + s*page_size; with pages larger
    // than a block there is one slot and the kernel starts at row (j*128) % page_size.
    plan.block_pages.reserve(static_cast<size_t>(num_blocks * plan.pages_per_block));
    for (int64_t r = 0; r < batch; ++r) {
        const int32_t* pages = args.kv_indices.data + args.kv_indptr.data[r];
        const int64_t kv_len = plan.kv_lens[static_cast<size_t>(r)];
        for (int64_t j = 0; j < ceil_div(kv_len, kBlock); ++j) {
            for (int64_t s = 0; s < plan.pages_per_block; ++s) {
                const int64_t start = j * kBlock + s * args.page_size;
                plan.block_pages.push_back(start < kv_len ? pages[start / args.page_size] : -1);
            }
        }
    }
}

void build_qtiles(const PlanArgs& args, Plan& plan) {
    for (int64_t r = 0; r < plan.batch_size(); ++r) {
        const int64_t q_len = plan.qo_lens[static_cast<size_t>(r)];
        const int64_t kv_len = plan.kv_lens[static_cast<size_t>(r)];
        // Row t sits at key position offset + t <= kv_len - 1, so a local block
        // is always a candidate. Only without causal masking can q_len exceed
        // kv_len and put the first rows before key 0: clamp those to block 0.
        const int64_t offset = kv_len - q_len;
        auto block_of = [](int64_t position) { return std::max<int64_t>(position, 0) / kBlock; };
        for (int64_t i = 0; i * kBlock < q_len; ++i) {
            const int64_t first_row = i * kBlock;
            const int64_t rows = std::min(kBlock, q_len - first_row);
            const int64_t last_row = first_row + rows - 1;
            const int64_t candidates =
                args.causal ? (offset + last_row) / kBlock + 1 : ceil_div(kv_len, kBlock);
            const int64_t local_first = block_of(offset + first_row);
            const int64_t local_last = block_of(offset + last_row);
            int64_t forced = args.force_local ? local_last - local_first + 1 : 0;
            if (args.force_sink && !(args.force_local && local_first == 0)) ++forced;
            // The epsilon keeps a product that is whole but for rounding
            // (0.55 * 100 = 55.00000000000001) from taking an extra block; the
            // floor of 1 keeps a tiny budget from selecting nothing.
            const auto budgeted = static_cast<int64_t>(
                std::ceil(args.budget * static_cast<double>(candidates) - 1e-9));
            const int64_t selected =
                std::min(candidates, std::max({forced, int64_t{1}, budgeted}));

            int32_t row[COSA_QT_COLUMNS];
            row[COSA_QT_REQUEST] = static_cast<int32_t>(r);
            row[COSA_QT_INDEX] = static_cast<int32_t>(i);
            row[COSA_QT_ROW_START] = static_cast<int32_t>(args.qo_indptr.data[r] + first_row);
            row[COSA_QT_ROWS] = static_cast<int32_t>(rows);
            row[COSA_QT_NUM_CANDIDATES] = static_cast<int32_t>(candidates);
            row[COSA_QT_LOCAL_FIRST] = static_cast<int32_t>(local_first);
            row[COSA_QT_LOCAL_LAST] = static_cast<int32_t>(local_last);
            row[COSA_QT_NUM_SELECTED] = static_cast<int32_t>(selected);
            plan.qtiles.insert(plan.qtiles.end(), row, row + COSA_QT_COLUMNS);
            plan.k_max = std::max(plan.k_max, row[COSA_QT_NUM_SELECTED]);
        }
    }
}

int32_t num_selected(const Plan& plan, int64_t qtile) {
    return plan.qtiles[static_cast<size_t>(qtile * COSA_QT_COLUMNS + COSA_QT_NUM_SELECTED)];
}

// K and V that one group of kv heads may keep in L2: a third of Hopper's 50 MB, which
// is two partitions and also streams Q and O. Measured on an H200 (bench/NOTES.md, session 4):
// 16 MiB groups beat 32 MiB ones by up to 14% at 8K and 16K keys, lose up to 7% at 32K.
constexpr int64_t kKvL2Bytes = int64_t{16} << 20;

// The (qtile, head) work items in launch order. CTAs run the first ~#SMs items
// together and take the next as they finish, so two rules apply. The kv heads
// go in groups whose K and V (2-byte elements, all requests) fit kKvL2Bytes:
// the tiles that run together then read the same keys, mostly from L2, instead
// of all kv heads streaming from memory. Within a group the longest tiles go
// first, so that the long tiles do not all land at the end.
void build_tile_order(Plan& plan, const PlanArgs& args) {
    const int64_t num_tiles = plan.num_tiles();  // < 2^24 qtiles * 2^31 heads
    // The first test bounds num_tiles, so that the product cannot overflow.
    if (2 * num_tiles > kInt32Max || num_tiles * plan.k_max > kInt32Max) {
        fail("qo_indptr, num_qo_heads and budget: ", plan.num_qtiles(), " query tiles x num_qo_heads=",
             plan.num_qo_heads, " with k_max=", plan.k_max,
             " give a tile order or order mask of more than ", kInt32Max, " entries");
    }
    std::vector<int32_t> qtiles_by_length(static_cast<size_t>(plan.num_qtiles()));
    std::iota(qtiles_by_length.begin(), qtiles_by_length.end(), 0);
    // Stable, so equal lengths keep ascending qtile order.
    std::stable_sort(qtiles_by_length.begin(), qtiles_by_length.end(), [&](int32_t a, int32_t b) {
        return num_selected(plan, a) > num_selected(plan, b);
    });
    const int64_t kv_head_bytes = plan.num_kv_blocks() * kBlock * args.head_dim * 2 * 2;  // K, V; 2 bytes
    const int64_t kv_heads_per_group =
        std::clamp<int64_t>(kKvL2Bytes / std::max<int64_t>(kv_head_bytes, 1), 1, args.num_kv_heads);
    const int64_t heads_per_group = kv_heads_per_group * (args.num_qo_heads / args.num_kv_heads);
    plan.tile_order.reserve(static_cast<size_t>(2 * num_tiles));
    for (int64_t first = 0; first < plan.num_qo_heads; first += heads_per_group) {
        const int64_t last = std::min<int64_t>(first + heads_per_group, plan.num_qo_heads);
        for (int32_t qtile : qtiles_by_length) {
            for (int64_t head = first; head < last; ++head) {
                plan.tile_order.push_back(qtile);
                plan.tile_order.push_back(static_cast<int32_t>(head));
            }
        }
    }
}

// Checks what resolve_order reads; returns the largest candidate count.
int64_t check_plan_layout(const Plan& plan) {
    if (plan.num_qo_heads < 1 || plan.pages_per_block < 1 || plan.k_max < 0) {
        fail("plan: num_qo_heads=", plan.num_qo_heads, " and pages_per_block=",
             plan.pages_per_block, " must be >= 1 and k_max=", plan.k_max, " >= 0");
    }
    if (plan.qtiles.size() % COSA_QT_COLUMNS != 0) {
        fail("plan: qtiles has ", plan.qtiles.size(), " entries, not rows of ", COSA_QT_COLUMNS);
    }
    if (plan.block_pages.size() % static_cast<size_t>(plan.pages_per_block) != 0) {
        fail("plan: block_pages has ", plan.block_pages.size(), " entries, not rows of ",
             plan.pages_per_block);
    }
    if (plan.kv_block_indptr.empty()) fail("plan: kv_block_indptr is empty");
    // num_qtiles <= int32 keeps num_tiles * k_max from overflowing int64.
    if (plan.num_qtiles() > kInt32Max ||
        (plan.k_max > 0 && plan.num_tiles() > kInt32Max / plan.k_max)) {
        fail("plan: the order mask would have more than ", kInt32Max, " entries");
    }
    const int64_t batch = static_cast<int64_t>(plan.kv_block_indptr.size()) - 1;
    int64_t max_candidates = 0;
    for (int64_t qt = 0; qt < plan.num_qtiles(); ++qt) {
        const int32_t* row = plan.qtiles.data() + qt * COSA_QT_COLUMNS;
        const int64_t r = row[COSA_QT_REQUEST];
        const int64_t candidates = row[COSA_QT_NUM_CANDIDATES];
        const int64_t selected = row[COSA_QT_NUM_SELECTED];
        if (r < 0 || r >= batch) fail("plan: qtiles[", qt, "] has request ", r, " outside [0, ", batch, ")");
        const int64_t first_block = plan.kv_block_indptr[static_cast<size_t>(r)];
        if (candidates < 0 || first_block < 0 || first_block + candidates > plan.num_kv_blocks()) {
            fail("plan: qtiles[", qt, "] has ", candidates, " candidates from key block ",
                 first_block, ", outside the ", plan.num_kv_blocks(), " rows of block_pages");
        }
        if (selected < 0 || selected > std::min<int64_t>(candidates, plan.k_max)) {
            fail("plan: qtiles[", qt, "] selects ", selected, " blocks, outside [0, min(",
                 candidates, " candidates, k_max=", plan.k_max, ")]");
        }
        max_candidates = std::max(max_candidates, candidates);
    }
    return max_candidates;
}

}  // namespace

Plan build_plan(const PlanArgs& args) {
    check_scalars(args);
    Plan plan;
    plan.num_qo_heads = static_cast<int32_t>(args.num_qo_heads);
    plan.pages_per_block = static_cast<int32_t>(std::max<int64_t>(1, kBlock / args.page_size));
    check_page_table(args, plan);
    build_block_table(args, plan);
    build_qtiles(args, plan);
    build_tile_order(plan, args);
    return plan;
}

void resolve_order(const Plan& plan, Span<const int32_t> order, Span<int32_t> out_pages) {
    const int64_t max_candidates = check_plan_layout(plan);
    check_span("order", order);
    check_span("out_pages", out_pages);
    const int64_t order_size = plan.order_size();
    const int64_t width = plan.pages_per_block;
    if (order.size != order_size) {
        fail("order must have num_qtiles*num_qo_heads*k_max = ", plan.num_qtiles(), "*",
             plan.num_qo_heads, "*", plan.k_max, " = ", order_size, " entries, got ", order.size);
    }
    if (out_pages.size != order_size * width) {
        fail("out_pages must have order's ", order_size, " entries * pages_per_block ", width,
             " = ", order_size * width, " entries, got ", out_pages.size);
    }

    // listed_in[b] is the last order row that listed block b: catches repeats.
    std::vector<int64_t> listed_in(static_cast<size_t>(max_candidates), -1);
    for (int64_t qt = 0; qt < plan.num_qtiles(); ++qt) {
        const int32_t* tile = plan.qtiles.data() + qt * COSA_QT_COLUMNS;
        const int32_t* blocks =
            plan.block_pages.data() + int64_t{plan.kv_block_indptr[static_cast<size_t>(tile[COSA_QT_REQUEST])]} * width;
        for (int64_t head = 0; head < plan.num_qo_heads; ++head) {
            const int64_t row = qt * plan.num_qo_heads + head;
            for (int64_t k = 0; k < plan.k_max; ++k) {
                const int64_t entry = row * plan.k_max + k;
                const int32_t block = order.data[entry];
                int32_t* out = out_pages.data + entry * width;
                if (k >= tile[COSA_QT_NUM_SELECTED]) {
                    if (block != -1) {
                        fail("order[", qt, ", ", head, ", ", k, "]=", block, " must be -1: query tile ",
                             qt, " selects ", tile[COSA_QT_NUM_SELECTED], " blocks");
                    }
                    std::fill(out, out + width, -1);
                    continue;
                }
                if (block < 0 || block >= tile[COSA_QT_NUM_CANDIDATES]) {
                    fail("order[", qt, ", ", head, ", ", k, "]=", block,
                         " is not a candidate block of query tile ", qt, ": must be in [0, ",
                         tile[COSA_QT_NUM_CANDIDATES], ")");
                }
                if (listed_in[static_cast<size_t>(block)] == row) {
                    fail("order[", qt, ", ", head, ", ", k, "]=", block,
                         " repeats a block listed earlier in the same row");
                }
                listed_in[static_cast<size_t>(block)] = row;
                std::copy(blocks + block * width, blocks + (block + 1) * width, out);
            }
        }
    }
}

}  // namespace cosa
