// Dispatch of the fused backward: split of the token range over the GPU's SMs.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "fused_backward.h"
#include "fused_kernels.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

// A per-device value, read once by `read(device, value)` (false where the query fails: then
// `fallback`, not kept, so that a later call asks again). The plan, hence the grad_w summation
// order, depends on these values, so every call on a device must see the same ones.
template <class T, size_t N, class Read>
T once_per_device(std::atomic<T> (&cache)[N], int device, T fallback, Read read) {
  std::atomic<T>* slot = device >= 0 && size_t(device) < N ? &cache[device] : nullptr;
  if (slot) {
    if (T v = slot->load(std::memory_order_relaxed); v > T(0)) return v;
  }
  T v{};
  if (!read(device, v) || !(v > T(0))) {
    (void)cudaGetLastError();
    return fallback;
  }
  if (slot) slot->store(v, std::memory_order_relaxed);
  return v;
}

int sm_count(int device) {
  static std::atomic<int> cached[64] = {};
  return once_per_device(cached, device, 132, [](int d, int& n) {
    return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d) == cudaSuccess;
  });
}

// Peak DRAM bandwidth in bytes/s (memory clock x bus width, double data rate); 0 where the
// attributes are missing.
double dram_bandwidth(int device) {
  static std::atomic<double> cached[64] = {};
  return once_per_device(cached, device, 0.0, [](int d, double& b) {
    int khz = 0, bits = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, d) != cudaSuccess)
      return false;
    b = 2.0 * 1e3 * double(khz) * double(bits) / 8.0;
    return true;
  });
}

// MOE_ROUTING_BACKWARD_PLAN (read once; a diagnostic for measuring the plans against each
// other): "h64" takes 64-column slices wherever they fit, "h128" never; unset or anything else,
// the cost model in plan() decides.
enum class PlanChoice { kAuto, kH64, kH128 };
PlanChoice plan_choice() {
  static const PlanChoice choice = [] {
    const char* v = std::getenv("MOE_ROUTING_BACKWARD_PLAN");
    if (v != nullptr && std::strcmp(v, "h64") == 0) return PlanChoice::kH64;
    if (v != nullptr && std::strcmp(v, "h128") == 0) return PlanChoice::kH128;
    return PlanChoice::kAuto;
  }();
  return choice;
}

// MOE_ROUTING_BACKWARD_UNIT64 (read once; a diagnostic, like MOE_ROUTING_BACKWARD_PLAN, for
// setting the crossing by measurement): a number in (1/3, 1] replaces unit64_torch's value on
// every device; unset or anything else, its anchors decide.
double unit64_override() {
  static const double value = [] {
    const char* v = std::getenv("MOE_ROUTING_BACKWARD_UNIT64");
    if (v == nullptr) return 0.0;
    char* end = nullptr;
    const double u = std::strtod(v, &end);
    return end != v && *end == '\0' && u > 1.0 / 3.0 && u <= 1.0 ? u : 0.0;
  }();
  return value;
}

// MOE_ROUTING_BACKWARD_SPLIT (read once; a diagnostic like MOE_ROUTING_BACKWARD_PLAN): k in
// [1, 8] CTAs per slice wherever k fits, in place of the plan's choice: per 64-column slice for
// the kernels that have those alone (256 experts, the wide kernels; plan64), per 128-column
// slice elsewhere (plan; unless MOE_ROUTING_BACKWARD_PLAN=h64), its grad_w summed as the plan
// would sum k partials; unset or anything else, 0.
int split_override() {
  static const int value = [] {
    const char* v = std::getenv("MOE_ROUTING_BACKWARD_SPLIT");
    if (v == nullptr || v[0] < '1' || v[0] > '8' || v[1] != '\0') return 0;
    return v[0] - '0';
  }();
  return value;
}

// The kernels of fused_kernels.def, by row (each defined in its own translation unit).
using LaunchFn = Status (*)(const RouterConfig&, const BackwardArgs&, int, const BackwardPlan&,
                            cudaStream_t, uint32_t);
