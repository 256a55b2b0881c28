// The fused forward's host side: which shapes it takes, its launch.
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::detail {

// True where the fused kernel handles the shape and pointers (others take the simple path).
bool fused_forward_supported(const RouterConfig& cfg, const ForwardArgs& args);

Status launch_fused_forward(const RouterConfig& cfg, const ForwardArgs& args, int device,
                            cudaStream_t stream);

// How the token tiles (of tile_t tokens: 128; 64 at small T; 192 where E has tall tiles,
// fused_kernels.def) are launched: tiles [0, tiles) in clusters of `split` CTAs (CTAs sharing a
// token tile along the hidden dimension: 1, 2, 3, 4, 6, 8 or 16), then, where tail_split is not
// 0, the remaining tiles in a second launch with clusters of tail_split: a last wave that would
// leave most SMs idle runs instead as a smaller, wider-split one.
struct ForwardPlan {
  int split = 1;
  int64_t tiles = 0;
  int tail_split = 0;
  int tile_t = 128;
};

// One instantiation per row of fused_kernels.def (expert count; kTallTiles: 192-token tiles
// too), each in its own translation unit (instances/fused_forward.cu).
template <int kExperts, bool kTallTiles>
Status launch_fused_forward_e(const RouterConfig& cfg, const ForwardArgs& args, int device,
                              const ForwardPlan& plan, cudaStream_t stream);

// Clusters of `split` CTAs of the E-expert kernel with tile_t-token tiles that fit the device
// at once (0: none). `device` (both functions): the validated device of the call, also the
// current one.
template <int kExperts, bool kTallTiles>
int fused_forward_active_clusters(int split, int tile_t, int device);

}  // namespace moe_routing::detail
