// One fused-forward kernel: row MOE_ROUTING_ROW of the FUSED_FORWARD rows of fused_kernels.def.
// The build compiles this file once per row, each its own translation unit.
#include "../fused_forward_launch.cuh"
#include "../fused_kernels.h"

#ifndef MOE_ROUTING_ROW
#error "MOE_ROUTING_ROW: the FUSED_FORWARD row of fused_kernels.def to instantiate"
#endif

namespace moe_routing::detail {
static_assert(MOE_ROUTING_ROW >= 0 && MOE_ROUTING_ROW < kNumFusedForward, "MOE_ROUTING_ROW");
inline constexpr FusedForwardKernel kRow = kFusedForwardKernels[MOE_ROUTING_ROW];

template Status launch_fused_forward_e<kRow.experts, kRow.tall_tiles>(const RouterConfig&,
                                                                      const ForwardArgs&, int,
                                                                      const ForwardPlan&,
                                                                      cudaStream_t);
template int fused_forward_active_clusters<kRow.experts, kRow.tall_tiles>(int, int, int);
}  // namespace moe_routing::detail
