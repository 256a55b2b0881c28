// Phase timeline of the fused kernels: builds them with the trace hooks of kernels/trace.cuh
// (a %globaltimer stamp per CTA and phase id), times back-to-back calls on rotated random
// inputs (CUDA events, median of 7 rounds) and prints, per phase id, the earliest, median and
// latest CTA: for the last call of a back-to-back round, and for one call alone.
//
//   phase_trace bwd T CTAS SUM [h64]   the backward on CTAS CTAs, grad_w summed by the last
//                                      CTA (SUM = last), spread over the CTAs of a slice
//                                      (spread) or in clusters (cluster); the last two need
//                                      CTAS a multiple of H/128. h64: 64-column slices, one
//                                      CTA each (CTAS = H/64, last)
//   phase_trace fwd T SPLIT [TILES TAIL]  the forward, clusters of SPLIT CTAs per 128-token
//                                      tile; with TILES and TAIL, the first TILES tiles so and
//                                      the rest in a second launch with clusters of TAIL
//                                      (FWD_TILE=64 or 192: 64- or 192-token tiles; CHECK
//                                      set: the indices against 128-token tiles in clusters
//                                      of one, 64 on the wide kernels; rows that differ counted)
//   phase_trace occupancy              the forward's clusters that fit at once, per tile and
//                                      cluster size (what its launch plan reads), and the
//                                      backward's 128-column ones, per cluster size
//
// Shapes: H = 5120, E = 160, K = 8, 8 groups, top 4 (ROUTER_GROUPS=n,k: n groups, the best k
// kept); the forward also FWD_SHAPE=E,K,H (E = 384 or 512 on the wide kernels, one group).
// Every input set has its own w, as in the benchmarks (SHARED_W set: one w for all, which then
// stays in L2). GRAPH set: the back-to-back calls replayed from a CUDA graph, as the benchmarks
// time them (else launched one by one). ROUTING set (backward): the routing inputs from the
// fused forward on each set's x and w, as the benchmarks make them (else spread synthetic ones).
// ACCUMULATE set: the backward adds into grad_w. TORCH_DTYPES set (backward): the inputs as
// PyTorch holds them (int64 indices, bf16 scores of all experts, bf16 gradients; grad_w bf16),
// through the any-K kernels, which pack them into compact rows once per launch (phases 11: a
// CTA's first row stored, 12: all its rows, 13: every CTA's arrival seen, 14: past that grid
// barrier), as the public range runs. TRACE_CTAS=ID,ID,...: also those phase ids of
// every CTA, one line each, with its SM and its last unit (backward). The backward's isolated call
// also prints the per-unit series of kernels/trace.cuh (the producer's, each consumer
// warpgroup's steps), medians over the CTAs, from clock64. Phase ids are the
// MOE_ROUTING_TRACE calls in the kernels. Build: research/phase_trace/build.sh (needs no GPU); run
// on a Hopper GPU.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>
constexpr int kMaxCtas = 1200;
constexpr int kIds = 512;  // per CTA (kernels::kTraceIds, checked below)
__device__ unsigned long long g_trace[kMaxCtas * kIds];  // %globaltimer, ns
__device__ long long g_clk[kMaxCtas * kIds];             // clock64 of the same stamp
__device__ unsigned g_smid[kMaxCtas];                     // the SM of each CTA (stamp 0's)
#define MOE_ROUTING_TRACE(cond, id)                                                   \
  do {                                                                                \
    if (cond) {                                                                       \
      unsigned long long t_;                                                          \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                         \
      g_trace[blockIdx.x * kIds + (id)] = t_;                                         \
      g_clk[blockIdx.x * kIds + (id)] = clock64();                                    \
      if ((id) == 0) {                                                                \
        unsigned sm_;                                                                 \
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                             \
        g_smid[blockIdx.x] = sm_;                                                     \
      }                                                                               \
    }                                                                                 \
  } while (0)
#include "fused_backward_launch.cuh"
#include "fused_forward_launch.cuh"
using namespace moe_routing;
static_assert(kernels::kTraceIds <= kIds, "trace ids");
#include "../cuda_check.h"

