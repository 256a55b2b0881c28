// The fused forward for 64 experts.
#include "fused_forward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_forward_e<64>(const RouterConfig&, const ForwardArgs&, int,
                                           const ForwardPlan&, cudaStream_t);
template int fused_forward_active_clusters<64>(int, int, int);
}  // namespace moe_routing::detail
