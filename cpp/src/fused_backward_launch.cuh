// Host launch of one fused-backward instantiation: TMA descriptors, parameters, launch.
#pragma once

#include "tma_encode.h"  // (before CUTLASS's headers)

#include <cute/tensor.hpp>

#include "fused_backward.h"
#include "kernels/fused_backward/kernel_sm90.cuh"
#include "kernels/fused_backward_wide/kernel_sm90.cuh"
#include "launch.h"

namespace moe_routing::detail {

namespace fused_backward_impl {

// The TMA descriptor of a [rows, H] bf16 tensor (x, grad_x, w) as (H, rows) with h contiguous,
// in boxes of `box` (a shared-memory layout).
template <class Op, class Box>
auto make_tma_h_major(Op op, const cutlass::bfloat16_t* base, int64_t hidden, int64_t rows,
                      Box box) {
  using namespace cute;
  Tensor m = make_tensor(make_gmem_ptr(base), make_shape(int(hidden), int(rows)),
                         make_stride(_1{}, hidden));
  return make_tma_copy(op, m, box);
}

// TMA descriptors of x and grad_x, both as (H, T) with h contiguous.
template <int kExperts, int kTopK, int kTileH>
auto make_params(const cutlass::bfloat16_t* x, cutlass::bfloat16_t* grad_x, int64_t hidden,
                 int64_t tokens) {
  using namespace cute;
  using Cfg = kernels::fused_backward::Config<kExperts, kTopK, kTileH>;
  auto tma_x = make_tma_h_major(SM90_TMA_LOAD{}, x, hidden, tokens,
                                typename Cfg::SmemLayoutX{}(_, _, 0));
  auto tma_gx = make_tma_h_major(SM90_TMA_STORE{}, grad_x, hidden, tokens,
                                 typename Cfg::SmemLayoutGXHalf{});
  using P = kernels::fused_backward::Params<decltype(tma_x), decltype(tma_gx)>;
  return P{tma_x, tma_gx};
}

template <int kExperts, int kTopK, int kTileH>
struct Kernel {
  using Cfg = kernels::fused_backward::Config<kExperts, kTopK, kTileH>;
  using P = decltype(make_params<kExperts, kTopK, kTileH>(nullptr, nullptr, 128, 1));
  static constexpr auto kernel = kernels::fused_backward::fused_backward_sm90<Cfg, P>;
  static constexpr bool kLargeClusters = false;  // clusters of at most 8
};

// The parameters both kernels' Params share: the inputs and outputs, the workspace's counters
// and partials, the router's constants, the plan.
template <class Cfg, class P>
void set_shared_params(P& p, const RouterConfig& cfg, const BackwardArgs& a,
                       const BackwardPlan& plan) {
  p.routing = routing_inputs(cfg, a);
  p.grad_w = a.grad_w.data;
  p.grad_w_bf16 = a.grad_w.dtype == DType::kBF16;
  p.torch_bf16 = a.precision == Precision::kTorchBf16;
  p.tickets = reinterpret_cast<int*>(a.workspace.data);
  p.readers = p.tickets + kMaxCounterSlices;
  p.partials = reinterpret_cast<float*>(a.workspace.data + kTicketBytes);
  p.tokens = a.tokens;
  p.hidden = int(cfg.hidden_size);
  p.scale = cfg.routed_scaling_factor;
  p.norm = cfg.norm_topk_prob;
  p.accumulate = a.accumulate_grad_w;
  p.sum = plan.sum;
  p.per_slice = plan.per_slice;
  p.top_k = int(cfg.num_experts_per_tok);
  p.sched.tiles = ceil_div(a.tokens, int64_t(Cfg::kTileT));
  p.sched.slices = cfg.hidden_size / Cfg::kTileH;
  p.sched.ctas = plan.ctas;
}

// The wide kernel's TMA descriptors: x and grad_x as above, w as (H, E) with h contiguous, in
// boxes of 64 h × kExperts / 2 e.
template <int kExperts>
auto make_wide_params(const cutlass::bfloat16_t* x, cutlass::bfloat16_t* grad_x,
                      const cutlass::bfloat16_t* w, int64_t hidden, int64_t tokens,
                      int64_t experts) {
  using namespace cute;
  using Cfg = kernels::fused_backward_wide::Config<kExperts>;
  auto tma_x = make_tma_h_major(SM90_TMA_LOAD{}, x, hidden, tokens,
                                typename Cfg::SmemLayoutX{}(_, _, 0));
  auto tma_gx = make_tma_h_major(SM90_TMA_STORE{}, grad_x, hidden, tokens,
                                 typename Cfg::SmemLayoutGXHalf{});
  auto tma_w = make_tma_h_major(SM90_TMA_LOAD{}, w, hidden, experts,
                                typename Cfg::SmemLayoutWHalf{});
  using P = kernels::fused_backward_wide::Params<decltype(tma_x), decltype(tma_gx),
                                                 decltype(tma_w)>;
  return P{tma_x, tma_gx, tma_w};
}

template <int kExperts>
struct WideKernel {
  using Cfg = kernels::fused_backward_wide::Config<kExperts>;
  using P = decltype(make_wide_params<kExperts>(nullptr, nullptr, nullptr, 128, 1, kExperts));
  static constexpr auto kernel = kernels::fused_backward_wide::fused_backward_wide_sm90<Cfg, P>;
  static constexpr bool kLargeClusters = false;
};

// The wide kernel (kWideTopK rows): any K up to 16 and E up to kExperts, every dtype; 64-column
// slices, one CTA each or k CTAs summed spread (plan64). Not precise mode.
template <int kExperts>
Status launch_wide(const RouterConfig& cfg, const BackwardArgs& a, int device,
                   const BackwardPlan& plan, cudaStream_t stream, uint32_t passes) {
  using K = WideKernel<kExperts>;
  using Cfg = typename K::Cfg;
  using Elem = typename Cfg::Elem;
  const int top_k = cfg.num_experts_per_tok;
  const int64_t E = cfg.n_routed_experts, H = cfg.hidden_size, T = a.tokens;
  if (top_k < 1 || top_k > Cfg::kTopK || E < 1 || E > kExperts || E % 16 != 0 ||
      passes != kernels::fused_backward::kPassG || a.precision == Precision::kPrecise)
    return Status::kUnsupported;
  if (Status s = prepare_kernel<K>(device); s != Status::kSuccess) return s;
  typename K::P p = make_wide_params<kExperts>(reinterpret_cast<const Elem*>(a.x.data),
                                               reinterpret_cast<Elem*>(a.grad_x.data),
                                               reinterpret_cast<const Elem*>(a.w.data), H, T, E);
  set_shared_params<Cfg>(p, cfg, a, plan);
  p.rows = reinterpret_cast<kernels::fused_backward_wide::WideRow*>(
      a.workspace.data + kTicketBytes + fused_backward_compact_offset(cfg, T));
  p.row_counters = reinterpret_cast<int*>(a.workspace.data + kCompactCounterOffset);
  p.experts = int(E);
  if (p.sched.slices > kMaxCounterSlices || plan.tile_h != Cfg::kTileH || H % Cfg::kTileH != 0)
    return Status::kUnsupported;
  // One segment per CTA: a whole slice (kLastCta), or one of its k parts (kSpread).
  const bool whole = plan.sum == GradWSum::kLastCta && int64_t(plan.ctas) == p.sched.slices;
  const bool spread = plan.sum == GradWSum::kSpread && plan.per_slice >= 2 &&
                      plan.per_slice <= p.sched.tiles &&
                      int64_t(plan.ctas) == int64_t(plan.per_slice) * p.sched.slices;
  if (!whole && !spread) return Status::kUnsupported;
  return launch_dependent<K>(unsigned(plan.ctas), 1, stream, p);
}

}  // namespace fused_backward_impl

template <int kExperts, int kTopK, int kTileH>
int fused_backward_active_clusters(int cluster, int device) {
  if constexpr (kTileH == 64) return 0;  // (one CTA per slice: no clusters)
  else
    return max_active_clusters<fused_backward_impl::Kernel<kExperts, kTopK, kTileH>>(cluster,
                                                                                    device);
}

namespace fused_backward_impl {

template <int kExperts, int kTopK, int kTileH>
Status launch_narrow(const RouterConfig& cfg, const BackwardArgs& a, int device,
                     const BackwardPlan& plan, cudaStream_t stream, uint32_t passes) {
  using K = fused_backward_impl::Kernel<kExperts, kTopK, kTileH>;
  using Cfg = typename K::Cfg;
  using Elem = typename Cfg::Elem;
  // A fixed K loads the routing rows as 16-byte vectors: K = kTopK, aligned rows and the
  // training dtypes only.
  const int top_k = cfg.num_experts_per_tok;
  if (Cfg::kAnyK ? top_k < 1 || top_k > Cfg::kTopK
                 : top_k != Cfg::kTopK || !routing_rows_aligned16(a) || !training_dtypes(a))
    return Status::kUnsupported;
  if (Status s = prepare_kernel<K>(device); s != Status::kSuccess) return s;
  const int64_t H = cfg.hidden_size, T = a.tokens;

  typename K::P p = fused_backward_impl::make_params<kExperts, kTopK, kTileH>(
      reinterpret_cast<const Elem*>(a.x.data), reinterpret_cast<Elem*>(a.grad_x.data), H, T);
  set_shared_params<Cfg>(p, cfg, a, plan);
  p.w = reinterpret_cast<const Elem*>(a.w.data);
  p.passes = passes;
  p.skew = Cfg::kSkew && top_k < 8;
  using kernels::fused_backward::CompactRow;
  // Compact rows (producer.cuh): G's sweep alone, not precise mode (whose residual sweep reads
  // the inputs again), for PyTorch's dtypes and, where the kernel compacts them
  // (Cfg::kCompactAnyRows), for every other input of any K.
  if (Cfg::kAnyK && passes == kernels::fused_backward::kPassG &&
      a.precision != Precision::kPrecise &&
      (kernels::torch_rows(p.routing, top_k) || Cfg::kCompactAnyRows)) {
    p.compact = reinterpret_cast<CompactRow*>(a.workspace.data + kTicketBytes +
                                              fused_backward_compact_offset(cfg, T));
    p.compact_counters = reinterpret_cast<int*>(a.workspace.data + kCompactCounterOffset);
  }
  using kernels::fused_backward::kPassG, kernels::fused_backward::kPassResidual;
  constexpr uint32_t kBoth = kPassG | kPassResidual;
  if (p.sched.slices > kMaxCounterSlices || plan.tile_h != kTileH || H % kTileH != 0 ||
      passes == 0 || (passes & ~kBoth) != 0 ||
      (passes == kBoth && !plan.one_segment_per_cta(p.sched.slices)))
    return Status::kUnsupported;
  // kTileH = 64: each CTA one segment (its grad_w goes out through shared memory): a whole slice
  // (kLastCta), or one of its k parts (kSpread).
  if (Cfg::kRoleSplit && plan.sum != GradWSum::kSpread &&
      (plan.sum != GradWSum::kLastCta || int64_t(plan.ctas) != p.sched.slices))
    return Status::kUnsupported;
  if (plan.sum != GradWSum::kLastCta &&
      (plan.per_slice < 2 || plan.per_slice > p.sched.tiles ||
       int64_t(plan.ctas) != int64_t(plan.per_slice) * p.sched.slices ||
       (plan.sum == GradWSum::kCluster && plan.per_slice > 8)))
    return Status::kUnsupported;

  const int cluster = plan.sum == GradWSum::kCluster ? plan.per_slice : 1;
  return launch_dependent<K>(unsigned(plan.ctas), cluster, stream, p);
}

}  // namespace fused_backward_impl

template <int kExperts, int kTopK, int kTileH>
Status launch_fused_backward_e(const RouterConfig& cfg, const BackwardArgs& a, int device,
                               const BackwardPlan& plan, cudaStream_t stream, uint32_t passes) {
  if constexpr (kTopK == kWideTopK) {
    static_assert(kTileH == 64, "the wide kernel's slices are 64 columns");
    return fused_backward_impl::launch_wide<kExperts>(cfg, a, device, plan, stream, passes);
  } else {
    return fused_backward_impl::launch_narrow<kExperts, kTopK, kTileH>(cfg, a, device, plan,
                                                                       stream, passes);
  }
}

}  // namespace moe_routing::detail