__device__ uint32_t hash32(uint64_t x) { x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33; return uint32_t(x); }
__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float f = (hash32(i * 0x9E3779B97F4A7C15ULL + seed) & 0xffff) / 32768.0f - 1.0f;
    uint32_t b = __float_as_uint(f); p[i] = uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
  }
}
__global__ void fill_f32(float* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = lo + (hi - lo) * ((hash32(i * 0x9E3779B97F4A7C15ULL + seed) & 0xffffff) / 16777216.0f);
}
__global__ void fill_idx(int32_t* p, int64_t T, int K, int E, uint64_t seed) {
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < T; t += (int64_t)gridDim.x * blockDim.x) {
    int b = hash32(t + seed) % E; for (int k = 0; k < K; ++k) p[t * K + k] = (b + k * (E / K)) % E;
  }
}
__global__ void widen_idx(const int32_t* in, int64_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[i];
}
template <class T> T* dalloc(size_t n) { T* p; CK(cudaMalloc(&p, n * sizeof(T))); return p; }

// The per-unit series of kernels/trace.cuh: per unit n, the median over the CTAs of each
// series' stamp, µs after the CTA's own stamp 1 (clock64, scaled by the CTA's clock rate
// between its stamps 1 and 5), and the CTA count that has unit n.
static void dump_units(int nctas) {
  std::vector<unsigned long long> tr(size_t(nctas) * kIds);
  std::vector<long long> clk(size_t(nctas) * kIds);
  CK(cudaMemcpyFromSymbol(tr.data(), g_trace, tr.size() * 8));
  CK(cudaMemcpyFromSymbol(clk.data(), g_clk, clk.size() * 8));
  using namespace kernels;
  const struct { int base; const char* name; } series[] = {
      {kTraceStageFree, "free"},  {kTraceGBuilt, "G"},       {kTraceDgradHasG, "d:G"},
      {kTraceDgradStagingFree, "d:iss"}, {kTraceDgradDone, "d:mma"}, {16, "done"},
      {kTraceWgradHasUnit, "w:unit"}, {kTraceWgradDone, "w:mma"}, {kTraceHasX, "x0"},
      {kTraceHasX + kTraceUnits, "x1"}};
  // Each CTA's clock: ns per clock between its stamps 1 and 5 (0: not both stamped).
  std::vector<double> ns_per_clk(nctas, 0.0);
  double mhz_sum = 0; int mhz_n = 0;
  for (int c = 0; c < nctas; ++c) {
    const size_t b = size_t(c) * kIds;
    if (!tr[b + 1] || !tr[b + 5] || clk[b + 5] == clk[b + 1]) continue;
    ns_per_clk[c] = double(tr[b + 5] - tr[b + 1]) / double(clk[b + 5] - clk[b + 1]);
    mhz_sum += 1e3 / ns_per_clk[c]; ++mhz_n;
  }
  printf("units (us after each CTA's stamp 1, medians over CTAs):\n    n");
  for (auto& s : series) printf(" %7s", s.name);
  printf("   ctas\n");
  for (int n = 0; n < kTraceUnits; ++n) {
    std::vector<std::vector<double>> v(std::size(series));
    int ctas = 0;
    for (int c = 0; c < nctas; ++c) {
      const size_t b = size_t(c) * kIds;
      if (ns_per_clk[c] == 0) continue;
      bool any = false;
      for (size_t i = 0; i < std::size(series); ++i)
        if (tr[b + series[i].base + n]) {
          v[i].push_back((clk[b + series[i].base + n] - clk[b + 1]) * ns_per_clk[c] * 1e-3);
          any = true;
        }
      ctas += any;
    }
    if (!ctas) continue;
    printf("  %3d", n);
    for (auto& x : v) {
      if (x.empty()) { printf(" %7s", "-"); continue; }
      std::sort(x.begin(), x.end());
      printf(" %7.2f", x[x.size() / 2]);
    }
    printf("   [%d]\n", ctas);
  }
  if (mhz_n) printf("  (SM clock %.0f MHz, mean over CTAs)\n", mhz_sum / mhz_n);
}

