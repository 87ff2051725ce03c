// The attention C API (cosa_plan_*, cosa_run): the remap plan's tables in device
// memory, launched with the KAP and OSK kernels that cute_kernels/aot.py exported
// ahead of time. Without COSA_AOT_KERNELS only the argument checks are compiled.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "c_api.hpp"
#include "kernels.hpp"

#ifdef COSA_AOT_KERNELS
#include <cuda_runtime.h>

namespace cosa {
void check_cuda(cudaError_t err, const char* what) {
    if (err != cudaSuccess)
        throw CudaError(std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}
}  // namespace cosa

// The exported headers report CUDA errors through this macro: throw, don't print.
#define CUTE_DSL_CUDA_ERROR_CHECK(err) cosa::check_cuda((err), "loading the kernels")
#include "cosa_kap_pool_bf16_d128.h"
#include "cosa_kap_pool_bf16_d64.h"
#include "cosa_kap_pool_fp16_d128.h"
#include "cosa_kap_pool_fp16_d64.h"
#include "cosa_kap_rank_bf16_d128.h"
#include "cosa_kap_rank_bf16_d64.h"
#include "cosa_kap_rank_fp16_d128.h"
#include "cosa_kap_rank_fp16_d64.h"
#include "cosa_osk_bf16_d128.h"
#include "cosa_osk_bf16_d64.h"
#include "cosa_osk_fp16_d128.h"
#include "cosa_osk_fp16_d64.h"
#endif

namespace {

// Key blocks of the longest request the KAP kernels rank (cute_kernels/kap.py's MAX_KEY_BLOCKS).
constexpr int64_t kKapMaxKeyBlocks = 16384;

// Whether cosa_run computes the plan's order mask itself (a NULL order), so that the plan holds
// KAP's scratch: the caller asked for KAP, and KAP ranks every request.
bool kap_ranks(cosa_proxy proxy, const cosa::Plan& plan) {
    return proxy == COSA_PROXY_KAP && plan.max_request_blocks() <= kKapMaxKeyBlocks;
}

}  // namespace

struct cosa_plan {
    cosa_remap_plan remap;
    // What cosa_run needs of cosa_plan_args: its scalars (the caller's arrays may be gone).
    cosa_dtype dtype{};
    int32_t head_dim = 0, page_size = 0, num_kv_heads = 0;
    int64_t num_pages = 0;
    bool causal = true, force_local = true, force_sink = true;
    cosa_proxy proxy = COSA_PROXY_KAP;
    double sm_scale = 0, delta = 0;
    int64_t total_q = 0;
    int device = 0;
    // One device allocation of 4-byte words: the plan tables, then the scratch, each array
    // at a word offset below, 256-byte aligned. The KAP arrays (the float means qbar and
    // kbar, and order) are there only where kap_ranks.
    int32_t* words = nullptr;
    int64_t num_words = 0;
    int64_t qo_lens = 0, kv_lens = 0, kv_block_indptr = 0, block_pages = 0, qtiles = 0,
            tile_order = 0, lse = 0, computed = 0, skipped = 0, qbar = 0, kbar = 0,
            order = 0;

