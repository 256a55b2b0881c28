// The C++ side of the Rust bridge (src/bridge.rs): plain integers in, status codes out.
#pragma once

#include <cstdint>

#include "rust/cxx.h"

namespace moe_routing::bridge {

struct Config;
struct ForwardBuffers;
struct BackwardBuffers;

int32_t validate_config(const Config& cfg);
uint64_t backward_workspace_bytes(const Config& cfg, int64_t tokens);
int32_t router_forward(const Config& cfg, const ForwardBuffers& bufs, uint64_t stream);
int32_t router_backward(const Config& cfg, const BackwardBuffers& bufs, uint64_t stream);
int32_t device_count();
rust::Str status_string(int32_t status);
rust::String last_cuda_error();
int32_t baseline_routing_grad_dense(const Config& cfg, int64_t tokens, uint64_t topk_idx,
                                     uint64_t topk_scores, uint64_t grad_topk_weights,
                                     uint64_t dense, uint64_t stream);
int32_t baseline_route_from_logits(const Config& cfg, int64_t tokens, uint64_t logits,
                                   uint64_t bias, uint64_t topk_idx, uint64_t topk_weights,
                                   uint64_t topk_scores, uint64_t stream);
int32_t baseline_copy(uint64_t in, uint64_t out, int64_t read_bytes, int64_t write_bytes,
                      int32_t ctas_per_sm, bool streaming_loads, bool streaming_stores,
                      uint64_t stream);

}  // namespace moe_routing::bridge
