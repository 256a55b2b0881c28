// Which kernels a router config takes, as the C ABI reports it (moe_routing_kernel_paths).
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::detail {

// The config half of fused_forward_supported (fused_forward.cu): the fused forward handles
// this E, groups and K (given 16-byte aligned x and w and T < 2^31, as callers' buffers are).
bool fused_forward_config_supported(const RouterConfig& cfg);

}  // namespace moe_routing::detail
