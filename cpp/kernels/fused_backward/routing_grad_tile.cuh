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

// How a kernel's builders read their routing rows (TokenRouting).
enum class RowFormat {
  kTraining,  // K = kTopK: int32 indices, f32 [T, K] scores and gradients, as 16-byte vectors
  kAny,       // any K <= kTopK and every dtype, element by element, the dtypes read at run time
  kTorch,     // K = 8: int64 indices, bf16 scores of all experts, bf16 gradients, rows 16-byte
              // aligned (PyTorch's own dtypes, the public benchmark's interface)
  kCompact,   // kTorch's rows, packed once per launch (compact_routing_rows): CompactRow
};

// One token's routing inputs, held in registers: the loads are issued before the builder
// waits for a free stage, and their values are used only when the row is packed, after it, so
// that their latency hides behind the wait. kTopK slots per token.
//   kTraining: each row loaded as 16-byte vectors (the host launches these kernels for those
//   dtypes, 16-byte aligned rows and K = kTopK only).
//   kAny: any K <= kTopK given at run time and every dtype, loaded element by element (a row
//   need not be 16-byte aligned), the unused slots holding expert -1 (never stored) and score
//   and gradient 0 (adding nothing). Scores and gradients stay as loaded (raw words) until
//   the row is packed: converting bf16 right after the load would wait for it there.
//   kTorch: kAny's work for one combination of dtypes, with the branches on them and on K
//   compiled away (kAny's run-time dtypes cost ~2 µs per unit in instructions alone).
// Staged indices (kAny with int64 indices or the scores of all experts, and kTorch): each
// builder copies its row of indices into shared memory a unit ahead (stage_indices, cp.async),
// so that the load reads them there and issues the gather they address at once (load_staged);
// the score rows are fetched into L2 at the same time.
template <int kTopK, RowFormat kFormat = RowFormat::kTraining>
struct TokenRouting {
  static_assert(kTopK % 4 == 0, "slots as 16-byte vectors");
  static constexpr bool kMayStage = false;
  static constexpr bool kTorchRounding = false;  // (the fixed-K kernels never round so)
  int4 idx4[kTopK / 4];
  float4 score4[kTopK / 4];
  float4 grad4[kTopK / 4];
  bool valid;

  __device__ __forceinline__ const int* idx() const { return reinterpret_cast<const int*>(idx4); }
  __device__ __forceinline__ float score_at(const kernels::RoutingInputs&, int k) const {
    return reinterpret_cast<const float*>(score4)[k];
  }
  __device__ __forceinline__ float grad_at(const kernels::RoutingInputs&, int k) const {
    return reinterpret_cast<const float*>(grad4)[k];
  }

  __device__ __forceinline__ void load(const kernels::RoutingInputs& in, int64_t t,
                                       int64_t tokens, int) {
    valid = t < tokens;
    if (!valid) return;
    const int64_t row = t * kTopK / 4;  // in 16-byte vectors
#pragma unroll
    for (int v = 0; v < kTopK / 4; ++v) {
      idx4[v] = __ldg(static_cast<const int4*>(in.idx) + row + v);
      score4[v] = __ldg(static_cast<const float4*>(in.scores) + row + v);
      grad4[v] = __ldg(static_cast<const float4*>(in.grad) + row + v);
    }
  }
};