using ClustersFn = int (*)(int, int);
template <size_t... I>
constexpr std::array<LaunchFn, sizeof...(I)> launchers(std::index_sequence<I...>) {
  return {&launch_fused_backward_e<kFusedBackwardKernels[I].experts,
                                   kFusedBackwardKernels[I].top_k,
                                   kFusedBackwardKernels[I].tile_h>...};
}
template <size_t... I>
constexpr std::array<ClustersFn, sizeof...(I)> cluster_queries(std::index_sequence<I...>) {
  return {&fused_backward_active_clusters<kFusedBackwardKernels[I].experts,
                                          kFusedBackwardKernels[I].top_k,
                                          kFusedBackwardKernels[I].tile_h>...};
}
constexpr auto kLaunch = launchers(std::make_index_sequence<kNumFusedBackward>{});
constexpr auto kActiveClusters = cluster_queries(std::make_index_sequence<kNumFusedBackward>{});

// Clusters of k CTAs (k = 2..8) of the 128-column kernel for E that fit on a device at once
// (K = 8's where E has one: the any-K kernels, like K = 8's, fit one CTA per SM), read once
// per device and E (the kernels' shared memory differs with E).
int active_clusters(int device, int64_t experts, int k) {
  static std::atomic<int> cached[64][kNumFusedBackward][9] = {};
  int row = fused_backward_row(experts, 8, 128);
  if (row < 0) row = fused_backward_row(experts, kAnyTopK, 128);
  if (row < 0 || k < 0 || k > 8) return 0;
  std::atomic<int>* slot = device >= 0 && device < 64 ? &cached[device][row][k] : nullptr;
  if (slot) {  // 0: not asked yet; -1: none fit
    if (int n = slot->load(std::memory_order_relaxed); n != 0) return n > 0 ? n : 0;
  }
  const int n = kActiveClusters[row](k, device);
  if (slot) slot->store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n;
}

// The persistent grid: k CTAs per slice, so that the split points within a slice are the same
// for every slice. CTAs running side by side then read the same token tiles (x rows 10 KB
// long, each CTA 256 bytes of every row) rather than tiles at unrelated offsets. The k CTAs of
// a slice sum its grad_w in the cheapest way the device allows (GradWSum): spread over the k
// CTAs, through shared memory where they fit as clusters (k <= 8), else through global
// memory. The spread sum has CTAs wait for each other: the grid is at most one CTA per SM
// (the kernel's shared memory allows no more), so all are resident once the SMs are free
// (and a slice's k CTAs are consecutive: see schedule.cuh for smaller SM partitions).
// Costs in units of one unit's time (about 2 µs), measured on an H200 at T = 512: the cluster
// sum about 2.5 units whatever k; the last-CTA sum about 1.7 (partial stores and ticket) plus
// 1.1 per partial; the spread sum through global memory about 2.8 (T = 4096, k = 3: ~6 µs
// from the last unit to the end). Where the slices outnumber the SMs, one range per SM
// (last-CTA sum). Where twice as many 64-column slices fit on the SMs, each CTA may instead
// take one whole 64-column slice: no partial sums at all, a unit about unit64 of a 128-column
// one (0.555: both plans measured single-call at H = 5120, E = 160, the 64-column one faster by
// 1.2-1.6 µs at 12 tiles, even at 13-15, slower from 16, where 0.55 would tie with the sum
// over 3 CTAs and keep 64 columns; docs/perf-log/backward.md v23).
//
// unit64 for PyTorch's K = 8 rows (torch_rows, packed into compact rows: the public range)
// depends on the device's DRAM, and is weighed against the 128-column plan's units spread over
// the grid rather than per CTA: there the 128-column plans are bound by DRAM, not by their CTAs'
// units (measured single-call with both plans forced, backward v38, an H100: 25.5 to 38.1 µs from
// 13 to 26 tiles, ~1 µs a tile, no steps at multiples of 3), while the 64-column ones are not.
// On that H100 (3.35 TB/s) the 64-column plan was faster up to 20 tiles (1.0-1.8 µs) and slower
// from 21 (0.6 µs at 21, 0.4 at 22, 1.8 at 23): 0.47 against the spread sum over 3 CTAs puts the
// crossing at 20.5 tiles. An H200 (4.8 TB/s) measured the 64-column plan at 22 tiles (s2700)
// 3.4 µs slower than the 128-column one at 23 (s2900; backward v37's run): 0.48 puts its
// crossing at 19 tiles, so that s2240 (18 tiles, not measured on both plans there) keeps 64
// columns. Between the two, interpolated by bandwidth; outside, the nearer one. At other H the
// same rule moves the crossing by a tile or two (H = 4096: 64 columns up to 12 tiles, was 14).
double unit64_torch(int device) {
  if (const double u = unit64_override(); u > 0.0) return u;
  constexpr double kBwH100 = 3.35e12, kBwH200 = 4.8e12, kUnit64H100 = 0.47, kUnit64H200 = 0.48;
  const double f = std::clamp((dram_bandwidth(device) - kBwH100) / (kBwH200 - kBwH100), 0.0, 1.0);
  return kUnit64H100 + f * (kUnit64H200 - kUnit64H100);
}

