// Backward, simple version (the shapes without a fused kernel). Where E and H are multiples of 8
// (TMA's row alignment): G [T, E] as bf16 (routing_grad_dense_bf16; precise mode also its bf16
// residual), then grad_x = G·w and grad_w = Gᵀ·x as tensor-core GEMMs (backward_gemm.cu), the
// fused kernels' numerics. Else: G in fp32 (routing_grad_dense), grad_x = G·w as a sparse sum
// over the K chosen rows of w, and grad_w = Gᵀ·x as a tiled fp32 GEMM on the CUDA cores, every
// sum in fp32. Deterministic either way.
#pragma once

#include <cuda_bf16.h>

#include "kernels/routing_inputs.cuh"

namespace moe_routing::kernels {

struct BackwardParams {
  const __nv_bfloat16* x;          // [T, H]
  const __nv_bfloat16* w;          // [E, H]
  RoutingInputs routing;           // [T, K] indices and gradients, the scores
  __nv_bfloat16* grad_x;           // [T, H]
  void* grad_w;                    // [E, H] f32, or bf16 (grad_w_bf16; written)
  float* dense_grad;               // [T, E] workspace (G)
  int64_t tokens;
  int hidden, experts, top_k;
  float scale;
  bool norm, accumulate, grad_w_bf16;
  bool torch_bf16;  // Precision::kTorchBf16
};

// Token t's G row (E floats at `row`, global or shared memory) by one warp: grad_logit at the
// K chosen experts, scattered into the zeroed row, serially over k so that repeated indices add
// in a fixed order. Indices outside [0, E) contribute nothing.
__device__ __forceinline__ void dense_grad_row(const BackwardParams& p, int64_t t, int lane,
                                               float* row) {
  const auto [e, gl] =
      load_routing_grad_lane(p.routing, t, p.top_k, p.scale, p.norm, p.torch_bf16);
  for (int i = lane; i < p.experts; i += 32) row[i] = 0.0f;
  __syncwarp();
  for (int k = 0; k < p.top_k; ++k) {
    const int ek = __shfl_sync(0xFFFFFFFFu, e, k);
    const float gk = __shfl_sync(0xFFFFFFFFu, gl, k);
    if (lane == 0 && ek >= 0 && ek < p.experts) row[ek] += gk;
    __syncwarp();
  }
}

// One warp per token: G [T, E] in fp32 (p.dense_grad).
__global__ void routing_grad_dense(BackwardParams p) {
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= p.tokens) return;
  dense_grad_row(p, t, threadIdx.x % 32, p.dense_grad + t * p.experts);
}

// As routing_grad_dense, for the tensor-core GEMMs: the row summed in fp32 in shared memory
// (kDenseWarps rows of E floats), then written as bf16 to g, and its rounding residual
// G - bf16(G) as bf16 to g_lo where not null. E even.
constexpr int kDenseWarps = 8;
__global__ void __launch_bounds__(kDenseWarps * 32)
    routing_grad_dense_bf16(BackwardParams p, __nv_bfloat16* g, __nv_bfloat16* g_lo) {
  extern __shared__ float dense_rows[];  // [kDenseWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kDenseWarps + warp;
  if (t >= p.tokens) return;  // (warp-level work alone below)
  float* row = dense_rows + warp * p.experts;
  dense_grad_row(p, t, lane, row);
  __nv_bfloat162* hi_out = reinterpret_cast<__nv_bfloat162*>(g + t * p.experts);
  __nv_bfloat162* lo_out = g_lo ? reinterpret_cast<__nv_bfloat162*>(g_lo + t * p.experts) : nullptr;
  for (int i = lane; i < p.experts / 2; i += 32) {
    const float2 v = make_float2(row[2 * i], row[2 * i + 1]);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
    hi_out[i] = hi;
    if (lo_out) {
      const float2 h = __bfloat1622float2(hi);
      lo_out[i] = __floats2bfloat162_rn(v.x - h.x, v.y - h.y);  // (exact in fp32)
    }
  }
}

// grad_x[t, :] = Σ_k grad_logit[t, k] · w[topk_idx[t, k], :]; one block per token,
// 8 columns per thread.
constexpr int kGradXThreads = 128;
__global__ void __launch_bounds__(kGradXThreads) grad_x_sparse(BackwardParams p) {
  __shared__ float gl_s[32];
  __shared__ int idx_s[32];
  const int64_t t = blockIdx.x;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const auto [e, gl] =
        load_routing_grad_lane(p.routing, t, p.top_k, p.scale, p.norm, p.torch_bf16);
    gl_s[lane] = (e >= 0 && e < p.experts) ? gl : 0.0f;
    idx_s[lane] = (e >= 0 && e < p.experts) ? e : 0;
  }
  __syncthreads();
  const int chunks = p.hidden / 8;
  for (int c = threadIdx.x; c < chunks; c += kGradXThreads) {
    float acc[8] = {};
    for (int k = 0; k < p.top_k; ++k) {
      uint4 wv = __ldg(reinterpret_cast<const uint4*>(p.w + int64_t(idx_s[k]) * p.hidden) + c);
      const __nv_bfloat162* wa = reinterpret_cast<const __nv_bfloat162*>(&wv);
      float g = gl_s[k];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 wf = __bfloat1622float2(wa[i]);
        acc[2 * i] = fmaf(g, wf.x, acc[2 * i]);
        acc[2 * i + 1] = fmaf(g, wf.y, acc[2 * i + 1]);
      }
    }
    uint4 out;
    __nv_bfloat162* oa = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) oa[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    reinterpret_cast<uint4*>(p.grad_x + t * p.hidden)[c] = out;
  }
}

// grad_w[e, h] (+)= Σ_t G[t, e] · x[t, h]: 64×64 output tile per block, 256 threads each
// owning a 4×4 patch, tokens in chunks of 16 through shared memory.
constexpr int kWgTile = 64, kWgChunk = 16, kWgThreads = 256;
__global__ void __launch_bounds__(kWgThreads) grad_w_tiled(BackwardParams p) {
  __shared__ float g_s[kWgChunk][kWgTile];
  __shared__ float x_s[kWgChunk][kWgTile];
  const int e0 = blockIdx.y * kWgTile, h0 = blockIdx.x * kWgTile;
  const int te = threadIdx.x / 16, th = threadIdx.x % 16;
  float acc[4][4] = {};
  for (int64_t t0 = 0; t0 < p.tokens; t0 += kWgChunk) {
    for (int i = threadIdx.x; i < kWgChunk * kWgTile; i += kWgThreads) {
      int r = i / kWgTile, c = i % kWgTile;
      int64_t t = t0 + r;
      bool tv = t < p.tokens;
      g_s[r][c] = (tv && e0 + c < p.experts) ? p.dense_grad[t * p.experts + e0 + c] : 0.0f;
      x_s[r][c] = (tv && h0 + c < p.hidden) ? __bfloat162float(p.x[t * p.hidden + h0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kWgChunk; ++r) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = g_s[r][te * 4 + i], b[i] = x_s[r][th * 4 + i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    int e = e0 + te * 4 + i;
    if (e >= p.experts) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int h = h0 + th * 4 + j;
      if (h >= p.hidden) continue;
      const int64_t o = int64_t(e) * p.hidden + h;
      if (p.grad_w_bf16) {
        static_cast<__nv_bfloat16*>(p.grad_w)[o] = __float2bfloat16_rn(acc[i][j]);
      } else {
        float* dst = static_cast<float*>(p.grad_w) + o;
        *dst = p.accumulate ? *dst + acc[i][j] : acc[i][j];
      }
    }
  }
}

}  // namespace moe_routing::kernels
