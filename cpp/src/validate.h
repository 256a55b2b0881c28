// Argument validation shared by every entry point: nothing launches before it passes.
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::detail {

// The device a stream belongs to (the current device for the legacy default stream).
Status stream_device(cudaStream_t stream, int* device);

// `ptr` must be device (or managed) memory of `device`, aligned to `align` bytes, and hold at
// least `need` elements of `elem` bytes. A null pointer passes only when `need` is 0.
Status check_buffer(const void* ptr, int64_t len, int64_t need, size_t elem, size_t align,
                    int device);

Status validate_forward(const RouterConfig& cfg, const ForwardArgs& a, int device);
Status validate_backward(const RouterConfig& cfg, const BackwardArgs& a, int device);

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
