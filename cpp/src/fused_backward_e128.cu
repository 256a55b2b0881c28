// The fused backward for 128 experts (GLM-4.5-Air).
#include "fused_backward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_backward_e<128, 8, 128>(const RouterConfig&, const BackwardArgs&,
                                                     int, const BackwardPlan&, cudaStream_t, uint32_t);
template int fused_backward_active_clusters<128, 8>(int, int);
}  // namespace moe_routing::detail
