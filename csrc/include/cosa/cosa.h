/*
 * cosa: C API of libcosa -- the paged-KV remap layer and, when built with the
 * kernels, CoSA's attention: the KAP proxy and the OSK kernel (the "Attention"
 * section below).
 *
 * Given a batch's page table (FlashInfer's CSR form) the remap layer builds
 * the plan tables that CoSA's kernel reads: per-request lengths, the physical
 * pages of every 128-token key block, one row per 128-row query tile, and the
 * order in which (query tile, head) work items are taken. docs/design.md
 * ("Plan tensors") defines every array exactly.
 *
 * Conventions:
 *  - Functions returning cosa_status never throw or abort; on failure
 *    cosa_last_error() says why (which argument is wrong, for
 *    COSA_ERROR_INVALID_ARGUMENT), and output parameters are left untouched
 *    unless documented otherwise.
 *  - Arrays are int32, row-major, passed as pointer + element count; a
 *    pointer may be NULL only when its count is 0.
 *  - A plan's tables are immutable after creation and may be read from many
 *    threads; cosa_run writes a plan's device scratch only where the caller
 *    passes no buffer of its own (see cosa_run).
 */
#ifndef COSA_COSA_H
#define COSA_COSA_H

#include <float.h>
#include <stdbool.h>
#include <stdint.h>

/* The single source of the version: CMake and the Python package read these. 0.2: the
 * KAP-backed C API's cosa_plan_args gained proxy (its layout changed). */
#define COSA_VERSION_MAJOR 0
#define COSA_VERSION_MINOR 2
#define COSA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, for preprocessor comparisons. */
#define COSA_VERSION (COSA_VERSION_MAJOR * 10000 + COSA_VERSION_MINOR * 100 + COSA_VERSION_PATCH)

#if defined(_WIN32)
#  if defined(COSA_BUILDING_LIBRARY)
#    define COSA_API __declspec(dllexport)
#  else
#    define COSA_API __declspec(dllimport)
#  endif
#else
#  define COSA_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Tokens per logical block, for queries (a query tile) and keys alike. */
enum { COSA_BLOCK_SIZE = 128 };

/* The largest sm_scale: the kernels scale logits by sm_scale * log2(e) in float32, which must be
   finite. */
#define COSA_MAX_SM_SCALE ((double)FLT_MAX / 1.4426950408889634)

/* Columns of the qtiles table (one row per request's 128-row query tile). */
enum cosa_qtile_column {
    COSA_QT_REQUEST = 0,        /* request index */
    COSA_QT_INDEX = 1,          /* tile index within the request */
    COSA_QT_ROW_START = 2,      /* first row of the tile in q (global row) */
    COSA_QT_ROWS = 3,           /* valid rows, 1..128 */
    COSA_QT_NUM_CANDIDATES = 4, /* key blocks the tile may see: 0..n-1 */
    COSA_QT_LOCAL_FIRST = 5,    /* first key block holding the tile's diagonal */
    COSA_QT_LOCAL_LAST = 6,     /* last one (LOCAL_FIRST or LOCAL_FIRST + 1) */
    COSA_QT_NUM_SELECTED = 7,   /* entries of the tile's order rows (stage 1) */
    COSA_QT_COLUMNS = 8
};

typedef enum cosa_status {
    COSA_OK = 0,
    COSA_ERROR_INVALID_ARGUMENT = 1, /* the input breaks a documented rule */
    COSA_ERROR_INTERNAL = 2,         /* out of memory or a bug in cosa */
    COSA_ERROR_UNSUPPORTED = 3,      /* libcosa was built without the kernels */
    COSA_ERROR_CUDA = 4              /* a CUDA call failed; the message names it */
} cosa_status;

/* The version of the loaded library (COSA_VERSION of its build). */
COSA_API int cosa_version(void);

/*
 * Message of the last cosa_status-returning call on this thread: "" after
 * success; after COSA_ERROR_INVALID_ARGUMENT it starts with the offending
 * argument's name, e.g.
 * "kv_indptr must be non-decreasing: kv_indptr[3]=7 > kv_indptr[4]=5";
 * after another error it says what failed (the CUDA call, the missing kernels).
 * Valid until the next such call on the same thread.
 */
