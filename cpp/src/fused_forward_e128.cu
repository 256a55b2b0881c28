// The fused forward for 128 experts.
#include "fused_forward_launch.cuh"

namespace moe_routing::detail {
template Status launch_fused_forward_e<128>(const RouterConfig&, const ForwardArgs&, int,
                                           const ForwardPlan&, cudaStream_t);
template int fused_forward_active_clusters<128>(int, int, int);
}  // namespace moe_routing::detail