__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, int bytes) {
  if (bytes == 16)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// 0, computed from v: a value the compiler cannot see through, so that what uses it waits for v.
__device__ __forceinline__ uint32_t zero_after(uint32_t v) {
  uint32_t zero;
  asm volatile("and.b32 %0, %1, 0;" : "=r"(zero) : "r"(v));
  return zero;
}

template <int kTopK>
struct TokenRouting<kTopK, RowFormat::kAny> {
  static constexpr bool kMayStage = true;
  static constexpr bool kTorchRounding = true;
  int idx_[kTopK];
  // Raw words: f32 bits, or a bf16 in the low half (the high half ignored).
  uint32_t score[kTopK];
  uint32_t grad[kTopK];
  bool valid;

  __device__ __forceinline__ const int* idx() const { return idx_; }
  __device__ __forceinline__ static float real(uint32_t w, bool bf16) {
    return __uint_as_float(bf16 ? w << 16 : w);
  }
  __device__ __forceinline__ float score_at(const kernels::RoutingInputs& in, int k) const {
    return real(score[k], in.scores_bf16);
  }
  __device__ __forceinline__ float grad_at(const kernels::RoutingInputs& in, int k) const {
    return real(grad[k], in.grad_bf16);
  }
  __device__ __forceinline__ static bool staged(const kernels::RoutingInputs& in) {
    return in.idx_i64 || in.scores_all;
  }

  // One word per slot of a [T, K] row of reals, as loaded (0 beyond K: 0.0f in either dtype).
  __device__ __forceinline__ static void load_row(const void* base, bool bf16, int64_t row,
                                                  int top_k, uint32_t (&out)[kTopK]) {
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      if (k >= top_k) out[k] = 0;
      else if (bf16) out[k] = __ldg(static_cast<const unsigned short*>(base) + row + k);
      else out[k] = __ldg(static_cast<const unsigned int*>(base) + row + k);
    }
  }

  // The chosen experts' scores of token t, from the scores of all experts (idx_ loaded).
  __device__ __forceinline__ void gather_scores(const kernels::RoutingInputs& in, int64_t t) {
    const int64_t all = t * in.scores_stride;
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      const int e = idx_[k];
      if (unsigned(e) >= unsigned(in.scores_stride)) score[k] = 0;
      else if (in.scores_bf16)
        score[k] = __ldg(static_cast<const unsigned short*>(in.scores) + all + e);
      else score[k] = __ldg(static_cast<const unsigned int*>(in.scores) + all + e);
    }
  }

  // The gradients and scores of token t, its indices loaded.
  __device__ __forceinline__ void load_reals(const kernels::RoutingInputs& in, int64_t t,
                                             int top_k) {
    const int64_t row = t * top_k;
    load_row(in.grad, in.grad_bf16, row, top_k, grad);
    if (in.scores_all) gather_scores(in, t);
    else load_row(in.scores, in.scores_bf16, row, top_k, score);
  }

  __device__ __forceinline__ void load(const kernels::RoutingInputs& in, int64_t t,
                                       int64_t tokens, int top_k) {
    valid = t < tokens;
    if (!valid) return;
#pragma unroll
    for (int k = 0; k < kTopK; ++k)
      idx_[k] = k < top_k ? kernels::load_index(in, t * top_k + k) : -1;
    load_reals(in, t, top_k);
  }

  // Copies row t's indices to `dst` (shared memory) in the background. `after` is 0, computed
  // from the indices last read from `dst` (load_staged's return): the copies are issued only
  // once those reads have returned, so that they cannot overwrite the row before it is read.
  __device__ __forceinline__ static void stage_indices(const kernels::RoutingInputs& in,
                                                       int64_t t, int64_t tokens, int top_k,
                                                       uint32_t dst, uint32_t after) {
    if (t >= tokens) return;
    dst += after;
    const int bytes = in.idx_i64 ? 8 : 4;
    const char* src = static_cast<const char*>(in.idx) + t * top_k * bytes;
#pragma unroll
    for (int k = 0; k < kTopK; ++k)
      if (k < top_k) cp_async(dst + k * bytes, src + k * bytes, bytes);
    cp_async_commit();
  }

  // load of token t, its indices read from `staged` (shared memory, stage_indices' copy).
  // Returns 0, computed from every index read (stage_indices' `after`).
  __device__ __forceinline__ uint32_t load_staged(const kernels::RoutingInputs& in, int64_t t,
                                                  int64_t tokens, int top_k,
                                                  const unsigned char* staged) {
    valid = t < tokens;
    if (!valid) return 0;
    cp_async_wait_all();
    uint32_t all = 0;
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      int e = -1;
      if (k < top_k)
        e = in.idx_i64 ? kernels::narrow_index(reinterpret_cast<const long long*>(staged)[k])
                       : reinterpret_cast<const int*>(staged)[k];
      idx_[k] = e;
      all |= uint32_t(e);
    }
    load_reals(in, t, top_k);
    return zero_after(all);
  }
};

