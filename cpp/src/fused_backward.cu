// Dispatch of the fused backward: split of the token range over the GPU's SMs.
#include <algorithm>
#include <atomic>

#include "fused_backward.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

constexpr int64_t kTileT = 128, kTileH = 128;

// CTAs of the persistent grid: k per slice, so that the split points within a slice are the
// same for every slice. CTAs running side by side then read the same token tiles (x rows
// 10 KB long, each CTA 256 bytes of every row) rather than tiles at unrelated offsets.
// Costs in units of one unit's time (a unit is about 2 µs; writing or reading one
// [E, kTileH] fp32 partial well under 1 µs). Where the slices outnumber the SMs, one range
// per SM.
int plan_ctas(int64_t units, int64_t tiles, int num_sms) {
  constexpr double kWritePartial = 0.3, kReadPartial = 0.35;
  const int64_t slices = units / tiles;
  const int64_t grid = std::min<int64_t>(num_sms, kFusedMaxCtas);
  const int64_t most = grid / slices;
  if (most < 1) return int(std::min(units, grid));
  int best = 1;
  double best_cost = 0.0;
  for (int64_t k = 1; k <= most && k <= tiles; ++k) {
    const double cost =
        double(ceil_div(tiles, k)) + (k == 1 ? 0.0 : kWritePartial + kReadPartial * double(k));
    if (k == 1 || cost < best_cost) best = int(k), best_cost = cost;
  }
  return int(best * slices);
}

// SM count per device, read once: the split (hence the grad_w summation order) depends on it.
int sm_count(int device) {
  static std::atomic<int> cached[64] = {};
  std::atomic<int>* slot = device >= 0 && device < 64 ? &cached[device] : nullptr;
  if (slot) {
    if (int n = slot->load(std::memory_order_relaxed); n > 0) return n;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  if (slot) slot->store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

bool fused_backward_supported(const RouterConfig& cfg, Precision precision) {
  return precision == Precision::kDefault && cfg.n_routed_experts == 160 &&
         cfg.num_experts_per_tok == 8 &&
         cfg.hidden_size % kTileH == 0;
}

size_t fused_backward_scratch_bytes(const RouterConfig& cfg, int64_t tokens) {
  // Partial slots: fewer than ctas + slices (schedule.cuh), ctas <= kFusedMaxCtas.
  const int64_t slices = cfg.hidden_size / kTileH;
  const int64_t units = ceil_div(tokens, kTileT) * slices;
  const int64_t ctas = units < kFusedMaxCtas ? units : kFusedMaxCtas;
  return size_t(ctas + slices) * size_t(cfg.n_routed_experts * kTileH) * sizeof(float);
}

Status launch_fused_backward(const RouterConfig& cfg, const BackwardArgs& a, int device,
                             cudaStream_t stream) {
  const int64_t tiles = ceil_div(a.tokens, kTileT), slices = cfg.hidden_size / kTileH;
  const int ctas = plan_ctas(tiles * slices, tiles, sm_count(device));
  switch (cfg.n_routed_experts) {
    case 160: return launch_fused_backward_e<160, 8>(cfg, a, device, ctas, stream);
    default: return Status::kUnsupported;
  }
}

}  // namespace moe_routing::detail