COSA_API const char* cosa_last_error(void);

/*
 * A batch of B requests in FlashInfer's paged-KV form.
 *
 * qo_indptr[B+1] and kv_indptr[B+1] start at 0 and never decrease.
 * kv_indices holds at least kv_indptr[B] page ids in [0, num_pages); extra
 * entries are ignored. kv_last_page_len[B] is 1..page_size for a request
 * with pages and 0 for one without; kv_len = page_size * (pages - 1) + last.
 * page_size is 16, 32, 64, 128 or 256; budget (the stage-1 fraction of
 * candidate blocks) is in (0, 1]. A request with query rows needs keys, and
 * with causal (bottom-right aligned) q_len <= kv_len.
 * force_local / force_sink count the diagonal block(s) / block 0 as forced:
 * always selected, whatever the budget. num_kv_heads divides num_qo_heads
 * (query head h reads kv head h / (num_qo_heads / num_kv_heads)); with
 * head_dim (1..65536) it sizes the K and V of one kv head, which the tile order
 * uses to keep the kv heads that run together within L2.
 * The plan's arrays are int32 and indexed by int32, so a request's kv_len,
 * the batch's key blocks times pages_per_block (block_pages), and the tile
 * order and order mask (num_qtiles * num_qo_heads * 2 and * k_max entries)
 * must each stay below 2^31.
 * No field has a default: a zero-initialised struct is non-causal with no
 * block forced, whereas Python's cosa.plan defaults causal, force_local and
 * force_sink to true.
 */
typedef struct cosa_remap_args {
    const int32_t* qo_indptr;
    int64_t qo_indptr_size;
    const int32_t* kv_indptr;
    int64_t kv_indptr_size;
    const int32_t* kv_indices;
    int64_t kv_indices_size;
    const int32_t* kv_last_page_len;
    int64_t kv_last_page_len_size;
    int64_t num_pages;
    int32_t page_size;
    int32_t num_qo_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    bool causal;
    double budget;
    bool force_local;
    bool force_sink;
} cosa_remap_args;

typedef struct cosa_remap_plan cosa_remap_plan;

/* Array sizes of a plan; array shapes are given in the getters below. */
typedef struct cosa_remap_plan_sizes {
    int32_t batch_size;      /* B */
    int32_t num_qo_heads;
    int32_t num_kv_blocks;   /* 128-token key blocks over all requests */
    int32_t pages_per_block; /* max(1, 128 / page_size) */
    int32_t num_qtiles;      /* 128-row query tiles over all requests */
    int32_t num_tiles;       /* num_qtiles * num_qo_heads work items */
    int32_t k_max;           /* largest QT_NUM_SELECTED; 0 without query rows */
} cosa_remap_plan_sizes;

/* Validates args and builds a plan; on success *out owns it (free with destroy). */
COSA_API cosa_status cosa_remap_plan_create(const cosa_remap_args* args, cosa_remap_plan** out);

/* Frees a plan; NULL is a no-op. */
COSA_API void cosa_remap_plan_destroy(cosa_remap_plan* plan);

COSA_API cosa_status cosa_remap_plan_info(const cosa_remap_plan* plan, cosa_remap_plan_sizes* out);

/*
 * The plan's arrays, owned by the plan; NULL when plan is NULL, and possibly
 * NULL when the array is empty.
 *   qo_lens[B], kv_lens[B]
 *   kv_block_indptr[B+1]   key blocks of request r: rows kv_block_indptr[r]..[r+1]-1
 *   block_pages[num_kv_blocks][pages_per_block]  physical page per slot, -1 past kv_len
 *   qtiles[num_qtiles][COSA_QT_COLUMNS]
 *   tile_order[num_tiles][2]  (qtile, head) in launch order: kv heads in groups
 *                             whose K and V fit L2, in each group most selected
 *                             blocks first
 */
