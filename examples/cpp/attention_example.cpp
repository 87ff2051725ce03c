// CoSA through libcosa's C API, no Python: a paged bf16 cache of two ragged
// requests, both stages (the KAP proxy's order mask, then the kernel), the run
// captured in a CUDA graph and replayed on new q and, at budget 1.0 with delta
// 0, a check against dense causal attention on the CPU.
//   attention_example [OUT [BUDGET DELTA]]
// OUT: also write o as float32 [total_q, Hq, D]; BUDGET, DELTA: 1.0 and 0 by default.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cosa/cosa.h"

namespace {

constexpr int32_t kHq = 4, kHkv = 2, kD = 128, kPageSize = 16;
const std::vector<int32_t> kQoLens = {300, 200}, kKvLens = {300, 456};  // the second is a chunk

uint16_t to_bf16(float x) {  // round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
}
// Deterministic inputs in [-1, 1) (tests/test_aot.py regenerates them in numpy).
float value(int64_t index, int64_t salt) {
    uint32_t x = static_cast<uint32_t>(index * 2654435761u + static_cast<uint64_t>(salt) * 40503u);
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    return static_cast<float>(x % 2048u) / 1024.0f - 1.0f;
}

void check(bool ok, const char* what) {
    if (!ok) {
        std::fprintf(stderr, "%s failed: %s\n", what, cosa_last_error());
        std::exit(1);
    }
}
void cuda(cudaError_t err) {
    if (err != cudaSuccess) {
        std::fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(err));
        std::exit(1);
    }
}
template <class T>
T* upload(const std::vector<T>& host) {
    void* device = nullptr;
    cuda(cudaMalloc(&device, host.size() * sizeof(T)));
    cuda(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(device);
}

}  // namespace

