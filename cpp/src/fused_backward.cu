// Dispatch of the fused backward: split of the token range over the GPU's SMs.
#include <algorithm>
#include <atomic>

#include "fused_backward.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

constexpr int64_t kTileT = 128, kTileH = 128;

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

// Clusters of k CTAs (k = 2..8) that fit on a device at once, read once per device.
int active_clusters(int device, int k) {
  static std::atomic<int> cached[64][9] = {};
  std::atomic<int>* slot = device >= 0 && device < 64 ? &cached[device][k] : nullptr;
  if (slot) {  // 0: not asked yet; -1: none fit
    if (int n = slot->load(std::memory_order_relaxed); n != 0) return n > 0 ? n : 0;
  }
  const int n = fused_backward_active_clusters<160, 8>(k, device);
  if (slot) slot->store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n;
}

struct Plan {
  int ctas;
  int cluster;  // 1: grad_w partials reduced through global memory
};

// The persistent grid: k CTAs per slice, so that the split points within a slice are the same
// for every slice. CTAs running side by side then read the same token tiles (x rows 10 KB
// long, each CTA 256 bytes of every row) rather than tiles at unrelated offsets. Where the
// k CTAs of every slice fit on the device at once as clusters (k <= 8), they sum grad_w in
// shared memory; otherwise through partials in global memory and a ticket.
// Costs in units of one unit's time (about 2 µs), measured on an H200 at T = 512: the cluster
// sum about 2.5 units whatever k; the global one about 1.7 (partial stores and ticket) plus
// 1.1 per partial read by the slice's last CTA. Where the slices outnumber the SMs, one range
// per SM (global reduction).
Plan plan(int64_t tiles, int64_t slices, int num_sms, int device) {
  constexpr double kClusterSum = 2.5, kWritePartial = 1.7, kReadPartial = 1.1;
  const int64_t grid = std::min<int64_t>(num_sms, kFusedMaxCtas);
  const int64_t most = grid / slices;
  if (most < 1) return {int(std::min(tiles * slices, grid)), 1};
  Plan best{int(slices), 1};
  double best_cost = double(tiles);
  for (int64_t k = 2; k <= most && k <= tiles; ++k) {
    const bool cluster = k <= 8 && active_clusters(device, int(k)) >= slices;
    const double sum = cluster ? kClusterSum : kWritePartial + kReadPartial * double(k);
    const double cost = double(ceil_div(tiles, k)) + sum;
    if (cost < best_cost) best = {int(k * slices), cluster ? int(k) : 1}, best_cost = cost;
  }
  return best;
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
  const Plan pl = plan(tiles, slices, sm_count(device), device);
  switch (cfg.n_routed_experts) {
    case 160: return launch_fused_backward_e<160, 8>(cfg, a, device, pl.ctas, pl.cluster, stream);
    default: return Status::kUnsupported;
  }
}

}  // namespace moe_routing::detail
