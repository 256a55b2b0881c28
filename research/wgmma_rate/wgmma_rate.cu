// Tensor-core rate of the 256-expert backward's per-unit wgmma mix, with no memory traffic:
// every CTA (one per SM, two consumer warpgroups) issues the GEMMs of `units` units from
// fixed shared-memory tiles, as the kernel's main loop does (issue, commit, wait), and the
// tool prints clocks per unit against the tensor peak (2048 bf16 multiply-adds per SM and
// clock). Two ways to share a unit of 128 tokens × 64 hidden columns × 256 experts:
//   data   (the kernel until v19) each warpgroup: dgrad 64 h × 64 t × 256 e (A = wᵀ in
//          registers), wgrad 64 h × 128 e × 128 t (A = x, B = Gᵀ, both from shared memory)
//   role   warpgroup 0: dgrad 64 h × 128 t × 256 e; warpgroup 1: wgrad 64 h × 256 e × 128 t
//
//   wgmma_rate [UNITS]   (default 2000)
//
// Build: research/wgmma_rate/build.sh (needs no GPU); run on a Hopper GPU.
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

using namespace cute;
using Elem = cutlass::bfloat16_t;

namespace wgmma_rate {

constexpr int kT = 128, kH = 64, kE = 256;

using SmemLayoutG = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Elem>{}, Shape<Int<kT>, Int<kE>>{}));
template <int kN>  // (e, t): the first kN experts of G, as wgrad's MN-major B
using SmemLayoutGt = decltype(composition(SmemLayoutG{}, make_layout(Shape<Int<kN>, Int<kT>>{},
                                                                     make_stride(Int<kT>{}, _1{}))));
using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<kH>, Int<kT>>{},
                                           Step<_2, _1>{}));

template <int kN>  // dgrad on one warpgroup: 64 h × kN t × 256 e
using MmaD = decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kN>, _16>,
                                                                GMMA::Major::K, GMMA::Major::K>()));
template <int kN>  // wgrad on one warpgroup: 64 h × kN e × 128 t
using MmaW = decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kN>, _16>,
                                                                GMMA::Major::MN, GMMA::Major::MN>()));

struct Smem {
  alignas(1024) Elem g[cosize_v<SmemLayoutG>];
  alignas(1024) Elem x[cosize_v<SmemLayoutX>];
};

