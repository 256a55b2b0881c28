// Helpers shared by the host launchers.
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::detail {

inline Status last_launch_status() {
  return cudaGetLastError() == cudaSuccess ? Status::kSuccess : Status::kCudaError;
}

inline Status cuda_status(cudaError_t err) {
  if (err == cudaSuccess) return Status::kSuccess;
  (void)cudaGetLastError();
  return Status::kCudaError;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace moe_routing::detail
