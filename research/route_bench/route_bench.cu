// The fused forward's routing epilogues alone: every CTA holds 128 rows of random scores in
// shared memory, laid out as the kernel's reduction buffer, and routes them as the kernel does
// after its main loop, four times in a row. Prints, per thread count and lanes per token, the
// median and slowest CTA's time per routing of the 128 rows (%globaltimer), the first (code not
// yet cached) and the last, for the few-lanes routing (route_thread.cuh). Then, for 8 to 64 rows
// per CTA on 256 threads, the few-lanes routing against one warp per token (route_redux.cuh,
// one or two tokens per warp at once), and how many outputs of the two differ (none should).
//
//   route_bench [N_GROUP TOPK_GROUP]   E = 160, top 8, 132 CTAs (default: 8 groups, top 4)
//
// Build: research/route_bench/build.sh (needs no GPU); run on a Hopper GPU.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/fused_forward/config.cuh"
#include "kernels/fused_forward/route_redux.cuh"
#include "kernels/fused_forward/route_thread.cuh"

using namespace moe_routing::kernels::fused_forward;

namespace route_bench {

constexpr int kExperts = 160, kRows = 128, kScratch = 64, kReps = 4;
constexpr int kStride = Config<kExperts>::kRedStride;  // the kernel's row stride
constexpr int kCtas = 132;

__device__ unsigned long long g_stamp[kCtas * (kReps + 1)];

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// CTA c routes rows [c·128, (c + 1)·128) of `scores` ([rows, E]) kReps times, kLanes lanes per
// token, kThreads / kLanes tokens per pass.
template <int kLanes, int kThreads>
__global__ void __launch_bounds__(kThreads, 1)
    route_rows(const float* scores, const float* bias_in, RouteParams p, RouteOut out) {
  extern __shared__ float4 smem4[];
  float* red = reinterpret_cast<float*>(smem4);        // [kRows + kScratch][kStride]
  float* bias = red + (kRows + kScratch) * kStride;    // [E]
  int* counts = reinterpret_cast<int*>(bias + kExperts);  // [E]
  for (int i = threadIdx.x; i < kRows * kExperts; i += kThreads)
    red[i / kExperts * kStride + i % kExperts] = scores[int64_t(blockIdx.x) * kRows * kExperts + i];
  for (int e = threadIdx.x; e < kExperts; e += kThreads) bias[e] = bias_in[e], counts[e] = 0;
  __syncthreads();
  RouteOut o = out;
  if (out.counts) o.counts = counts;
  for (int rep = 0; rep < kReps; ++rep) {
    if (threadIdx.x == 0) g_stamp[blockIdx.x * (kReps + 1) + rep] = now();
    for (int r0 = 0; r0 < kRows; r0 += kThreads / kLanes) {
      const int r = r0 + threadIdx.x / kLanes;
      uint32_t* group_keys = reinterpret_cast<uint32_t*>(red + kRows * kStride) + r;
      ThreadRoute<kExperts>::template run<kLanes>(red + r * kStride, bias, group_keys, kRows, p, o,
                                                  int64_t(blockIdx.x) * kRows + r, true,
                                                  threadIdx.x % kLanes);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) g_stamp[blockIdx.x * (kReps + 1) + kReps] = now();
}

// Few rows per CTA (small T, split clusters): CTA c routes its first kFew rows on 256 threads,
// either as the kernel's few-lanes routing (256 / kFew lanes per token, at most kMaxLanes) or
// one warp per token (kTok tokens per warp at once, route_redux.cuh).
template <int kFew, int kRedux, int kTok>
__global__ void __launch_bounds__(256, 1)
    route_few(const float* scores, const float* bias_in, RouteParams p, RouteOut out) {
  extern __shared__ float4 smem4[];
  float* red = reinterpret_cast<float*>(smem4);
  float* bias = red + (kRows + kScratch) * kStride;
  int* counts = reinterpret_cast<int*>(bias + kExperts);
  for (int i = threadIdx.x; i < kFew * kExperts; i += 256)
    red[i / kExperts * kStride + i % kExperts] = scores[int64_t(blockIdx.x) * kRows * kExperts + i];
  for (int e = threadIdx.x; e < kExperts; e += 256) bias[e] = bias_in[e], counts[e] = 0;
  __syncthreads();
  RouteOut o = out;
  if (out.counts) o.counts = counts;
  for (int rep = 0; rep < kReps; ++rep) {
    if (threadIdx.x == 0) g_stamp[blockIdx.x * (kReps + 1) + rep] = now();
    if constexpr (kRedux) {
      ReduxRoute<kExperts>::template run_rows<kTok>(red, kStride, kFew,
                                                    int64_t(blockIdx.x) * kRows, INT64_MAX,
                                                    threadIdx.x / 32, 8, bias, p, o);
    } else {
      constexpr int kMax = ThreadRoute<kExperts>::kMaxLanes;
      constexpr int kLanes = 256 / kFew < kMax ? 256 / kFew : kMax;
      const int r = threadIdx.x / kLanes;
      if (r < kFew) {
        uint32_t* group_keys = reinterpret_cast<uint32_t*>(red + kRows * kStride) + r;
        ThreadRoute<kExperts>::template run<kLanes>(red + r * kStride, bias, group_keys, kRows, p,
                                                    o, int64_t(blockIdx.x) * kRows + r, true,
                                                    threadIdx.x % kLanes);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) g_stamp[blockIdx.x * (kReps + 1) + kReps] = now();
}

#include "../cuda_check.h"

}  // namespace route_bench
using namespace route_bench;

int main(int argc, char** argv) {
  const int n_group = argc > 1 ? std::atoi(argv[1]) : 8;
  const int topk_group = argc > 2 ? std::atoi(argv[2]) : 4;
  constexpr int kTopK = 8;
  std::vector<float> scores(size_t(kCtas) * kRows * kExperts), bias(kExperts);
  uint32_t state = 12345u;
  auto uniform = [&] { state = state * 1664525u + 1013904223u; return (state >> 8) / 16777216.0f; };
  for (float& v : scores) v = uniform();
  for (float& v : bias) v = (uniform() - 0.5f) * 0.01f;
  float *d_scores, *d_bias, *d_weights, *d_topk_scores;
  int *d_idx, *d_counts;
  const size_t outs = size_t(kCtas) * kRows * kTopK;
  CK(cudaMalloc(&d_scores, scores.size() * sizeof(float)));
  CK(cudaMalloc(&d_bias, kExperts * sizeof(float)));
  CK(cudaMalloc(&d_weights, outs * sizeof(float)));
  CK(cudaMalloc(&d_topk_scores, outs * sizeof(float)));
  CK(cudaMalloc(&d_idx, outs * sizeof(int)));
  CK(cudaMalloc(&d_counts, kExperts * sizeof(int)));
  CK(cudaMemcpy(d_scores, scores.data(), scores.size() * sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_bias, bias.data(), kExperts * sizeof(float), cudaMemcpyHostToDevice));
  const RouteParams p{kTopK, n_group, topk_group, 2.5f, true, kExperts};
  const RouteOut out{d_idx, d_weights, d_topk_scores, nullptr, d_counts, false};
  const int smem = ((kRows + kScratch) * kStride + 2 * kExperts) * int(sizeof(float));
  std::printf("E = %d, top %d, %d groups, top %d groups: %d CTAs x %d rows, us per routing\n",
              kExperts, kTopK, n_group, topk_group, kCtas, kRows);
  auto run = [&](auto kernel, int lanes, int threads) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (int i = 0; i < 3; ++i) kernel<<<kCtas, threads, smem>>>(d_scores, d_bias, p, out);
    CK(cudaDeviceSynchronize());
    std::vector<unsigned long long> t(kCtas * (kReps + 1));
    CK(cudaMemcpyFromSymbol(t.data(), g_stamp, t.size() * sizeof(t[0])));
    std::printf("%2d lanes, %4d threads:", lanes, threads);
    for (int rep : {0, kReps - 1}) {
      std::vector<double> d(kCtas);
      for (int c = 0; c < kCtas; ++c)
        d[c] = (t[c * (kReps + 1) + rep + 1] - t[c * (kReps + 1) + rep]) / 1000.0;
      std::sort(d.begin(), d.end());
      std::printf("  %s median %.2f max %.2f", rep == 0 ? "first" : "last", d[kCtas / 2], d.back());
    }
    std::printf("\n");
  };
  run(route_rows<2, 256>, 2, 256);  // the kernel's 8 routing warps at 128 rows
  run(route_rows<2, 128>, 2, 128);
  run(route_rows<4, 256>, 4, 256);
  run(route_rows<4, 512>, 4, 512);
  run(route_rows<8, 512>, 8, 512);
  // Few rows: the few-lanes routing against one warp per token; and the outputs compared.
  std::vector<int> idx_a(outs), idx_b(outs);
  std::vector<float> w_a(outs), w_b(outs);
  auto fetch = [&](std::vector<int>& i, std::vector<float>& w) {
    CK(cudaMemcpy(i.data(), d_idx, outs * sizeof(int), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w.data(), d_weights, outs * sizeof(float), cudaMemcpyDeviceToHost));
  };
  // The few-lanes kernel, then each warp-per-token kernel with its tokens per warp at once.
  using Kernel = decltype(&route_few<8, 0, 1>);
  auto few = [&](int rows, Kernel lanes_kernel,
                 std::initializer_list<std::pair<Kernel, int>> warp_kernels) {
    CK(cudaMemset(d_idx, 0xFF, outs * sizeof(int)));
    std::printf("%3d rows, few lanes:   ", rows);
    run(lanes_kernel, 0, 256);
    fetch(idx_a, w_a);
    for (auto [k, tok] : warp_kernels) {
      CK(cudaMemset(d_idx, 0xFF, outs * sizeof(int)));
      std::printf("%3d rows, warp/token (%d):", rows, tok);
      run(k, 0, 256);
      fetch(idx_b, w_b);
      size_t bad = 0;
      for (int c = 0; c < kCtas; ++c)
        for (int i = 0; i < rows * kTopK; ++i) {
          const size_t o = size_t(c) * kRows * kTopK + i;
          bad += idx_a[o] != idx_b[o] || std::memcmp(&w_a[o], &w_b[o], 4) != 0;
        }
      std::printf("    outputs differing from few lanes: %zu of %zu\n", bad, size_t(kCtas) * rows * kTopK);
    }
  };
  few(8, route_few<8, 0, 1>, {{route_few<8, 1, 1>, 1}});
  few(16, route_few<16, 0, 1>, {{route_few<16, 1, 1>, 1}, {route_few<16, 1, 2>, 2}});
  few(32, route_few<32, 0, 1>, {{route_few<32, 1, 1>, 1}, {route_few<32, 1, 2>, 2}});
  few(64, route_few<64, 0, 1>, {{route_few<64, 1, 1>, 1}, {route_few<64, 1, 2>, 2}});
  return 0;
}
