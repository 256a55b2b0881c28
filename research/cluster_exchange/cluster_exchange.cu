// The fused forward's split-K exchange alone: every CTA of a cluster holds a 128-row partial
// (fp32, rows E + 8 words apart, as the kernel's reduction buffer), and the CTA that owns a
// row range sums those rows over the cluster in rank order. Four ways to move the rows:
//   gather   the owner's threads load them with 16-byte ld.shared::cluster (the kernel's
//            split_sum.cuh), all of a thread's loads in flight at once
//   st.async every CTA's threads push the rows each owner needs with 16-byte st.async into the
//            owner's receive area, completion counted on the owner's mbarrier
//   st.v2    the same from a wgmma accumulator's layout (8-byte pairs, as from registers)
//   bulk     one thread per destination pushes each owner's rows with one
//            cp.async.bulk.shared::cluster (the rows are contiguous)
// and `none`, the same rounds with only the owner's own rows summed. Each launch runs 32
// rounds (partial written, cluster barrier, exchange, sum, cluster barrier). Prints per
// cluster size and way the median over CTAs and rounds of the exchange-and-sum (%globaltimer,
// from the first barrier to the sums in place) and the event time per round, and checks that
// every way gives the same sums.
//
//   cluster_exchange   E = 160, clusters of 2, 3, 4, 6, 8, 16 on ⌊132 / size⌋ clusters
//
// Build: research/cluster_exchange/build.sh (needs no GPU); run on a Hopper GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>

#include "kernels/cluster.cuh"
#include "kernels/fused_forward/split_sum.cuh"

using namespace moe_routing::kernels;
using moe_routing::kernels::fused_forward::split_sum;

