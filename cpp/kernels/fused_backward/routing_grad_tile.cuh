// Producer side: the routing-gradient tile G (t, e) in shared memory, built from the [T, K]
// inputs directly (no dense [T, E] tensor in global memory).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace moe_routing::kernels::fused_backward {

// One token's routing inputs, held in registers: loaded a tile ahead so that their latency
// hides behind the wait for a free stage.
template <int kTopK>
struct TokenRouting {
  static_assert(kTopK % 4 == 0, "rows load as 16-byte vectors");
  int4 idx[kTopK / 4];
  float4 score[kTopK / 4];
  float4 grad[kTopK / 4];
  bool valid;

  __device__ __forceinline__ void load(const int32_t* __restrict__ topk_idx,
                                       const float* __restrict__ topk_scores,
                                       const float* __restrict__ grad_topk_w, int64_t t,
                                       int64_t tokens) {
    valid = t < tokens;
    if (!valid) return;
    const int64_t row = t * kTopK / 4;  // in 16-byte vectors; a warp reads 32 whole rows
#pragma unroll
    for (int v = 0; v < kTopK / 4; ++v) {
      idx[v] = __ldg(reinterpret_cast<const int4*>(topk_idx) + row + v);
      score[v] = __ldg(reinterpret_cast<const float4*>(topk_scores) + row + v);
      grad[v] = __ldg(reinterpret_cast<const float4*>(grad_topk_w) + row + v);
    }
  }
};

// Zeroes the tile, then thread j scatters the K routing gradients of its token (row j).
// Rows past the last token stay zero. Indices outside [0, E) contribute nothing; the indices
// of a row are distinct (the forward guarantees it).
//   sG: (kTileT, E) view of one stage; called by the 128 threads of the producer warpgroup.
template <int kTileT, int kExperts, int kTopK, class SmemTensorG>
__device__ __forceinline__ void build_routing_grad_tile(SmemTensorG&& sG, int thread,
                                                        const TokenRouting<kTopK>& in,
                                                        float scale, bool norm,
                                                        uint32_t barrier_id) {
  static_assert(kTileT == 128, "one producer thread per token");
  constexpr int kVecs = kTileT * kExperts * 2 / 16;
  uint4* raw = reinterpret_cast<uint4*>(raw_pointer_cast(sG.data()));
#pragma unroll 4
  for (int i = thread; i < kVecs; i += 128) raw[i] = make_uint4(0, 0, 0, 0);
  cutlass::arch::NamedBarrier::sync(128, barrier_id);
  if (!in.valid) return;

  const float* s = reinterpret_cast<const float*>(in.score);
  const float* g = reinterpret_cast<const float*>(in.grad);
  const int* e = reinterpret_cast<const int*>(in.idx);
  float sum_s = 0.0f, dot = 0.0f;
#pragma unroll
  for (int k = 0; k < kTopK; ++k) {
    sum_s += s[k];
    dot = fmaf(g[k], s[k], dot);
  }
  sum_s += 1e-20f;
  const float a = scale / sum_s, b = dot / sum_s;
#pragma unroll
  for (int k = 0; k < kTopK; ++k) {
    const float grad_s = norm ? a * (g[k] - b) : scale * g[k];
    if (unsigned(e[k]) < unsigned(kExperts))
      sG(thread, e[k]) = cutlass::bfloat16_t(grad_s * s[k] * (1.0f - s[k]));
  }
}

}  // namespace moe_routing::kernels::fused_backward
