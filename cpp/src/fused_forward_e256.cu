// The fused forward for 256 experts (DeepSeek-V3).
#include "fused_forward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_forward_e<256>(const RouterConfig&, const ForwardArgs&, int,
                                           const ForwardPlan&, cudaStream_t);
template int fused_forward_active_clusters<256>(int, int, int);
}  // namespace moe_routing::detail