    ~cosa_plan();
};

namespace {

using cosa::fail;
using cosa::guarded;
using cosa::require;

void check_plan_args(const cosa_plan_args& a) {
    if (a.remap.head_dim != 64 && a.remap.head_dim != 128)
        fail("head_dim must be 64 or 128, got ", a.remap.head_dim);
    if (a.dtype != COSA_DTYPE_BFLOAT16 && a.dtype != COSA_DTYPE_FLOAT16)
        fail("dtype must be COSA_DTYPE_BFLOAT16 or COSA_DTYPE_FLOAT16, got ", a.dtype);
    if (!(a.sm_scale > 0 && a.sm_scale <= COSA_MAX_SM_SCALE))
        fail("sm_scale must be in (0, ", cosa::repr(COSA_MAX_SM_SCALE), "] (float32 logits), got ",
             cosa::repr(a.sm_scale));
    if (!(std::isfinite(a.delta) && a.delta >= 0))
        fail("delta must be finite and >= 0, got ", cosa::repr(a.delta));
    if (a.proxy != COSA_PROXY_KAP && a.proxy != COSA_PROXY_CALLER)
        fail("proxy must be COSA_PROXY_KAP or COSA_PROXY_CALLER, got ", a.proxy);
    if (a.remap.num_pages > std::numeric_limits<int32_t>::max())
        fail("num_pages must fit in int32, got ", a.remap.num_pages);
}

void check_aligned(const void* data, std::size_t alignment, const char* name) {
    if (reinterpret_cast<std::uintptr_t>(data) % alignment != 0)
        fail(name, " must be ", alignment, "-byte aligned");
}

// q, k, v and o: the kernel reads 16-byte vectors along a contiguous last dim.
void check_operand(const void* data, const int64_t* strides, int rank, const char* name) {
    require(data, name);
    check_aligned(data, 16, name);
    for (int i = 0; i < rank; ++i)
        if (strides[i] <= 0 || strides[i] % 8 != 0)
            fail(name, " strides must be positive multiples of 8, got stride[", i, "]=", strides[i]);
}

// The OSK kernel's TMA addresses a cache's pages and kv heads together in 16-byte units, by an
// int32 coordinate: the last of them must start within MAX_BOX_UNITS of the first (32 GiB;
// cute_kernels/osk.py, _check_box_reach, the same rule for Python's run).  `strides` in elements
// of 2 bytes, multiples of 8 (check_operand).
void check_box_reach(const int64_t* strides, int64_t pages, int64_t heads, const char* name) {
    constexpr int64_t kMaxBoxUnits = std::numeric_limits<int32_t>::max() - 1;
    const int64_t page_units = strides[0] / 8, head_units = strides[2] / 8;
    const bool far = (pages > 1 && page_units > kMaxBoxUnits / (pages - 1)) ||
                     (heads > 1 && head_units > kMaxBoxUnits / (heads - 1)) ||
                     (pages - 1) * page_units + (heads - 1) * head_units > kMaxBoxUnits;
    if (far)
        fail(name, "'s last page and kv head start more than ", kMaxBoxUnits,
             " 16-byte units past its first, beyond what the kernel's TMA addresses (32 GiB)");
}

// o [tokens, heads, head_dim] is written by many CTAs at once: no two of its elements may share
// an address.  Taken by increasing stride, each dim must step past everything the dims below
// it span (head_dim contiguous elements first).
void check_disjoint(const int64_t* strides, int64_t tokens, int64_t heads, int64_t head_dim, const char* name) {
    struct Dim {
        int64_t extent, stride;
    };
    std::array<Dim, 2> dims{{{tokens, strides[0]}, {heads, strides[1]}}};
    if (dims[0].stride > dims[1].stride) std::swap(dims[0], dims[1]);
    int64_t span = head_dim;  // one past the largest offset the dims so far reach
    for (const Dim& dim : dims) {
        if (dim.extent <= 1) continue;
        if (dim.stride < span)
            fail(name, " strides {", strides[0], ", ", strides[1], "} make its [", tokens, ", ", heads, ", ",
                 head_dim, "] elements overlap");
        span = dim.stride > (std::numeric_limits<int64_t>::max() - span) / (dim.extent - 1)
                   ? std::numeric_limits<int64_t>::max()
                   : span + dim.stride * (dim.extent - 1);
    }
}

// The bytes [first, end) an array's elements lie in, empty for no elements: `extents` with the
// last dim contiguous and `strides` (elements) for the others.  An end past the address space
// saturates, which can only make an overlap more likely to be reported.
struct Span {
    const char* name;
    std::uintptr_t first = 0, end = 0;
};

Span span_of(const char* name, const void* data, int64_t element_size, std::initializer_list<int64_t> extents,
             std::initializer_list<int64_t> strides) {
    constexpr auto kMax = std::numeric_limits<std::uintptr_t>::max();
    const auto first = reinterpret_cast<std::uintptr_t>(data);
    std::uintptr_t last = 0;  // the last element's offset, in elements
    auto stride = strides.begin();
    for (const int64_t extent : extents) {
        if (extent <= 0) return {name};
        const auto step = static_cast<std::uintptr_t>(stride != strides.end() ? *stride++ : 1);
        const auto reach = static_cast<std::uintptr_t>(extent - 1);
        last = (step != 0 && reach > (kMax - last) / step) ? kMax : last + reach * step;
    }
    const auto size = static_cast<std::uintptr_t>(element_size);
    const std::uintptr_t bytes = last >= kMax / size - 1 ? kMax : (last + 1) * size;
    return {name, first, bytes > kMax - first ? kMax : first + bytes};
}

// The kernels write `outputs` while they read `inputs`: no output may meet another or an input
// (cosa.checks.check_apart, the same rule for Python's run).
void check_apart(const std::vector<Span>& outputs, const std::vector<Span>& inputs) {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
        const Span& out = outputs[i];
        auto refuse_if_met = [&](const Span& other) {
            if (out.first < other.end && other.first < out.end)
                fail(out.name, " shares memory with ", other.name,
                     ": an output must not overlap another output or an input");
        };
        for (std::size_t j = i + 1; j < outputs.size(); ++j) refuse_if_met(outputs[j]);
        for (const Span& in : inputs) refuse_if_met(in);
    }
}

// What cosa_run reads and writes, before any of it is touched: q, the cache and o as the
// kernels take them (16-byte vectors), the optional arrays aligned, and no output meeting
// another or an input.
void check_run_operands(const cosa_plan& plan, const cosa_run_args& args) {
    const cosa::Plan& p = plan.remap.plan;
    check_operand(args.q, args.q_strides, 2, "q");
    check_operand(args.k_cache, args.k_strides, 3, "k_cache");
    check_operand(args.v_cache, args.v_strides, 3, "v_cache");
    check_operand(args.o, args.o_strides, 2, "o");
    const int64_t total_q = plan.total_q, hq = p.num_qo_heads, d = plan.head_dim, nq = p.num_qtiles(),
                  k_max = p.k_max, page = plan.page_size, hkv = plan.num_kv_heads, pages = plan.num_pages;
    check_box_reach(args.k_strides, pages, hkv, "k_cache");
    check_box_reach(args.v_strides, pages, hkv, "v_cache");
    check_disjoint(args.o_strides, total_q, hq, d, "o");
    // the optional arrays' 4-byte elements, as the kernels were compiled for them
    for (const auto& [data, name] : {std::pair<const void*, const char*>{args.order, "order"},
                                     {args.lse, "lse"}, {args.computed, "computed"}, {args.skipped, "skipped"}})
        check_aligned(data, 4, name);
    // the plan's memory is written too: its scratch (order, means, and lse and the counts by default)
    std::vector<Span> outputs{span_of("o", args.o, 2, {total_q, hq, d}, {args.o_strides[0], args.o_strides[1]}),
                              span_of("the plan's memory", plan.words, 4, {plan.num_words}, {})};
    if (args.lse != nullptr) outputs.push_back(span_of("lse", args.lse, 4, {total_q, hq}, {hq}));
    if (args.computed != nullptr) outputs.push_back(span_of("computed", args.computed, 4, {nq, hq}, {hq}));
    if (args.skipped != nullptr) outputs.push_back(span_of("skipped", args.skipped, 4, {nq, hq}, {hq}));
    std::vector<Span> inputs{
        span_of("q", args.q, 2, {total_q, hq, d}, {args.q_strides[0], args.q_strides[1]}),
        span_of("k_cache", args.k_cache, 2, {pages, page, hkv, d},
                {args.k_strides[0], args.k_strides[1], args.k_strides[2]}),
        span_of("v_cache", args.v_cache, 2, {pages, page, hkv, d},
                {args.v_strides[0], args.v_strides[1], args.v_strides[2]})};
    if (args.order != nullptr) inputs.push_back(span_of("order", args.order, 4, {nq, hq, k_max}, {hq * k_max, k_max}));
    check_apart(outputs, inputs);
}

}  // namespace

