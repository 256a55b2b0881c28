// Host launch of one fused-backward instantiation: TMA descriptors, parameters, launch.
#pragma once

#include <atomic>

#include <cute/tensor.hpp>

#include "fused_backward.h"
#include "kernels/fused_backward/kernel_sm90.cuh"
#include "launch.h"

namespace moe_routing::detail {

template <int kExperts, int kTopK>
Status launch_fused_backward_e(const RouterConfig& cfg, const BackwardArgs& a, int device,
                               int ctas, cudaStream_t stream) {
  using namespace cute;
  namespace fb = kernels::fused_backward;
  using Cfg = fb::Config<kExperts, kTopK>;
  using Elem = typename Cfg::Elem;
  const int64_t H = cfg.hidden_size, T = a.tokens;

  // Global tensors, h-major: (H, T) with h contiguous.
  Tensor mX = make_tensor(make_gmem_ptr(reinterpret_cast<const Elem*>(a.x.data)),
                          make_shape(int(H), int(T)), make_stride(_1{}, H));
  auto tma_x = make_tma_copy(SM90_TMA_LOAD{}, mX, typename Cfg::SmemLayoutX{}(_, _, 0));
  Tensor mGX = make_tensor(make_gmem_ptr(reinterpret_cast<Elem*>(a.grad_x.data)),
                           make_shape(int(H), int(T)), make_stride(_1{}, H));
  auto tma_gx = make_tma_copy(SM90_TMA_STORE{}, mGX, typename Cfg::SmemLayoutGXHalf{});

  using P = fb::Params<decltype(tma_x), decltype(tma_gx)>;
  P p{tma_x, tma_gx};
  p.w = reinterpret_cast<const Elem*>(a.w.data);
  p.topk_idx = a.topk_idx.data;
  p.topk_scores = a.topk_scores.data;
  p.grad_topk_weights = a.grad_topk_weights.data;
  p.grad_w = a.grad_w.data;
  p.tickets = reinterpret_cast<int*>(a.workspace.data);
  p.partials = reinterpret_cast<float*>(a.workspace.data + kTicketBytes);
  p.tokens = T;
  p.hidden = int(H);
  p.scale = cfg.routed_scaling_factor;
  p.norm = cfg.norm_topk_prob;
  p.accumulate = a.accumulate_grad_w;
  p.sched.tiles = ceil_div(T, Cfg::kTileT);
  p.sched.slices = H / Cfg::kTileH;
  p.sched.ctas = ctas;

  auto kernel = fb::fused_backward_sm90<Cfg, P>;
  // The shared-memory opt-in is per device and sticks: set it once per device.
  static std::atomic<uint64_t> smem_set{0};
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(smem_set.load(std::memory_order_acquire) & bit)) {
    RelaxedCaptureScope relaxed;
    if (Status s = cuda_status(cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
        s != Status::kSuccess)
      return s;
    smem_set.fetch_or(bit, std::memory_order_release);
  }
  cudaLaunchAttribute attr = dependent_launch_attribute();
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(unsigned(ctas));
  c.blockDim = dim3(Cfg::kThreads);
  c.dynamicSmemBytes = Cfg::kSmemBytes;
  c.stream = stream;
  c.attrs = &attr;
  c.numAttrs = 1;
  return cuda_status(cudaLaunchKernelEx(&c, kernel, p));
}

}  // namespace moe_routing::detail
