// The fused backward for 64 experts, any K up to 8 (Moonlight: K = 6): 64 experts have no
// kernels of their own for K = 8.
#include "fused_backward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_backward_e<64, kAnyTopK, 128>(const RouterConfig&, const BackwardArgs&,
                                                          int, const BackwardPlan&, cudaStream_t,
                                                          uint32_t);
template int fused_backward_active_clusters<64, kAnyTopK>(int, int);
}  // namespace moe_routing::detail
