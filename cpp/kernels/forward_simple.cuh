// Forward, simple version: one block per token computes its E logits (fp32 accumulation of
// bf16 products), then one warp does sigmoid, bias, group selection, top-k and weights.
#pragma once

#include <cuda_bf16.h>

#include "kernels/routing.cuh"

namespace moe_routing::kernels {

struct ForwardParams {
  const __nv_bfloat16* x;  // [T, H]
  const __nv_bfloat16* w;  // [E, H]
  const float* bias;       // [E]
  int32_t* topk_idx;       // [T, K]
  float* topk_weights;     // [T, K]
  float* topk_scores;      // [T, K]
  float* scores;           // [T, E] or null
  int32_t* counts;         // [E] (zeroed by the host) or null
  int64_t tokens;
  int hidden, experts, top_k, n_group, topk_group;
  float scale;
  bool norm;
};

constexpr int kForwardThreads = 256;

// Dynamic smem: float score[E], float choice[E], uint64 key[E], float group_score[n_group],
// uint8 kept[n_group].
__global__ void __launch_bounds__(kForwardThreads) router_forward_simple(ForwardParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int E = p.experts;
  float* score = reinterpret_cast<float*>(smem);
  float* choice = score + E;
  uint64_t* key = reinterpret_cast<uint64_t*>(choice + E);  // 8E bytes in: aligned
  float* group_score = reinterpret_cast<float*>(key + E);
  uint8_t* kept = reinterpret_cast<uint8_t*>(group_score + p.n_group);

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = p.hidden / 8;
  const uint4* xrow = reinterpret_cast<const uint4*>(p.x + t * p.hidden);
  for (int e = warp; e < E; e += kForwardThreads / 32) {
    const uint4* wrow = reinterpret_cast<const uint4*>(p.w + int64_t(e) * p.hidden);
    float acc = 0.0f;
    for (int c = lane; c < chunks; c += 32) {
      uint4 xv = __ldg(xrow + c), wv = __ldg(wrow + c);
      const __nv_bfloat162* xa = reinterpret_cast<const __nv_bfloat162*>(&xv);
      const __nv_bfloat162* wa = reinterpret_cast<const __nv_bfloat162*>(&wv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 xf = __bfloat1622float2(xa[i]), wf = __bfloat1622float2(wa[i]);
        acc = fmaf(xf.x, wf.x, acc);
        acc = fmaf(xf.y, wf.y, acc);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      float s = sigmoid(acc);
      score[e] = s;
      choice[e] = s + p.bias[e];
    }
  }
  __syncthreads();
  if (p.scores)
    for (int e = threadIdx.x; e < E; e += kForwardThreads) p.scores[t * E + e] = score[e];
  if (warp != 0) return;

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
    p.topk_idx[o] = my_idx;
    p.topk_weights[o] = wgt;
    p.topk_scores[o] = s;
    if (p.counts) atomicAdd(p.counts + my_idx, 1);
  }
}

inline size_t forward_simple_smem_bytes(int experts, int n_group) {
  return size_t(experts) * 16 + size_t(n_group) * 5;
}

}  // namespace moe_routing::kernels