using cosa::kernels::OskArgs;
using cosa::kernels::PoolArgs;
using cosa::kernels::RankArgs;
using cosa::kernels::Tensor;

#ifdef COSA_AOT_KERNELS
namespace {

template <class T, class = void>
struct has_strides : std::false_type {};
template <class T>
struct has_strides<T, std::void_t<decltype(T::dynamic_strides)>> : std::true_type {};

// Fills one of the exported argument structs (they differ only in array lengths).
template <class T>
T descriptor(const Tensor& t) {
    T d{};
    static_assert(std::size(decltype(d.dynamic_shapes){}) <= std::size(decltype(t.shape){}),
                  "an exported kernel takes more extents than Tensor holds");
    d.data = t.data;
    for (std::size_t i = 0; i < std::size(d.dynamic_shapes); ++i) d.dynamic_shapes[i] = t.shape[i];
    if constexpr (has_strides<T>::value)
        for (std::size_t i = 0; i < std::size(d.dynamic_strides); ++i) d.dynamic_strides[i] = t.stride[i];
    return d;
}

// One launcher per exported kernel: its module is loaded on first use, its tensors described.
// A load that fails part way (on one of the devices) frees the library it made; the next call
// tries again.
#define COSA_MODULE(P)                                            \
    static P##_Kernel_Module_t module = [] {                      \
        P##_Kernel_Module_t m{};                                  \
        try {                                                     \
            P##_Kernel_Module_Load(&m);                           \
        } catch (...) {                                           \
            if (m.module != nullptr) cudaLibraryUnload(m.module); \
            throw;                                                \
        }                                                         \
        return m;                                                 \
    }()