template <int kTopK>
struct TokenRouting<kTopK, RowFormat::kTorch> {
  static_assert(kTopK == 8, "rows of 8 slots: one 16-byte vector of bf16 gradients");
  static constexpr bool kMayStage = true;
  static constexpr bool kTorchRounding = true;
  int idx_[kTopK];
  uint32_t score[kTopK];  // bf16 bits in the low half
  uint4 grad4;            // the row's bf16 gradients, as loaded
  bool valid;

  __device__ __forceinline__ const int* idx() const { return idx_; }
  __device__ __forceinline__ float score_at(const kernels::RoutingInputs&, int k) const {
    return __uint_as_float(score[k] << 16);
  }
  __device__ __forceinline__ float grad_at(const kernels::RoutingInputs&, int k) const {
    const uint32_t w = reinterpret_cast<const uint32_t*>(&grad4)[k / 2];
    return __uint_as_float(k % 2 ? w & 0xffff0000u : w << 16);
  }
  __device__ __forceinline__ static bool staged(const kernels::RoutingInputs&) { return true; }

  __device__ __forceinline__ static void stage_indices(const kernels::RoutingInputs& in,
                                                       int64_t t, int64_t tokens, int,
                                                       uint32_t dst, uint32_t after) {
    if (t >= tokens) return;
    dst += after;
    const char* src = static_cast<const char*>(in.idx) + t * kTopK * 8;
#pragma unroll
    for (int v = 0; v < kTopK * 8 / 16; ++v) cp_async(dst + 16 * v, src + 16 * v, 16);
    cp_async_commit();
  }

  __device__ __forceinline__ uint32_t load_staged(const kernels::RoutingInputs& in, int64_t t,
                                                  int64_t tokens, int,
                                                  const unsigned char* staged) {
    valid = t < tokens;
    if (!valid) return 0;
    grad4 = __ldg(static_cast<const uint4*>(in.grad) + t);
    cp_async_wait_all();
    uint32_t all = 0;
#pragma unroll
    for (int v = 0; v < kTopK / 2; ++v) {
      const longlong2 pair = reinterpret_cast<const longlong2*>(staged)[v];
      idx_[2 * v] = kernels::narrow_index(pair.x);
      idx_[2 * v + 1] = kernels::narrow_index(pair.y);
      all |= uint32_t(idx_[2 * v]) | uint32_t(idx_[2 * v + 1]);
    }
    gather_scores(in, t);
    return zero_after(all);
  }

  // The whole load of token t at once, waiting for its indices (compact_routing_rows).
  __device__ __forceinline__ void load_direct(const kernels::RoutingInputs& in, int64_t t) {
    valid = true;
    grad4 = __ldg(static_cast<const uint4*>(in.grad) + t);
#pragma unroll
    for (int v = 0; v < kTopK / 2; ++v) {
      const longlong2 pair = __ldg(static_cast<const longlong2*>(in.idx) + t * (kTopK / 2) + v);
      idx_[2 * v] = kernels::narrow_index(pair.x);
      idx_[2 * v + 1] = kernels::narrow_index(pair.y);
    }
    gather_scores(in, t);
  }

  __device__ __forceinline__ void gather_scores(const kernels::RoutingInputs& in, int64_t t) {
    const unsigned short* row =
        static_cast<const unsigned short*>(in.scores) + t * in.scores_stride;
#pragma unroll
    for (int k = 0; k < kTopK; ++k)
      score[k] = unsigned(idx_[k]) < unsigned(in.scores_stride) ? __ldg(row + idx_[k]) : 0u;
  }