// `any_rows`: rows that only the 64-column kernels compact, the any-K kernels' rows other than
// PyTorch's K = 8 ones (another K or other dtypes) at 128 and 160 experts (Config::
// kCompactAnyRows), outside precise mode (whose two sweeps read the inputs). The 128-column
// kernels load those rows unit by unit, 8-11 µs more per call than their K = 8 kernels whatever
// T (an H100, top-6 at H = 4096 and 5120, 8 to 64 tiles), so their plan is charged kAnyRows128
// units more: the crossing moves to ~34 tiles at H = 4096 (measured 34) and ~45 at H = 5120
// (measured 38), from 12-16 tiles, below which 64 columns measured 4-10 µs faster (backward
// v39). (K = 8 rows in the training dtypes that are not 16-byte aligned take the any-K kernels
// too, but keep the plan of aligned rows, hence their bits.)
constexpr double kAnyRows128 = 7.0;

BackwardPlan plan(int64_t tiles, int64_t slices, int64_t experts, int num_sms, int device,
                  bool torch_inputs, bool any_rows) {
  constexpr double kClusterSum = 2.5, kSpreadSum = 2.8, kWritePartial = 1.7, kReadPartial = 1.1;
  constexpr double kUnit64Training = 0.555;
  const int64_t grid = std::min<int64_t>(num_sms, kFusedMaxCtas);
  const int64_t most = grid / slices;
  if (most < 1) return {int(std::min(tiles * slices, grid)), 1, GradWSum::kLastCta};
  const PlanChoice choice = plan_choice();
  if (2 * slices <= grid && choice == PlanChoice::kH64)
    return {int(2 * slices), 1, GradWSum::kLastCta, 64};
  // The best 128-column plan by its CTAs' units (ceil), and its time as the units spread over
  // the grid (smooth): what the 64-column plan is weighed against for PyTorch's rows.
  BackwardPlan best{int(slices), 1, GradWSum::kLastCta};
  double best_cost = double(tiles), best_smooth = double(tiles);
  const bool spread = slices <= kMaxCounterSlices;
  const int forced = split_override();
  if (forced == 1) return best;
  for (int64_t k = 2; k <= most && k <= tiles; ++k) {
    GradWSum sum = GradWSum::kLastCta;
    double cost = kWritePartial + kReadPartial * double(k);
    if (spread && kSpreadSum < cost) sum = GradWSum::kSpread, cost = kSpreadSum;
    if (k <= 8 && kClusterSum < cost && active_clusters(device, experts, int(k)) >= slices)
      sum = GradWSum::kCluster, cost = kClusterSum;
    if (k == forced) return {int(k * slices), int(k), sum};
    const double smooth = cost + double(tiles) / double(k);
    cost += double(ceil_div(tiles, k));
    if (cost < best_cost)
      best = {int(k * slices), int(k), sum}, best_cost = cost, best_smooth = smooth;
  }
  const double unit64 = torch_inputs ? unit64_torch(device) : kUnit64Training;
  const double cost128 =
      (torch_inputs ? best_smooth : best_cost) + (any_rows ? kAnyRows128 : 0.0);
  if (2 * slices <= grid && choice != PlanChoice::kH128 && unit64 * double(tiles) <= cost128)
    return {int(2 * slices), 1, GradWSum::kLastCta, 64};
  return best;
}

