// Producer side: the routing-gradient tile G (t, e) in shared memory, built from the [T, K]
// inputs directly (no dense [T, E] tensor in global memory).
//
// G has K nonzeros per row. Each G stage is zeroed once when the kernel starts; after that a
// builder thread owns its rows: it clears the K entries it set in that stage last time and
// sets the K new ones, 2K two-byte stores per row instead of rewriting the whole tile.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>

namespace moe_routing::kernels::fused_backward {

// One token's routing inputs, held in registers: the loads are issued before the builder
// waits for a free stage, so that their latency hides behind the wait.
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
    const int64_t row = t * kTopK / 4;  // in 16-byte vectors
#pragma unroll
    for (int v = 0; v < kTopK / 4; ++v) {
      idx[v] = __ldg(reinterpret_cast<const int4*>(topk_idx) + row + v);
      score[v] = __ldg(reinterpret_cast<const float4*>(topk_scores) + row + v);
      grad[v] = __ldg(reinterpret_cast<const float4*>(grad_topk_w) + row + v);
    }
  }
};

__device__ __forceinline__ void st_shared_b16(uint32_t addr, uint16_t bits) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(bits) : "memory");
}

// Row `row` of one G stage: clears the experts recorded in `set_experts` (the row's previous
// use of this stage), then writes the token's K routing gradients and records their experts.
// A row past the last token ends up all zero. Indices outside [0, E) contribute nothing; the
// indices of a row are distinct (the forward guarantees it).
//   sG: (kTileT, E) view of one stage.  set_experts: the row's K bytes in that stage.
// Stores go through st.shared with the layout's (swizzled) offsets: through the generic
// address space they cost several times more.
template <int kExperts, int kTopK, class SmemTensorG>
__device__ __forceinline__ void update_routing_grad_row(SmemTensorG&& sG, int row,
                                                        uint8_t* set_experts,
                                                        const TokenRouting<kTopK>& in,
                                                        float scale, bool norm) {
  static_assert(kTopK % 4 == 0, "the record is stored as 32-bit words");
  // &sG(row, e): the element's address after the layout's swizzle (which CuTe applies to the
  // pointer, so raw_pointer_cast(sG.data()) plus an offset would miss it).
  auto addr = [&](int e) { return cute::cast_smem_ptr_to_uint(&sG(row, e)); };
  uint32_t* record = reinterpret_cast<uint32_t*>(set_experts);
  uint32_t prev[kTopK / 4];
#pragma unroll
  for (int v = 0; v < kTopK / 4; ++v) prev[v] = record[v];
#pragma unroll
  for (int k = 0; k < kTopK; ++k) st_shared_b16(addr(int((prev[k / 4] >> (8 * (k % 4))) & 0xff)), 0);

  uint32_t now[kTopK / 4] = {};
  if (in.valid) {
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
      if (unsigned(e[k]) < unsigned(kExperts)) {
        const __nv_bfloat16 v = __float2bfloat16_rn(grad_s * s[k] * (1.0f - s[k]));
        st_shared_b16(addr(e[k]), __bfloat16_as_ushort(v));
        now[k / 4] |= uint32_t(e[k]) << (8 * (k % 4));
      }
    }
  }
#pragma unroll
  for (int v = 0; v < kTopK / 4; ++v) record[v] = now[v];
}

}  // namespace moe_routing::kernels::fused_backward
