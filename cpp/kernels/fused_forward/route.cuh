// The fused forward's routing epilogue: one token per group of kWidth lanes, its E logits in
// registers (lane j of the group holds experts e = j + kWidth·i). Same selection as the simple
// kernel (rank_key: larger first, lower index on ties, NaN below everything), same weights.
#pragma once

#include <cstdint>

#include "kernels/routing.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_forward {

struct RouteParams {
  int top_k, n_group, topk_group;
  float scale;
  bool norm;
};

// Outputs of one token; `scores` (T × E) and `counts` (shared, E) may be null.
struct RouteOut {
  int32_t* topk_idx;
  float* topk_weights;
  float* topk_scores;
  float* scores;
  int* counts;
};

template <int kWidth>
__device__ __forceinline__ uint64_t group_max_u64(uint64_t v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xFFFFFFFFu, v, o, kWidth);
    v = other > v ? other : v;
  }
  return v;
}

// Largest of n keys as a balanced tree: depth ⌈log2 n⌉ instead of a chain of n − 1 compares.
template <int kN>
__device__ __forceinline__ uint64_t max_key(const uint64_t* k) {
  if constexpr (kN == 1) {
    return k[0];
  } else {
    const uint64_t a = max_key<kN / 2>(k), b = max_key<kN - kN / 2>(k + kN / 2);
    return a > b ? a : b;
  }
}

// The two largest keys of a stream (k1 > k2), updated with one more.
__device__ __forceinline__ void top2_insert(uint64_t& k1, uint64_t& k2, uint64_t k) {
  if (k > k1) { k2 = k1; k1 = k; } else if (k > k2) { k2 = k; }
}

template <int kExperts, int kWidth>
struct TokenRoute {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "width");
  static_assert(kExperts % kWidth == 0, "experts split evenly over the lanes of a token");
  static constexpr int kPer = kExperts / kWidth;       // experts per lane
  static constexpr int kMaxGroups = 32;                // kept groups fit a 32-bit mask
  static constexpr int kGroupSlots = (kMaxGroups + kWidth - 1) / kWidth;
  static constexpr int kSelSlots = (16 + kWidth - 1) / kWidth;  // top_k <= 16

  // Group of each of the lane's experts (token-independent: computed once per thread).
  __device__ __forceinline__ static void groups(const RouteParams& p, int (&gid)[kPer]) {
    const int sub = threadIdx.x % kWidth;
    const int per_group = kExperts / p.n_group;
#pragma unroll
    for (int i = 0; i < kPer; ++i) gid[i] = (sub + kWidth * i) / per_group;
  }

  // Called by all 32 lanes (shuffles); `valid` false: compute, write nothing.
  // `choice_row`: E floats of shared scratch private to this token's lanes.
  __device__ __forceinline__ static void run(const float (&logit)[kPer], const float (&bias)[kPer],
                                             const int (&gid)[kPer], float* choice_row,
                                             const RouteParams& p, const RouteOut& out, int64_t t,
                                             bool valid) {
    const int sub = threadIdx.x % kWidth;
    float score[kPer];
    uint64_t key[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = sub + kWidth * i;
      score[i] = sigmoid(logit[i]);
      const float c = score[i] + bias[i];
      key[i] = rank_key(c, e);
      if (p.n_group > 1) choice_row[e] = c;
    }
    MOE_ROUTING_TRACE(threadIdx.x == 128, 10);

    if (p.n_group > 1) {
      __syncwarp();
      const int per_group = kExperts / p.n_group;
      // Group score: sum of the group's two best choices (ranked as in top-k). Lane `sub`
      // scores groups sub, sub + kWidth, ...
      uint64_t gkey[kGroupSlots];
#pragma unroll
      for (int j = 0; j < kGroupSlots; ++j) {
        const int g = sub + kWidth * j;
        gkey[j] = 0;
        if (g < p.n_group) {
          // Two interleaved scans (even and odd members), merged: half the dependent chain.
          uint64_t a1 = 0, a2 = 0, b1 = 0, b2 = 0;
          const int e0 = g * per_group;
          int i = 0;
          for (; i + 1 < per_group; i += 2) {
            top2_insert(a1, a2, rank_key(choice_row[e0 + i], e0 + i));
            top2_insert(b1, b2, rank_key(choice_row[e0 + i + 1], e0 + i + 1));
          }
          if (i < per_group) top2_insert(a1, a2, rank_key(choice_row[e0 + i], e0 + i));
          top2_insert(a1, a2, b1);
          top2_insert(a1, a2, b2);
          gkey[j] = rank_key(choice_row[key_index(a1)] + choice_row[key_index(a2)], g);
        }
      }
      uint32_t kept = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        uint64_t best = 0;
#pragma unroll
        for (int j = 0; j < kGroupSlots; ++j) best = gkey[j] > best ? gkey[j] : best;
        best = group_max_u64<kWidth>(best);
        kept |= 1u << key_index(best);
#pragma unroll
        for (int j = 0; j < kGroupSlots; ++j) gkey[j] = gkey[j] == best ? 0 : gkey[j];
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (!((kept >> gid[i]) & 1u)) key[i] = 0;
      __syncwarp();  // choice_row reads done before the next token overwrites it
    }

    MOE_ROUTING_TRACE(threadIdx.x == 128, 11);
    int sel_idx[kSelSlots];
    float sel_score[kSelSlots];
#pragma unroll
    for (int j = 0; j < kSelSlots; ++j) sel_idx[j] = 0, sel_score[j] = 0.0f;
    float sum = 0.0f;
    uint64_t local = max_key<kPer>(key);  // the lane's best remaining candidate
    for (int k = 0; k < p.top_k; ++k) {
      const uint64_t best = group_max_u64<kWidth>(local);
      const int e = key_index(best);
      float mine = 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i)  // take the winner out (keys are unique: only its owner)
        if (key[i] == best) mine = score[i], key[i] = 0;
      local = max_key<kPer>(key);
      const float s = __shfl_sync(0xFFFFFFFFu, mine, e % kWidth, kWidth);
      sum += s;  // selection order: the same bits every run
#pragma unroll
      for (int j = 0; j < kSelSlots; ++j)
        if (k == sub + kWidth * j) sel_idx[j] = e, sel_score[j] = s;
    }
    MOE_ROUTING_TRACE(threadIdx.x == 128, 12);
    if (!valid) return;
#pragma unroll
    for (int j = 0; j < kSelSlots; ++j) {
      const int k = sub + kWidth * j;
      if (k < p.top_k) {
        const float s = sel_score[j];
        float wgt = s;
        if (p.norm) wgt = s / (sum + 1e-20f);
        wgt *= p.scale;
        const int64_t o = t * p.top_k + k;
        out.topk_idx[o] = sel_idx[j];
        out.topk_weights[o] = wgt;
        out.topk_scores[o] = s;
        if (out.counts) atomicAdd(out.counts + sel_idx[j], 1);
      }
    }
    if (out.scores) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) out.scores[t * kExperts + sub + kWidth * i] = score[i];
    }
  }
};

}  // namespace moe_routing::kernels::fused_forward
