// The text behind a Status::kCudaError, kept per thread for last_cuda_error() (router.h).
// Inline, so that every program that includes the launchers (the library, the bridge, the
// research tools) has it without another translation unit.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "moe_routing/router.h"

namespace moe_routing::detail {

// The calling thread's text (one object per thread across translation units).
inline std::string& last_cuda_error_text() {
  thread_local std::string text;
  return text;
}

// Records `err` as the calling thread's last CUDA error and returns Status::kCudaError.
inline Status cuda_error(cudaError_t err) {
  last_cuda_error_text() = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
  return Status::kCudaError;
}

// The same for an exception caught at an API boundary: its what() (null: unknown).
inline Status exception_error(const char* what) {
  last_cuda_error_text() =
      std::string("exception in the library: ") + (what != nullptr ? what : "unknown");
  return Status::kCudaError;
}

}  // namespace moe_routing::detail
