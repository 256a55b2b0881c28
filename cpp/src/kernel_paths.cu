// Which kernels a router config takes: the C++ API's kernel_paths (the C ABI's
// moe_routing_kernel_paths answers through it).
#include "fused_backward.h"
#include "kernel_paths.h"

namespace moe_routing {

Status kernel_paths(const RouterConfig& cfg, KernelPaths* paths) {
  if (paths == nullptr) return Status::kNullPointer;
  if (Status s = validate_config(cfg); s != Status::kSuccess) return s;
  paths->forward_fused = detail::fused_forward_config_supported(cfg);
  paths->backward_fused = detail::fused_backward_supported(cfg);
  return Status::kSuccess;
}

}  // namespace moe_routing