#define COSA_TENSOR(P, NAME, FIELD) auto FIELD = descriptor<P##_Tensor_##NAME##_t>(a.FIELD)

#define COSA_OSK_LAUNCHER(P)                                                                   \
    int32_t P##_launch(const OskArgs& a, cudaStream_t stream) {                                \
        COSA_MODULE(P);                                                                        \
        COSA_TENSOR(P, mQ, q);                                                                 \
        COSA_TENSOR(P, mK, k);                                                                 \
        COSA_TENSOR(P, mV, v);                                                                 \
        COSA_TENSOR(P, mO, o);                                                                 \
        COSA_TENSOR(P, mLSE, lse);                                                             \
        COSA_TENSOR(P, mBlockPages, block_pages);                                              \
        COSA_TENSOR(P, mKvBlockIndptr, kv_block_indptr);                                       \
        COSA_TENSOR(P, mQoLens, qo_lens);                                                      \
        COSA_TENSOR(P, mKvLens, kv_lens);                                                      \
        COSA_TENSOR(P, mQtiles, qtiles);                                                       \
        COSA_TENSOR(P, mTileOrder, tile_order);                                                \
        COSA_TENSOR(P, mOrder, order);                                                         \
        COSA_TENSOR(P, mComputed, computed);                                                   \
        COSA_TENSOR(P, mSkipped, skipped);                                                     \
        return cute_dsl_##P##_wrapper(&module, &q, &k, &v, &o, &lse, &block_pages,             \
                                      &kv_block_indptr, &qo_lens, &kv_lens, &qtiles,           \
                                      &tile_order, &order, &computed, &skipped, a.sm_scale,    \
                                      a.log_delta, a.page_shift, a.group, a.causal,            \
                                      a.num_tiles, stream);                                    \
    }