COSA_API const int32_t* cosa_remap_plan_qo_lens(const cosa_remap_plan* plan);
COSA_API const int32_t* cosa_remap_plan_kv_lens(const cosa_remap_plan* plan);
COSA_API const int32_t* cosa_remap_plan_kv_block_indptr(const cosa_remap_plan* plan);
COSA_API const int32_t* cosa_remap_plan_block_pages(const cosa_remap_plan* plan);
COSA_API const int32_t* cosa_remap_plan_qtiles(const cosa_remap_plan* plan);
COSA_API const int32_t* cosa_remap_plan_tile_order(const cosa_remap_plan* plan);

/*
 * Resolves an order mask to physical pages, as the kernel does through
 * block_pages. order[num_qtiles][num_qo_heads][k_max] lists, per row, the
 * tile's selected key blocks (request-local indices in [0, QT_NUM_CANDIDATES),
 * each at most once) in its first QT_NUM_SELECTED entries and -1 after them.
 * out_pages[num_qtiles][num_qo_heads][k_max][pages_per_block] receives the
 * entries' block_pages rows, -1 for padding entries. The sizes are element
 * counts and must match exactly. On failure out_pages is unspecified.
 */
COSA_API cosa_status cosa_remap_resolve_order(const cosa_remap_plan* plan, const int32_t* order,
                                              int64_t order_size, int32_t* out_pages,
                                              int64_t out_pages_size);

/* ------------------------------------------------------------------------
 * Attention: both stages on device pointers, no Python needed: the KAP proxy
 * writes the order mask (stage 1), the OSK kernel walks it (stage 2); or the
 * caller passes an order mask of its own (see cosa_run_args.order).
 * Present when libcosa was built with -DCOSA_AOT_KERNELS=ON (the kernels are
 * exported ahead of time and linked in; docs/design.md "Ahead-of-time
 * kernels"); otherwise cosa_plan_create validates its arguments as usual
 * and, where they are valid, returns COSA_ERROR_UNSUPPORTED.
 * Needs an SM90 GPU and the CUDA driver at run time (the CUDA runtime is
 * linked statically).
 * ------------------------------------------------------------------------ */

/* Whether this libcosa carries the kernels. */
COSA_API bool cosa_has_kernels(void);

typedef enum cosa_dtype {
    COSA_DTYPE_BFLOAT16 = 0,
    COSA_DTYPE_FLOAT16 = 1
} cosa_dtype;

/* Who writes the order masks cosa_run walks. */
typedef enum cosa_proxy {
    COSA_PROXY_KAP = 0,   /* KAP, in cosa_run, wherever a run passes a NULL order; the plan
                             holds its scratch (see cosa_plan_create) */
    COSA_PROXY_CALLER = 1 /* the caller: every run passes an order, and the plan holds none
                             of KAP's scratch */
} cosa_proxy;

typedef struct cosa_plan_args {
    cosa_remap_args remap; /* page table, heads and selection, as for cosa_remap_plan_create;
                              remap.head_dim 64 or 128 */
    int32_t dtype;         /* a cosa_dtype: of q, the cache and o (int32_t, not the enum, so
                              that any value a caller stores is one libcosa can reject) */
    double sm_scale;       /* logit scale in (0, COSA_MAX_SM_SCALE]
                              (usually 1/sqrt(head_dim)) */
    double delta;          /* stage-2 skip threshold, finite and >= 0; 0 computes every selected block */
    int32_t proxy;         /* a cosa_proxy: COSA_PROXY_KAP (zero-initialised args) or
                              COSA_PROXY_CALLER */
} cosa_plan_args;

typedef struct cosa_plan cosa_plan;

