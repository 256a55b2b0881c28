// Host launcher of the forward: the fused kernel where it handles the shape, else the simple one.
#include "forward_params.h"
#include "fused_forward.h"
#include "kernels/forward_simple.cuh"
#include "launch.h"
#include "validate.h"

namespace moe_routing {

Status router_forward(const RouterConfig& cfg, const ForwardArgs& a, cudaStream_t stream) {
  int device = 0;
  if (Status s = detail::validate_forward(cfg, a, stream, &device); s != Status::kSuccess)
    return s;
  detail::DeviceGuard guard(device);
  if (a.tokens == 0) {
    if (a.expert_counts.data)  // no tokens: every count is zero
      return detail::cuda_status(cudaMemsetAsync(
          a.expert_counts.data, 0, sizeof(int32_t) * size_t(cfg.n_routed_experts), stream));
    return Status::kSuccess;
  }
  if (detail::fused_forward_supported(cfg, a))
    return detail::launch_fused_forward(cfg, a, device, stream);

  kernels::ForwardParams p = detail::forward_params(cfg, a.tokens);
  p.x = reinterpret_cast<const __nv_bfloat16*>(a.x.data);
  p.w = reinterpret_cast<const __nv_bfloat16*>(a.w.data);
  p.bias = a.bias.data;
  p.topk_idx = a.topk_idx.data;
  p.idx_i64 = a.topk_idx.dtype == DType::kI64;
  p.topk_weights = a.topk_weights.data;
  p.topk_scores = a.topk_scores.data;
  p.scores = a.scores.data;
  p.counts = a.expert_counts.data;
  if (p.counts) {
    if (Status s = detail::cuda_status(
            cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * size_t(p.experts), stream));
        s != Status::kSuccess)
      return s;
  }
  const size_t smem = kernels::forward_simple_smem_bytes(p.experts, p.n_group);
  kernels::router_forward_simple<<<unsigned(a.tokens), kernels::kForwardThreads, smem, stream>>>(p);
  return detail::last_launch_status();
}

}  // namespace moe_routing
