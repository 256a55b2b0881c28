// The unfused baselines' non-GEMM steps, as a framework would run them around library GEMMs,
// and a plain copy. Used by the benchmarks.
//   backward: the dense routing gradient G [T, E] in bf16, before two GEMMs
//   forward:  the routing from fp32 logits [T, E] (after the GEMM x·wᵀ)
//   copy:     a case's bytes moved with no compute (the ceiling), or written alone (L2 flush)
#include <algorithm>

#include <cuda_bf16.h>

#include "src/forward_params.h"
#include "kernels/route_warp.cuh"
#include "kernels/routing.cuh"
#include "src/launch.h"
#include "baseline.h"
#include "src/validate.h"

namespace moe_routing::kernels {

__global__ void routing_grad_dense_bf16(const int32_t* topk_idx, const float* topk_scores,
                                        const float* grad_topk_weights, __nv_bfloat16* dense,
                                        int64_t tokens, int experts, int top_k, float scale,
                                        bool norm) {
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= tokens) return;
  const auto [e, gl] = load_routing_grad_lane(topk_idx, topk_scores, grad_topk_weights, t, top_k,
                                              scale, norm);
  __nv_bfloat16* row = dense + t * experts;
  for (int i = lane; i < experts; i += 32) {
    float v = 0.0f;
    for (int k = 0; k < top_k; ++k) {  // shuffles outside the branch: all lanes take part
      const int ek = __shfl_sync(0xFFFFFFFFu, e, k);
      const float gk = __shfl_sync(0xFFFFFFFFu, gl, k);
      if (ek == i) v += gk;
    }
    row[i] = __float2bfloat16(v);
  }
}

constexpr int kRouteWarps = 8;

__host__ __device__ inline size_t route_scratch_bytes(int experts, int n_group) {
  return (forward_simple_smem_bytes(experts, n_group) + 15) / 16 * 16;
}

// One warp per token: sigmoid, bias, then the simple forward's selection, from fp32 logits.
__global__ void __launch_bounds__(kRouteWarps * 32) route_from_logits(ForwardParams p,
                                                                      const float* logits) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int E = p.experts;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = smem + warp * route_scratch_bytes(E, p.n_group);
  float* score = reinterpret_cast<float*>(mine);
  float* choice = score + E;
  uint64_t* key = reinterpret_cast<uint64_t*>(choice + E);
  float* group_score = reinterpret_cast<float*>(key + E);
  uint8_t* kept = reinterpret_cast<uint8_t*>(group_score + p.n_group);
  const int64_t t = int64_t(blockIdx.x) * kRouteWarps + warp;
  if (t >= p.tokens) return;  // whole warps
  for (int e = lane; e < E; e += 32) {
    const float s = sigmoid(logits[t * E + e]);
    score[e] = s;
    choice[e] = s + p.bias[e];
  }
  __syncwarp();
  route_token_warp(p, t, score, choice, key, group_score, kept);
}

// The copy (research/ceiling's kernel): 16-byte vectors, kCopyUnroll of them in flight per thread.
constexpr int kCopyThreads = 256, kCopyUnroll = 4;

// Cache hints: `.cs` (streaming, evict first) or the default.
template <bool kStreaming>
__device__ __forceinline__ uint4 load_vector(const uint4* p) {
  return kStreaming ? __ldcs(p) : *p;
}
template <bool kStreaming>
__device__ __forceinline__ void store_vector(uint4* p, uint4 v) {
  if (kStreaming)
    __stcs(p, v);
  else
    *p = v;
}

// Vectors [0, max(reads, writes)): vector i read from `in` where i < reads, written to `out`
// where i < writes (the vector read, or one made of i where there is none, so that every store
// depends on a load where there is one). Grid-stride; a grid that covers every vector at once
// runs each thread's loop once.
template <bool kLoadCs, bool kStoreCs>
__global__ void __launch_bounds__(kCopyThreads) copy_vectors(const uint4* __restrict__ in,
                                                             uint4* __restrict__ out,
                                                             int64_t reads, int64_t writes) {
  const int64_t n = reads > writes ? reads : writes;
  for (int64_t base = int64_t(blockIdx.x) * kCopyThreads * kCopyUnroll + threadIdx.x; base < n;
       base += int64_t(gridDim.x) * kCopyThreads * kCopyUnroll) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {  // all loads issued before any store
      const int64_t i = base + int64_t(u) * kCopyThreads;
      v[u] = i < reads ? load_vector<kLoadCs>(in + i) : make_uint4(uint32_t(i), 1, 2, 3);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kCopyThreads;
      if (i < writes) store_vector<kStoreCs>(out + i, v[u]);
    }
  }
}

}  // namespace moe_routing::kernels