  // Whether load_quad may read these scores: rows of exactly kExperts, 16-byte aligned.
  template <int kExperts>
  __device__ __forceinline__ static bool quad_rows(const kernels::RoutingInputs& in) {
    return in.scores_stride == kExperts && (reinterpret_cast<uintptr_t>(in.scores) & 15) == 0;
  }

  // Token t loaded by a quad of lanes (`sub` = lane % 4, every lane of the warp calling it):
  // its indices, gradients and whole row of scores at once, in one round trip instead of the
  // indices' and then the gather's (the row's 16-byte chunks dealt round robin, ~the bytes of
  // the gather's 8 sectors). The chosen scores then move between the quad's lanes by
  // shuffles. Every lane ends with the whole row. `live`: the same in the quad.
  template <int kExperts>
  __device__ __forceinline__ void load_quad(const kernels::RoutingInputs& in, int64_t t,
                                            bool live, int sub) {
    static_assert(kExperts % 32 == 0, "a score row of whole 16-byte chunks per lane");
    constexpr int kChunks = kExperts / 32;  // per lane
    constexpr unsigned kAll = 0xffffffffu;
    valid = live;
    uint4 chunk[kChunks];
    longlong2 pair = make_longlong2(-1, -1);
    grad4 = make_uint4(0, 0, 0, 0);
    if (live) {
      const uint4* row = static_cast<const uint4*>(in.scores) + t * (kExperts / 8);
      grad4 = __ldg(static_cast<const uint4*>(in.grad) + t);
      pair = __ldg(static_cast<const longlong2*>(in.idx) + t * (kTopK / 2) + sub);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) chunk[i] = __ldg(row + sub + 4 * i);
    } else {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) chunk[i] = make_uint4(0, 0, 0, 0);
    }
    const int lo = kernels::narrow_index(pair.x), hi = kernels::narrow_index(pair.y);
    const int quad0 = (threadIdx.x % 32) & ~3;
    uint32_t picked[kTopK / 2] = {};  // the chosen scores this lane holds, bf16 pairs
#pragma unroll
    for (int k = 0; k < kTopK; ++k) {
      const int e = __shfl_sync(kAll, k % 2 ? hi : lo, quad0 + k / 2);
      idx_[k] = e;
      // Element e is word (e / 2) % 4 of chunk e / 8, which is lane (e / 8) % 4's chunk e / 32.
      const int word = (e >> 1) & 3, mine = e >> 5;
      uint32_t w = 0;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const uint4 c = chunk[i];
        const uint32_t pick = word == 0 ? c.x : word == 1 ? c.y : word == 2 ? c.z : c.w;
        w = i == mine ? pick : w;
      }
      const bool held = unsigned(e) < unsigned(kExperts) && ((e >> 3) & 3) == sub;
      const uint32_t half = held ? (w >> (16 * (e & 1))) & 0xffffu : 0u;
      picked[k / 2] |= half << (16 * (k % 2));
    }
#pragma unroll
    for (int v = 0; v < kTopK / 2; ++v) {
      picked[v] |= __shfl_xor_sync(kAll, picked[v], 1);
      picked[v] |= __shfl_xor_sync(kAll, picked[v], 2);
    }
#pragma unroll
    for (int k = 0; k < kTopK; ++k) score[k] = (picked[k / 2] >> (16 * (k % 2))) & 0xffffu;
  }
};

// One token's packed row of G (PackedRow, K = 8) in global memory, 32 bytes: experts and
// valid bits, then the bf16 gradients. Written by compact_routing_rows once per launch, read by
// every unit of the token's tile (RowFormat::kCompact).
struct CompactRow {
  uint4 experts;  // experts[0], experts[1], valid, 0
  uint4 grads;
};

template <int kTopK>
struct TokenRouting<kTopK, RowFormat::kCompact> {
  static_assert(kTopK == 8, "a compact row holds 8 slots");
  static constexpr bool kMayStage = false;
  CompactRow row;
  bool valid;

