// The C API over remap.hpp: exceptions become a status and a thread-local message.
#include <vector>

#include "c_api.hpp"

namespace cosa {

Plan build_plan(const cosa_remap_args& args) {
    PlanArgs plan_args;
    plan_args.qo_indptr = {args.qo_indptr, args.qo_indptr_size};
    plan_args.kv_indptr = {args.kv_indptr, args.kv_indptr_size};
    plan_args.kv_indices = {args.kv_indices, args.kv_indices_size};
    plan_args.kv_last_page_len = {args.kv_last_page_len, args.kv_last_page_len_size};
    plan_args.num_pages = args.num_pages;
    plan_args.page_size = args.page_size;
    plan_args.num_qo_heads = args.num_qo_heads;
    plan_args.num_kv_heads = args.num_kv_heads;
    plan_args.head_dim = args.head_dim;
    plan_args.causal = args.causal;
    plan_args.budget = args.budget;
    plan_args.force_local = args.force_local;
    plan_args.force_sink = args.force_sink;
    return build_plan(plan_args);
}

}  // namespace cosa

namespace {

using cosa::guarded;
using cosa::require;

const int32_t* data_or_null(const cosa_remap_plan* plan, std::vector<int32_t> cosa::Plan::*array) {
    return plan == nullptr ? nullptr : (plan->plan.*array).data();
}

}  // namespace

extern "C" {

int cosa_version(void) { return COSA_VERSION; }

const char* cosa_last_error(void) { return cosa::last_error().c_str(); }

cosa_status cosa_remap_plan_create(const cosa_remap_args* args, cosa_remap_plan** out) {
    return guarded([&] {
        require(args, "args");
        require(out, "out");
        *out = new cosa_remap_plan{cosa::build_plan(*args)};
    });
}

void cosa_remap_plan_destroy(cosa_remap_plan* plan) { delete plan; }

cosa_status cosa_remap_plan_info(const cosa_remap_plan* plan, cosa_remap_plan_sizes* out) {
    return guarded([&] {
        require(plan, "plan");
        require(out, "out");
        // build_plan keeps every count within int32.
        const cosa::Plan& p = plan->plan;
        out->batch_size = static_cast<int32_t>(p.batch_size());
        out->num_qo_heads = p.num_qo_heads;
        out->num_kv_blocks = static_cast<int32_t>(p.num_kv_blocks());
        out->pages_per_block = p.pages_per_block;
        out->num_qtiles = static_cast<int32_t>(p.num_qtiles());
        out->num_tiles = static_cast<int32_t>(p.num_tiles());
        out->k_max = p.k_max;
    });
}

const int32_t* cosa_remap_plan_qo_lens(const cosa_remap_plan* plan) {
    return data_or_null(plan, &cosa::Plan::qo_lens);
}

const int32_t* cosa_remap_plan_kv_lens(const cosa_remap_plan* plan) {
    return data_or_null(plan, &cosa::Plan::kv_lens);
}

const int32_t* cosa_remap_plan_kv_block_indptr(const cosa_remap_plan* plan) {
    return data_or_null(plan, &cosa::Plan::kv_block_indptr);
}

const int32_t* cosa_remap_plan_block_pages(const cosa_remap_plan* plan) {
    return data_or_null(plan, &cosa::Plan::block_pages);
}

const int32_t* cosa_remap_plan_qtiles(const cosa_remap_plan* plan) {
    return data_or_null(plan, &cosa::Plan::qtiles);
}

const int32_t* cosa_remap_plan_tile_order(const cosa_remap_plan* plan) {
    return data_or_null(plan, &cosa::Plan::tile_order);
}

cosa_status cosa_remap_resolve_order(const cosa_remap_plan* plan, const int32_t* order,
                                     int64_t order_size, int32_t* out_pages,
                                     int64_t out_pages_size) {
    return guarded([&] {
        require(plan, "plan");
        cosa::resolve_order(plan->plan, {order, order_size}, {out_pages, out_pages_size});
    });
}

}  // extern "C"
