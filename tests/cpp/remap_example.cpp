// Builds the plan of a small hand-made page table through the C API of an
// installed libcosa and checks it against values worked out by hand.
#include <cosa/cosa.h>

#include <cstdio>
#include <cstring>
#include <vector>

extern "C" int check_error_path(void);

namespace {

int failures = 0;

#define CHECK(condition)                                                  \
    do {                                                                  \
        if (!(condition)) {                                               \
            std::fprintf(stderr, "FAIL line %d: %s\n", __LINE__, #condition); \
            ++failures;                                                   \
        }                                                                 \
    } while (false)

bool equal(const int32_t* actual, const std::vector<int32_t>& expected) {
    return std::memcmp(actual, expected.data(), expected.size() * sizeof(int32_t)) == 0;
}

}  // namespace

int main() {
    CHECK(cosa_version() == COSA_VERSION);

    // Request 0: 100 query rows over pages 7, 2, 9 with 20 rows in the last:
    // kv_len = 2*64 + 20 = 148, two key blocks. Request 1: no query rows, one
    // full page (4). Pages are 64 rows, so a 128-token block has two slots.
    const std::vector<int32_t> qo_indptr = {0, 100, 100};
    const std::vector<int32_t> kv_indptr = {0, 3, 4};
    const std::vector<int32_t> kv_indices = {7, 2, 9, 4};
    const std::vector<int32_t> kv_last_page_len = {20, 64};
    cosa_remap_args args = {};
    args.qo_indptr = qo_indptr.data();
    args.qo_indptr_size = static_cast<int64_t>(qo_indptr.size());
    args.kv_indptr = kv_indptr.data();
    args.kv_indptr_size = static_cast<int64_t>(kv_indptr.size());
    args.kv_indices = kv_indices.data();
    args.kv_indices_size = static_cast<int64_t>(kv_indices.size());
    args.kv_last_page_len = kv_last_page_len.data();
    args.kv_last_page_len_size = static_cast<int64_t>(kv_last_page_len.size());
    args.num_pages = 10;
    args.page_size = 64;
    args.num_qo_heads = 2;
    args.num_kv_heads = 1;
    args.head_dim = 64;
    args.causal = true;
    args.budget = 0.5;
    args.force_local = true;
    args.force_sink = true;

    cosa_remap_plan* plan = nullptr;
    if (cosa_remap_plan_create(&args, &plan) != COSA_OK) {
        std::fprintf(stderr, "FAIL: cosa_remap_plan_create: %s\n", cosa_last_error());
        return 1;
    }
    cosa_remap_plan_sizes sizes = {};
    CHECK(cosa_remap_plan_info(plan, &sizes) == COSA_OK);
    CHECK(sizes.batch_size == 2 && sizes.num_qo_heads == 2 && sizes.num_kv_blocks == 3);
    CHECK(sizes.pages_per_block == 2 && sizes.num_qtiles == 1 && sizes.num_tiles == 2);
    CHECK(sizes.k_max == 2);

    CHECK(equal(cosa_remap_plan_qo_lens(plan), {100, 0}));
    CHECK(equal(cosa_remap_plan_kv_lens(plan), {148, 64}));
    CHECK(equal(cosa_remap_plan_kv_block_indptr(plan), {0, 2, 3}));
    CHECK(equal(cosa_remap_plan_block_pages(plan), {7, 2, 9, -1, 4, -1}));
    // Rows 0..99 sit at key positions 48..147: blocks 0 and 1 are candidates,
    // both local, both forced.
    const int32_t* qtile = cosa_remap_plan_qtiles(plan);
    CHECK(qtile[COSA_QT_ROWS] == 100 && qtile[COSA_QT_NUM_CANDIDATES] == 2);
    CHECK(qtile[COSA_QT_LOCAL_FIRST] == 0 && qtile[COSA_QT_LOCAL_LAST] == 1);
    CHECK(qtile[COSA_QT_NUM_SELECTED] == 2);
    CHECK(equal(cosa_remap_plan_tile_order(plan), {0, 0, 0, 1}));

    const std::vector<int32_t> order = {1, 0, 0, 1};  // [qtile 0][head 0..1][k 0..1]
    std::vector<int32_t> pages(order.size() * 2);
    CHECK(cosa_remap_resolve_order(plan, order.data(), static_cast<int64_t>(order.size()),
                                   pages.data(), static_cast<int64_t>(pages.size())) == COSA_OK);
    CHECK(pages == std::vector<int32_t>({9, -1, 7, 2, 7, 2, 9, -1}));

    const std::vector<int32_t> repeated = {1, 1, 0, 1};
    CHECK(cosa_remap_resolve_order(plan, repeated.data(), static_cast<int64_t>(repeated.size()),
                                   pages.data(), static_cast<int64_t>(pages.size())) ==
          COSA_ERROR_INVALID_ARGUMENT);
    CHECK(std::strncmp(cosa_last_error(), "order", 5) == 0);

    cosa_remap_plan_destroy(plan);

    // A request of 2^23 tokens (2^16 query tiles by 2^16 key blocks) plans: the remap plan's
    // tables grow with the request, not with its square.
    const int32_t long_tokens = 1 << 23, long_page = 256, long_pages = long_tokens / long_page;
    std::vector<int32_t> long_indices(static_cast<size_t>(long_pages));
    for (int32_t i = 0; i < long_pages; ++i) long_indices[static_cast<size_t>(i)] = i;
    const std::vector<int32_t> long_qo = {0, long_tokens}, long_kv = {0, long_pages}, long_last = {long_page};
    cosa_remap_args long_args = args;
    long_args.qo_indptr = long_qo.data();
    long_args.qo_indptr_size = 2;
    long_args.kv_indptr = long_kv.data();
    long_args.kv_indptr_size = 2;
    long_args.kv_indices = long_indices.data();
    long_args.kv_indices_size = long_pages;
    long_args.kv_last_page_len = long_last.data();
    long_args.kv_last_page_len_size = 1;
    long_args.num_pages = long_pages;
    long_args.page_size = long_page;
    long_args.num_qo_heads = 1;
    long_args.budget = 1e-9;
    cosa_remap_plan* long_plan = nullptr;
    CHECK(cosa_remap_plan_create(&long_args, &long_plan) == COSA_OK);
    CHECK(cosa_remap_plan_info(long_plan, &sizes) == COSA_OK && sizes.num_qtiles == 1 << 16);
    cosa_remap_plan_destroy(long_plan);

    failures += check_error_path();
    if (failures == 0) std::printf("remap_example: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
