// Cluster sizes (CTAs sharing a token tile along the hidden dimension) that the fused forward's
// split sum is instantiated for: the host's plan picks among them, the launch checks against
// them, the kernel dispatches on them. Plain C++: the host dispatcher includes it without CuTe.
#pragma once

namespace moe_routing::kernels::fused_forward {

inline constexpr int kClusterSizes[] = {1, 2, 3, 4, 6, 8, 16};
inline constexpr int kNumClusterSizes = int(sizeof(kClusterSizes) / sizeof(kClusterSizes[0]));

constexpr bool is_cluster_size(int k) {
  for (int s : kClusterSizes)
    if (s == k) return true;
  return false;
}

}  // namespace moe_routing::kernels::fused_forward
