// The unfused baselines' non-GEMM steps, for benchmarks.
//
// Backward: G [T, E] bf16 (dense routing gradient, zero outside the chosen experts), to be
// followed by two library GEMMs (grad_x = G·w, grad_w = Gᵀ·x).
// Forward: the routing of fp32 logits [T, E] (from a library GEMM x·wᵀ) into topk_idx,
// topk_weights, topk_scores [T, K], with the forward's selection semantics.
// Copy: bytes moved with no compute, for a case's ceiling (and, written alone, to flush L2).
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::baseline {

Status routing_grad_dense_bf16(const RouterConfig& cfg, int64_t tokens, const int32_t* topk_idx,
                               const float* topk_scores, const float* grad_topk_weights,
                               uint16_t* dense, cudaStream_t stream);

Status route_from_logits(const RouterConfig& cfg, int64_t tokens, const float* logits,
                         const float* bias, int32_t* topk_idx, float* topk_weights,
                         float* topk_scores, cudaStream_t stream);

// 16-byte vector i read from `in` where i < ceil(read_bytes / 16) and written to `out` where
// i < ceil(write_bytes / 16): the vector read, or a nonzero one made of i where none is (so
// both buffers need their byte counts rounded up to 16, and 16-byte alignment). 256 threads
// per CTA, 4 loads in flight per thread; ctas_per_sm 0: one pass (a grid that covers every
// vector), else grid-stride over that many CTAs per SM (at most 32). The streaming flags give
// the loads and the stores the evict-first hint (.cs).
Status copy_bytes(const void* in, void* out, int64_t read_bytes, int64_t write_bytes,
                  int ctas_per_sm, bool streaming_loads, bool streaming_stores,
                  cudaStream_t stream);

}  // namespace moe_routing::baseline
