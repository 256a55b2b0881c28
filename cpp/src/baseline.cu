// The unfused baseline's elementwise step: the dense routing gradient G [T, E] in bf16, as a
// framework would materialize it before two library GEMMs. Used by the benchmarks.
#include <cuda_bf16.h>

#include "kernels/routing.cuh"
#include "launch.h"
#include "moe_routing/baseline.h"
#include "validate.h"

namespace moe_routing::kernels {

__global__ void routing_grad_dense_bf16(const int32_t* topk_idx, const float* topk_scores,
                                        const float* grad_topk_weights, __nv_bfloat16* dense,
                                        int64_t tokens, int experts, int top_k, float scale,
                                        bool norm) {
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= tokens) return;
  const auto [e, gl] = load_routing_grad_lane(topk_idx, topk_scores, grad_topk_weights, t, top_k,
                                              scale, norm);
  __nv_bfloat16* row = dense + t * experts;
  for (int i = lane; i < experts; i += 32) {
    float v = 0.0f;
    for (int k = 0; k < top_k; ++k) {  // shuffles outside the branch: all lanes take part
      const int ek = __shfl_sync(0xFFFFFFFFu, e, k);
      const float gk = __shfl_sync(0xFFFFFFFFu, gl, k);
      if (ek == i) v += gk;
    }
    row[i] = __float2bfloat16(v);
  }
}

}  // namespace moe_routing::kernels

namespace moe_routing::baseline {

Status routing_grad_dense_bf16(const RouterConfig& cfg, int64_t tokens, const int32_t* topk_idx,
                               const float* topk_scores, const float* grad_topk_weights,
                               uint16_t* dense, cudaStream_t stream) {
  if (Status s = validate_config(cfg); s != Status::kSuccess) return s;
  if (tokens < 0 || tokens > INT32_MAX) return Status::kInvalidShape;
  if (tokens == 0) return Status::kSuccess;
  if (!topk_idx || !topk_scores || !grad_topk_weights || !dense) return Status::kNullPointer;
  constexpr int kWarps = 8;
  kernels::routing_grad_dense_bf16<<<unsigned(detail::ceil_div(tokens, kWarps)), kWarps * 32, 0,
                                     stream>>>(
      topk_idx, topk_scores, grad_topk_weights, reinterpret_cast<__nv_bfloat16*>(dense), tokens,
      int(cfg.n_routed_experts), int(cfg.num_experts_per_tok), cfg.routed_scaling_factor,
      cfg.norm_topk_prob);
  return detail::last_launch_status();
}

}  // namespace moe_routing::baseline
