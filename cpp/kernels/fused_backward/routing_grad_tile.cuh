// Producer side: the routing-gradient tile G (t, e) in shared memory, built from the [T, K]
// inputs directly (no dense [T, E] tensor in global memory).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace moe_routing::kernels::fused_backward {

// Zeroes the tile, then thread j scatters the K routing gradients of token t0 + j.
// Rows past the last token stay zero. Indices outside [0, E) contribute nothing; the indices
// of a row are distinct (the forward guarantees it).
//   sG: (kTileT, E) view of one stage; called by the 128 threads of the producer warpgroup.
template <int kTileT, int kExperts, class SmemTensorG>
__device__ __forceinline__ void build_routing_grad_tile(SmemTensorG&& sG, int thread,
                                                        const int32_t* __restrict__ topk_idx,
                                                        const float* __restrict__ topk_scores,
                                                        const float* __restrict__ grad_topk_w,
                                                        int64_t t0, int64_t tokens, int top_k,
                                                        float scale, bool norm,
                                                        uint32_t barrier_id) {
  static_assert(kTileT == 128, "one producer thread per token");
  constexpr int kVecs = kTileT * kExperts * 2 / 16;
  uint4* raw = reinterpret_cast<uint4*>(raw_pointer_cast(sG.data()));
#pragma unroll 4
  for (int i = thread; i < kVecs; i += 128) raw[i] = make_uint4(0, 0, 0, 0);
  cutlass::arch::NamedBarrier::sync(128, barrier_id);

  const int64_t t = t0 + thread;
  if (t < tokens) {
    const int64_t row = t * top_k;
    float sum_s = 0.0f, dot = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      float s = __ldg(topk_scores + row + k), g = __ldg(grad_topk_w + row + k);
      sum_s += s;
      dot = fmaf(g, s, dot);
    }
    sum_s += 1e-20f;
    for (int k = 0; k < top_k; ++k) {
      const int e = __ldg(topk_idx + row + k);
      const float s = __ldg(topk_scores + row + k), g = __ldg(grad_topk_w + row + k);
      const float grad_s = norm ? (scale / sum_s) * (g - dot / sum_s) : scale * g;
      if (unsigned(e) < unsigned(kExperts))
        sG(thread, e) = cutlass::bfloat16_t(grad_s * s * (1.0f - s));
    }
  }
}

}  // namespace moe_routing::kernels::fused_backward
