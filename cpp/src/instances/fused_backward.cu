// One fused-backward kernel: row MOE_ROUTING_ROW of the FUSED_BACKWARD rows of
// fused_kernels.def. The build compiles this file once per row, each its own translation unit.
#include "../fused_backward_launch.cuh"
#include "../fused_kernels.h"

#ifndef MOE_ROUTING_ROW
#error "MOE_ROUTING_ROW: the FUSED_BACKWARD row of fused_kernels.def to instantiate"
#endif

namespace moe_routing::detail {
static_assert(MOE_ROUTING_ROW >= 0 && MOE_ROUTING_ROW < kNumFusedBackward, "MOE_ROUTING_ROW");
inline constexpr FusedBackwardKernel kRow = kFusedBackwardKernels[MOE_ROUTING_ROW];

template Status launch_fused_backward_e<kRow.experts, kRow.top_k, kRow.tile_h>(
    const RouterConfig&, const BackwardArgs&, int, const BackwardPlan&, cudaStream_t, uint32_t);
template int fused_backward_active_clusters<kRow.experts, kRow.top_k, kRow.tile_h>(int, int);
}  // namespace moe_routing::detail
