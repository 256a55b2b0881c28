// The forward's per-token selection by one warp from scores in shared memory: the reference
// semantics of every forward path (the simple kernel and the unfused baseline use it; the
// fused kernel's register version in fused_forward/route.cuh implements the same ranking).
#pragma once

#include <cuda_bf16.h>

#include "kernels/routing.cuh"

namespace moe_routing::kernels {

struct ForwardParams {
  const __nv_bfloat16* x;  // [T, H]
  const __nv_bfloat16* w;  // [E, H]
  const float* bias;       // [E]
  void* topk_idx;          // [T, K] int32, or int64 where idx_i64
  float* topk_weights;     // [T, K]
  float* topk_scores;      // [T, K]
  float* scores;           // [T, E] or null
  int32_t* counts;         // [E] (zeroed by the host) or null
  int64_t tokens;
  int hidden, experts, top_k, n_group, topk_group;
  float scale;
  bool norm;
  bool idx_i64 = false;
};

// One token's routing by one warp (all 32 lanes), from score[e] = sigmoid(logit) and
// choice[e] = score + bias in shared memory; `key` (E), `group_score` and `kept` (n_group) are
// shared scratch. Writes the token's outputs (and counts) from lanes k < K.
__device__ __forceinline__ void route_token_warp(const ForwardParams& p, int64_t t,
                                                 const float* score, const float* choice,
                                                 uint64_t* key, float* group_score,
                                                 uint8_t* kept) {
  const int E = p.experts;
  const int lane = threadIdx.x % 32;
  const int per_group = E / p.n_group;
  if (p.n_group > 1) {
    // Group score: sum of the two best choices of the group (ranked as in top-k).
    for (int g = lane; g < p.n_group; g += 32) {
      uint64_t k1 = 0, k2 = 0;
      for (int i = 0; i < per_group; ++i) {
        int e = g * per_group + i;
        uint64_t k = rank_key(choice[e], e);
        if (k > k1) { k2 = k1; k1 = k; } else if (k > k2) { k2 = k; }
      }
      group_score[g] = choice[key_index(k1)] + choice[key_index(k2)];
      kept[g] = 0;
    }
    __syncwarp();
    for (int r = 0; r < p.topk_group; ++r) {
      uint64_t best = 0;
      for (int g = lane; g < p.n_group; g += 32)
        if (!kept[g]) { uint64_t k = rank_key(group_score[g], g); best = k > best ? k : best; }
      best = warp_max_u64(best);
      if (lane == 0) kept[key_index(best)] = 1;
      __syncwarp();
    }
  }
  for (int e = lane; e < E; e += 32)
    key[e] = (p.n_group == 1 || kept[e / per_group]) ? rank_key(choice[e], e) : 0;
  __syncwarp();

  int my_idx = 0;
  for (int k = 0; k < p.top_k; ++k) {
    uint64_t best = 0;
    for (int e = lane; e < E; e += 32) best = key[e] > best ? key[e] : best;
    best = warp_max_u64(best);
    int e = key_index(best);
    if (lane == k) my_idx = e;
    if (lane == 0) key[e] = 0;
    __syncwarp();
  }
  const bool active = lane < p.top_k;
  float s = active ? score[my_idx] : 0.0f;
  float wgt = s;
  if (p.norm) wgt = s / (warp_sum(s) + 1e-20f);
  wgt *= p.scale;
  if (active) {
    int64_t o = t * p.top_k + lane;
    if (p.idx_i64) static_cast<int64_t*>(p.topk_idx)[o] = my_idx;
    else static_cast<int32_t*>(p.topk_idx)[o] = my_idx;
    p.topk_weights[o] = wgt;
    p.topk_scores[o] = s;
    if (p.counts) atomicAdd(p.counts + my_idx, 1);
  }
}

// Shared scratch of route_token_warp plus the scores: float score[E], float choice[E],
// uint64 key[E], float group_score[n_group], uint8 kept[n_group].
__host__ __device__ inline size_t forward_simple_smem_bytes(int experts, int n_group) {
  return size_t(experts) * 16 + size_t(n_group) * 5;
}

}  // namespace moe_routing::kernels
