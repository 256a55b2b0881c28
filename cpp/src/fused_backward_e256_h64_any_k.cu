// The fused backward for 256 experts, any K up to 8 (or K = 8 with routing rows not 16-byte
// aligned), 64-column slices (kRoleSplit).
#include "fused_backward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_backward_e<256, kAnyTopK, 64>(const RouterConfig&, const BackwardArgs&,
                                                          int, const BackwardPlan&, cudaStream_t,
                                                          uint32_t);
}  // namespace moe_routing::detail
