// Dispatch of the fused forward: the token tile and the cluster size (split of the hidden
// dimension) per T.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "fused_forward.h"
#include "fused_kernels.h"
#include "kernel_paths.h"
#include "kernels/fused_forward/cluster_sizes.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

constexpr int64_t kTileT = 128, kTileH = 64;
// The kernel's split_sum instantiations. (Not 5: the occupancy query allowed 24 clusters of 5,
// but 24 tiles in clusters of 5 ran as two waves on an H200, 33.9 us against 19.3 us in
// clusters of 4.)
constexpr const auto& kSplits = kernels::fused_forward::kClusterSizes;
constexpr int kNumSplits = kernels::fused_forward::kNumClusterSizes;

// A wave's cost per token tile, in eighths of a 128-token tile's hidden block (~0.47 us / 8):
// the part that does not shrink with the split (pipeline fill, reduction, routing; `fixed1`
// without a split, `fixed` with one), a hidden block of a CTA, and the DRAM bytes of x per
// eighth (a wave's main loop is also bounded by DRAM; it binds where more than ~125 CTAs
// stream at once).
struct TileCost {
  int tile_t;
  int64_t fixed1, fixed, block, dram_bytes;
};
constexpr TileCost kTileCosts[] = {
    // 128 tokens. Fitted on an H200 (H = 5120, E = 160, one wave per split): 80 blocks per CTA
    // 50 us, 40 blocks 32 us, 20 21.5 us, 10 16.5 us, 5 15.4 us: 26 blocks of fixed cost. DRAM:
    // the main loop of one wave of 128 tiles at H = 5120, 168 MB in 39.1 us (4.3 TB/s).
    {128, 8 * 26, 8 * 26, 8, 252700},
    // 64 tokens (half the x bytes per block, half the partial bytes through the cluster
    // network, twice the tiles). Fitted on an H200: 10 blocks per CTA 11.0 us, 14 12.1 us, 20
    // 13.5 us, 27 16.2 us, 40 19.3-20.2 us, 80 31.3 us.
    {64, 136, 136, 5, 252700},
    // 192 tokens (E = 160). Measured on an H200 (phase timeline, graph replay): unsplit, 80
    // blocks on 86 CTAs 68.1 us (main loop 51.5: 0.64 us a block; routing 192 rows and the rest
    // 16.6 us); split, 40 blocks 41.2 us (2), 27 29.4 us (3), 20 27.9 us (4), 14 21.6 us (6);
    // DRAM: one wave of 128 tiles, 252 MB in 61.7 us (4.1 TB/s with 5 stages in flight).
    {192, 283, 235, 11, 239700},
};
// A second launch for the last tiles: its start, in eighths.
constexpr int64_t kTailCost = 16;

// The kernels of fused_kernels.def, by row (each defined in its own translation unit).
using LaunchFn = Status (*)(const RouterConfig&, const ForwardArgs&, int, const ForwardPlan&,
                            cudaStream_t);
using ClustersFn = int (*)(int, int, int);
template <size_t... I>
constexpr std::array<LaunchFn, sizeof...(I)> launchers(std::index_sequence<I...>) {
  return {&launch_fused_forward_e<kFusedForwardKernels[I].experts,
                                  kFusedForwardKernels[I].tall_tiles>...};
}
template <size_t... I>
constexpr std::array<ClustersFn, sizeof...(I)> cluster_queries(std::index_sequence<I...>) {
  return {&fused_forward_active_clusters<kFusedForwardKernels[I].experts,
                                         kFusedForwardKernels[I].tall_tiles>...};
}
constexpr auto kLaunch = launchers(std::make_index_sequence<kNumFusedForward>{});
constexpr auto kActiveClusters = cluster_queries(std::make_index_sequence<kNumFusedForward>{});

// Active clusters per expert count, tile and split size for one device, read once: the split,
// hence the order of the logit summation, depends only on the device, E and T. (Per E: the
// kernels differ in shared memory, and 192-token tiles exist where E has tall tiles alone.)
constexpr int kNumTiles = int(sizeof(kTileCosts) / sizeof(kTileCosts[0]));
struct Occupancy {
  std::atomic<int> clusters[kNumFusedForward][kNumTiles][kNumSplits];
};

int active_clusters(int device, int which, int64_t experts, int tile) {
  static Occupancy cached[64] = {};
  const int e = fused_forward_row_for(experts);
  if (e < 0) return 0;
  std::atomic<int>* slot =
      device >= 0 && device < 64 ? &cached[device].clusters[e][tile][which] : nullptr;
  if (slot) {  // 0: not asked yet; -1: the device has no room for such clusters
    if (int n = slot->load(std::memory_order_relaxed); n != 0) return n > 0 ? n : 0;
  }
  const int n = kActiveClusters[e](kSplits[which], kTileCosts[tile].tile_t, device);
  if (slot) slot->store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n;
}

// MOE_ROUTING_FORWARD_SPLIT (read once; a diagnostic for measuring the plans against each
// other): a cluster size of kSplits that replaces the plan's, every tile of the plan's tile size
// at that split in one launch, where such clusters fit; unset or anything else, 0.
int split_override() {
  static const int value = [] {
    const char* v = std::getenv("MOE_ROUTING_FORWARD_SPLIT");
    if (v == nullptr) return 0;
    char* end = nullptr;
    const long s = std::strtol(v, &end, 10);
    return end != v && *end == '\0' && s > 0 && s <= 16 &&
                   kernels::fused_forward::is_cluster_size(int(s))
               ? int(s)
               : 0;
  }();
  return value;
}

