// The paged-KV remap layer: validates a batch's page table and builds the plan
// tables of docs/design.md ("Plan tensors"). Host code, run once per batch shape.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cosa/cosa.h"  // COSA_BLOCK_SIZE and the qtile columns, shared with C users

namespace cosa {

// Shortest round-trip form, so that a rejected 1.0000001 does not print as 1 (nor -1e-9 as -0.000000).
inline std::string repr(double value) {
    char buffer[32];
    return std::string(buffer, std::to_chars(buffer, buffer + sizeof buffer, value).ptr);
}

// Throws std::invalid_argument with the parts streamed into one message, which starts with the
// offending argument's name (cosa_last_error's rule for COSA_ERROR_INVALID_ARGUMENT).
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
    std::ostringstream message;
    (message << ... << parts);
    throw std::invalid_argument(message.str());
}

inline constexpr std::array<int32_t, 5> kPageSizes = {16, 32, 64, 128, 256};

// A caller-owned array; `data` may be null only when `size` is 0.
template <class T>
struct Span {
    T* data = nullptr;
    int64_t size = 0;
};

struct PlanArgs {
    Span<const int32_t> qo_indptr;         // [B+1]
    Span<const int32_t> kv_indptr;         // [B+1]
    Span<const int32_t> kv_indices;        // [>= kv_indptr[B]]
    Span<const int32_t> kv_last_page_len;  // [B]
    // 64-bit so that out-of-range values reach validation instead of wrapping.
    int64_t num_pages = 0;
    int64_t page_size = 0;
    int64_t num_qo_heads = 0;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
    bool causal = true;
    double budget = 1.0;
    bool force_local = true;
    bool force_sink = true;
};

// The plan tables, row-major. Sizes derive from the arrays, so they cannot
// disagree with them; build_plan keeps every element count within int32.
struct Plan {
    int32_t num_qo_heads = 0;
    int32_t pages_per_block = 1;
    int32_t k_max = 0;
    std::vector<int32_t> qo_lens;          // [B]
    std::vector<int32_t> kv_lens;          // [B]
    std::vector<int32_t> kv_block_indptr;  // [B+1]
    std::vector<int32_t> block_pages;      // [num_kv_blocks, pages_per_block]
    std::vector<int32_t> qtiles;           // [num_qtiles, COSA_QT_COLUMNS]
    std::vector<int32_t> tile_order;       // [num_tiles, 2]

    int64_t batch_size() const { return static_cast<int64_t>(qo_lens.size()); }
    int64_t num_kv_blocks() const {
        return static_cast<int64_t>(block_pages.size()) / pages_per_block;
    }
    int64_t num_qtiles() const { return static_cast<int64_t>(qtiles.size()) / COSA_QT_COLUMNS; }
    // Key blocks of the longest request.
    int64_t max_request_blocks() const {
        int64_t most = 0;
        for (size_t r = 0; r + 1 < kv_block_indptr.size(); ++r)
            most = std::max<int64_t>(most, kv_block_indptr[r + 1] - kv_block_indptr[r]);
        return most;
    }
    int64_t num_tiles() const { return num_qtiles() * num_qo_heads; }
    // Entries of the order mask [num_qtiles, num_qo_heads, k_max].
    int64_t order_size() const { return num_tiles() * k_max; }
};

// Throws std::invalid_argument, its message starting with the offending
// argument's name, when `args` breaks a rule of cosa.h's cosa_remap_args.
COSA_API Plan build_plan(const PlanArgs& args);

// Writes order's physical pages to out_pages
// [num_qtiles, num_qo_heads, k_max, pages_per_block] (see
// cosa_remap_resolve_order). Reads plan.qtiles, kv_block_indptr, block_pages,
// num_qo_heads, pages_per_block and k_max, and checks first that they are
// consistent, so that a plan assembled by hand (say from Python arrays) cannot
// make it read out of bounds. Throws std::invalid_argument naming `plan`,
// `order` or `out_pages`.
COSA_API void resolve_order(const Plan& plan, Span<const int32_t> order, Span<int32_t> out_pages);

}  // namespace cosa
