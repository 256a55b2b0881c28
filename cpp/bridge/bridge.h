// The C++ side of the Rust bridge (src/bridge.rs): plain integers in, status codes out.
#pragma once

#include <cstdint>

#include "rust/cxx.h"

namespace moe_routing::bridge {

struct Config;
struct ForwardBuffers;
struct BackwardBuffers;

int32_t validate_config(const Config& cfg);
int32_t kernel_paths(const Config& cfg, bool& forward_fused, bool& backward_fused);
uint64_t backward_workspace_bytes(const Config& cfg, int64_t tokens);
int32_t router_forward(const Config& cfg, const ForwardBuffers& bufs, uint64_t stream);
int32_t router_backward(const Config& cfg, const BackwardBuffers& bufs, uint64_t stream);
int32_t device_count();
rust::Str status_string(int32_t status);
rust::String last_cuda_error();

}  // namespace moe_routing::bridge
