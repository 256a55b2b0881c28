// Host launch of one fused-backward instantiation: TMA descriptors, parameters, launch.
#pragma once

#include <atomic>

#include <cute/tensor.hpp>

#include "fused_backward.h"
#include "kernels/fused_backward/kernel_sm90.cuh"
#include "launch.h"

namespace moe_routing::detail {

namespace fused_backward_impl {

// TMA descriptors of x and grad_x, both as (H, T) with h contiguous.
template <int kExperts, int kTopK>
auto make_params(const cutlass::bfloat16_t* x, cutlass::bfloat16_t* grad_x, int64_t hidden,
                 int64_t tokens) {
  using namespace cute;
  using Cfg = kernels::fused_backward::Config<kExperts, kTopK>;
  Tensor mX = make_tensor(make_gmem_ptr(x), make_shape(int(hidden), int(tokens)),
                          make_stride(_1{}, hidden));
  auto tma_x = make_tma_copy(SM90_TMA_LOAD{}, mX, typename Cfg::SmemLayoutX{}(_, _, 0));
  Tensor mGX = make_tensor(make_gmem_ptr(grad_x), make_shape(int(hidden), int(tokens)),
                           make_stride(_1{}, hidden));
  auto tma_gx = make_tma_copy(SM90_TMA_STORE{}, mGX, typename Cfg::SmemLayoutGXHalf{});
  using P = kernels::fused_backward::Params<decltype(tma_x), decltype(tma_gx)>;
  return P{tma_x, tma_gx};
}

template <int kExperts, int kTopK>
struct Kernel {
  using Cfg = kernels::fused_backward::Config<kExperts, kTopK>;
  using P = decltype(make_params<kExperts, kTopK>(nullptr, nullptr, 128, 1));
  static constexpr auto kernel = kernels::fused_backward::fused_backward_sm90<Cfg, P>;

  // The shared-memory opt-in is per device and sticks: set it once per device.
  static Status prepare(int device) {
    static std::atomic<uint64_t> smem_set{0};
    const uint64_t bit = uint64_t(1) << (device & 63);
    if (smem_set.load(std::memory_order_acquire) & bit) return Status::kSuccess;
    RelaxedCaptureScope relaxed;
    if (Status s = cuda_status(cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
        s != Status::kSuccess)
      return s;
    smem_set.fetch_or(bit, std::memory_order_release);
    return Status::kSuccess;
  }

  // Launch configuration: `attrs` has room for two attributes (cluster, dependent launch).
  static cudaLaunchConfig_t config(unsigned grid, int cluster, cudaStream_t stream,
                                   cudaLaunchAttribute* attrs) {
    cudaLaunchConfig_t c{};
    c.gridDim = dim3(grid);
    c.blockDim = dim3(Cfg::kThreads);
    c.dynamicSmemBytes = Cfg::kSmemBytes;
    c.stream = stream;
    attrs[0] = {};
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = unsigned(cluster);
    attrs[0].val.clusterDim.y = 1;
    attrs[0].val.clusterDim.z = 1;
    c.attrs = attrs;
    c.numAttrs = 1;
    return c;
  }
};

}  // namespace fused_backward_impl

template <int kExperts, int kTopK>
int fused_backward_active_clusters(int cluster, int device) {
  using K = fused_backward_impl::Kernel<kExperts, kTopK>;
  RelaxedCaptureScope relaxed;  // a query, not stream work: allowed under graph capture
  if (K::prepare(device) != Status::kSuccess) return 0;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t c = K::config(unsigned(cluster), cluster, nullptr, attrs);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, K::kernel, &c) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

template <int kExperts, int kTopK>
Status launch_fused_backward_e(const RouterConfig& cfg, const BackwardArgs& a, int device,
                               int ctas, int cluster, cudaStream_t stream) {
  using K = fused_backward_impl::Kernel<kExperts, kTopK>;
  using Cfg = typename K::Cfg;
  using Elem = typename Cfg::Elem;
  if (Status s = K::prepare(device); s != Status::kSuccess) return s;
  const int64_t H = cfg.hidden_size, T = a.tokens;

  typename K::P p = fused_backward_impl::make_params<kExperts, kTopK>(
      reinterpret_cast<const Elem*>(a.x.data), reinterpret_cast<Elem*>(a.grad_x.data), H, T);
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
  p.cluster = cluster;
  p.sched.tiles = ceil_div(T, Cfg::kTileT);
  p.sched.slices = H / Cfg::kTileH;
  p.sched.ctas = ctas;
  if (cluster < 1 || cluster > 8 ||
      (cluster > 1 && int64_t(ctas) != int64_t(cluster) * p.sched.slices))
    return Status::kUnsupported;

  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t c = K::config(unsigned(ctas), cluster, stream, attrs);
  attrs[1] = dependent_launch_attribute();
  c.numAttrs = 2;
  return cuda_status(cudaLaunchKernelEx(&c, K::kernel, p));
}

}  // namespace moe_routing::detail
