// The fused forward's routing epilogue: one or two tokens per group of kWidth lanes, their E
// logits in registers (lane j of the group holds experts e = j + kWidth·i). Same selection as the simple
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
  // E: the kernel's instantiation (kExperts) or fewer, the rest masked (w's rows beyond E
  // arrive as zeros, their bias is NaN: never chosen; no scores output).
  int experts;
};

// The weight of a chosen expert from its score and the sum of the token's chosen scores (summed
// in selection order by the caller): one formula for every routing path, so the same bits.
__device__ __forceinline__ float topk_weight(float score, float sum, const RouteParams& p) {
  return (p.norm ? score / (sum + 1e-20f) : score) * p.scale;
}

// Outputs of one token; `scores` (T × E) and `counts` (shared, E) may be null.
struct RouteOut {
  void* topk_idx;  // [T, K] int32, or int64 where idx_i64
  float* topk_weights;
  float* topk_scores;
  float* scores;
  int* counts;
  bool idx_i64;
  __device__ __forceinline__ void store_idx(int64_t o, int e) const {
    if (idx_i64) static_cast<int64_t*>(topk_idx)[o] = e;
    else static_cast<int32_t*>(topk_idx)[o] = e;
  }
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
    const int per_group = p.experts / p.n_group;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {  // (masked experts: groups >= n_group, never kept; < 32)
      const int g = (sub + kWidth * i) / per_group;
      gid[i] = g < 31 ? g : 31;
    }
  }

  // Routes kTok tokens per group of kWidth lanes at once: their dependent chains (shuffle
  // reductions, compare-select scans) interleave, which the few warps of the epilogue need to
  // keep the schedulers busy. Called by all 32 lanes (shuffles); `valid[u]` false: compute,
  // write nothing. `choice_row[u]`: E floats of shared scratch private to token u's lanes.
  template <int kTok>
  __device__ __forceinline__ static void run(const float (&logit)[kTok][kPer],
                                             const float (&bias)[kPer], const int (&gid)[kPer],
                                             float* const (&choice_row)[kTok],
                                             const RouteParams& p, const RouteOut& out,
                                             const int64_t (&t)[kTok], const bool (&valid)[kTok]) {
    const int sub = threadIdx.x % kWidth;
    float score[kTok][kPer];
    uint64_t key[kTok][kPer];
#pragma unroll
    for (int u = 0; u < kTok; ++u) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int e = sub + kWidth * i;
        score[u][i] = sigmoid(logit[u][i]);
        const float c = score[u][i] + bias[i];
        key[u][i] = rank_key(c, e);  // (masked experts: NaN bias, below every real expert)
        if (p.n_group > 1) choice_row[u][e] = c;
      }
    }
    MOE_ROUTING_TRACE(threadIdx.x == 128, 10);

    if (p.n_group > 1) {
      __syncwarp();
      const int per_group = p.experts / p.n_group;
      // Group score: sum of the group's two best choices (ranked as in top-k). Lane `sub`
      // scores groups sub, sub + kWidth, ...
      uint64_t gkey[kTok][kGroupSlots];
#pragma unroll
      for (int j = 0; j < kGroupSlots; ++j) {
        const int g = sub + kWidth * j;
#pragma unroll
        for (int u = 0; u < kTok; ++u) gkey[u][j] = 0;
        if (g < p.n_group) {
          // Two interleaved scans per token (even and odd members), merged.
          uint64_t a1[kTok], a2[kTok], b1[kTok], b2[kTok];
#pragma unroll
          for (int u = 0; u < kTok; ++u) a1[u] = a2[u] = b1[u] = b2[u] = 0;
          const int e0 = g * per_group;
          int i = 0;
          for (; i + 1 < per_group; i += 2) {
#pragma unroll
            for (int u = 0; u < kTok; ++u) {
              top2_insert(a1[u], a2[u], rank_key(choice_row[u][e0 + i], e0 + i));
              top2_insert(b1[u], b2[u], rank_key(choice_row[u][e0 + i + 1], e0 + i + 1));
            }
          }
#pragma unroll
          for (int u = 0; u < kTok; ++u) {
            if (i < per_group) top2_insert(a1[u], a2[u], rank_key(choice_row[u][e0 + i], e0 + i));
            top2_insert(a1[u], a2[u], b1[u]);
            top2_insert(a1[u], a2[u], b2[u]);
            gkey[u][j] = rank_key(choice_row[u][key_index(a1[u])] + choice_row[u][key_index(a2[u])], g);
          }
        }
      }
      uint32_t kept[kTok];
#pragma unroll
      for (int u = 0; u < kTok; ++u) kept[u] = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        uint64_t best[kTok];
#pragma unroll
        for (int u = 0; u < kTok; ++u) {
          best[u] = 0;
#pragma unroll
          for (int j = 0; j < kGroupSlots; ++j) best[u] = gkey[u][j] > best[u] ? gkey[u][j] : best[u];
        }
#pragma unroll
        for (int u = 0; u < kTok; ++u) best[u] = group_max_u64<kWidth>(best[u]);
#pragma unroll
        for (int u = 0; u < kTok; ++u) {
          kept[u] |= 1u << key_index(best[u]);
#pragma unroll
          for (int j = 0; j < kGroupSlots; ++j) gkey[u][j] = gkey[u][j] == best[u] ? 0 : gkey[u][j];
        }
      }
