// The text behind a Status::kCudaError, kept per thread for last_cuda_error() (router.h).
#pragma once

#include <cuda_runtime_api.h>

#include "moe_routing/router.h"

namespace moe_routing::detail {

// Records `err` as the calling thread's last CUDA error and returns Status::kCudaError.
Status cuda_error(cudaError_t err);
// The same for an exception caught at an API boundary: its what() (null: unknown).
Status exception_error(const char* what);

}  // namespace moe_routing::detail
