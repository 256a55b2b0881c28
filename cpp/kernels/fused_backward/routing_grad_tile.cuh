// Producer side: the routing-gradient tile G (t, e) in shared memory, built from the [T, K]
// inputs directly (no dense [T, E] tensor in global memory).
//
// G has K nonzeros per row. Each G stage is zeroed once when the kernel starts; after that a
// builder thread owns its rows: it clears the K entries it set in that stage last time and
// sets the K new ones, 2K two-byte stores per row instead of rewriting the whole tile.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include <cute/tensor.hpp>

namespace moe_routing::kernels::fused_backward {

// One token's routing inputs, held in registers: the loads are issued before the builder
// waits for a free stage, so that their latency hides behind the wait. kTopK slots per token:
// K = kTopK, whose rows load as 16-byte vectors; or (kAnyK) any K <= kTopK given at run time,
// loaded element by element (a row of K 4-byte values need not be 16-byte aligned), the
// unused slots holding expert -1 (never stored) and score and gradient 0 (adding nothing).
template <int kTopK, bool kAnyK = false>
struct TokenRouting {
  static_assert(kTopK % 4 == 0, "slots as 16-byte vectors");
  int4 idx[kTopK / 4];
  float4 score[kTopK / 4];
  float4 grad[kTopK / 4];
  bool valid;

  __device__ __forceinline__ void load(const int32_t* __restrict__ topk_idx,
                                       const float* __restrict__ topk_scores,
                                       const float* __restrict__ grad_topk_w, int64_t t,
                                       int64_t tokens, int top_k) {
    valid = t < tokens;
    if (!valid) return;
    if constexpr (kAnyK) {
      int* e = reinterpret_cast<int*>(idx);
      float* s = reinterpret_cast<float*>(score);
      float* g = reinterpret_cast<float*>(grad);
      const int64_t row = t * top_k;
#pragma unroll
      for (int k = 0; k < kTopK; ++k) {
        const bool used = k < top_k;
        e[k] = used ? __ldg(topk_idx + row + k) : -1;
        s[k] = used ? __ldg(topk_scores + row + k) : 0.0f;
        g[k] = used ? __ldg(grad_topk_w + row + k) : 0.0f;
      }
    } else {
      const int64_t row = t * kTopK / 4;  // in 16-byte vectors
#pragma unroll
      for (int v = 0; v < kTopK / 4; ++v) {
        idx[v] = __ldg(reinterpret_cast<const int4*>(topk_idx) + row + v);
        score[v] = __ldg(reinterpret_cast<const float4*>(topk_scores) + row + v);
        grad[v] = __ldg(reinterpret_cast<const float4*>(grad_topk_w) + row + v);
      }
    }
  }
};

// The 128-byte line of `first`, and that of `last` where it is another one.
__device__ __forceinline__ void prefetch_l1_span(const void* first, const void* last) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(first));
  if ((reinterpret_cast<uintptr_t>(first) ^ reinterpret_cast<uintptr_t>(last)) >> 7)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(last));
}

// One token's routing inputs fetched into L1 ahead of their loads (TokenRouting::load then
// finds them there; ld.global.nc goes through L1). A fixed K fetches the row's first line (its
// rows are 16-byte aligned: a row of 8 crosses a line only where the array is not 32-byte
// aligned, and the fetch is a hint). With kAnyK a row may cross a line anywhere, and the three
// arrays need not be aligned alike: each row's last line is fetched where it differs.
template <int kTopK, bool kAnyK = false>
__device__ __forceinline__ void prefetch_token_routing(const int32_t* topk_idx,
                                                       const float* topk_scores,
                                                       const float* grad_topk_w, int64_t t,
                                                       int64_t tokens, int top_k) {
  static_assert(kTopK * 4 <= 128, "a row spans at most two lines");
  if (t >= tokens) return;
  if constexpr (kAnyK) {
    const int64_t first = t * top_k, last = first + top_k - 1;
    prefetch_l1_span(topk_idx + first, topk_idx + last);
    prefetch_l1_span(topk_scores + first, topk_scores + last);
    prefetch_l1_span(grad_topk_w + first, grad_topk_w + last);
  } else {
    const int64_t first = t * kTopK;
    asm volatile("prefetch.global.L1 [%0];" ::"l"(topk_idx + first));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(topk_scores + first));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(grad_topk_w + first));
  }
}

__device__ __forceinline__ void st_shared_b16(uint32_t addr, uint16_t bits) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(bits) : "memory");
}