namespace moe_routing::baseline {

Status routing_grad_dense_bf16(const RouterConfig& cfg, int64_t tokens, const int32_t* topk_idx,
                               const float* topk_scores, const float* grad_topk_weights,
                               uint16_t* dense, cudaStream_t stream) {
  if (Status s = validate_config(cfg); s != Status::kSuccess) return s;
  if (tokens < 0 || tokens > INT32_MAX) return Status::kInvalidShape;
  if (tokens == 0) return Status::kSuccess;
  if (!topk_idx || !topk_scores || !grad_topk_weights || !dense) return Status::kNullPointer;
  constexpr int kWarps = 8;
  kernels::routing_grad_dense_bf16<<<unsigned(detail::ceil_div(tokens, kWarps)), kWarps * 32, 0,
                                     stream>>>(
      topk_idx, topk_scores, grad_topk_weights, reinterpret_cast<__nv_bfloat16*>(dense), tokens,
      int(cfg.n_routed_experts), int(cfg.num_experts_per_tok), cfg.routed_scaling_factor,
      cfg.norm_topk_prob);
  return detail::last_launch_status();
}

Status route_from_logits(const RouterConfig& cfg, int64_t tokens, const float* logits,
                         const float* bias, int32_t* topk_idx, float* topk_weights,
                         float* topk_scores, cudaStream_t stream) {
  if (Status s = validate_config(cfg); s != Status::kSuccess) return s;
  if (tokens < 0 || tokens > INT32_MAX) return Status::kInvalidShape;
  if (tokens == 0) return Status::kSuccess;
  if (!logits || !bias || !topk_idx || !topk_weights || !topk_scores) return Status::kNullPointer;
  kernels::ForwardParams p = detail::forward_params(cfg, tokens);
  p.bias = bias;
  p.topk_idx = topk_idx;
  p.topk_weights = topk_weights;
  p.topk_scores = topk_scores;
  const size_t smem = kernels::kRouteWarps * kernels::route_scratch_bytes(p.experts, p.n_group);
  if (smem > 48 * 1024) return Status::kUnsupported;  // no opt-in: a benchmark helper
  kernels::route_from_logits<<<unsigned(detail::ceil_div(tokens, kernels::kRouteWarps)),
                               kernels::kRouteWarps * 32, smem, stream>>>(p, logits);
  return detail::last_launch_status();
}

Status copy_bytes(const void* in, void* out, int64_t read_bytes, int64_t write_bytes,
                  int ctas_per_sm, bool streaming_loads, bool streaming_stores,
                  cudaStream_t stream) {
  if (read_bytes < 0 || write_bytes < 0 || ctas_per_sm < 0 || ctas_per_sm > 32)
    return Status::kInvalidShape;
  if ((read_bytes > 0 && !in) || (write_bytes > 0 && !out)) return Status::kNullPointer;
  if ((read_bytes > 0 && !detail::aligned16(in)) || (write_bytes > 0 && !detail::aligned16(out)))
    return Status::kMisaligned;
  const int64_t reads = detail::ceil_div(read_bytes, 16);
  const int64_t writes = detail::ceil_div(write_bytes, 16);
  const int64_t n = reads > writes ? reads : writes;
  if (n == 0) return Status::kSuccess;
  constexpr int64_t kPerCta = int64_t(kernels::kCopyThreads) * kernels::kCopyUnroll;
  int64_t grid = detail::ceil_div(n, kPerCta);  // one pass
  if (ctas_per_sm > 0) {
    int device = 0, sms = 0;
    if (Status s = detail::cuda_status(cudaGetDevice(&device)); s != Status::kSuccess) return s;
    if (Status s = detail::cuda_status(
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        s != Status::kSuccess)
      return s;
    grid = std::min<int64_t>(grid, int64_t(sms) * ctas_per_sm);
  }
  if (grid > INT32_MAX) return Status::kInvalidShape;
  auto* src = static_cast<const uint4*>(in);
  auto* dst = static_cast<uint4*>(out);
  const dim3 g(unsigned(grid), 1, 1), b(kernels::kCopyThreads, 1, 1);
  if (streaming_loads && streaming_stores)
    kernels::copy_vectors<true, true><<<g, b, 0, stream>>>(src, dst, reads, writes);
  else if (streaming_loads)
    kernels::copy_vectors<true, false><<<g, b, 0, stream>>>(src, dst, reads, writes);
  else if (streaming_stores)
    kernels::copy_vectors<false, true><<<g, b, 0, stream>>>(src, dst, reads, writes);
  else
    kernels::copy_vectors<false, false><<<g, b, 0, stream>>>(src, dst, reads, writes);
  return detail::last_launch_status();
}

}  // namespace moe_routing::baseline
