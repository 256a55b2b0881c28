// The simple forward kernels' parameters from a router config (the routing fields; buffers are
// the caller's).
#pragma once

#include "kernels/route_warp.cuh"
#include "moe_routing/router.h"

namespace moe_routing::detail {

inline kernels::ForwardParams forward_params(const RouterConfig& cfg, int64_t tokens) {
  kernels::ForwardParams p{};
  p.tokens = tokens;
  p.hidden = int(cfg.hidden_size);
  p.experts = int(cfg.n_routed_experts);
  p.top_k = int(cfg.num_experts_per_tok);
  p.n_group = int(cfg.n_group);
  p.topk_group = int(cfg.topk_group);
  p.scale = cfg.routed_scaling_factor;
  p.norm = cfg.norm_topk_prob;
  return p;
}

}  // namespace moe_routing::detail
