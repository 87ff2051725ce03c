// The launchers of the kernels that cute_kernels/aot.py exported into libcosa: cosa_run
// launches through them, and so does Python's run (cosa._C), so that both run the same
// binaries with the same host code.  Only libcosa's own code and cosa._C use this header;
// the launchers check nothing of their tensors (their callers do).
#pragma once

#include <cstdint>

#include "cosa/cosa.h"

namespace cosa::kernels {

// A tensor as the exported kernels take it: its extents (all dynamic, head_dim too) and
// the strides of all but its contiguous last dim.
struct Tensor {
    void* data;
    int32_t shape[4];
    int64_t stride[3];
};

// The arguments of each exported kernel, in its order (cute_kernels/osk.py, kap.py).
struct OskArgs {
    Tensor q, k, v, o, lse, block_pages, kv_block_indptr, qo_lens, kv_lens, qtiles, tile_order,
        order, computed, skipped;
    float sm_scale, log_delta;
    int32_t page_shift, group, causal, num_tiles;
};
struct PoolArgs {
    Tensor k, block_pages, kv_block_indptr, kv_lens, kbar;
    int32_t page_shift;
};
struct RankArgs {
    Tensor q, qbar, kbar, qtiles, kv_block_indptr, order;
    int32_t max_request_blocks, force_local, force_sink;
};

// Launches the configuration's kernel (head_dim 64 or 128) on `stream` (a cudaStream_t) of
// the current device.  Throws std::invalid_argument for another configuration, CudaError
// when loading or launching fails, Unsupported in a libcosa built without the kernels.
COSA_API void launch(cosa_dtype dtype, int32_t head_dim, const OskArgs& args, void* stream);
COSA_API void launch(cosa_dtype dtype, int32_t head_dim, const PoolArgs& args, void* stream);
COSA_API void launch(cosa_dtype dtype, int32_t head_dim, const RankArgs& args, void* stream);

}  // namespace cosa::kernels