// Byte offset of G(t, e) in one stage of Config::SmemLayoutG: K-major SW64 atoms of 8 rows ×
// 32 experts (64 bytes a row), tiled t first; the swizzle XORs the 16-byte chunk within a row
// with bits 1-2 of the row. The same offsets as &sG(t, e) (checked for every (t, e) against
// CuTe), computed without CuTe's swizzled-pointer arithmetic, which made the build several
// times longer.
template <int kTileT>
struct RoutingGradRow {
  uint32_t base;  // shared-memory address of the row's first atom, within the stage
  uint32_t swizzle;
  __device__ __forceinline__ RoutingGradRow(uint32_t stage, int t)
      : base(stage + uint32_t(t >> 3) * 512u + uint32_t(t & 7) * 64u),
        swizzle(uint32_t((t & 7) >> 1) << 4) {}
  __device__ __forceinline__ uint32_t operator()(int e) const {
    return base + uint32_t(e >> 5) * uint32_t(kTileT * 64) + ((uint32_t(e & 31) * 2u) ^ swizzle);
  }
};

// One token's row of G, ready to store: its K experts as bytes (0 where unused) and their
// routing gradients as bf16, 6 registers for K = 8 instead of the 24 of the inputs.
template <int kTopK>
struct PackedRow {
  uint32_t experts[kTopK / 4];
  uint32_t grads[kTopK / 2];  // bf16 pairs
  uint32_t valid;             // bit k: expert k is stored
};

// The routing gradients of one token: scaling, normalization and sigmoid gradients, rounded
// to bf16; `residual`: what that rounding leaves out, G - bf16(G) (exact in fp32), rounded to
// bf16, so that bf16(G) + residual is G to ~2^-18 of it. Indices outside [0, E) contribute
// nothing.
template <int kExperts, int kTopK, bool kAnyK>
__device__ __forceinline__ PackedRow<kTopK> pack_routing_grad_row(
    const TokenRouting<kTopK, kAnyK>& in, float scale, bool norm, bool residual) {
  PackedRow<kTopK> out{};
  if (!in.valid) return out;
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
  for (int k = 0; k < kTopK; k += 2) {
    float v[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float grad_s = norm ? a * (g[k + j] - b) : scale * g[k + j];
      v[j] = grad_s * s[k + j] * (1.0f - s[k + j]);
      if (residual) v[j] -= __bfloat162float(__float2bfloat16_rn(v[j]));
    }
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[0], v[1]);
    out.grads[k / 2] = *reinterpret_cast<const uint32_t*>(&pair);
  }
#pragma unroll
  for (int k = 0; k < kTopK; ++k) {
    if (unsigned(e[k]) < unsigned(kExperts)) {
      out.experts[k / 4] |= uint32_t(e[k]) << (8 * (k % 4));
      out.valid |= 1u << k;
    }
  }
  return out;
}

// Row `row` of one G stage: clears the experts recorded in `set_experts` (the row's previous
// use of this stage), then stores the packed row and records its experts. A row past the last
// token ends up all zero. The indices of a row are distinct (the forward guarantees it).
//   stage: shared-memory address of the G stage.  set_experts: the row's K bytes there.
template <int kTileT, int kTopK>
__device__ __forceinline__ void store_routing_grad_row(uint32_t stage, int row,
                                                       uint8_t* set_experts,
                                                       const PackedRow<kTopK>& in) {
  static_assert(kTopK % 4 == 0, "the record is stored as 32-bit words");
  const RoutingGradRow<kTileT> addr(stage, row);
  uint32_t* record = reinterpret_cast<uint32_t*>(set_experts);
  uint32_t prev[kTopK / 4];
#pragma unroll
  for (int v = 0; v < kTopK / 4; ++v) prev[v] = record[v];
#pragma unroll
  for (int k = 0; k < kTopK; ++k) st_shared_b16(addr(int((prev[k / 4] >> (8 * (k % 4))) & 0xff)), 0);
#pragma unroll
  for (int k = 0; k < kTopK; ++k) {
    if (in.valid & (1u << k))
      st_shared_b16(addr(int((in.experts[k / 4] >> (8 * (k % 4))) & 0xff)),
                    uint16_t(in.grads[k / 2] >> (16 * (k % 2))));
  }
#pragma unroll
  for (int v = 0; v < kTopK / 4; ++v) record[v] = in.experts[v];
}

}  // namespace moe_routing::kernels::fused_backward