/*
 * Validates args, builds the remap plan and copies its tables to memory the
 * plan owns on the current CUDA device (a synchronous copy); the plan may
 * then be run on that device only, from any stream. With proxy
 * COSA_PROXY_KAP, where KAP can rank the batch (no request of more than 16384
 * key blocks, 2M tokens), that memory also holds KAP's scratch, whether or not
 * the runs pass an order of their own: the float block means of q and K, and
 * the order mask; for one request of 32 query and 8 kv heads of head_dim 128
 * at budget 0.25: 20 MB and 32 MB at 128K tokens, 0.2 GB and 2.1 GB at 1M
 * (COSA_PROXY_CALLER leaves them out). Any plan needs an order mask
 * (num_qtiles * num_qo_heads * k_max entries, k_max about budget * key
 * blocks) below 2^31 entries: at 32 query heads and budget 0.25, requests of
 * fewer than 2M tokens.
 */
COSA_API cosa_status cosa_plan_create(const cosa_plan_args* args, cosa_plan** out);

/* Frees a plan and its device memory; NULL is a no-op. */
COSA_API void cosa_plan_destroy(cosa_plan* plan);

/* The plan's host tables (sizes, qtiles, ...), owned by the plan. */
COSA_API const cosa_remap_plan* cosa_plan_remap(const cosa_plan* plan);

/*
 * Device pointers of one run; strides are in elements. q and o are
 * [total_q, num_qo_heads, head_dim] with a contiguous last dim: *_strides =
 * {token, head}. The caches are [num_pages, ...] with a contiguous last dim:
 * *_strides = {page, token within the page, head}, so NHD
 * [num_pages, page_size, H, D] is {page_size*H*D, H*D, D} and HND
 * [num_pages, H, page_size, D] is {H*page_size*D, D, page_size*D}; views of
 * one combined [num_pages, 2, ...] cache are fine. Every stride is a multiple
 * of 8 and every q, k, v, o pointer 16-byte aligned (order, lse, computed and
 * skipped 4-byte aligned); no two elements of o may share an address. A
 * cache's last page and head start at most 32 GiB past its first element:
 * (num_pages - 1) * page stride + (H - 1) * head stride, in elements, at
 * most 8 * (2^31 - 2), since the TMA's int32 coordinate counts 16-byte
 * units. What
 * cosa_run writes (o, lse, computed, skipped, the plan's scratch) may not
 * overlap any of it or what it reads (q, k_cache, v_cache, order), as address
 * ranges. With a plan without query rows every pointer may be NULL.
 */
typedef struct cosa_run_args {
    const void* q;
    int64_t q_strides[2];
    const void* k_cache;
    int64_t k_strides[3];
    const void* v_cache;
    int64_t v_strides[3];
    /* NULL: the KAP proxy computes the order mask at the plan's budget into
     * plan-owned scratch, as Python's cosa.run does (needs a COSA_PROXY_KAP
     * plan KAP can rank, see cosa_plan_create). Else the caller's, int32
     * [num_qtiles][num_qo_heads][k_max], contiguous: each tile's key blocks in
     * visiting order, as for cosa_remap_resolve_order (e.g. Python's
     * cosa.order_mask; local blocks first keeps every row's running max finite
     * from the first block). Not checked on device. */
    const int32_t* order;
    void* o;
    int64_t o_strides[2];
    /* Optional (NULL: plan-owned scratch): float [total_q][num_qo_heads]
     * contiguous, ln of each row's softmax denominator, -inf when no key was
     * computed; int32 [num_qtiles][num_qo_heads] contiguous, blocks computed /
     * skipped by stage 2. */
    float* lse;
    int32_t* computed;
    int32_t* skipped;
} cosa_run_args;

/*
 * Enqueues the kernels on stream (a cudaStream_t; NULL is the legacy default
 * stream): KAP's two when order is NULL, then OSK. No host sync, and no
 * allocation but a kernel's load the first time the process launches it
 * (KAP's at the first call with a NULL order); any call, a first one too,
 * may be captured in a CUDA graph (examples/cpp replays one on new data).
 * Runs sharing a plan's scratch (NULL order, lse, computed, skipped) must not
 * overlap. Host-side checks only: bad device pointers are not detected.
 */
COSA_API cosa_status cosa_run(const cosa_plan* plan, const cosa_run_args* args, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* COSA_COSA_H */