int main(int argc, char** argv) {
    // Page table: each request's pages, handed out in reverse to make the mapping non-trivial.
    const int32_t batch = static_cast<int32_t>(kQoLens.size());
    std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, last_page_len;
    for (int32_t r = 0; r < batch; ++r) {
        qo_indptr.push_back(qo_indptr.back() + kQoLens[r]);
        kv_indptr.push_back(kv_indptr.back() + (kKvLens[r] + kPageSize - 1) / kPageSize);
        last_page_len.push_back(kKvLens[r] - (kv_indptr.back() - kv_indptr[r] - 1) * kPageSize);
    }
    const int32_t num_pages = kv_indptr.back(), total_q = qo_indptr.back();
    std::vector<int32_t> kv_indices(num_pages);
    for (int32_t i = 0; i < num_pages; ++i) kv_indices[i] = num_pages - 1 - i;

    // q [total_q, Hq, D] and an NHD cache [num_pages, 2, page_size, Hkv, D], bf16.
    std::vector<uint16_t> q(static_cast<size_t>(total_q) * kHq * kD);
    std::vector<uint16_t> cache(static_cast<size_t>(num_pages) * 2 * kPageSize * kHkv * kD);
    for (size_t i = 0; i < q.size(); ++i) q[i] = to_bf16(value(static_cast<int64_t>(i), 1));
    for (size_t i = 0; i < cache.size(); ++i) cache[i] = to_bf16(value(static_cast<int64_t>(i), 2));

    const double budget = argc > 3 ? std::atof(argv[2]) : 1.0, delta = argc > 3 ? std::atof(argv[3]) : 0.0;
    cosa_plan_args args{};
    args.remap = {qo_indptr.data(), batch + 1, kv_indptr.data(), batch + 1, kv_indices.data(),
                  num_pages, last_page_len.data(), batch, num_pages, kPageSize, kHq, kHkv, kD,
                  /*causal=*/true, budget, /*force_local=*/true, /*force_sink=*/true};
    args.dtype = COSA_DTYPE_BFLOAT16;
    args.sm_scale = 1.0 / std::sqrt(static_cast<double>(kD));
    args.delta = delta;  // 0: stage 2 off, every selected block is computed
    args.proxy = COSA_PROXY_KAP;  // cosa_run ranks; COSA_PROXY_CALLER: every run passes its order
    cosa_plan* plan = nullptr;
    check(cosa_plan_create(&args, &plan) == COSA_OK, "cosa_plan_create");

    uint16_t* d_q = upload(q);
    uint16_t* d_cache = upload(cache);
    uint16_t* d_o = upload(std::vector<uint16_t>(q.size()));
    const int64_t page = 2LL * kPageSize * kHkv * kD;
    cosa_run_args run{};
    run.q = d_q;
    run.q_strides[0] = kHq * kD;
    run.q_strides[1] = kD;
    run.k_cache = d_cache;
    run.v_cache = d_cache + page / 2;
    for (int64_t* s : {run.k_strides, run.v_strides}) {
        s[0] = page;
        s[1] = kHkv * kD;
        s[2] = kD;
    }
    run.order = nullptr;  // the plan's proxy (KAP) writes the order mask on the device
    run.o = d_o;
    run.o_strides[0] = kHq * kD;
    run.o_strides[1] = kD;
    check(cosa_run(plan, &run, nullptr) == COSA_OK, "cosa_run");
    std::vector<uint16_t> o(q.size());
    cuda(cudaMemcpy(o.data(), d_o, o.size() * 2, cudaMemcpyDeviceToHost));

    std::vector<float> out(o.size());
    std::transform(o.begin(), o.end(), out.begin(), from_bf16);
    if (argc > 1) {
        FILE* f = std::fopen(argv[1], "wb");
        const bool written = f != nullptr && std::fwrite(out.data(), sizeof(float), out.size(), f) == out.size();
        if (f == nullptr || std::fclose(f) != 0 || !written) {
            std::fprintf(stderr, "writing o to %s failed\n", argv[1]);
            return 1;
        }
    }

    // The run captured in a CUDA graph, as a serving engine would, and replayed on new q: it
    // must equal an eager run on that q, bit for bit.
    cudaStream_t stream;
    cuda(cudaStreamCreate(&stream));
    uint16_t* d_o_graph = upload(std::vector<uint16_t>(q.size()));
    run.o = d_o_graph;
    cudaGraph_t graph;
    cudaGraphExec_t replay;
    cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    check(cosa_run(plan, &run, stream) == COSA_OK, "cosa_run (captured)");
    cuda(cudaStreamEndCapture(stream, &graph));
    cuda(cudaGraphInstantiate(&replay, graph, 0));
    std::vector<uint16_t> q_next(q.size()), o_graph(q.size()), o_eager(q.size());
    for (size_t i = 0; i < q.size(); ++i) q_next[i] = to_bf16(value(static_cast<int64_t>(i), 3));
    cuda(cudaMemcpy(d_q, q_next.data(), q_next.size() * 2, cudaMemcpyHostToDevice));
    cuda(cudaGraphLaunch(replay, stream));
    cuda(cudaStreamSynchronize(stream));
    run.o = d_o;
    check(cosa_run(plan, &run, nullptr) == COSA_OK, "cosa_run (new q)");
    cuda(cudaMemcpy(o_graph.data(), d_o_graph, o_graph.size() * 2, cudaMemcpyDeviceToHost));
    cuda(cudaMemcpy(o_eager.data(), d_o, o_eager.size() * 2, cudaMemcpyDeviceToHost));
    if (o_graph != o_eager || o_graph == o) {
        std::fprintf(stderr, "the graph's replay differs from the eager run on new q, or new q changed nothing\n");
        return 1;
    }
    std::printf("graph replay on new q equals the eager run\n");
    cuda(cudaGraphExecDestroy(replay));
    cuda(cudaGraphDestroy(graph));
    cuda(cudaStreamDestroy(stream));

    cosa_plan_destroy(plan);
    for (void* p : {static_cast<void*>(d_q), static_cast<void*>(d_cache), static_cast<void*>(d_o),
                    static_cast<void*>(d_o_graph)})
        cuda(cudaFree(p));
    if (budget != 1.0 || delta != 0.0) {
        std::printf("budget %g, delta %g: o written; only budget 1 with delta 0 has a dense reference\n", budget,
                    delta);
        return 0;
    }

    // Dense causal attention (bottom-right aligned) on the CPU, in double: what budget 1.0
    // computes when stage 2 is off, whatever order the proxy chose.
    double max_err = 0.0;
    for (int32_t r = 0; r < batch; ++r) {
        for (int32_t i = 0; i < kQoLens[r]; ++i) {
            const int32_t row = qo_indptr[r] + i, visible = kKvLens[r] - kQoLens[r] + i + 1;
            for (int32_t h = 0; h < kHq; ++h) {
                const int32_t hk = h / (kHq / kHkv);
                auto key = [&](int32_t pos, int32_t kv) {  // kv 0: K, 1: V
                    const int32_t p = kv_indices[kv_indptr[r] + pos / kPageSize];
                    return &cache[static_cast<size_t>(p) * page + kv * page / 2 +
                                  (static_cast<size_t>(pos % kPageSize) * kHkv + hk) * kD];
                };
                const uint16_t* qrow = &q[(static_cast<size_t>(row) * kHq + h) * kD];
                std::vector<double> logits(visible);
                double m = -INFINITY, sum = 0.0;
                for (int32_t pos = 0; pos < visible; ++pos) {
                    double s = 0.0;
                    for (int32_t d = 0; d < kD; ++d) s += from_bf16(qrow[d]) * from_bf16(key(pos, 0)[d]);
                    logits[pos] = s * args.sm_scale;
                    m = std::max(m, logits[pos]);
                }
                std::vector<double> acc(kD, 0.0);
                for (int32_t pos = 0; pos < visible; ++pos) {
                    const double p = std::exp(logits[pos] - m);
                    sum += p;
                    for (int32_t d = 0; d < kD; ++d) acc[d] += p * from_bf16(key(pos, 1)[d]);
                }
                for (int32_t d = 0; d < kD; ++d) {
                    const size_t at = (static_cast<size_t>(row) * kHq + h) * kD + d;
                    max_err = std::max(max_err, std::fabs(out[at] - acc[d] / sum));
                }
            }
        }
    }
    std::printf("max |o - reference| = %.3g\n", max_err);
    if (max_err > 2e-2) return 1;
    std::printf("all checks passed\n");
    return 0;
}
