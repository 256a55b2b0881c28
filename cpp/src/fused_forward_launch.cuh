// Host launch of one fused-forward instantiation: TMA descriptors, parameters, cluster launch.
#pragma once

#include "tma_encode.h"  // (before CUTLASS's headers)

#include <cute/tensor.hpp>

#include "fused_forward.h"
#include "kernels/fused_forward/kernel_sm90.cuh"
#include "launch.h"

namespace moe_routing::detail {

namespace fused_forward_impl {

// TMA descriptors and parameters of the E-expert kernel with kTileT-token tiles, for w of
// `experts` rows (<= kExperts: the rest masked).
template <int kExperts, int kTileT>
auto make_params(const cutlass::bfloat16_t* x, const cutlass::bfloat16_t* w, int64_t tokens,
                 int64_t hidden, int64_t experts) {
  using namespace cute;
  using Cfg = kernels::fused_forward::Config<kExperts, kTileT>;
  // (T, H) and (E, H), h contiguous: K-major operands.
  Tensor mX = make_tensor(make_gmem_ptr(x), make_shape(int(tokens), int(hidden)),
                          make_stride(hidden, _1{}));
  Tensor mW = make_tensor(make_gmem_ptr(w), make_shape(int(experts), int(hidden)),
                          make_stride(hidden, _1{}));
  auto tma_x = make_tma_copy(SM90_TMA_LOAD{}, mX, typename Cfg::SmemLayoutX{}(_, _, 0));
  // (A box of kWBoxRows rows of w: a stage is kWBoxes of them.)
  auto tma_w = make_tma_copy(SM90_TMA_LOAD{}, mW, typename Cfg::SmemLayoutWBox{});
  using P = kernels::fused_forward::Params<decltype(tma_x), decltype(tma_w)>;
  return P{tma_x, tma_w};
}

template <int kExperts, int kTileT>
struct Kernel {
  using Cfg = kernels::fused_forward::Config<kExperts, kTileT>;
  using Elem = typename Cfg::Elem;
  using P = decltype(make_params<kExperts, kTileT>(nullptr, nullptr, 1, 64, kExperts));

  static constexpr auto kernel = kernels::fused_forward::fused_forward_sm90<Cfg, P>;
  static constexpr bool kLargeClusters = true;  // clusters of 16 where the device has them
};

template <int kExperts, int kTileT>
Status launch(const RouterConfig& cfg, const ForwardArgs& a, int device, const ForwardPlan& plan,
              cudaStream_t stream) {
  using K = Kernel<kExperts, kTileT>;
  using Cfg = typename K::Cfg;
  using Elem = typename K::Elem;
  if (Status s = prepare_kernel<K>(device); s != Status::kSuccess) return s;

  typename K::P p = make_params<kExperts, kTileT>(reinterpret_cast<const Elem*>(a.x.data),
                                   reinterpret_cast<const Elem*>(a.w.data), a.tokens,
                                   cfg.hidden_size, cfg.n_routed_experts);
  p.bias = a.bias.data;
  p.topk_idx = a.topk_idx.data;
  p.idx_i64 = a.topk_idx.dtype == DType::kI64;
  p.topk_weights = a.topk_weights.data;
  p.topk_scores = a.topk_scores.data;
  p.scores = a.scores.data;
  p.counts = a.expert_counts.data;
  p.tokens = a.tokens;
  p.hidden = int(cfg.hidden_size);
  p.hblocks = int(ceil_div(cfg.hidden_size, Cfg::kTileH));
  p.route = {int(cfg.num_experts_per_tok), int(cfg.n_group), int(cfg.topk_group),
             cfg.routed_scaling_factor, cfg.norm_topk_prob, int(cfg.n_routed_experts)};
  const int64_t tiles = ceil_div(a.tokens, Cfg::kTileT);
  auto valid = [&](int split) {
    return kernels::fused_forward::is_cluster_size(split) && split <= p.hblocks;
  };
  const bool tail = plan.tail_split != 0 && plan.tiles < tiles;
  if (cfg.n_routed_experts > kExperts || !valid(plan.split) || plan.tiles < 1 || plan.tiles > tiles ||
      (tail && !valid(plan.tail_split)) || (!tail && plan.tiles != tiles))
    return Status::kUnsupported;

  if (p.counts) {
    if (Status s = cuda_status(
            cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * cfg.n_routed_experts, stream));
        s != Status::kSuccess)
      return s;
  }
  // Tiles [tile0, tile0 + count) in clusters of `split`.
  auto launch = [&](int64_t tile0, int64_t count, int split) {
    p.tile0 = int(tile0);
    return launch_dependent<K>(unsigned(count * split), split, stream, p);
  };
  if (Status s = launch(0, plan.tiles, plan.split); s != Status::kSuccess || !tail) return s;
  return launch(plan.tiles, tiles - plan.tiles, plan.tail_split);
}

}  // namespace fused_forward_impl

// kTallTiles: 192-token tiles too (fused_kernels.def).
template <int kExperts, bool kTallTiles>
int fused_forward_active_clusters(int split, int tile_t, int device) {
  using namespace fused_forward_impl;
  if constexpr (kTallTiles) {
    if (tile_t == 192) return max_active_clusters<Kernel<kExperts, 192>>(split, device);
  }
  if (tile_t == 64) return max_active_clusters<Kernel<kExperts, 64>>(split, device);
  if constexpr (kernels::fused_forward::tile_fits(kExperts, 128)) {
    if (tile_t == 128) return max_active_clusters<Kernel<kExperts, 128>>(split, device);
  }
  return 0;  // (no such kernel: the plan skips the tile)
}

template <int kExperts, bool kTallTiles>
Status launch_fused_forward_e(const RouterConfig& cfg, const ForwardArgs& a, int device,
                              const ForwardPlan& plan, cudaStream_t stream) {
  using namespace fused_forward_impl;
  if (plan.tile_t == 64) return launch<kExperts, 64>(cfg, a, device, plan, stream);
  if constexpr (kernels::fused_forward::tile_fits(kExperts, 128)) {
    if (plan.tile_t == 128) return launch<kExperts, 128>(cfg, a, device, plan, stream);
  }
  if constexpr (kTallTiles) {
    if (plan.tile_t == 192) return launch<kExperts, 192>(cfg, a, device, plan, stream);
  }
  return Status::kUnsupported;
}

}  // namespace moe_routing::detail