static void dump_trace(int nctas, const char* label) {
  std::vector<unsigned long long> tr(size_t(nctas) * kIds);
  CK(cudaMemcpyFromSymbol(tr.data(), g_trace, tr.size() * 8));
  unsigned long long t0 = ~0ull;
  for (int c = 0; c < nctas; ++c) if (tr[c * kIds]) t0 = std::min(t0, tr[c * kIds]);
  printf("trace %s (us from first CTA entry): id: min med max [n]\n", label);
  for (int id = 0; id < kIds; id = id == 63 ? kernels::kTraceMisc : id + 1) {
    std::vector<double> v;
    for (int c = 0; c < nctas; ++c) if (tr[c * kIds + id]) v.push_back((tr[c * kIds + id] - t0) * 1e-3);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    printf("  %2d: %8.2f %8.2f %8.2f [%zu]\n", id, v.front(), v[v.size() / 2], v.back(), v.size());
  }
  if (const char* ids = getenv("TRACE_CTAS")) {  // e.g. "1,2,3,6,7": those ids of every CTA
    std::vector<int> want;
    for (const char* c = ids; *c;) { want.push_back(atoi(c)); while (*c && *c != ',') ++c; if (*c) ++c; }
    std::vector<unsigned> smid(nctas);
    CK(cudaMemcpyFromSymbol(smid.data(), g_smid, nctas * 4));
    for (int c = 0; c < nctas; ++c) {
      printf("  cta %4d sm %3u:", c, smid[c]);
      int last = -1;
      for (int id = 16; id < 64; ++id) if (tr[c * kIds + id]) last = id;  // units: 16 + n
      for (int id : want) printf(" %8.2f", tr[c * kIds + id] ? (tr[c * kIds + id] - t0) * 1e-3 : -1.0);
      printf("  last unit %d at %8.2f\n", last - 16, last >= 0 ? (tr[c * kIds + last] - t0) * 1e-3 : -1.0);
    }
  }
}