// The launch plan with the least estimated time: waves of clusters × (fixed cost + the larger
// of a CTA's blocks and the wave's x bytes through DRAM). A plan either runs every tile at one
// split, or runs whole waves at one split and the remaining tiles (a last wave that would leave
// SMs idle) at another, in a second launch; with 128-token tiles, with 64-token tiles, whose
// blocks (half the x bytes) and split sums (half the partial bytes through the cluster network,
// which moves ~20-30 GB/s per SM) cost less, for twice the tiles (the small-T plans), or with
// 192-token tiles (E = 160), two thirds of the tiles of 128 (one wave where 128-token tiles
// need a second, or more SMs busy at a split).
ForwardPlan plan(const RouterConfig& cfg, int64_t tokens, int device) {
  const int64_t hblocks = ceil_div(cfg.hidden_size, kTileH);
  // (Replaced by the first tile and split the device has room for; above 256 experts the tiles
  // are of 64 tokens alone.)
  const int row = fused_forward_row_for(cfg.n_routed_experts);  // (>= 0: the caller's check)
  const int64_t tile0 =
      kernels::fused_forward::tile_fits(kFusedForwardKernels[row].experts, int(kTileT)) ? kTileT
                                                                                      : 64;
  ForwardPlan best{1, ceil_div(tokens, tile0), 0, int(tile0)};
  int64_t best_cost = INT64_MAX;
  for (int tile = 0; tile < kNumTiles; ++tile) {
    const TileCost& tc = kTileCosts[tile];
    const int tile_t = tc.tile_t;
    const int64_t tiles = ceil_div(tokens, tile_t);
    int clusters[kNumSplits] = {};
    for (int which = 0; which < kNumSplits && kSplits[which] <= hblocks; ++which)
      clusters[which] = active_clusters(device, which, cfg.n_routed_experts, tile);
    // One wave of n tiles in clusters of kSplits[which]: the fixed part, then the main loop, a
    // CTA's blocks or the wave's x bytes through DRAM.
    const int64_t tile_bytes = int64_t(tile_t) * hblocks * kTileH * 2;
    auto wave = [&](int which, int64_t n) {
      const int64_t blocks = ceil_div(hblocks, int64_t(kSplits[which]));
      const int64_t loop = std::max(tc.block * blocks, ceil_div(n * tile_bytes, tc.dram_bytes));
      return (kSplits[which] == 1 ? tc.fixed1 : tc.fixed) + loop;
    };
    // `n` tiles in waves of clusters[which]: the full waves, then a partial one.
    auto waves = [&](int which, int64_t n) {
      const int64_t full = n / clusters[which], rest = n % clusters[which];
      return full * wave(which, clusters[which]) + (rest ? wave(which, rest) : 0);
    };
    for (int which = 0; which < kNumSplits; ++which) {  // ties keep the smaller split
      if (clusters[which] <= 0) continue;
      const int64_t cost = waves(which, tiles);
      if (cost < best_cost) best = {kSplits[which], tiles, 0, tile_t}, best_cost = cost;
      const int64_t whole = tiles / clusters[which] * clusters[which];
      if (whole == 0 || whole == tiles) continue;
      for (int tail = 0; tail < kNumSplits; ++tail) {
        if (tail == which || clusters[tail] <= 0) continue;
        const int64_t c = waves(which, whole) + waves(tail, tiles - whole) + kTailCost;
        if (c < best_cost) best = {kSplits[which], whole, kSplits[tail], tile_t}, best_cost = c;
      }
    }
  }
  if (const int s = split_override(); s > 0 && s <= hblocks) {
    int which = 0;
    while (kSplits[which] != s) ++which;
    int tile = 0;
    while (kTileCosts[tile].tile_t != best.tile_t) ++tile;
    if (active_clusters(device, which, cfg.n_routed_experts, tile) > 0)
      return {s, ceil_div(tokens, int64_t(best.tile_t)), 0, best.tile_t};
  }
  return best;
}

// Which row serves E: its own, else the narrowest wider one; E a multiple of 16 up to 512.
constexpr int row_experts(long long experts) {
  const int row = fused_forward_row_for(experts);
  return row < 0 ? -1 : kFusedForwardKernels[row].experts;
}
static_assert(row_experts(160) == 160 && row_experts(96) == 128 && row_experts(144) == 160 &&
                  row_experts(16) == 64 && row_experts(320) == 384 && row_experts(400) == 512 &&
                  row_experts(512) == 512 && row_experts(72) == -1 && row_experts(528) == -1 &&
                  row_experts(0) == -1,
              "fused_forward_row_for");

}  // namespace

bool fused_forward_config_supported(const RouterConfig& cfg) {
  // The routing epilogue keeps the kept groups in a 32-bit mask.
  // Any E that is a multiple of 16 up to the widest row (the rest of its row masked).
  return fused_forward_row_for(cfg.n_routed_experts) >= 0 && cfg.n_group <= 32 &&
         cfg.num_experts_per_tok <= 16;
}

bool fused_forward_supported(const RouterConfig& cfg, const ForwardArgs& a) {
  // TMA needs 16-byte aligned bases and row strides (H % 8 == 0 is validated); the cluster
  // needs hblocks >= 1.
  return fused_forward_config_supported(cfg) && aligned16(a.x.data) && aligned16(a.w.data) &&
         a.tokens <= int64_t(INT32_MAX);
}

Status launch_fused_forward(const RouterConfig& cfg, const ForwardArgs& a, int device,
                            cudaStream_t stream) {
  const int row = fused_forward_row_for(cfg.n_routed_experts);
  if (row < 0) return Status::kUnsupported;
  return kLaunch[row](cfg, a, device, plan(cfg, a.tokens, device), stream);
}

}  // namespace moe_routing::detail
