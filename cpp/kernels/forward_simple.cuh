// Forward, simple version: one block per token computes its E logits (fp32 accumulation of
// bf16 products), then one warp does sigmoid, bias, group selection, top-k and weights.
#pragma once

#include <cuda_bf16.h>

#include "kernels/route_warp.cuh"

namespace moe_routing::kernels {

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

  route_token_warp(p, t, score, choice, key, group_score, kept);
}

}  // namespace moe_routing::kernels