#define COSA_KAP_POOL_LAUNCHER(P)                                                              \
    int32_t P##_launch(const PoolArgs& a, cudaStream_t stream) {                               \
        COSA_MODULE(P);                                                                        \
        COSA_TENSOR(P, mK, k);                                                                 \
        COSA_TENSOR(P, mBlockPages, block_pages);                                              \
        COSA_TENSOR(P, mKvBlockIndptr, kv_block_indptr);                                       \
        COSA_TENSOR(P, mKvLens, kv_lens);                                                      \
        COSA_TENSOR(P, mKbar, kbar);                                                           \
        return cute_dsl_##P##_wrapper(&module, &k, &block_pages, &kv_block_indptr, &kv_lens,   \
                                      &kbar, a.page_shift, stream);                            \
    }

#define COSA_KAP_RANK_LAUNCHER(P)                                                              \
    int32_t P##_launch(const RankArgs& a, cudaStream_t stream) {                               \
        COSA_MODULE(P);                                                                        \
        COSA_TENSOR(P, mQ, q);                                                                 \
        COSA_TENSOR(P, mQbar, qbar);                                                           \
        COSA_TENSOR(P, mKbar, kbar);                                                           \
        COSA_TENSOR(P, mQtiles, qtiles);                                                       \
        COSA_TENSOR(P, mKvBlockIndptr, kv_block_indptr);                                       \
        COSA_TENSOR(P, mOrder, order);                                                         \
        return cute_dsl_##P##_wrapper(&module, &q, &qbar, &kbar, &qtiles, &kv_block_indptr,   \
                                      &order, a.max_request_blocks, a.force_local,             \
                                      a.force_sink, stream);                                   \
    }

COSA_OSK_LAUNCHER(cosa_osk_bf16_d64)
COSA_OSK_LAUNCHER(cosa_osk_bf16_d128)
COSA_OSK_LAUNCHER(cosa_osk_fp16_d64)
COSA_OSK_LAUNCHER(cosa_osk_fp16_d128)
COSA_KAP_POOL_LAUNCHER(cosa_kap_pool_bf16_d64)
COSA_KAP_POOL_LAUNCHER(cosa_kap_pool_bf16_d128)
COSA_KAP_POOL_LAUNCHER(cosa_kap_pool_fp16_d64)
COSA_KAP_POOL_LAUNCHER(cosa_kap_pool_fp16_d128)
COSA_KAP_RANK_LAUNCHER(cosa_kap_rank_bf16_d64)
COSA_KAP_RANK_LAUNCHER(cosa_kap_rank_bf16_d128)
COSA_KAP_RANK_LAUNCHER(cosa_kap_rank_fp16_d64)
COSA_KAP_RANK_LAUNCHER(cosa_kap_rank_fp16_d128)

template <class Args>
using Launcher = int32_t (*)(const Args&, cudaStream_t);

// A kernel's launchers, one per configuration: bf16 d64, bf16 d128, fp16 d64, fp16 d128.
#define COSA_CONFIGS(KERNEL)                                                                   \
    {cosa_##KERNEL##_bf16_d64_launch, cosa_##KERNEL##_bf16_d128_launch,                        \
     cosa_##KERNEL##_fp16_d64_launch, cosa_##KERNEL##_fp16_d128_launch}
const Launcher<OskArgs> kOsk[4] = COSA_CONFIGS(osk);
const Launcher<PoolArgs> kPool[4] = COSA_CONFIGS(kap_pool);
const Launcher<RankArgs> kRank[4] = COSA_CONFIGS(kap_rank);

template <class Args>
void launch_config(const Launcher<Args> (&configs)[4], cosa_dtype dtype, int32_t head_dim, const Args& args,
                   void* stream, const char* what) {
    if ((dtype != COSA_DTYPE_BFLOAT16 && dtype != COSA_DTYPE_FLOAT16) || (head_dim != 64 && head_dim != 128))
        fail(what, ": no kernel for dtype ", static_cast<int>(dtype), " and head_dim ", head_dim);
    const int config = (dtype == COSA_DTYPE_BFLOAT16 ? 0 : 2) + (head_dim == 64 ? 0 : 1);
    const int32_t ret = configs[config](args, static_cast<cudaStream_t>(stream));
    if (ret != 0) throw cosa::CudaError(std::string(what) + " launch failed with code " + std::to_string(ret));
}

}  // namespace