  // Written in this launch by other CTAs: read through L2 (ld.global.cg), not the
  // non-coherent path.
  __device__ __forceinline__ void load(const CompactRow* rows, int64_t t, int64_t tokens) {
    valid = t < tokens;
    if (!valid) return;
    const uint4* src = reinterpret_cast<const uint4*>(rows + t);
    row.experts = __ldcg(src);
    row.grads = __ldcg(src + 1);
  }
};

// Token t's row of the scores of all experts fetched into L2 (staged indices: the
// gather at its indices a unit later then finds it there).
__device__ __forceinline__ void prefetch_score_row_l2(const kernels::RoutingInputs& in, int64_t t,
                                                      int64_t tokens) {
  if (t >= tokens || !in.scores_all) return;
  const int bytes = in.scores_bf16 ? 2 : 4;
  const char* row = static_cast<const char*>(in.scores) + t * in.scores_stride * bytes;
  for (int o = 0; o < in.scores_stride * bytes; o += 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + o));
  asm volatile("prefetch.global.L2 [%0];" ::"l"(row + in.scores_stride * bytes - 1));
}

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
// k: the row's slots (K).
__device__ __forceinline__ void prefetch_token_routing(const kernels::RoutingInputs& in,
                                                       int64_t t, int64_t tokens, int k) {
  if (t >= tokens) return;
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

// The routing gradients v of one token's slots (fp32, before the bf16 rounding; kResidual: what
// that rounding leaves out): scaling, normalization and sigmoid gradients, computed as
// `rounding` says. Unused slots (score and gradient 0) get 0.
template <int kTopK, RowFormat kFormat>
__device__ __forceinline__ void routing_grad_values(const TokenRouting<kTopK, kFormat>& in,
                                                    const kernels::RoutingInputs& dtypes,
                                                    float scale, bool norm, GradRounding rounding,
                                                    float (&v)[kTopK]) {
  float s[kTopK], g[kTopK];
#pragma unroll
  for (int k = 0; k < kTopK; ++k) s[k] = in.score_at(dtypes, k), g[k] = in.grad_at(dtypes, k);
  if (TokenRouting<kTopK, kFormat>::kTorchRounding && rounding == GradRounding::kTorchBf16) {
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
}

// The routing gradients of one token, packed: rounded to bf16 as `rounding` says. Indices
// outside [0, E) contribute nothing.
template <int kExperts, int kTopK, RowFormat kFormat>
__device__ __forceinline__ PackedRow<kTopK> pack_routing_grad_row(
    const TokenRouting<kTopK, kFormat>& in, const kernels::RoutingInputs& dtypes, float scale,
    bool norm, GradRounding rounding) {
  PackedRow<kTopK> out{};
  if (!in.valid) return out;
  const int* e = in.idx();
  float v[kTopK];
  routing_grad_values(in, dtypes, scale, norm, rounding, v);
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

// kCompact: the row as packed by compact_routing_rows.
template <int kExperts, int kTopK>
__device__ __forceinline__ PackedRow<kTopK> pack_routing_grad_row(
    const TokenRouting<kTopK, RowFormat::kCompact>& in, const kernels::RoutingInputs&, float,
    bool, GradRounding) {
  PackedRow<kTopK> out{};
  if (!in.valid) return out;
  out.experts[0] = in.row.experts.x, out.experts[1] = in.row.experts.y;
  out.valid = in.row.experts.z;
  out.grads[0] = in.row.grads.x, out.grads[1] = in.row.grads.y;
  out.grads[2] = in.row.grads.z, out.grads[3] = in.row.grads.w;
  return out;
}

__device__ __forceinline__ void store_compact_row(CompactRow* rows, int64_t t,
                                                  const PackedRow<8>& in) {
  uint4* dst = reinterpret_cast<uint4*>(rows + t);
  __stcg(dst, make_uint4(in.experts[0], in.experts[1], in.valid, 0u));
  __stcg(dst + 1, make_uint4(in.grads[0], in.grads[1], in.grads[2], in.grads[3]));
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
