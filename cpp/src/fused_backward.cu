// Dispatch of the fused backward: split of the token range over the GPU's SMs.
#include <atomic>

#include "fused_backward.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

constexpr int64_t kTileT = 128, kTileH = 128;

// CTAs of the persistent grid. Each CTA takes ceil(units / ctas) units; where ranges do not
// align with slices, every CTA also writes a grad_w partial and the last contributor of each
// slice reads them all. Costs in units of one unit's time (measured on the H200: a unit is
// about 2 µs, writing or reading one [E, kTileH] fp32 partial well under 1 µs).
int plan_ctas(int64_t units, int64_t tiles, int num_sms) {
  constexpr double kWritePartial = 0.3, kReadPartial = 0.35;
  const int64_t most = units < num_sms ? units : num_sms;
  int best = 1;
  double best_cost = 0.0;
  for (int64_t c = 1; c <= most && c <= kFusedMaxCtas; ++c) {
    const int64_t per = ceil_div(units, c);
    const int64_t shortest = units / c;
    const bool aligned = units % c == 0 && shortest % tiles == 0;
    const int64_t contributors = ceil_div(tiles, shortest) + 1;  // per slice, at most
    const double cost =
        double(per) + (aligned ? 0.0 : kWritePartial + kReadPartial * double(contributors));
    if (c == 1 || cost < best_cost) best = int(c), best_cost = cost;
  }
  return best;
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
    case 160: return launch_fused_backward_e<160, 8>(cfg, a, ctas, stream);
    default: return Status::kUnsupported;
  }
}

}  // namespace moe_routing::detail
