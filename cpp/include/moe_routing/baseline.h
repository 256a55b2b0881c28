// The unfused baseline's elementwise step, for benchmarks: G [T, E] bf16 (dense routing
// gradient, zero outside the chosen experts), to be followed by two library GEMMs
// (grad_x = G·w, grad_w = Gᵀ·x).
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::baseline {

Status routing_grad_dense_bf16(const RouterConfig& cfg, int64_t tokens, const int32_t* topk_idx,
                               const float* topk_scores, const float* grad_topk_weights,
                               uint16_t* dense, cudaStream_t stream);

}  // namespace moe_routing::baseline
