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

#include "kernels/routing_inputs.cuh"

namespace moe_routing::kernels::fused_backward {

// One token's routing inputs, held in registers: the loads are issued before the builder
// waits for a free stage, so that their latency hides behind the wait. kTopK slots per token:
// K = kTopK, whose [T, K] rows load as 16-byte vectors (any dtype: a row of 8 is 16, 32 or 64
// bytes); or (kAnyK) any K <= kTopK given at run time, loaded element by element (a row need
// not be 16-byte aligned), the unused slots holding expert -1 (never stored) and score and
// gradient 0 (adding nothing). The scores of all experts ([T, E]) are gathered at the chosen
// ones once the indices are in.
template <int kTopK, bool kAnyK = false>
struct TokenRouting {
  static_assert(kTopK % 8 == 0 || kAnyK, "fixed K: rows of whole 16-byte vectors in every dtype");
  int idx[kTopK];
  float score[kTopK];
  float grad[kTopK];
  bool valid;

  // n reals of row `row` (16-byte aligned) as 16-byte vectors.
  template <int n>
  __device__ __forceinline__ static void load_reals(const void* base, bool bf16, int64_t row,
                                                    float (&out)[n]) {
    if (bf16) {
      const uint4* v = static_cast<const uint4*>(base) + row * n / 8;
#pragma unroll
      for (int i = 0; i < n / 8; ++i) {
        const uint4 u = __ldg(v + i);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(h[j]);
          out[8 * i + 2 * j] = f.x, out[8 * i + 2 * j + 1] = f.y;
        }
      }
    } else {
      const float4* v = static_cast<const float4*>(base) + row * n / 4;
#pragma unroll
      for (int i = 0; i < n / 4; ++i) {
        const float4 f = __ldg(v + i);
        out[4 * i] = f.x, out[4 * i + 1] = f.y, out[4 * i + 2] = f.z, out[4 * i + 3] = f.w;
      }
    }
  }

  // Row t's indices: kTopK (16-byte vectors) or top_k of them (kAnyK; -1 beyond).
  __device__ __forceinline__ static void load_indices(const kernels::RoutingInputs& in,
                                                      int64_t t, int top_k, int (&idx)[kTopK]) {
    if constexpr (kAnyK) {
#pragma unroll
      for (int k = 0; k < kTopK; ++k) idx[k] = k < top_k ? kernels::load_index(in, t * top_k + k) : -1;
    } else if (in.idx_i64) {
      const longlong2* v = static_cast<const longlong2*>(in.idx) + t * kTopK / 2;
#pragma unroll
      for (int i = 0; i < kTopK / 2; ++i) {
        const longlong2 e = __ldg(v + i);
        idx[2 * i] = kernels::narrow_index(e.x), idx[2 * i + 1] = kernels::narrow_index(e.y);
      }
    } else {
      const int4* v = static_cast<const int4*>(in.idx) + t * kTopK / 4;
#pragma unroll
      for (int i = 0; i < kTopK / 4; ++i) {
        const int4 e = __ldg(v + i);
        idx[4 * i] = e.x, idx[4 * i + 1] = e.y, idx[4 * i + 2] = e.z, idx[4 * i + 3] = e.w;
      }
    }
  }

  // Row t's gradients, and its scores where they are [T, K].
  __device__ __forceinline__ void load_rows(const kernels::RoutingInputs& in, int64_t t,
                                            int top_k) {
    if constexpr (kAnyK) {
      const int64_t row = t * top_k;
#pragma unroll
      for (int k = 0; k < kTopK; ++k) {
        const bool used = k < top_k;
        grad[k] = used ? kernels::load_real(in.grad, in.grad_bf16, row + k) : 0.0f;
        if (!in.scores_all) score[k] = used ? kernels::load_real(in.scores, in.scores_bf16, row + k) : 0.0f;
      }
    } else {
      load_reals(in.grad, in.grad_bf16, t, grad);
      if (!in.scores_all) load_reals(in.scores, in.scores_bf16, t, score);
    }
  }

  // Token t (valid where t < tokens): indices, gradients and [T, K] scores, all loads issued
  // at once; the scores of all experts gathered once the indices are in (load_gathered keeps
  // that wait off the producer's path).
  __device__ __forceinline__ void load(const kernels::RoutingInputs& in, int64_t t,
                                       int64_t tokens, int top_k) {
    valid = t < tokens;
    if (!valid) return;
    load_indices(in, t, top_k, idx);
    load_rows(in, t, top_k);
    if (in.scores_all) {
#pragma unroll
      for (int k = 0; k < kTopK; ++k) score[k] = kernels::load_score(in, t, 0, idx[k]);
    }
  }

