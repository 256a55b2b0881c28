// The fused forward's routing epilogue for CTAs with few rows (small T): one warp per token,
// each choice found by warp reductions (redux.sync) instead of a per-lane sorted list.
//
// Lane l holds experts [l·kPer, (l + 1)·kPer) (kPer = E / 32), so a group of E / n_group experts
// is 32 / n_group whole lanes where n_group divides 32. Per token:
//   group scores   each lane's two best choice keys, merged over the group's lanes (xor
//                  shuffles), summed as values: the same key as route_thread.cuh's scan
//   kept groups    group g is kept where fewer than topk_group groups rank above it
//   choices        each lane's experts sorted once; top_k rounds: redux max of the lanes'
//                  heads, the lowest lane holding it wins (larger key first, then the lower
//                  expert, as rank_key orders them) and shifts its list
//   weights        the chosen scores summed in selection order (the bits of the other paths)
// A round is a short dependent chain (one reduction, a ballot, the shift), where the few-lanes
// routing's per-lane lists are a long one; it wins where a CTA has few rows (8-16 on an H200;
// docs/perf-log/forward.md, "v14"); at 512 experts, 16 a lane, where top_k > 8 (v17).
#pragma once

#include <cstdint>

#include "kernels/fused_forward/route.cuh"
#include "kernels/fused_forward/route_thread.cuh"

namespace moe_routing::kernels::fused_forward {

template <int kExperts>
struct ReduxRoute {
  static_assert(kExperts % 32 == 0 && kExperts <= 512, "whole experts per lane, at most 16");
  static constexpr int kPer = kExperts / 32;
  static constexpr uint32_t kFull = 0xFFFFFFFFu;

  // Groups of whole lanes, one choice per round up to 32.
  __host__ __device__ static bool supports(const RouteParams& p) {
    return p.n_group >= 1 && p.n_group <= 32 && 32 % p.n_group == 0 && p.top_k >= 1 &&
           p.top_k <= 32 && p.topk_group >= 1 && p.topk_group <= p.n_group;
  }

  // Rows [0, rows) of scores at `scores` (`stride` floats apart, shared memory), row r token
  // row0 + r (outputs only below `tokens`), kTok at a time on warp `warp` of `warps`: warp w
  // takes rows [w·kTok, (w + 1)·kTok), then those `warps`·kTok further on. A spare slot of the
  // last pass repeats the last row and writes nothing. Every lane of the warp calls this.
  template <int kTok>
  __device__ __forceinline__ static void run_rows(const float* scores, int stride, int rows,
                                                  int64_t row0, int64_t tokens, int warp,
                                                  int warps, const float* bias,
                                                  const RouteParams& p, const RouteOut& out) {
    for (int r0 = warp * kTok; r0 < rows; r0 += warps * kTok) {  // warp-uniform
      const float* s[kTok];
      int64_t t[kTok];
      bool valid[kTok];
#pragma unroll
      for (int u = 0; u < kTok; ++u) {
        const int r = r0 + u < rows ? r0 + u : rows - 1;
        s[u] = scores + r * stride;
        t[u] = row0 + r;
        valid[u] = r0 + u < rows && t[u] < tokens;
      }
      run<kTok>(s, bias, p, out, t, valid);
    }
  }

  // kTok tokens per warp at once (their chains interleave): token u's scores at s[u] (E floats,
  // shared memory), its outputs written where valid[u]. bias: E floats in shared memory. Every
  // lane of the warp calls this.
  template <int kTok>
  __device__ __forceinline__ static void run(const float* const (&s)[kTok], const float* bias,
                                             const RouteParams& p, const RouteOut& out,
                                             const int64_t (&t)[kTok], const bool (&valid)[kTok]) {
    const int lane = threadIdx.x % 32;
    const int e0 = lane * kPer;
    uint32_t key[kTok][kPer];
    if constexpr (kPer % 4 == 0) {  // 16-byte vectors: a quarter-warp's reads in distinct banks
#pragma unroll
      for (int i = 0; i < kPer; i += 4) {
        const float4 b = *reinterpret_cast<const float4*>(bias + e0 + i);
#pragma unroll
        for (int u = 0; u < kTok; ++u) {
          const float4 v = *reinterpret_cast<const float4*>(s[u] + e0 + i);
          key[u][i] = choice_key(v.x + b.x), key[u][i + 1] = choice_key(v.y + b.y);
          key[u][i + 2] = choice_key(v.z + b.z), key[u][i + 3] = choice_key(v.w + b.w);
        }
      }
    } else {  // lanes kPer words apart: distinct banks for odd kPer (E = 64, kPer = 2: two-way)
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const float b = bias[e0 + i];
#pragma unroll
        for (int u = 0; u < kTok; ++u) key[u][i] = choice_key(s[u][e0 + i] + b);
      }
    }

