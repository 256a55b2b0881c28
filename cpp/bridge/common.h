// What the cxx bridges share (the library's, bridge/bridge.cc, and the benches' baselines',
// baseline/cpp/baseline_bridge.cc): the router configuration from a bridge struct with
// RouterConfig's fields, and the guard that keeps exceptions from crossing into Rust.
#pragma once

#include <cstdint>
#include <exception>

#include "moe_routing/router.h"
#include "src/cuda_error.h"

namespace moe_routing::bridge {

template <class C>
RouterConfig to_config(const C& c) {
  RouterConfig r;
  r.hidden_size = c.hidden_size;
  r.n_routed_experts = c.n_routed_experts;
  r.num_experts_per_tok = c.num_experts_per_tok;
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  r.routed_scaling_factor = c.routed_scaling_factor;
  r.norm_topk_prob = c.norm_topk_prob;
  return r;
}

// No exception may cross into Rust: one is reported as a CUDA error with its text
// (last_cuda_error).
template <class F>
int32_t guarded(F&& f) noexcept {
  try {
    return static_cast<int32_t>(f());
  } catch (const std::exception& e) {
    return static_cast<int32_t>(moe_routing::detail::exception_error(e.what()));
  } catch (...) {
    return static_cast<int32_t>(moe_routing::detail::exception_error(nullptr));
  }
}

}  // namespace moe_routing::bridge
