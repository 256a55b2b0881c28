// DRAM throughput of the fused backward's access pattern, without its compute: each CTA reads
// tiles of `rows` tokens × `cols` bf16 columns of x and writes them to y (the same bytes as
// x read once and grad_x written once), in the backward's schedule: H / `cols` column slices,
// `per` consecutive CTAs per slice, each taking a contiguous range of the slice's token tiles.
// Variants, each on the same grid:
//   pattern             a tile loaded whole (16-byte loads, all in flight), then stored
//   two tiles in flight the next tile's loads issued before this tile's stores (cols <= 256)
//   TMA boxes           one thread, 2D TMA loads and stores of whole tiles through a ring of
//                       96 or 192 KB of shared memory (rows 128, cols 64 or 128)
//   contiguous          the same bytes, each CTA a contiguous range of whole rows (also on 132)
//   (128 × 128 tiles)   the pattern with other cache hints, TMA with L2 policies (and evict-last
//                       lines demoted after use), what a following kernel then finds in L2,
//                       and cudaMemcpyAsync of the tensor
//
//   dram_pattern T H COLS PER [ROWS]      (COLS ∈ {64, 128, 256, 512}, ROWS ∈ {128, 64})
//
// Prints the time per call (CUDA events, median of 7 rounds of 40 back-to-back launches over 4
// rotated buffer pairs) and TB/s counting the 4·T·H bytes moved. Build:
// research/dram_pattern/build.sh (no GPU needed); run on a Hopper GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "../cuda_check.h"

constexpr int kThreads = 256;
template <int V>
using I = std::integral_constant<int, V>;

// The backward's schedule for CTA blockIdx.x: slice blockIdx.x / per, and token tiles [t0, t1),
// the (blockIdx.x % per)-th of per contiguous ranges of the slice's ⌈T / rows⌉ tiles.
struct TileRange {
  int slice;
  int64_t t0, t1;
};
__device__ __forceinline__ TileRange tile_range(int64_t T, int rows, int per) {
  const int range = blockIdx.x % per;
  const int64_t ntiles = (T + rows - 1) / rows;
  return {int(blockIdx.x / per), range * ntiles / per, (range + 1) * ntiles / per};
}

// This thread's vector j (16 bytes) of tile t of a slice (kRows × kCols bf16): its offset in x
// and y, in vectors, and its row.
template <int kCols, int kRows>
__device__ __forceinline__ int64_t tile_vec(int64_t t, int j, int slice, int H, int64_t& row) {
  constexpr int kVecsPerRow = kCols * 2 / 16;
  const int i = threadIdx.x + kThreads * j;
  row = t * kRows + i / kVecsPerRow;
  return row * (int64_t(H) * 2 / 16) + int64_t(slice) * kVecsPerRow + i % kVecsPerRow;
}

template <int kCols, int kRows>
constexpr int kTileVecs = kRows * kCols * 2 / 16 / kThreads;  // per thread

// A tile loaded whole, then stored. kHint: 0 streaming loads and stores (.cs), 1 plain loads
// and stores, 2 plain loads and .cs stores.
template <int kCols, int kRows, int kHint = 0>
__global__ void __launch_bounds__(kThreads) tiles(const uint4* __restrict__ x, uint4* __restrict__ y,
                                                  int64_t T, int H, int per) {
  constexpr int kVecs = kTileVecs<kCols, kRows>;
  static_assert(kRows * kCols * 2 / 16 % kThreads == 0, "whole tile");
  const TileRange r = tile_range(T, kRows, per);
  for (int64_t t = r.t0; t < r.t1; ++t) {
    uint4 v[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      int64_t row;
      const int64_t o = tile_vec<kCols, kRows>(t, j, r.slice, H, row);
      v[j] = row < T ? (kHint == 0 ? __ldcs(x + o) : x[o]) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      int64_t row;
      const int64_t o = tile_vec<kCols, kRows>(t, j, r.slice, H, row);
      if (row < T) {
        if (kHint == 1) y[o] = v[j];
        else __stcs(y + o, v[j]);
      }
    }
  }
}

// As `tiles`, with the next tile's loads issued before this tile's stores (two tiles in flight).
template <int kCols, int kRows>
__global__ void __launch_bounds__(kThreads) tiles2(const uint4* __restrict__ x, uint4* __restrict__ y,
                                                   int64_t T, int H, int per) {
  constexpr int kVecs = kTileVecs<kCols, kRows>;
  const TileRange r = tile_range(T, kRows, per);
  uint4 v[kVecs], w[kVecs];
  auto load = [&](int64_t t, uint4 (&d)[kVecs]) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      int64_t row;
      const int64_t o = tile_vec<kCols, kRows>(t, j, r.slice, H, row);
      d[j] = t < r.t1 && row < T ? __ldcs(x + o) : make_uint4(0, 0, 0, 0);
    }
  };
  auto store = [&](int64_t t, const uint4 (&d)[kVecs]) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      int64_t row;
      const int64_t o = tile_vec<kCols, kRows>(t, j, r.slice, H, row);
      if (row < T) __stcs(y + o, d[j]);
    }
  };
  load(r.t0, v);
  for (int64_t t = r.t0; t < r.t1; t += 2) {
    load(t + 1, w);
    store(t, v);
    if (t + 1 >= r.t1) break;
    load(t + 2, v);
    store(t + 1, w);
  }
}

