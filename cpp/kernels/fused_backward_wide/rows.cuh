// The wide fused backward's routing rows: every token's row of G packed once per launch (all
// CTAs, all threads, before the units), then read by each unit of its tile, two producer threads
// a row.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/fused_backward/routing_grad_tile.cuh"
#include "kernels/fused_backward/sync.cuh"
#include "kernels/fused_backward_wide/config.cuh"
#include "kernels/routing_inputs.cuh"

namespace moe_routing::kernels::fused_backward_wide {

using fused_backward::GradRounding;
using fused_backward::RowFormat;
using fused_backward::TokenRouting;

// An unused slot's expert.
constexpr uint32_t kNoExpert = 0xffffu;

// One token's packed row of G, 64 bytes: its 16 slots' experts as 16-bit ids (kNoExpert where
// unused, or outside [0, E)), then their routing gradients as bf16. Half q (slots 8q ... 8q + 7)
// is experts[q] and grads[q].
struct WideRow {
  uint4 experts[2];
  uint4 grads[2];
};

// Token t's row (t < tokens): its K inputs in their dtypes (any K <= 16), the routing gradients
// rounded as `rounding` says.
template <class P>
__device__ __forceinline__ void pack_wide_row(const P& p, int64_t t, GradRounding rounding) {
  TokenRouting<kWideTopK, RowFormat::kAny> in;
  in.load(p.routing, t, p.tokens, p.top_k);
  float v[kWideTopK];
  fused_backward::routing_grad_values(in, p.routing, p.scale, p.norm, rounding, v);
  uint32_t experts[kWideTopK / 2], grads[kWideTopK / 2];
#pragma unroll
  for (int k = 0; k < kWideTopK; k += 2) {
    const int e0 = in.idx_[k], e1 = in.idx_[k + 1];
    const uint32_t lo = unsigned(e0) < unsigned(p.experts) ? uint32_t(e0) : kNoExpert;
    const uint32_t hi = unsigned(e1) < unsigned(p.experts) ? uint32_t(e1) : kNoExpert;
    experts[k / 2] = lo | (hi << 16);
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[k], v[k + 1]);
    grads[k / 2] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  uint4* dst = reinterpret_cast<uint4*>(p.rows + t);
  __stcg(dst + 0, make_uint4(experts[0], experts[1], experts[2], experts[3]));
  __stcg(dst + 1, make_uint4(experts[4], experts[5], experts[6], experts[7]));
  __stcg(dst + 2, make_uint4(grads[0], grads[1], grads[2], grads[3]));
  __stcg(dst + 3, make_uint4(grads[4], grads[5], grads[6], grads[7]));
}

// Every token's row, all threads of all CTAs (token t by thread t / ctas % kThreads of CTA
// t % ctas), then a grid barrier: the grid is at most one CTA per SM, all resident. The last CTA
// past the barrier resets both counters (zero between launches) for the next launch.
template <class Cfg, class P>
__device__ __forceinline__ void pack_wide_rows(const P& p, int cta, GradRounding rounding) {
  const int64_t ctas = gridDim.x;
  for (int64_t t = cta + ctas * threadIdx.x; t < p.tokens; t += ctas * Cfg::kThreads)
    pack_wide_row(p, t, rounding);
  __syncthreads();  // orders every thread's row stores before thread 0's release
  if (threadIdx.x == 0) fused_backward::grid_barrier(p.row_counters, int(ctas), [] {});
  __syncthreads();
}

// Half q of token t's row, as a builder thread loads it a unit ahead (written in this launch by
// other CTAs: through L2, not the non-coherent path). Past the last token: no experts.
struct WideRowHalf {
  uint4 experts;
  uint4 grads;

  __device__ __forceinline__ void load(const WideRow* rows, int64_t t, int64_t tokens, int q) {
    if (t < tokens) {
      experts = __ldcg(&rows[t].experts[q]);
      grads = __ldcg(&rows[t].grads[q]);
    } else {
      experts = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
      grads = make_uint4(0, 0, 0, 0);
    }
  }
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Half a row of one G stage: clears the experts this thread set there last time (`prev`), then
// stores its 8 slots. A row's experts are distinct (the forward guarantees it), so the two halves
// of one token's row never touch the same entry; but the row's previous token (two units back)
// may have had, in the other half, an expert that this token has in this half: the other thread
// then clears the entry this one sets. Both threads of a row are lanes of one warp: every lane's
// clears are ordered before any lane's stores by a warp barrier (the whole warp calls this).
template <int kTileT>
__device__ __forceinline__ void store_wide_half(uint32_t stage, int row, const uint4& prev,
                                                const WideRowHalf& in) {
  const fused_backward::RoutingGradRow<kTileT> addr(stage, row);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t e = (word(prev, k / 2) >> (16 * (k % 2))) & 0xffffu;
    if (e != kNoExpert) fused_backward::st_shared_b16(addr(int(e)), 0);
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t e = (word(in.experts, k / 2) >> (16 * (k % 2))) & 0xffffu;
    if (e != kNoExpert)
      fused_backward::st_shared_b16(addr(int(e)),
                                    uint16_t(word(in.grads, k / 2) >> (16 * (k % 2))));
  }
}

}  // namespace moe_routing::kernels::fused_backward_wide