namespace cosa::kernels {
void launch(cosa_dtype dtype, int32_t head_dim, const OskArgs& args, void* stream) {
    launch_config(kOsk, dtype, head_dim, args, stream, "OSK kernel");
}
void launch(cosa_dtype dtype, int32_t head_dim, const PoolArgs& args, void* stream) {
    launch_config(kPool, dtype, head_dim, args, stream, "KAP pool kernel");
}
void launch(cosa_dtype dtype, int32_t head_dim, const RankArgs& args, void* stream) {
    launch_config(kRank, dtype, head_dim, args, stream, "KAP rank kernel");
}
}  // namespace cosa::kernels

cosa_plan::~cosa_plan() { cudaFree(words); }  // the device is the plan's; errors cannot be reported

#else
namespace {
[[noreturn]] void no_kernels() {
    throw cosa::Unsupported("libcosa was built without the kernels (configure with -DCOSA_AOT_KERNELS=ON)");
}
}  // namespace

namespace cosa::kernels {
void launch(cosa_dtype, int32_t, const OskArgs&, void*) { no_kernels(); }
void launch(cosa_dtype, int32_t, const PoolArgs&, void*) { no_kernels(); }
void launch(cosa_dtype, int32_t, const RankArgs&, void*) { no_kernels(); }
}  // namespace cosa::kernels

cosa_plan::~cosa_plan() = default;
#endif

