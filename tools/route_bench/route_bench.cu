// The fused forward's few-lanes routing epilogue (route_thread.cuh) alone: every CTA holds 128
// rows of random scores in shared memory, laid out as the kernel's reduction buffer, and routes
// them as the kernel does after its main loop, four times in a row. Prints, per thread count and
// lanes per token, the median and slowest CTA's time per routing of the 128 rows (%globaltimer),
// the first (code not yet cached) and the last.
//
//   route_bench [N_GROUP TOPK_GROUP]   E = 160, top 8, 132 CTAs (default: 8 groups, top 4)
//
// Build: tools/route_bench/build.sh (needs no GPU); run on a Hopper GPU.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/fused_forward/config.cuh"
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

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::printf("CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__);          \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

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
  const RouteParams p{kTopK, n_group, topk_group, 2.5f, true};
  const RouteOut out{d_idx, d_weights, d_topk_scores, nullptr, d_counts};
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
  return 0;
}