// E with 64-column kernels alone (256), and the wide kernels: one CTA per 64-column slice, or,
// where the slices leave SMs idle, k CTAs per slice (a k-th of its token tiles each) whose
// partials are summed spread (kSpread), each CTA a share of the slice: where that costs fewer
// units than one CTA per slice. `spread_sum`: the spread sum's cost in the kernel's units,
// measured with k forced (MOE_ROUTING_BACKWARD_SPLIT; an H100, single calls, T = 512-4096;
// backward v40): 256 experts (Kimi-Linear, MiniMax-M2, Ling-flash-2.0: 36-64 slices) 0.8-2.6
// units, kSpreadSum64 = 2 (was 5, an estimate from E = 160's, which kept one CTA per slice at
// T = 1024, 2-4 µs slower); the wide kernels (64-token units, 512 experts top-16 at H = 4096)
// 2.7-3.1, kSpreadSumWide = 3 (was 10, an estimate).
constexpr double kSpreadSum64 = 2.0, kSpreadSumWide = 3.0;
BackwardPlan plan64(int64_t tiles, int64_t slices, int num_sms, double spread_sum) {
  const int64_t grid = std::min<int64_t>(num_sms, kFusedMaxCtas);
  BackwardPlan best{int(slices), 1, GradWSum::kLastCta, 64};
  double best_cost = double(tiles);
  if (slices > kMaxCounterSlices) return best;
  if (const int k = split_override(); k == 1)
    return best;
  else if (k > 1 && k * slices <= grid && k <= tiles)
    return {int(k * slices), k, GradWSum::kSpread, 64};
  for (int64_t k = 2; k * slices <= grid && k <= tiles; ++k) {
    const double cost = spread_sum + double(ceil_div(tiles, k));
    if (cost < best_cost) best = {int(k * slices), int(k), GradWSum::kSpread, 64}, best_cost = cost;
  }
  return best;
}

// The kernel of E for the plan's slice width: K = 8 with 16-byte aligned routing rows in the
// training dtypes has its own where E has one (vector loads); any other K, alignment or dtype
// takes the any-K one.
Status launch_passes(const RouterConfig& cfg, const BackwardArgs& a, int device,
                     const BackwardPlan& pl, cudaStream_t stream, uint32_t passes) {
  const int64_t e = cfg.n_routed_experts;
  const bool k8 = cfg.num_experts_per_tok == 8 && fused_backward_row(e, 8, pl.tile_h) >= 0 &&
                  routing_rows_aligned16(a) && training_dtypes(a);
  const int row = fused_backward_row(e, k8 ? 8 : kAnyTopK, pl.tile_h);
  if (row < 0) return Status::kUnsupported;
  return kLaunch[row](cfg, a, device, pl, stream, passes);
}

// Which wide shapes take the wide kernels. By default those of more than 256 experts (Kimi-K2
// 20-23% faster than the simple path's GEMMs at every T on an H100), and not more than 8
// experts a token at up to 256 experts, which the 384-expert kernel serves masked, at up to 2.4x
// the tensor work: 160 experts top-12 was slower than the simple path at every T (backward
// "Wide v1"). MOE_ROUTING_WIDE_BACKWARD (read at each call of a wide shape, so that a process
// may set it before its first such call): "1" takes them for every wide shape, "0" for none.
bool wide_backward_enabled(const RouterConfig& cfg) {
  const char* v = std::getenv("MOE_ROUTING_WIDE_BACKWARD");
  if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  return cfg.n_routed_experts > 256;
}

}  // namespace