extern "C" {

bool cosa_has_kernels(void) {
#ifdef COSA_AOT_KERNELS
    return true;
#else
    return false;
#endif
}

cosa_status cosa_plan_create(const cosa_plan_args* args, cosa_plan** out) {
    return guarded([&] {
        require(args, "args");
        require(out, "out");
        check_plan_args(*args);
        cosa::Plan host = cosa::build_plan(args->remap);
#ifdef COSA_AOT_KERNELS
        auto plan = std::make_unique<cosa_plan>();
        plan->dtype = static_cast<cosa_dtype>(args->dtype);
        plan->head_dim = args->remap.head_dim;
        plan->page_size = args->remap.page_size;
        plan->num_kv_heads = args->remap.num_kv_heads;
        plan->num_pages = args->remap.num_pages;
        plan->causal = args->remap.causal;
        plan->sm_scale = args->sm_scale;
        plan->delta = args->delta;
        plan->total_q = args->remap.qo_indptr[args->remap.qo_indptr_size - 1];
        plan->force_local = args->remap.force_local;
        plan->force_sink = args->remap.force_sink;
        plan->proxy = static_cast<cosa_proxy>(args->proxy);
        const bool ranks = kap_ranks(plan->proxy, host);
        const int64_t num_qtiles = host.num_qtiles();
        // Head counts are bounded only by int32: with no query rows, KAP's key means can ask for
        // more words than int64 counts, and the offsets would wrap inside the allocation.
        constexpr int64_t kMaxWords = std::numeric_limits<int64_t>::max() / sizeof(int32_t) / 2;
        int64_t at = 0;
        auto carve = [&](int64_t& offset, std::initializer_list<int64_t> extents) {
            int64_t words = 1;
            for (const int64_t extent : extents) {
                if (extent != 0 && words > kMaxWords / extent) words = kMaxWords;
                else words *= extent;
            }
            words = (words + 63) / 64 * 64;  // 256 bytes: aligned for 16-byte vectors and int64
            if (words > kMaxWords - at)
                fail("num_qo_heads=", host.num_qo_heads, " and num_kv_heads=", plan->num_kv_heads, " over ",
                     host.num_kv_blocks(), " key blocks give the plan more than ", kMaxWords, " words");
            offset = at;
            at += words;
        };
        const auto size = [](const auto& table) { return static_cast<int64_t>(table.size()); };
        carve(plan->qo_lens, {size(host.qo_lens)});
        carve(plan->kv_lens, {size(host.kv_lens)});
        carve(plan->kv_block_indptr, {size(host.kv_block_indptr)});
        carve(plan->block_pages, {size(host.block_pages)});
        carve(plan->qtiles, {size(host.qtiles)});
        carve(plan->tile_order, {size(host.tile_order)});
        carve(plan->lse, {plan->total_q, host.num_qo_heads});  // float, 4 bytes like int32
        carve(plan->computed, {host.num_tiles()});
        carve(plan->skipped, {host.num_tiles()});
        if (ranks) {
            carve(plan->qbar, {num_qtiles, host.num_qo_heads, plan->head_dim});
            carve(plan->kbar, {host.num_kv_blocks(), plan->num_kv_heads, plan->head_dim});
            carve(plan->order, {host.order_size()});
        }
        plan->num_words = at;
        cosa::check_cuda(cudaGetDevice(&plan->device), "cudaGetDevice");
        cosa::check_cuda(cudaMalloc(reinterpret_cast<void**>(&plan->words),
                                    static_cast<std::size_t>(std::max<int64_t>(at, 1)) * sizeof(int32_t)),
                         "cudaMalloc");
        auto upload = [&](int64_t offset, const auto& table) {
            cosa::check_cuda(cudaMemcpy(plan->words + offset, table.data(), table.size() * sizeof(table[0]),
                                        cudaMemcpyHostToDevice),
                             "cudaMemcpy");
        };
        upload(plan->qo_lens, host.qo_lens);
        upload(plan->kv_lens, host.kv_lens);
        upload(plan->kv_block_indptr, host.kv_block_indptr);
        upload(plan->block_pages, host.block_pages);
        upload(plan->qtiles, host.qtiles);
        upload(plan->tile_order, host.tile_order);
        plan->remap.plan = std::move(host);
        *out = plan.release();
#else
        no_kernels();
#endif
    });
}

void cosa_plan_destroy(cosa_plan* plan) { delete plan; }

const cosa_remap_plan* cosa_plan_remap(const cosa_plan* plan) { return plan == nullptr ? nullptr : &plan->remap; }

cosa_status cosa_run(const cosa_plan* plan, const cosa_run_args* args, void* stream) {
    return guarded([&] {
        require(plan, "plan");
        require(args, "args");
        const cosa::Plan& p = plan->remap.plan;
        if (p.num_tiles() == 0) return;  // no query rows: nothing to read or write (empty tensors may be NULL)
        check_run_operands(*plan, *args);
        if (args->order == nullptr && plan->proxy == COSA_PROXY_CALLER)
            fail("order must not be NULL: the plan was created with proxy COSA_PROXY_CALLER");
        if (args->order == nullptr && !kap_ranks(plan->proxy, p))
            fail("order must not be NULL: the longest request has ", p.max_request_blocks(),
                 " key blocks, more than the ", kKapMaxKeyBlocks, " that cosa_run's proxy ranks");
#ifdef COSA_AOT_KERNELS
        int device = 0;
        cosa::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
        if (device != plan->device)
            fail("plan was created on device ", plan->device, ", the current device is ", device);
        const int32_t hq = p.num_qo_heads, d = plan->head_dim, page_size = plan->page_size,
                      hkv = plan->num_kv_heads, nq = static_cast<int32_t>(p.num_qtiles()),
                      num_kv_blocks = static_cast<int32_t>(p.num_kv_blocks()),
                      batch = static_cast<int32_t>(p.batch_size());
        const auto total_q = static_cast<int32_t>(plan->total_q), pages = static_cast<int32_t>(plan->num_pages);
        const auto page_shift = static_cast<int32_t>(std::log2(page_size));
        int32_t* w = plan->words;
        const Tensor q{const_cast<void*>(args->q), {total_q, hq, d}, {args->q_strides[0], args->q_strides[1]}};
        const Tensor k{const_cast<void*>(args->k_cache), {pages, page_size, hkv, d},
                       {args->k_strides[0], args->k_strides[1], args->k_strides[2]}};
        const Tensor block_pages{w + plan->block_pages, {num_kv_blocks, p.pages_per_block}, {p.pages_per_block}};
        const Tensor kv_block_indptr{w + plan->kv_block_indptr, {batch + 1}, {}};
        const Tensor kv_lens{w + plan->kv_lens, {batch}, {}};
        const Tensor qtiles{w + plan->qtiles, {nq, COSA_QT_COLUMNS}, {COSA_QT_COLUMNS}};
        const Tensor order{args->order != nullptr ? const_cast<int32_t*>(args->order) : w + plan->order,
                           {nq, hq, p.k_max}, {static_cast<int64_t>(hq) * p.k_max, p.k_max}};
        if (args->order == nullptr) {  // stage 1: KAP's order mask into the plan's scratch
            const Tensor kbar{w + plan->kbar, {num_kv_blocks, hkv, d}, {static_cast<int64_t>(hkv) * d, d}};
            cosa::kernels::launch(plan->dtype, d, PoolArgs{k, block_pages, kv_block_indptr, kv_lens, kbar, page_shift},
                                  stream);
            cosa::kernels::launch(plan->dtype, d,
                                  RankArgs{q, {w + plan->qbar, {nq, hq, d}, {static_cast<int64_t>(hq) * d, d}},
                                           kbar, qtiles, kv_block_indptr, order,
                                           static_cast<int32_t>(p.max_request_blocks()), plan->force_local,
                                           plan->force_sink},
                                  stream);
        }
        OskArgs a{};
        a.q = q;
        a.k = k;
        a.v = {const_cast<void*>(args->v_cache), {pages, page_size, hkv, d},
               {args->v_strides[0], args->v_strides[1], args->v_strides[2]}};
        a.o = {args->o, {total_q, hq, d}, {args->o_strides[0], args->o_strides[1]}};
        a.lse = {args->lse != nullptr ? static_cast<void*>(args->lse) : w + plan->lse, {total_q, hq}, {hq}};
        a.block_pages = block_pages;
        a.kv_block_indptr = kv_block_indptr;
        a.qo_lens = {w + plan->qo_lens, {batch}, {}};
        a.kv_lens = kv_lens;
        a.qtiles = qtiles;
        a.tile_order = {w + plan->tile_order, {static_cast<int32_t>(p.num_tiles()), 2}, {2}};
        a.order = order;
        a.computed = {args->computed != nullptr ? args->computed : w + plan->computed, {nq, hq}, {hq}};
        a.skipped = {args->skipped != nullptr ? args->skipped : w + plan->skipped, {nq, hq}, {hq}};
        a.sm_scale = static_cast<float>(plan->sm_scale);
        a.log_delta = plan->delta > 0 ? static_cast<float>(std::log(plan->delta)) : -std::numeric_limits<float>::infinity();
        a.page_shift = page_shift;
        a.group = hq / hkv;
        a.causal = plan->causal ? 1 : 0;
        a.num_tiles = static_cast<int32_t>(p.num_tiles());
        cosa::kernels::launch(plan->dtype, d, a, stream);
#else
        (void)stream;
        no_kernels();
#endif
    });
}

}  // extern "C"