  // Token t with its indices loaded before (`ahead`, a unit earlier, so that their latency is
  // not on the producer's path): gradients loaded and the chosen experts' scores gathered from
  // the scores of all experts, issued together.
  __device__ __forceinline__ void load_gathered(const kernels::RoutingInputs& in, int64_t t,
                                                int64_t tokens, int top_k,
                                                const int (&ahead)[kTopK]) {
    valid = t < tokens;
    if (!valid) return;
#pragma unroll
    for (int k = 0; k < kTopK; ++k) idx[k] = ahead[k];
    load_rows(in, t, top_k);
#pragma unroll
    for (int k = 0; k < kTopK; ++k) score[k] = kernels::load_score(in, t, 0, idx[k]);
  }
};

// The 128-byte line of `first`, and that of `last` where it is another one.
__device__ __forceinline__ void prefetch_l1_span(const void* first, const void* last) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(first));
  if ((reinterpret_cast<uintptr_t>(first) ^ reinterpret_cast<uintptr_t>(last)) >> 7)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(last));
}

// Row t (`k` elements of `bytes` each) of an array, fetched into L1.
__device__ __forceinline__ void prefetch_row(const void* base, int64_t t, int k, int bytes) {
  const char* first = static_cast<const char*>(base) + t * k * bytes;
  prefetch_l1_span(first, first + (k - 1) * bytes);
}

// One token's [T, K] routing inputs fetched into L1 ahead of their loads (TokenRouting::load
// then finds them there; ld.global.nc goes through L1). A row may cross a line, and the arrays
// need not be aligned alike: each row's last line is fetched where it differs from its first.
// (The scores of all experts are gathered where the indices point: not fetched.)
template <int kTopK, bool kAnyK = false>
__device__ __forceinline__ void prefetch_token_routing(const kernels::RoutingInputs& in,
                                                       int64_t t, int64_t tokens, int top_k) {
  static_assert(kTopK * 8 <= 128, "a row spans at most two lines");
  if (t >= tokens) return;
  const int k = kAnyK ? top_k : kTopK;
  prefetch_row(in.idx, t, k, in.idx_i64 ? 8 : 4);
  prefetch_row(in.grad, t, k, in.grad_bf16 ? 2 : 4);
  if (!in.scores_all) prefetch_row(in.scores, t, k, in.scores_bf16 ? 2 : 4);
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

// How pack_routing_grad_row computes a row's routing gradients.
enum class GradRounding : int {
  kBf16,       // in fp32, rounded to bf16 once
  kResidual,   // what that rounding leaves out, G - bf16(G) (exact in fp32), rounded to bf16,
               // so that bf16(G) + residual is G to ~2^-18 of it (precise mode's second sweep)
  kTorchBf16,  // every step rounded to bf16 as eager PyTorch does (routing_inputs.cuh)
};

// The routing gradients of one token: scaling, normalization and sigmoid gradients, rounded
// to bf16 as `rounding` says. Indices outside [0, E) contribute nothing.
template <int kExperts, int kTopK, bool kAnyK>
__device__ __forceinline__ PackedRow<kTopK> pack_routing_grad_row(
    const TokenRouting<kTopK, kAnyK>& in, float scale, bool norm, GradRounding rounding) {
  PackedRow<kTopK> out{};
  if (!in.valid) return out;
  const float* s = in.score;
  const float* g = in.grad;
  const int* e = in.idx;
  float v[kTopK];
  if (rounding == GradRounding::kTorchBf16) {
    float sb[kTopK], gs[kTopK];
    float sum_s = 0.0f, dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kTopK; ++k) sb[k] = kernels::bf16_round(s[k]), sum_s += sb[k];
    const float S = kernels::torch_normalizer(sum_s);
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      gs[k] = kernels::torch_scaled(g[k], scale);
      dot += kernels::torch_product(gs[k], sb[k], S);
    }
#pragma unroll
    for (int k = 0; k < kTopK; ++k) v[k] = kernels::torch_logit_grad(gs[k], dot, sb[k], S, norm);
  } else {
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
      v[k] = grad_s * s[k] * (1.0f - s[k]);
      if (rounding == GradRounding::kResidual) v[k] -= kernels::bf16_round(v[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kTopK; k += 2) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[k], v[k + 1]);
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