// As `tiles`, moved by the tensor memory accelerator as the fused kernel moves x and grad_x:
// one thread per CTA loads each 128 × kCols tile as one 2D TMA box into a ring of kStages
// shared-memory tiles (one mbarrier each) and stores it as one box, kStages − 2 tiles ahead.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
// kLoadHint, kStoreHint: L2 eviction priority of the TMA loads and stores (0 none, 1 evict-first,
// 2 evict-last). kDemote: once a tile has landed, its x lines are set back to evict-normal
// (`applypriority`, by the warp's 32 lanes), so that no line stays marked after the call.
template <int kCols, int kStages, int kLoadHint = 0, int kStoreHint = 0, bool kDemote = false>
__global__ void __launch_bounds__(32) tiles_tma(const __grid_constant__ CUtensorMap tx,
                                                const __grid_constant__ CUtensorMap ty, int64_t T,
                                                int per, const char* xraw = nullptr, int H = 0) {
  constexpr int kRows = 128, kTileBytes = kRows * kCols * 2;
  extern __shared__ __align__(128) char ring[];  // kStages tiles
  __shared__ __align__(8) uint64_t full[kStages];
  const int lane = threadIdx.x;
  const auto [slice, t0, t1] = tile_range(T, kRows, per);
  if (lane == 0) {
    for (int i = 0; i < kStages; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[i])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const int c0 = slice * kCols;
  auto policy = [](int hint) {
    uint64_t p = 0;
    if (hint == 1) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    if (hint == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    return p;
  };
  const uint64_t load_policy = policy(kLoadHint), store_policy = policy(kStoreHint);
  constexpr int kAhead = kStages - 2;
  for (int64_t t = t0; t < t1 + kAhead; ++t) {
    if (t < t1 && lane == 0) {  // load tile t into stage t % kStages (its last store read)
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      const int s = int(t % kStages);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                   "r"(kTileBytes) : "memory");
      if constexpr (kLoadHint == 0)
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
            ::"r"(smem_u32(ring + s * kTileBytes)), "l"(&tx), "r"(c0), "r"(int(t * kRows)),
            "r"(smem_u32(&full[s])) : "memory");
      else
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;"
            ::"r"(smem_u32(ring + s * kTileBytes)), "l"(&tx), "r"(c0), "r"(int(t * kRows)),
            "r"(smem_u32(&full[s])), "l"(load_policy) : "memory");
    }
    const int64_t u = t - kAhead;  // store tile u once it has landed
    if (u >= t0) {
      const int s = int(u % kStages);
      const uint32_t parity = uint32_t((u - t0) / kStages) & 1u;
      uint32_t done = 0;
      while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_u32(&full[s])), "r"(parity) : "memory");
      if constexpr (kDemote) {
        constexpr int kLinesPerRow = kCols * 2 / 128;
        for (int i = lane; i < kRows * kLinesPerRow; i += 32) {
          const int64_t row = u * kRows + i / kLinesPerRow;
          if (row < T)
            asm volatile("applypriority.global.L2::evict_normal [%0], 128;" ::"l"(
                xraw + row * int64_t(H) * 2 + int64_t(c0) * 2 + (i % kLinesPerRow) * 128) : "memory");
        }
      }
      if (lane != 0) continue;
      if constexpr (kStoreHint == 0)
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                     ::"l"(&ty), "r"(c0), "r"(int(u * kRows)), "r"(smem_u32(ring + s * kTileBytes))
                     : "memory");
      else
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;"
                     ::"l"(&ty), "r"(c0), "r"(int(u * kRows)), "r"(smem_u32(ring + s * kTileBytes)),
                     "l"(store_policy) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Reads n vectors through L2 (a following kernel's working set), for the L2 left by a copy.
__global__ void probe(const uint4* __restrict__ b, int64_t n, unsigned* out) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(b + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *out = acc;
}

// (T, H) bf16 row-major as a 2D tensor map with 128-row × kCols boxes, no swizzle.
static CUtensorMap tensor_map(void* base, int64_t T, int H, int cols) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(H), cuuint64_t(T)};
  const cuuint64_t strides[1] = {cuuint64_t(H) * 2};
  const cuuint32_t box[2] = {cuuint32_t(cols), 128u};
  const cuuint32_t estr[2] = {1u, 1u};
  if (encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    printf("tensor map encoding failed\n");
    exit(1);
  }
  return m;
}

