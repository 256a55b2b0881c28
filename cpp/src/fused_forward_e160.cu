// The fused forward for 160 experts (GLM-4.5).
#include "fused_forward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_forward_e<160>(const RouterConfig&, const ForwardArgs&, int,
                                           const ForwardPlan&, cudaStream_t);
template int fused_forward_active_clusters<160>(int, int, int);
}  // namespace moe_routing::detail
