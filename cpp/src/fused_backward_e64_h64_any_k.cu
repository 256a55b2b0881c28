// The fused backward for 64 experts, any K up to 8 (Moonlight: K = 6), 64-column slices
// (small T).
#include "fused_backward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_backward_e<64, kAnyTopK, 64>(const RouterConfig&, const BackwardArgs&,
                                                          int, const BackwardPlan&, cudaStream_t,
                                                          uint32_t);
}  // namespace moe_routing::detail
