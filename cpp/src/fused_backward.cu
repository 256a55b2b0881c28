// Dispatch of the fused backward: split of the token range over the GPU's SMs.
#include <atomic>

#include "fused_backward.h"
#include "launch.h"

namespace moe_routing::detail {
namespace {

constexpr int64_t kTileT = 128, kTileH = 128;

struct Split {
  int splits, tiles_per_split;
};

// CTAs per h-slice so that the grid fills the SMs once (one CTA per SM).
Split plan(const RouterConfig& cfg, int64_t tokens, int num_sms) {
  const int64_t slices = cfg.hidden_size / kTileH;
  const int64_t tiles = ceil_div(tokens, kTileT);
  int64_t target = num_sms / slices;
  target = target < 1 ? 1 : (target > kFusedMaxSplits ? kFusedMaxSplits : target);
  const int64_t per = ceil_div(tiles, target);
  return {int(ceil_div(tiles, per)), int(per)};
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
  // Upper bound over devices: at most kFusedMaxSplits partials of [E, H] fp32.
  const int64_t tiles = ceil_div(tokens, kTileT);
  const int64_t splits = tiles < kFusedMaxSplits ? tiles : kFusedMaxSplits;
  if (splits <= 1) return 0;
  return size_t(splits) * size_t(cfg.n_routed_experts * cfg.hidden_size) * sizeof(float);
}

Status launch_fused_backward(const RouterConfig& cfg, const BackwardArgs& a, int device,
                             cudaStream_t stream) {
  const Split s = plan(cfg, a.tokens, sm_count(device));
  switch (cfg.n_routed_experts) {
    case 160: return launch_fused_backward_e<160, 8>(cfg, a, s.splits, s.tiles_per_split, stream);
    default: return Status::kUnsupported;
  }
}

}  // namespace moe_routing::detail