int main(int argc, char** argv) {
  if (argc >= 2 && !strcmp(argv[1], "occupancy")) {  // the forward plan's inputs
    for (int tile : {128, 64, 192})
      for (int split : kernels::fused_forward::kClusterSizes)
        printf("fwd tile %d split %d: %d clusters at once\n", tile, split,
               detail::fused_forward_active_clusters<160, true>(split, tile, 0));
    for (int k = 2; k <= 8; ++k)  // the backward's 128-column kernels (plan(): kCluster where a slice's k fit)
      printf("bwd clusters of %d: %d at once (K = 8), %d (any K)\n", k,
             detail::fused_backward_active_clusters<160, 8, 128>(k, 0),
             detail::fused_backward_active_clusters<160, kernels::fused_backward::kAnyTopK, 128>(k, 0));
    return 0;
  }
  if (argc < 3) { printf("phase_trace bwd T [CTAS last|spread|cluster] | fwd T [SPLIT] | occupancy\n"); return 2; }
  const bool bwd = argv[1][0] == 'b';
  const int64_t T = atoll(argv[2]);
  // FWD_SHAPE=E,K,H (forward only): 384 or 512 experts on their wide kernels (64-token tiles,
  // FWD_TILE=64), one group; else H = 5120, E = 160, K = 8.
  int64_t H = 5120; int E = 160, K = 8;
  const char* fwd_shape = bwd ? nullptr : getenv("FWD_SHAPE");
  if (fwd_shape) {
    E = atoi(fwd_shape);
    const char* c = strchr(fwd_shape, ',');
    K = c ? atoi(c + 1) : 8;
    c = c ? strchr(c + 1, ',') : nullptr;
    H = c ? atoll(c + 1) : 7168;
    if (E != 160 && E != 384 && E != 512) { printf("FWD_SHAPE: E = 160, 384 or 512\n"); return 1; }
  }
  RouterConfig cfg{}; cfg.hidden_size = H; cfg.n_routed_experts = E; cfg.num_experts_per_tok = K;
  const char* groups = getenv("ROUTER_GROUPS");  // "n,k": n groups, the best k kept
  cfg.n_group = groups ? atoi(groups) : fwd_shape ? 1 : 8;
  cfg.topk_group = groups && strchr(groups, ',') ? atoi(strchr(groups, ',') + 1) : fwd_shape ? 1 : 4;
  cfg.routed_scaling_factor = 2.5f; cfg.norm_topk_prob = true;
  const size_t set_bytes = bwd ? size_t(4 * T * H + 6 * E * H + 12 * T * K) : size_t(2 * T * H + 12 * T * K);
  const int sets = int(std::min<size_t>(12, std::max<size_t>(2, (100u << 20) / set_bytes + 1)));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  // w per input set, as the benchmarks rotate it (SHARED_W set: one w for every set, kept in L2).
  const bool shared_w = getenv("SHARED_W") != nullptr;
  float* bias = dalloc<float>(E); fill_f32<<<1, 256>>>(bias, E, 9, -0.1f, 0.1f);
  std::vector<uint16_t*> x(sets), gx(sets); std::vector<int32_t*> idx(sets); std::vector<float*> sc(sets), gt(sets), gw(sets), ow(sets);
  std::vector<uint8_t*> ws(sets);
  std::vector<uint16_t*> w(sets);
  for (int s = 0; s < sets; ++s) {
    if (s == 0 || !shared_w) { w[s] = dalloc<uint16_t>(E * H); fill_bf16<<<264, 256>>>(w[s], E * H, 7 + s); }
    else w[s] = w[0];
  }
  for (int s = 0; s < sets; ++s) {
    x[s] = dalloc<uint16_t>(T * H); fill_bf16<<<1024, 256>>>(x[s], T * H, 100 + s);
    idx[s] = dalloc<int32_t>(T * K); fill_idx<<<256, 256>>>(idx[s], T, K, E, 200 + s);
    sc[s] = dalloc<float>(T * K); fill_f32<<<256, 256>>>(sc[s], T * K, 300 + s, 0.05f, 1.f);
    gt[s] = dalloc<float>(T * K); fill_f32<<<256, 256>>>(gt[s], T * K, 400 + s, -1.f, 1.f);
    if (bwd) { gx[s] = dalloc<uint16_t>(T * H); gw[s] = dalloc<float>(E * H); ws[s] = dalloc<uint8_t>(64 << 20); CK(cudaMemset(ws[s], 0, 64 << 20)); }
    else { ow[s] = dalloc<float>(T * K); }
  }
  if (bwd && getenv("ROUTING")) {  // the backward's routing inputs from the forward, as the benchmarks make them
    float* weights = dalloc<float>(T * K);
    for (int s = 0; s < sets; ++s) {
      ForwardArgs f{}; f.tokens = T;
      f.x = {x[s], int64_t(T * H)}; f.w = {w[s], int64_t(E * H)}; f.bias = {bias, int64_t(E)};
      f.topk_idx = {idx[s], int64_t(T * K)}; f.topk_weights = {weights, int64_t(T * K)};
      f.topk_scores = {sc[s], int64_t(T * K)};
      detail::ForwardPlan pl;
      pl.tile_t = 128, pl.split = 1, pl.tiles = (T + 127) / 128, pl.tail_split = 0;
      if (detail::launch_fused_forward_e<160, true>(cfg, f, 0, pl, st) != Status::kSuccess) {
        printf("forward failed\n");
        return 1;
      }
    }
    CK(cudaStreamSynchronize(st));
  }
  // TORCH_DTYPES: each set's routing inputs as PyTorch holds them.
  const bool torch_dtypes = bwd && getenv("TORCH_DTYPES") != nullptr;
  std::vector<int64_t*> idx64(sets);
  std::vector<uint16_t*> sc_all(sets), gt16(sets);
  if (torch_dtypes) {
    for (int s = 0; s < sets; ++s) {
      idx64[s] = dalloc<int64_t>(T * K); widen_idx<<<256, 256>>>(idx[s], idx64[s], T * K);
      sc_all[s] = dalloc<uint16_t>(T * E); fill_bf16<<<256, 256>>>(sc_all[s], T * E, 500 + s);
      gt16[s] = dalloc<uint16_t>(T * K); fill_bf16<<<256, 256>>>(gt16[s], T * K, 600 + s);
    }
  }
  CK(cudaDeviceSynchronize());
  int grid = 0;
  // The forward on E's kernel (the wide ones for 384 and 512 experts).
  auto launch_forward = [&](const ForwardArgs& f, const detail::ForwardPlan& pl) {
    if (E == 512) return detail::launch_fused_forward_e<512, false>(cfg, f, 0, pl, st);
    if (E == 384) return detail::launch_fused_forward_e<384, false>(cfg, f, 0, pl, st);
    return detail::launch_fused_forward_e<160, true>(cfg, f, 0, pl, st);
  };
  // The forward's arguments on input set s.
  auto forward_args = [&](int s) {
    ForwardArgs a{}; a.tokens = T;
    a.x = {x[s], int64_t(T * H)}; a.w = {w[s], int64_t(E * H)}; a.bias = {bias, int64_t(E)};
    a.topk_idx = {idx[s], int64_t(T * K)}; a.topk_weights = {ow[s], int64_t(T * K)}; a.topk_scores = {sc[s], int64_t(T * K)};
    return a;
  };
  auto call = [&](int s) -> int {
    if (bwd) {
      BackwardArgs a{}; a.tokens = T;
      a.x = {x[s], int64_t(T * H)}; a.w = {w[s], int64_t(E * H)}; a.topk_idx = {idx[s], int64_t(T * K)};
      a.topk_scores = {sc[s], int64_t(T * K)}; a.grad_topk_weights = {gt[s], int64_t(T * K)};
      a.grad_x = {gx[s], int64_t(T * H)}; a.grad_w = {gw[s], int64_t(E * H)}; a.workspace = {ws[s], int64_t(64 << 20)};
      a.accumulate_grad_w = getenv("ACCUMULATE") != nullptr;  // add into grad_w
      if (torch_dtypes) {  // (scores of all experts, in [-1, 1): the kernel reads them as given)
        a.topk_idx = DeviceInput(idx64[s], T * K, DType::kI64);
        a.topk_scores = {};
        a.scores = DeviceInput(sc_all[s], T * E, DType::kBF16);
        a.grad_topk_weights = DeviceInput(gt16[s], T * K, DType::kBF16);
        a.grad_w = DeviceOutput(gw[s], E * H, DType::kBF16);
        a.accumulate_grad_w = false;
      }
      detail::BackwardPlan pl;
      pl.ctas = argc > 3 ? atoi(argv[3]) : int(H / 128);
      const char m = argc > 4 ? argv[4][0] : 'l';
      pl.sum = m == 's' ? detail::GradWSum::kSpread : m == 'c' ? detail::GradWSum::kCluster
                                                                : detail::GradWSum::kLastCta;
      pl.per_slice = pl.sum == detail::GradWSum::kLastCta ? 1 : pl.ctas / int(H / 128);
      grid = pl.ctas;
      if (grid > kMaxCtas) return -1;
      // Clusters that do not all fit at once never finish (the kernels' grid barriers wait for
      // every CTA): the library's plan checks this; so does this tool.
      if (pl.sum == detail::GradWSum::kCluster) {
        constexpr int kAny = kernels::fused_backward::kAnyTopK;
        const int fit = torch_dtypes
                            ? detail::fused_backward_active_clusters<160, kAny, 128>(pl.per_slice, 0)
                            : detail::fused_backward_active_clusters<160, 8, 128>(pl.per_slice, 0);
        if (fit < int(H / 128)) {
          printf("clusters of %d: %d fit at once, %lld slices need them\n", pl.per_slice, fit,
                 (long long)(H / 128));
          return -2;
        }
      }
      // PASSES: 1 the default sweep, r the residual sweep alone, 2 both in one launch (precise
      // mode), l both as two launches.
      const char* passes = getenv("PASSES") ? getenv("PASSES") : "1";
      const bool h64 = argc > 5 && argv[5][0] == 'h';  // 64-column slices, one CTA each
      if (h64) pl.tile_h = 64;
      auto pass = [&](uint32_t sweeps, const BackwardArgs& args) {
        constexpr int kAny = kernels::fused_backward::kAnyTopK;
        if (torch_dtypes)
          return h64 ? detail::launch_fused_backward_e<160, kAny, 64>(cfg, args, 0, pl, st, sweeps)
                     : detail::launch_fused_backward_e<160, kAny, 128>(cfg, args, 0, pl, st, sweeps);
        return h64 ? detail::launch_fused_backward_e<160, 8, 64>(cfg, args, 0, pl, st, sweeps)
                   : detail::launch_fused_backward_e<160, 8, 128>(cfg, args, 0, pl, st, sweeps);
      };
      using kernels::fused_backward::kPassG, kernels::fused_backward::kPassResidual;
      if (passes[0] == 'r') return int(pass(kPassResidual, a));
      if (passes[0] == '2') return int(pass(kPassG | kPassResidual, a));
      Status r = pass(kPassG, a);
      if (r != Status::kSuccess || passes[0] != 'l') return int(r);
      BackwardArgs acc = a;
      acc.accumulate_grad_w = true;
      return int(pass(kPassResidual, acc));
    } else {
      const ForwardArgs a = forward_args(s);
      const int split = argc > 3 ? atoi(argv[3]) : 1;
      const int tile_t = getenv("FWD_TILE") ? atoi(getenv("FWD_TILE")) : 128;  // 128, 64 or 192
      const int64_t tiles = (T + tile_t - 1) / tile_t;
      grid = int(argc > 5 ? std::max(atoll(argv[4]) * split, (tiles - atoll(argv[4])) * atoi(argv[5]))
                          : tiles * split);
      if (grid > kMaxCtas) return -1;
      detail::ForwardPlan pl;
      pl.tile_t = tile_t;
      pl.split = split;
      pl.tiles = argc > 5 ? atoll(argv[4]) : tiles;
      pl.tail_split = argc > 5 ? atoi(argv[5]) : 0;
      return int(launch_forward(a, pl));
    }
  };
  for (int s = 0; s < sets; ++s) {
    if (int r = call(s)) {
      if (r == -1) printf("at most %d CTAs are traced\n", kMaxCtas);
      else if (r > 0) printf("launch status %d\n", r);  // (-2: said why)
      return 1;
    }
  }
  CK(cudaStreamSynchronize(st));
  if (!bwd && getenv("CHECK")) {  // set 0's indices and weights against clusters of one (128-
                                  // token tiles; 64 on the wide kernels, which have no others)
    std::vector<int32_t> i1(T * K), i2(T * K); std::vector<float> w1(T * K), w2(T * K);
    CK(cudaMemcpy(i1.data(), idx[0], T * K * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w1.data(), ow[0], T * K * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemset(idx[0], 0xff, T * K * 4)); CK(cudaMemset(ow[0], 0xff, T * K * 4));
    const ForwardArgs f = forward_args(0);
    const int tile_t = kernels::fused_forward::tile_fits(E, 128) ? 128 : 64;
    detail::ForwardPlan pl; pl.tile_t = tile_t, pl.split = 1, pl.tiles = (T + tile_t - 1) / tile_t, pl.tail_split = 0;
    if (launch_forward(f, pl) != Status::kSuccess) { printf("forward failed\n"); return 1; }
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(i2.data(), idx[0], T * K * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w2.data(), ow[0], T * K * 4, cudaMemcpyDeviceToHost));
    int64_t rows = 0; double maxd = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool same = true;
      for (int k = 0; k < K; ++k) same = same && i1[t * K + k] == i2[t * K + k];
      rows += !same;
      if (same) for (int k = 0; k < K; ++k) maxd = std::max(maxd, double(std::abs(w1[t * K + k] - w2[t * K + k])));
    }
    printf("check: %lld of %lld rows choose other experts than clusters of one; max weight difference elsewhere %.3g\n", (long long)rows, (long long)T, maxd);
  }
  const int n = sets * std::max(1, int(60 / sets));
  // GRAPH set: a round's n calls captured once into a CUDA graph and replayed, as the
  // benchmarks time them (else launched one by one from the host).
  cudaGraphExec_t graph = nullptr;
  if (getenv("GRAPH")) {
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; ++i) call(i % sets);
    cudaGraph_t g; CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&graph, g, 0));
    CK(cudaGraphLaunch(graph, st)); CK(cudaStreamSynchronize(st));  // the first replay uploads it
  }
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<float> times;
  for (int r = 0; r < 7; ++r) {
    CK(cudaEventRecord(a, st));
    if (graph) CK(cudaGraphLaunch(graph, st));
    else for (int i = 0; i < n; ++i) call(i % sets);
    CK(cudaEventRecord(b, st)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); times.push_back(ms * 1000 / n);
  }
  std::sort(times.begin(), times.end());
  printf("%s T=%lld grid=%d sets=%d: median %.2f us (min %.2f max %.2f)\n", bwd ? "bwd" : "fwd", (long long)T, grid, sets, times[3], times[0], times[6]);
  dump_trace(grid, "back-to-back");
  // One isolated call: the previous kernel is done before it starts.
  void* tp; CK(cudaGetSymbolAddress(&tp, g_trace)); CK(cudaMemset(tp, 0, sizeof(unsigned long long) * kMaxCtas * kIds));
  CK(cudaDeviceSynchronize());
  call(0); CK(cudaStreamSynchronize(st));
  dump_trace(grid, "isolated");
  if (bwd) dump_units(grid);
  CK(cudaGetLastError());
  return 0;
}