namespace cluster_exchange {

constexpr int kExperts = 160, kRows = 128, kStride = kExperts + 8, kThreads = 256, kRounds = 32;
constexpr int kMaxCtas = 132;
enum Way { kNone, kGather, kStAsync, kStV2, kBulk, kWays };
const char* const kWayNames[kWays] = {"none", "gather", "st.async", "st.v2", "bulk"};

__device__ unsigned long long g_time[kMaxCtas * kRounds];
__device__ float g_check[kMaxCtas * kThreads];

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
using Barrier = cutlass::arch::ClusterTransactionBarrier;
// Barrier::wait, but traps after ~1 s rather than hang where bytes go missing.
__device__ __forceinline__ void wait_or_trap(uint64_t* bar, uint32_t parity) {
  for (long n = 0; !Barrier::try_wait(bar, parity); ++n)
    if (n > (1l << 22)) __trap();
}
__device__ __forceinline__ void st_async_v4(uint32_t dst, float4 v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
      ::"r"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void st_async_v2(uint32_t dst, float a, float b, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
      ::"r"(dst), "f"(a), "f"(b), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bulk_push(uint32_t dst, uint32_t src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];" ::"r"(dst), "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ float value(int rank, int row, int e, int round) {
  return float((rank * 131 + row * 7 + e * 3 + round) % 1024) * (1.0f / 256.0f) - 1.9f;
}

template <int kSplit, int kWay>
__global__ void __launch_bounds__(kThreads, 1) exchange() {
  constexpr int kMaxOwned = (kRows + kSplit - 1) / kSplit;
  extern __shared__ float4 smem4[];
  float* partial = reinterpret_cast<float*>(smem4);  // [kRows][kStride]
  float* recv = partial + kRows * kStride;           // [kSplit][kMaxOwned][kStride]
  uint64_t* bar = reinterpret_cast<uint64_t*>(recv + kSplit * kMaxOwned * kStride);
  const uint32_t bar_addr = cute::cast_smem_ptr_to_uint(bar);
  const int rank = cluster_rank(), tid = threadIdx.x;
  auto owned0 = [](int r) { return r * kRows / kSplit; };
  const int row0 = owned0(rank), rows = owned0(rank + 1) - row0;
  if (tid == 0) {
    Barrier::init(bar, 1);
    cutlass::arch::fence_barrier_init();
  }
  cluster_arrive();
  cluster_wait();
  float check = 0.0f;
  for (int round = 0; round < kRounds; ++round) {
    for (int i = tid; i < kRows * kExperts; i += kThreads)
      partial[i / kExperts * kStride + i % kExperts] = value(rank, i / kExperts, i % kExperts, round);
    if constexpr (kWay == kBulk) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    cluster_arrive();  // every partial written, every receive area free
    cluster_wait();
    const unsigned long long t0 = now();
    if constexpr (kWay == kGather) {
      split_sum<kSplit, kRows, kExperts, kStride, kThreads>(partial, row0, rows, tid, false,
                                                            nullptr, 0, 0, kExperts);
    } else if constexpr (kWay != kNone) {
      // Bytes to land here: rows × E floats from each other CTA (whole padded rows for bulk).
      constexpr int kRowBytes = (kWay == kBulk ? kStride : kExperts) * 4;
      if (tid == 0) Barrier::arrive_and_expect_tx(bar, uint32_t((kSplit - 1) * rows * kRowBytes));
      const uint32_t recv_addr = cute::cast_smem_ptr_to_uint(recv);
      if constexpr (kWay == kStAsync) {
        // Vectors (destination, row, column/4) over every destination but this CTA.
        constexpr int kVecs = kExperts / 4;
        for (int v = tid; v < kSplit * kMaxOwned * kVecs; v += kThreads) {
          const int d = v / (kMaxOwned * kVecs), r = v / kVecs % kMaxOwned, c = v % kVecs * 4;
          if (d == rank || r >= owned0(d + 1) - owned0(d)) continue;
          const float4 x = *reinterpret_cast<const float4*>(partial + (owned0(d) + r) * kStride + c);
          const uint32_t off = uint32_t(((rank * kMaxOwned + r) * kStride + c) * 4);
          st_async_v4(map_dsmem(recv_addr + off, d), x, map_dsmem(bar_addr, d));
        }
      } else if constexpr (kWay == kStV2) {
        // A 64×160 wgmma accumulator per warpgroup: thread (warp w, lane l) holds rows
        // 64·wg + 16·(w % 4) + l / 4 (+ 8), columns 8·j + 2·(l % 4) (+ 1), j < 20.
        const int wg = tid / 128, w = tid / 32 % 4, l = tid % 32;
        for (int half = 0; half < 2; ++half) {
          const int row = 64 * wg + 16 * w + l / 4 + 8 * half;
          int d = 0;
          while (owned0(d + 1) <= row) ++d;
          if (d == rank) continue;
          const uint32_t rbar = map_dsmem(bar_addr, d);
#pragma unroll
          for (int j = 0; j < kExperts / 8; ++j) {
            const int c = 8 * j + 2 * (l % 4);
            const uint32_t off = uint32_t(((rank * kMaxOwned + row - owned0(d)) * kStride + c) * 4);
            st_async_v2(map_dsmem(recv_addr + off, d), value(rank, row, c, round),
                        value(rank, row, c + 1, round), rbar);
          }
        }
      } else {  // bulk
        if (tid < kSplit && tid != rank) {
          const int d = tid, n = owned0(d + 1) - owned0(d);
          const uint32_t src = cute::cast_smem_ptr_to_uint(partial + owned0(d) * kStride);
          const uint32_t off = uint32_t(rank * kMaxOwned * kStride * 4);
          // Whole rows, the padding too, so that they are one copy.
          bulk_push(map_dsmem(recv_addr + off, d), src, uint32_t(n * kStride * 4),
                    map_dsmem(bar_addr, d));
        }
      }
      wait_or_trap(bar, round & 1);
      // The sums, in rank order, from the receive area (own rank: the own partial).
      for (int v = tid; v < rows * (kExperts / 4); v += kThreads) {
        const int r = v / (kExperts / 4), c = v % (kExperts / 4) * 4;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k = 0; k < kSplit; ++k) {
          const float* src = k == rank ? partial + (row0 + r) * kStride
                                       : recv + (k * kMaxOwned + r) * kStride;
          const float4 x = *reinterpret_cast<const float4*>(src + c);
          s.x += x.x, s.y += x.y, s.z += x.z, s.w += x.w;
        }
        *reinterpret_cast<float4*>(partial + (row0 + r) * kStride + c) = s;
      }
    }
    __syncthreads();
    if (tid == 0) g_time[blockIdx.x * kRounds + round] = now() - t0;
    for (int v = tid; v < rows * kExperts; v += kThreads)
      check += partial[(row0 + v / kExperts) * kStride + v % kExperts] * float(round + 1);
    cluster_arrive();  // sums read; the receive areas and partials may be overwritten
    cluster_wait();
  }
  g_check[blockIdx.x * kThreads + tid] = check;
}

#include "../cuda_check.h"

template <int kSplit, int kWay>
void run(std::vector<float>& check_out) {
  constexpr int kMaxOwned = (kRows + kSplit - 1) / kSplit;
  const int ctas = kMaxCtas / kSplit * kSplit;
  const size_t smem = size_t(kRows + kSplit * kMaxOwned) * kStride * 4 + 16;
  auto k = exchange<kSplit, kWay>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(ctas);
  c.blockDim = dim3(kThreads);
  c.dynamicSmemBytes = smem;
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeClusterDimension;
  a[0].val.clusterDim.x = kSplit, a[0].val.clusterDim.y = 1, a[0].val.clusterDim.z = 1;
  c.attrs = a, c.numAttrs = 1;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ev;
  for (int rep = 0; rep < 7; ++rep) {
    CK(cudaEventRecord(e0));
    CK(cudaLaunchKernelEx(&c, k));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ev.push_back(ms * 1000.f / kRounds);
  }
  std::sort(ev.begin(), ev.end());
  std::vector<unsigned long long> t(ctas * kRounds);
  CK(cudaMemcpyFromSymbol(t.data(), g_time, t.size() * 8));
  std::sort(t.begin(), t.end());
  std::vector<float> chk(ctas * kThreads);
  CK(cudaMemcpyFromSymbol(chk.data(), g_check, chk.size() * 4));
  const char* same = "";
  if (kWay == kGather) check_out = chk;
  else if (kWay != kNone) same = check_out == chk ? "  sums equal gather's" : "  SUMS DIFFER";
  printf("cluster %2d %-8s exchange+sum median %6.2f us (p90 %6.2f)  round %6.2f us%s\n", kSplit,
         kWayNames[kWay], t[t.size() / 2] * 1e-3, t[t.size() * 9 / 10] * 1e-3, ev[3], same);
}

template <int kSplit>
void run_all() {
  std::vector<float> check;
  run<kSplit, kNone>(check);
  run<kSplit, kGather>(check);
  run<kSplit, kStAsync>(check);
  run<kSplit, kStV2>(check);
  run<kSplit, kBulk>(check);
}

}  // namespace cluster_exchange

int main() {
  using namespace cluster_exchange;
  setvbuf(stdout, nullptr, _IOLBF, 0);
  run_all<2>();
  run_all<3>();
  run_all<4>();
  run_all<6>();
  run_all<8>();
  run_all<16>();
  return 0;
}
