// The unfused baselines' non-GEMM steps, for benchmarks.
//
// Backward: G [T, E] bf16 (dense routing gradient, zero outside the chosen experts), to be
// followed by two library GEMMs (grad_x = G·w, grad_w = Gᵀ·x).
// Forward: the routing of fp32 logits [T, E] (from a library GEMM x·wᵀ) into topk_idx,
// topk_weights, topk_scores [T, K], with the forward's selection semantics.
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::baseline {

Status routing_grad_dense_bf16(const RouterConfig& cfg, int64_t tokens, const int32_t* topk_idx,
                               const float* topk_scores, const float* grad_topk_weights,
                               uint16_t* dense, cudaStream_t stream);

Status route_from_logits(const RouterConfig& cfg, int64_t tokens, const float* logits,
                         const float* bias, int32_t* topk_idx, float* topk_weights,
                         float* topk_scores, cudaStream_t stream);

}  // namespace moe_routing::baseline
