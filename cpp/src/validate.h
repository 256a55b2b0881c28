// Argument validation shared by every entry point: nothing launches before it passes.
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::detail {

// Validation runs in two passes so that every argument error a host can see is reported, the
// same with or without a GPU, before the CUDA runtime is asked anything:
//   1. config, token count, and per buffer: null, alignment, capacity (in argument order);
//   2. the stream's device, and per buffer: device (or managed) memory of that device.
// On success `device` holds the stream's device. Nothing launches before both pass.
Status validate_forward(const RouterConfig& cfg, const ForwardArgs& a, cudaStream_t stream,
                        int* device);
Status validate_backward(const RouterConfig& cfg, const BackwardArgs& a, cudaStream_t stream,
                         int* device);

// Makes `device` current for the scope of a launch and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace moe_routing::detail
