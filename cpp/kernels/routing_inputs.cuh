// The backward's routing inputs in the dtypes the caller holds them in (router.h: BackwardArgs),
// read in place by every backward kernel: no conversion kernel runs before them.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/routing.cuh"

namespace moe_routing::kernels {

struct RoutingInputs {
  const void* idx = nullptr;     // [T, K] int32 or int64
  const void* scores = nullptr;  // [T, scores_stride] f32 or bf16
  const void* grad = nullptr;    // [T, K] grad_topk_weights, f32 or bf16
  // Elements per token of `scores`: K (the chosen experts' scores, slot by slot) or E
  // (scores_all: every expert's, read at the chosen ones).
  int scores_stride = 0;
  bool idx_i64 = false;
  bool scores_all = false;
  bool scores_bf16 = false;
  bool grad_bf16 = false;
  // K = 8 and a 16-byte aligned base: rows loadable as 16-byte vectors (the fused kernels'
  // RowFormat::kTorch).
  bool idx_rows16 = false;
  bool grad_rows16 = false;
};

// PyTorch's K = 8 inputs (int64 indices, the bf16 scores of all experts, bf16 gradients) in rows
// of 16 bytes: what the fused kernels of any K read as RowFormat::kTorch, packed into compact
// rows once per launch. The host asks it too (its plan, the compact rows' workspace).
__host__ __device__ __forceinline__ bool torch_rows(const RoutingInputs& in, int top_k) {
  return top_k == 8 && in.idx_i64 && in.scores_all && in.scores_bf16 && in.grad_bf16 &&
         in.idx_rows16 && in.grad_rows16;
}

// Whether the any-K kernel of a slice width compacts the rows that are not torch_rows (another
// K, other dtypes) as it compacts PyTorch's: the 64-column kernels from 128 experts (backward
// v29). The kernels' Config::kCompactAnyRows, and the host's plan (backward v39: the
// 128-column kernels load those rows unit by unit).
__host__ __device__ constexpr bool compacts_any_rows(int experts, int tile_h) {
  return tile_h == 64 && experts >= 128;
}

// An int64 index outside [0, 2^31) becomes -1: out of [0, E), so it contributes nothing.
__device__ __forceinline__ int narrow_index(int64_t v) {
  return uint64_t(v) <= 0x7fffffffull ? int(v) : -1;
}

__device__ __forceinline__ int load_index(const RoutingInputs& in, int64_t o) {
  if (in.idx_i64) return narrow_index(__ldg(static_cast<const long long*>(in.idx) + o));
  return __ldg(static_cast<const int*>(in.idx) + o);
}

__device__ __forceinline__ float load_real(const void* p, bool bf16, int64_t o) {
  if (bf16) return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(p) + o));
  return __ldg(static_cast<const float*>(p) + o);
}

// The score of token t's slot at offset o (t·K + k) whose expert is e. Of all experts' scores,
// an expert outside [0, E) has none: 0.
__device__ __forceinline__ float load_score(const RoutingInputs& in, int64_t t, int64_t o,
                                            int e) {
  if (!in.scores_all) return load_real(in.scores, in.scores_bf16, o);
  return unsigned(e) < unsigned(in.scores_stride)
             ? load_real(in.scores, in.scores_bf16, t * in.scores_stride + e)
             : 0.0f;
}

__device__ __forceinline__ float bf16_round(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// Precision::kTorchBf16: the routing gradient of one slot as eager bf16 PyTorch computes it,
// every elementwise step rounded to bf16, in the composition's order (README: numerics):
//   S = bf16(bf16(Σ s) + 1e-20)                       the forward's normalizer
//   g' = bf16(g · scale)                              scaling
//   dot = bf16(Σ_k bf16(g'_k · bf16(s_k / S)))        the normalization's products and sum
//   q = bf16(bf16(g' − dot) / S)  (norm)  or  g'      the difference and the quotient
//   G = bf16(bf16(q · s) · bf16(1 − s))               the sigmoid's gradient
// s already bf16. These helpers are the steps; callers sum in slot order (k = 0, 1, ...).
__device__ __forceinline__ float torch_normalizer(float sum_s) {
  return bf16_round(bf16_round(sum_s) + 1e-20f);
}
__device__ __forceinline__ float torch_scaled(float g, float scale) {
  return bf16_round(g * scale);
}
__device__ __forceinline__ float torch_product(float g_scaled, float s, float S) {
  return bf16_round(g_scaled * bf16_round(s / S));
}
__device__ __forceinline__ float torch_logit_grad(float g_scaled, float dot, float s, float S,
                                                  bool norm) {
  const float q = norm ? bf16_round(bf16_round(g_scaled - bf16_round(dot)) / S) : g_scaled;
  return bf16_round(bf16_round(q * s) * bf16_round(1.0f - s));
}

// load_routing_grad_lane (routing.cuh) of inputs in any of their dtypes; `torch`:
// Precision::kTorchBf16's rounding. Called by all 32 lanes.
__device__ __forceinline__ LaneRoutingGrad load_routing_grad_lane(const RoutingInputs& in,
                                                                  int64_t t, int top_k,
                                                                  float scale, bool norm,
                                                                  bool torch) {
  const int lane = threadIdx.x % 32;
  const bool active = lane < top_k;
  const int64_t o = t * top_k + lane;
  const int e = active ? load_index(in, o) : -1;
  const float s = active ? load_score(in, t, o, e) : 0.0f;
  const float g = active ? load_real(in.grad, in.grad_bf16, o) : 0.0f;
  if (!torch) return {e, routing_grad_lane(s, g, active, scale, norm)};
  const float sb = bf16_round(s);
  const float S = torch_normalizer(warp_sum(sb));
  const float gs = torch_scaled(g, scale);
  const float dot = warp_sum(active ? torch_product(gs, sb, S) : 0.0f);
  return {e, active ? torch_logit_grad(gs, dot, sb, S, norm) : 0.0f};
}

}  // namespace moe_routing::kernels