// The same bytes, each CTA a contiguous range, 16 vectors per thread per step.
__global__ void __launch_bounds__(kThreads) contiguous(const uint4* __restrict__ x, uint4* __restrict__ y,
                                                       int64_t n) {
  constexpr int kVecs = 16;
  const int64_t per_cta = (n + gridDim.x - 1) / gridDim.x;
  const int64_t b = blockIdx.x * per_cta, e = n < b + per_cta ? n : b + per_cta;
  for (int64_t s = b; s < e; s += int64_t(kThreads) * kVecs) {
    uint4 v[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t o = s + threadIdx.x + int64_t(kThreads) * j;
      v[j] = o < e ? __ldcs(x + o) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t o = s + threadIdx.x + int64_t(kThreads) * j;
      if (o < e) __stcs(y + o, v[j]);
    }
  }
}

template <class F>
static float time_us(F&& call, int sets) {
  for (int i = 0; i < sets; ++i) call(i);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  const int n = 40;
  for (int r = 0; r < 7; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < n; ++i) call(i % sets);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000 / n);
  }
  std::sort(t.begin(), t.end());
  return t[3];
}

int main(int argc, char** argv) {
  if (argc < 5) {
    printf("usage: dram_pattern T H COLS PER [ROWS]\n");
    return 2;
  }
  const int64_t T = atoll(argv[1]);
  const int H = atoi(argv[2]), cols = atoi(argv[3]), per = atoi(argv[4]);
  const int rows = argc > 5 ? atoi(argv[5]) : 128;
  const int slices = H / cols, grid = slices * per;
  const int sets = 4;
  const size_t bytes = size_t(T) * H * 2;
  const double mb = 2.0 * bytes;  // x read and y written
  auto tbps = [&](double us) { return mb / us * 1e-6; };
  std::vector<uint4*> x(sets), y(sets);
  for (int s = 0; s < sets; ++s) {
    CK(cudaMalloc(&x[s], bytes));
    CK(cudaMalloc(&y[s], bytes));
    CK(cudaMemset(x[s], 0x3c, bytes));  // nonzero
  }
  auto launch = [&](int s) {
#define CASE(C, R) \
    if (cols == C && rows == R) { tiles<C, R><<<grid, kThreads>>>(x[s], y[s], T, H, per); return; }
    CASE(64, 128) CASE(128, 128) CASE(256, 128) CASE(512, 128) CASE(128, 64) CASE(256, 64)
#undef CASE
    printf("unsupported COLS/ROWS\n");
    exit(2);
  };
  const float tp = time_us(launch, sets);
  auto launch2 = [&](int s) {
    if (cols == 128 && rows == 128) tiles2<128, 128><<<grid, kThreads>>>(x[s], y[s], T, H, per);
    else if (cols == 256 && rows == 128) tiles2<256, 128><<<grid, kThreads>>>(x[s], y[s], T, H, per);
    else if (cols == 64 && rows == 128) tiles2<64, 128><<<grid, kThreads>>>(x[s], y[s], T, H, per);
  };
  const float tp2 = (rows == 128 && cols <= 256) ? time_us(launch2, sets) : 0.0f;
  float tb[2] = {0.0f, 0.0f};
  if (rows == 128 && (cols == 64 || cols == 128)) {
    std::vector<CUtensorMap> mx(sets), my(sets);
    for (int s = 0; s < sets; ++s) mx[s] = tensor_map(x[s], T, H, cols), my[s] = tensor_map(y[s], T, H, cols);
    // A launcher of tiles_tma<C, S, L, SH, D> on set s, its shared memory allowed.
    auto tma = [&](auto c, auto stages, auto load_hint, auto store_hint, auto demote) {
      constexpr int C = decltype(c)::value, S = decltype(stages)::value;
      constexpr int L = decltype(load_hint)::value, SH = decltype(store_hint)::value;
      constexpr bool D = decltype(demote)::value;
      constexpr int smem = S * 128 * C * 2;
      CK(cudaFuncSetAttribute(tiles_tma<C, S, L, SH, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      return [&](int s) {
        tiles_tma<C, S, L, SH, D><<<grid, 32, smem>>>(mx[s], my[s], T, per,
                                                     reinterpret_cast<const char*>(x[s]), H);
      };
    };
    const std::false_type plain;
    if (cols == 128) {
      tb[0] = time_us(tma(I<128>{}, I<3>{}, I<0>{}, I<0>{}, plain), sets);
      tb[1] = time_us(tma(I<128>{}, I<6>{}, I<0>{}, I<0>{}, plain), sets);
      auto hinted = [&](auto load_hint, auto store_hint) {
        const float us = time_us(tma(I<128>{}, I<3>{}, load_hint, store_hint, plain), sets);
        printf("T=%lld: TMA, 96 KB ring, load hint %d store hint %d (1 evict-first, 2 evict-last): %.2f us %.2f TB/s\n",
               (long long)T, decltype(load_hint)::value, decltype(store_hint)::value, us, tbps(us));
      };
      hinted(I<1>{}, I<0>{}); hinted(I<2>{}, I<0>{}); hinted(I<0>{}, I<1>{});
      hinted(I<1>{}, I<1>{}); hinted(I<2>{}, I<1>{}); hinted(I<0>{}, I<2>{});
      // Evict-last loads with the x lines demoted after use.
      const auto demoted = tma(I<128>{}, I<3>{}, I<2>{}, I<1>{}, std::true_type{});
      const float us = time_us(demoted, sets);
      printf("T=%lld: TMA, load evict-last demoted after use, store evict-first: %.2f us %.2f TB/s\n",
             (long long)T, us, tbps(us));
      // What a following kernel finds in L2: after one copy, a 24 MB buffer read twice; the
      // second read's time (median of 5).
      const int64_t pn = 24ll * 1024 * 1024 / 16;
      uint4* pb;
      unsigned* po;
      CK(cudaMalloc(&pb, pn * 16));
      CK(cudaMalloc(&po, 4));
      CK(cudaMemset(pb, 1, pn * 16));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      auto after = [&](const char* name, auto copy) {
        std::vector<float> v;
        for (int r = 0; r < 5; ++r) {
          copy(0);
          probe<<<264, 512>>>(pb, pn, po);
          CK(cudaEventRecord(a));
          probe<<<264, 512>>>(pb, pn, po);
          CK(cudaEventRecord(b));
          CK(cudaEventSynchronize(b));
          float ms;
          CK(cudaEventElapsedTime(&ms, a, b));
          v.push_back(ms * 1000);
        }
        std::sort(v.begin(), v.end());
        printf("T=%lld: 24 MB re-read after a copy with %s: %.2f us\n", (long long)T, name, v[2]);
      };
      after("no hints", tma(I<128>{}, I<3>{}, I<0>{}, I<0>{}, plain));
      after("evict-last loads, evict-first stores", tma(I<128>{}, I<3>{}, I<2>{}, I<1>{}, plain));
      after("the same, x demoted after use", demoted);
      after("no copy", [](int) {});
      CK(cudaFree(pb));
      CK(cudaFree(po));
    } else {
      tb[0] = time_us(tma(I<64>{}, I<6>{}, I<0>{}, I<0>{}, plain), sets);
      tb[1] = time_us(tma(I<64>{}, I<12>{}, I<0>{}, I<0>{}, plain), sets);
    }
  }
  CK(cudaGetLastError());
  const int64_t n = int64_t(bytes / 16);
  const float tc = time_us([&](int s) { contiguous<<<grid, kThreads>>>(x[s], y[s], n); }, sets);
  const float tc132 = time_us([&](int s) { contiguous<<<132, kThreads>>>(x[s], y[s], n); }, sets);
  CK(cudaGetLastError());
  if (cols == 128 && rows == 128) {  // cache hints, and the runtime's own copy of the same bytes
    const float h1 = time_us([&](int s) { tiles<128, 128, 1><<<grid, kThreads>>>(x[s], y[s], T, H, per); }, sets);
    const float h2 = time_us([&](int s) { tiles<128, 128, 2><<<grid, kThreads>>>(x[s], y[s], T, H, per); }, sets);
    const float mc = time_us([&](int s) { CK(cudaMemcpyAsync(y[s], x[s], bytes, cudaMemcpyDeviceToDevice)); }, sets);
    printf("T=%lld: pattern with plain loads and stores %.2f TB/s, plain loads and .cs stores %.2f TB/s; cudaMemcpy %.2f us %.2f TB/s\n",
           (long long)T, tbps(h1), tbps(h2), mc, tbps(mc));
  }
  printf("T=%lld H=%d cols=%d rows=%d per=%d grid=%d: pattern %.2f us %.2f TB/s | two tiles in flight %.2f us %.2f TB/s | TMA boxes, ring of 96 / 192 KB %.2f / %.2f TB/s | contiguous (same grid) %.2f us %.2f TB/s | contiguous 132 CTAs %.2f us %.2f TB/s\n",
         (long long)T, H, cols, rows, per, grid, tp, tbps(tp), tp2, tp2 > 0 ? tbps(tp2) : 0.0,
         tb[0] > 0 ? tbps(tb[0]) : 0.0, tb[1] > 0 ? tbps(tb[1]) : 0.0, tc, tbps(tc), tc132, tbps(tc132));
  return 0;
}