bool fused_backward_supported(const RouterConfig& cfg) {
  // More than 256 experts, or more than 8 a token: the wide kernels (wide_backward_enabled),
  // any K up to 16, E a multiple of 16 up to 512 (below 272 on the 384-expert kernel, masked).
  if (fused_backward_wide_shape(cfg))
    return wide_backward_enabled(cfg) && fused_backward_wide_row_for(cfg.n_routed_experts) >= 0 &&
           cfg.num_experts_per_tok >= 1 && cfg.num_experts_per_tok <= kWideTopK &&
           cfg.hidden_size % 64 == 0 && cfg.hidden_size / 64 <= kMaxCounterSlices;
  // K up to 8 (K = 8 with aligned routing rows has kernels of its own where E does:
  // launch_passes).
  if (cfg.num_experts_per_tok < 1 || cfg.num_experts_per_tok > 8) return false;
  // E with 128-column kernels (64, 128, 160): 128-column slices, or 64-column ones at small T.
  if (has_fused_backward(cfg.n_routed_experts, 128)) return cfg.hidden_size % kTileH == 0;
  // E with 64-column kernels alone (256, DeepSeek-V3): 64-column slices at every T (plan64).
  return has_fused_backward(cfg.n_routed_experts, 64) && cfg.hidden_size % 64 == 0 &&
         cfg.hidden_size / 64 <= kMaxCounterSlices;
}

bool fused_backward_takes(const RouterConfig& cfg, Precision precision) {
  // (The wide kernels have no residual sweep: precise mode takes the simple path's GEMMs.)
  return fused_backward_supported(cfg) &&
         !(fused_backward_wide_shape(cfg) && precision == Precision::kPrecise);
}

// Precise mode: a second sweep adds xᵀ · (G - bf16(G)) to grad_w, the part of G that the bf16
// G leaves out (in a fixed order: still deterministic): in the same launch where each CTA has
// one segment (the residual's sweep first), else as a second launch that adds into grad_w.
// grad_x is the G sweep's: with G in bf16 its error stays within grad_x's own bf16 rounding.
Status launch_fused_backward(const RouterConfig& cfg, const BackwardArgs& a, int device,
                             cudaStream_t stream) {
  if (!fused_backward_takes(cfg, a.precision)) return Status::kUnsupported;
  if (fused_backward_wide_shape(cfg)) {
    const int row = fused_backward_wide_row_for(cfg.n_routed_experts);
    const BackwardPlan pl =
        plan64(ceil_div(a.tokens, int64_t(64)), cfg.hidden_size / 64, sm_count(device),
               kSpreadSumWide);
    return kLaunch[row](cfg, a, device, pl, stream, kernels::fused_backward::kPassG);
  }
  const int64_t tiles = ceil_div(a.tokens, kTileT), slices = cfg.hidden_size / kTileH;
  const bool torch_rows = kernels::torch_rows(routing_inputs(cfg, a), cfg.num_experts_per_tok);
  const bool compact = a.precision != Precision::kPrecise;
  const BackwardPlan pl =
      has_fused_backward(cfg.n_routed_experts, 128)
          ? plan(tiles, slices, cfg.n_routed_experts, sm_count(device), device,
                 torch_rows && compact,
                 compact && !torch_rows &&
                     kernels::compacts_any_rows(int(cfg.n_routed_experts), 64) &&
                     !(cfg.num_experts_per_tok == 8 && training_dtypes(a)))
          : plan64(tiles, cfg.hidden_size / 64, sm_count(device), kSpreadSum64);
  using kernels::fused_backward::kPassG, kernels::fused_backward::kPassResidual;
  if (a.precision != Precision::kPrecise) return launch_passes(cfg, a, device, pl, stream, kPassG);
  // (validate_backward: precise mode writes grad_w as f32.)
  if (pl.one_segment_per_cta(slices))
    return launch_passes(cfg, a, device, pl, stream, kPassG | kPassResidual);
  const Status s = launch_passes(cfg, a, device, pl, stream, kPassG);
  if (s != Status::kSuccess) return s;
  BackwardArgs residual = a;
  residual.accumulate_grad_w = true;
  return launch_passes(cfg, residual, device, pl, stream, kPassResidual);
}

}  // namespace moe_routing::detail
