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

// Puts the calling thread in relaxed stream-capture mode for its scope. The host-side queries
// before a launch (stream device, pointer attributes, kernel attributes) are not stream work,
// but under a global-mode capture (what PyTorch's CUDA graphs use) the runtime refuses them
// as "potentially unsafe" and invalidates the capture. In relaxed mode they are allowed; the
// launches themselves are captured as usual.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Launch attribute of the fused kernels: they may start while the stream's previous kernel is
// still running, and wait for it on the device before touching global memory
// (kernels/dependent_launch.cuh).
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

}  // namespace moe_routing::detail
