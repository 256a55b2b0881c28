// Cluster sizes (CTAs sharing a token tile along the hidden dimension) that the fused forward's
// split sum is instantiated for, and the token tiles of each expert count: the host's plan
// picks among them, the launch checks against them, the kernel dispatches on them. Plain C++:
// the host dispatcher includes it without CuTe.
#pragma once

namespace moe_routing::kernels::fused_forward {

inline constexpr int kClusterSizes[] = {1, 2, 3, 4, 6, 8, 16};
inline constexpr int kNumClusterSizes = int(sizeof(kClusterSizes) / sizeof(kClusterSizes[0]));

constexpr bool is_cluster_size(int k) {
  for (int s : kClusterSizes)
    if (s == k) return true;
  return false;
}

// The token tiles an E-expert kernel has: above 256 experts 64 tokens alone, each warpgroup
// holding 64 × E/2 logits (96 accumulators a thread at E = 384, 128 at 512; a wgmma's N is at
// most 256).
constexpr bool tile_fits(int experts, int tile_t) { return experts <= 256 || tile_t == 64; }

}  // namespace moe_routing::kernels::fused_forward
