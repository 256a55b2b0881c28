// Per-token routing math shared by the forward and backward kernels.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace moe_routing::kernels {

// Order-preserving key of a score: larger value ranks higher, NaN ranks below every
// non-NaN (including -inf), and equal values rank the lower index higher. Key 0 is below
// every candidate and marks "not a candidate".
__device__ __forceinline__ uint64_t rank_key(float v, int idx) {
  uint32_t u = __float_as_uint(v);
  uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  if (v != v) ord = 0;  // NaN
  return (uint64_t(ord) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(idx));
}

__device__ __forceinline__ int key_index(uint64_t key) {
  return int(0xFFFFFFFFu - uint32_t(key & 0xFFFFFFFFu));
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    uint64_t other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Accurate sigmoid in fp32 (no fast-math intrinsics: selection must match the reference).
// 1 / y for y = 1 + e^-x >= 1 is computed as the IEEE division's own fast path does (reciprocal
// estimate, one Newton step): the same bits as 1.0f / y wherever y < 2^126, without the
// division's branch to its slow path. Beyond that the score is 0 (the division would give a
// denormal below 2^-126); y = inf gives 0, NaN stays NaN.
__device__ __forceinline__ float sigmoid(float x) {
  const float y = 1.0f + expf(-x);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  const float e = fmaf(-y, r, 1.0f);
  r = fmaf(r, e, r);
  return y == __int_as_float(0x7f800000) ? 0.0f : r;
}

// Gradient of the routing weights with respect to the logits at the K chosen experts.
//   out_k = c · s_k / (Σ s + 1e-20)   (norm)   or   c · s_k   (no norm)
//   grad_s_j = (c / S) · (g_j − Σ_k g_k s_k / S)   or   c · g_j
//   grad_logit_j = grad_s_j · s_j · (1 − s_j)
// Called by all 32 lanes of a warp; lane k < K holds (s_k, g_k) and gets grad_logit_k.
__device__ __forceinline__ float routing_grad_lane(float s, float g, bool active, float scale,
                                                   bool norm) {
  float grad_s;
  if (norm) {
    float sum_s = warp_sum(active ? s : 0.0f) + 1e-20f;
    float dot = warp_sum(active ? g * s : 0.0f);
    grad_s = (scale / sum_s) * (g - dot / sum_s);
  } else {
    grad_s = scale * g;
  }
  return active ? grad_s * s * (1.0f - s) : 0.0f;
}

// Lane k < K of a warp loads (index, score, grad) of token t and gets its expert and
// grad_logit; other lanes get expert -1 and 0. Called by all 32 lanes.
struct LaneRoutingGrad {
  int expert;
  float grad_logit;
};

__device__ __forceinline__ LaneRoutingGrad load_routing_grad_lane(
    const int32_t* topk_idx, const float* topk_scores, const float* grad_topk_weights, int64_t t,
    int top_k, float scale, bool norm) {
  const int lane = threadIdx.x % 32;
  const bool active = lane < top_k;
  const int64_t o = t * top_k + lane;
  const float s = active ? topk_scores[o] : 0.0f;
  const float g = active ? grad_topk_weights[o] : 0.0f;
  return {active ? topk_idx[o] : -1, routing_grad_lane(s, g, active, scale, norm)};
}

}  // namespace moe_routing::kernels
