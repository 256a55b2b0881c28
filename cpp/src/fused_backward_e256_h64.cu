// The fused backward for 256 experts (DeepSeek-V3), 64-column slices: one consumer warpgroup
// takes dgrad, the other wgrad (kRoleSplit).
#include "fused_backward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_backward_e<256, 8, 64>(const RouterConfig&, const BackwardArgs&,
                                                    int, const BackwardPlan&, cudaStream_t, uint32_t);
}  // namespace moe_routing::detail