    // Each lane's experts sorted (odd-even transposition: larger key first, the lower expert
    // on ties), so that a lane's best is its head and a round only shifts the winner's list.
    int pos[kTok][kPer];  // expert e0 + pos
#pragma unroll
    for (int u = 0; u < kTok; ++u) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) pos[u][i] = i;
#pragma unroll
      for (int pass = 0; pass < kPer; ++pass) {
#pragma unroll
        for (int i = pass % 2; i + 1 < kPer; i += 2) {
          const bool swap = key[u][i + 1] > key[u][i] ||
                            (key[u][i + 1] == key[u][i] && pos[u][i + 1] < pos[u][i]);
          const uint32_t ka = key[u][i], kb = key[u][i + 1];
          const int pa = pos[u][i], pb = pos[u][i + 1];
          key[u][i] = swap ? kb : ka, key[u][i + 1] = swap ? ka : kb;
          pos[u][i] = swap ? pb : pa, pos[u][i + 1] = swap ? pa : pb;
        }
      }
    }

    if (p.n_group > 1) {
      const int lanes = 32 / p.n_group;  // per group
      uint32_t k1[kTok], k2[kTok];       // the group's two largest keys, with multiplicity
#pragma unroll
      for (int u = 0; u < kTok; ++u) {
        k1[u] = key[u][0];
        if constexpr (kPer > 1) k2[u] = key[u][1];
        else k2[u] = 0u;
      }
      for (int o = 1; o < lanes; o <<= 1) {
#pragma unroll
        for (int u = 0; u < kTok; ++u) {
          const uint32_t b1 = __shfl_xor_sync(kFull, k1[u], o);
          const uint32_t b2 = __shfl_xor_sync(kFull, k2[u], o);
          k2[u] = umax(umin(k1[u], b1), umax(k2[u], b2));
          k1[u] = umax(k1[u], b1);
        }
      }
      const int g = lane / lanes;
#pragma unroll
      for (int u = 0; u < kTok; ++u) {
        const uint32_t gk = choice_key(key_value(k1[u]) + key_value(k2[u]));
        int above = 0;
        for (int h = 0; h < p.n_group; ++h) {
          const uint32_t kh = __shfl_sync(kFull, gk, h * lanes);
          above += kh > gk || (kh == gk && h < g);
        }
        if (above >= p.topk_group) key[u][0] = 0;  // nothing: the lane never wins a round
      }
    }

    // Round j: the largest head over the warp (redux), held by the lowest lane whose head it is
    // (ballot); that lane's list shifts. Choice j goes to lane j.
    const uint32_t lanes_below = (1u << lane) - 1u;
    int idx[kTok];
#pragma unroll
    for (int u = 0; u < kTok; ++u) idx[u] = 0;
    for (int j = 0; j < p.top_k; ++j) {
#pragma unroll
      for (int u = 0; u < kTok; ++u) {
        const uint32_t m = __reduce_max_sync(kFull, key[u][0]);
        const uint32_t holders = __ballot_sync(kFull, key[u][0] == m);
        // The lowest lane holding it: its experts are below every higher lane's, and its head
        // is its lowest expert of that key.
        const bool won = key[u][0] == m && (holders & lanes_below) == 0;
        const int e = __shfl_sync(kFull, e0 + pos[u][0], __ffs(holders) - 1);  // off the chain
#pragma unroll
        for (int i = 0; i + 1 < kPer; ++i) {
          key[u][i] = won ? key[u][i + 1] : key[u][i];
          pos[u][i] = won ? pos[u][i + 1] : pos[u][i];
        }
        key[u][kPer - 1] = won ? 0u : key[u][kPer - 1];
        idx[u] = lane == j ? e : idx[u];
      }
    }

    // Weights: the chosen scores summed in selection order, from 0.
#pragma unroll
    for (int u = 0; u < kTok; ++u) {
      const float sel = lane < p.top_k ? s[u][idx[u]] : 0.0f;
      float sum = 0.0f;
      for (int j = 0; j < p.top_k; ++j) sum += __shfl_sync(kFull, sel, j);
      if (valid[u] && lane < p.top_k) {
        const int64_t o = t[u] * p.top_k + lane;
        out.store_idx(o, idx[u]);
        out.topk_weights[o] = topk_weight(sel, sum, p);
        out.topk_scores[o] = sel;
        if (out.counts) atomicAdd(out.counts + idx[u], 1);
      }
    }
  }
};

}  // namespace moe_routing::kernels::fused_forward