// dgrad of kN tokens from token t0 (kN / 16 ... the whole K = 256 in 16 k-steps).
template <int kN>
struct Dgrad {
  MmaD<kN> mma;
  decltype(partition_fragment_C(MmaD<kN>{}, Shape<_64, Int<kN>>{})) acc;
  decltype(MmaD<kN>{}.get_thread_slice(0).partition_fragment_A(
      make_tensor(make_gmem_ptr((Elem*)nullptr), Layout<Shape<_64, Int<kE>>>{}))) a;
  __device__ void issue(Smem& s, int t0, int ct) {
    Tensor sG = make_tensor(make_smem_ptr(s.g), SmemLayoutG{});  // (t, e)
    Tensor sGn = local_tile(sG, Shape<Int<kN>, Int<kE>>{}, make_coord(t0 / kN, 0));
    auto thr = mma.get_thread_slice(ct);
    Tensor b = thr.make_fragment_B(thr.partition_B(sGn));
    warpgroup_fence_operand(a);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
      gemm(mma, a(_, _, k), b(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  }
};

// wgrad of kN experts from expert e0, over the 128 tokens.
template <int kN>
struct Wgrad {
  MmaW<kN> mma;
  decltype(partition_fragment_C(MmaW<kN>{}, Shape<_64, Int<kN>>{})) acc;
  __device__ void issue(Smem& s, int e0, int ct) {
    Tensor sX = make_tensor(make_smem_ptr(s.x), SmemLayoutX{});                    // (h, t)
    Tensor sGt = make_tensor(make_smem_ptr(s.g + e0 * kT), SmemLayoutGt<kN>{});   // (e, t)
    auto thr = mma.get_thread_slice(ct);
    Tensor a = thr.make_fragment_A(thr.partition_A(sX));
    Tensor b = thr.make_fragment_B(thr.partition_B(sGt));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) gemm(mma, a(_, _, k), b(_, _, k), acc);
    warpgroup_commit_batch();
  }
};

__device__ long long g_clocks[1024];
__device__ float g_sink[1024];

enum Mode : int { kData = 0, kRole = 1 };

template <int kMode>
__global__ void __launch_bounds__(256, 1) run(int units) {
  extern __shared__ __align__(1024) unsigned char raw[];
  Smem& s = *reinterpret_cast<Smem*>(raw);
  for (int i = threadIdx.x; i < int(sizeof(Smem) / 2); i += 256)
    reinterpret_cast<Elem*>(raw)[i] = Elem(float((i * 7) % 13) * 0.01f);
  __syncthreads();
  cutlass::arch::fence_view_async_shared();
  const int wg = threadIdx.x / 128, ct = threadIdx.x % 128;
  float sink = 0.f;
  long long clocks = 0;
  // Each warpgroup's loop with only its own operands live (as in a kernel whose warpgroups
  // take different code paths).
  auto loop = [&](auto& d, auto& w, auto body) {
    if constexpr (!std::is_same_v<std::decay_t<decltype(d)>, int>) {
      for (int i = 0; i < size(d.a); ++i) d.a(i) = Elem(0.01f * (i % 5));
    }
    if constexpr (!std::is_same_v<std::decay_t<decltype(w)>, int>) clear(w.acc);
    const long long c0 = clock64();
    for (int u = 0; u < units; ++u) body();
    clocks = clock64() - c0;
    if constexpr (!std::is_same_v<std::decay_t<decltype(w)>, int>) {
      warpgroup_fence_operand(w.acc);
      sink += w.acc(0);
    }
  };
  int none = 0;
  if constexpr (kMode == kData) {
    Dgrad<64> d;
    Wgrad<128> w;
    loop(d, w, [&] {
      d.issue(s, 64 * wg, ct);
      w.issue(s, 128 * wg, ct);
      warpgroup_wait<1>();
      sink += d.acc(0);
      warpgroup_wait<0>();
    });
  } else if constexpr (kMode == kRole) {
    if (wg == 0) {
      Dgrad<128> d;
      loop(d, none, [&] {
        d.issue(s, 0, ct);
        warpgroup_wait<0>();
        sink += d.acc(0);
      });
    } else {
      Wgrad<256> w;
      loop(none, w, [&] {
        w.issue(s, 0, ct);
        warpgroup_wait<0>();
      });
    }
  }
  if (ct == 0) g_clocks[blockIdx.x * 2 + wg] = clocks;
  if (sink == 12345.f) g_sink[threadIdx.x] = sink;
}

// Multiply-adds per unit and CTA (4.2 M).
constexpr double kUnitMacs = 2.0 * kT * kH * kE;  // dgrad + wgrad of one unit

template <int kMode>
void measure(const char* name, int units, int ctas) {
  const int smem = int(sizeof(Smem)) + 1024;
  cudaFuncSetAttribute(run<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  run<kMode><<<ctas, 256, smem>>>(10);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  cudaEventRecord(e0);
  run<kMode><<<ctas, 256, smem>>>(units);
  cudaEventRecord(e1);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("%s: %s\n", name, cudaGetErrorString(err));
    std::exit(1);
  }
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  std::vector<long long> clocks(2 * ctas);
  cudaMemcpyFromSymbol(clocks.data(), g_clocks, sizeof(long long) * 2 * ctas);
  long long worst = 0;
  for (long long c : clocks) worst = c > worst ? c : worst;
  const double per_unit = double(worst) / units;
  const double peak = kUnitMacs / 2048.0;
  std::printf("%-34s %8.1f clocks/unit  %5.1f%% of peak  %8.3f us/unit (events)\n", name,
              per_unit, 100.0 * peak / per_unit, 1e3 * ms / units);
}

}  // namespace wgmma_rate

int main(int argc, char** argv) {
  using namespace wgmma_rate;
  const int units = argc > 1 ? std::atoi(argv[1]) : 2000;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::printf("%d CTAs x 2 warpgroups, %d units; peak: 2048 multiply-adds per SM and clock\n", sms,
              units);
  for (int rep = 0; rep < 2; ++rep) {
    measure<kData>("data split (kernel until v19)", units, sms);
    measure<kRole>("role split", units, sms);
  }
  return 0;
}