#pragma unroll
      for (int u = 0; u < kTok; ++u)
#pragma unroll
        for (int i = 0; i < kPer; ++i)
          if (!((kept[u] >> gid[i]) & 1u)) key[u][i] = 0;
      __syncwarp();  // choice_row reads done before the next tokens overwrite it
    }
    MOE_ROUTING_TRACE(threadIdx.x == 128, 11);

    int sel_idx[kTok][kSelSlots];
    float sel_score[kTok][kSelSlots];
    float sum[kTok];
    uint64_t local[kTok];  // the lane's best remaining candidate
#pragma unroll
    for (int u = 0; u < kTok; ++u) {
#pragma unroll
      for (int j = 0; j < kSelSlots; ++j) sel_idx[u][j] = 0, sel_score[u][j] = 0.0f;
      sum[u] = 0.0f;
      local[u] = max_key<kPer>(key[u]);
    }
    for (int k = 0; k < p.top_k; ++k) {
      uint64_t best[kTok];
#pragma unroll
      for (int u = 0; u < kTok; ++u) best[u] = group_max_u64<kWidth>(local[u]);
#pragma unroll
      for (int u = 0; u < kTok; ++u) {
        const int e = key_index(best[u]);
        float mine = 0.0f;
#pragma unroll
        for (int i = 0; i < kPer; ++i)  // take the winner out (keys are unique: only its owner)
          if (key[u][i] == best[u]) mine = score[u][i], key[u][i] = 0;
        local[u] = max_key<kPer>(key[u]);
        const float s = __shfl_sync(0xFFFFFFFFu, mine, e % kWidth, kWidth);
        sum[u] += s;  // selection order: the same bits every run
#pragma unroll
        for (int j = 0; j < kSelSlots; ++j)
          if (k == sub + kWidth * j) sel_idx[u][j] = e, sel_score[u][j] = s;
      }
    }
    MOE_ROUTING_TRACE(threadIdx.x == 128, 12);
#pragma unroll
    for (int u = 0; u < kTok; ++u) {
      if (!valid[u]) continue;
#pragma unroll
      for (int j = 0; j < kSelSlots; ++j) {
        const int k = sub + kWidth * j;
        if (k < p.top_k) {
          const float s = sel_score[u][j];
          const int64_t o = t[u] * p.top_k + k;
          out.store_idx(o, sel_idx[u][j]);
          out.topk_weights[o] = topk_weight(s, sum[u], p);
          out.topk_scores[o] = s;
          if (out.counts) atomicAdd(out.counts + sel_idx[u][j], 1);
        }
      }
      if (out.scores) {
        float* row = out.scores + t[u] * p.experts + sub;
        const int n = p.experts / kWidth;  // (E a multiple of kWidth: lane sub's experts below E)
#pragma unroll
        for (int i = 0; i < kPer; ++i)
          if (i < n) row[kWidth * i] = score[u][i];
      }
    }
  }
};

}  // namespace moe_routing::kernels::fused_forward
