// Host launcher of the backward.
#include "backward_gemm.h"
#include "fused_backward.h"
#include "kernels/backward_simple.cuh"
#include "launch.h"
#include "validate.h"

namespace moe_routing {

size_t backward_workspace_bytes(const RouterConfig& cfg, int64_t tokens) {
  if (tokens <= 0 || validate_config(cfg) != Status::kSuccess) return 0;
  // Tickets, then the larger of the two paths' scratch (the precision picks the path).
  const size_t dense = size_t(tokens) * size_t(cfg.n_routed_experts) * sizeof(float);
  const size_t fused = detail::fused_backward_scratch_bytes(cfg, tokens);
  const size_t scratch = dense > fused ? dense : fused;
  return detail::kTicketBytes + (scratch + 255) / 256 * 256;
}

Status router_backward(const RouterConfig& cfg, const BackwardArgs& a, cudaStream_t stream) {
  int device = 0;
  if (Status s = detail::validate_backward(cfg, a, stream, &device); s != Status::kSuccess)
    return s;
  detail::DeviceGuard guard(device);
  const int64_t E = cfg.n_routed_experts, H = cfg.hidden_size;
  if (a.tokens == 0) {
    if (a.accumulate_grad_w) return Status::kSuccess;
    return detail::cuda_status(
        cudaMemsetAsync(a.grad_w.data, 0, size_t(E * H) * dtype_bytes(a.grad_w.dtype), stream));
  }

  if (detail::fused_backward_takes(cfg, a.precision))
    return detail::launch_fused_backward(cfg, a, device, stream);

  kernels::BackwardParams p{};
  p.x = reinterpret_cast<const __nv_bfloat16*>(a.x.data);
  p.w = reinterpret_cast<const __nv_bfloat16*>(a.w.data);
  p.routing = detail::routing_inputs(cfg, a);
  p.grad_x = reinterpret_cast<__nv_bfloat16*>(a.grad_x.data);
  p.grad_w = a.grad_w.data;
  p.grad_w_bf16 = a.grad_w.dtype == DType::kBF16;
  p.torch_bf16 = a.precision == Precision::kTorchBf16;
  p.dense_grad = reinterpret_cast<float*>(a.workspace.data + detail::kTicketBytes);
  p.tokens = a.tokens;
  p.hidden = int(H);
  p.experts = int(E);
  p.top_k = int(cfg.num_experts_per_tok);
  p.scale = cfg.routed_scaling_factor;
  p.norm = cfg.norm_topk_prob;
  p.accumulate = a.accumulate_grad_w;

  // G as bf16 and the two GEMMs on the tensor cores, where the shapes allow (the workspace's
  // fp32 G region holds G and its residual as bf16).
  const bool precise = a.precision == Precision::kPrecise;
  detail::BackwardGemms gemms;
  auto* g_hi = reinterpret_cast<__nv_bfloat16*>(p.dense_grad);
  __nv_bfloat16* g_lo = precise ? g_hi + a.tokens * E : nullptr;
  gemms.g = g_hi;
  gemms.g_lo = g_lo;
  gemms.x = p.x;
  gemms.w = p.w;
  gemms.grad_x = p.grad_x;
  gemms.grad_w = p.grad_w;
  gemms.grad_w_bf16 = p.grad_w_bf16;
  gemms.accumulate = p.accumulate;
  gemms.tokens = a.tokens;
  gemms.experts = int(E);
  gemms.hidden = int(H);
  if (detail::backward_gemms_supported(gemms, device)) {
    const size_t smem = size_t(kernels::kDenseWarps) * size_t(E) * sizeof(float);
    kernels::routing_grad_dense_bf16<<<unsigned(detail::ceil_div(a.tokens, kernels::kDenseWarps)),
                                       kernels::kDenseWarps * 32, smem, stream>>>(
        p, g_hi, g_lo);
    if (Status s = detail::last_launch_status(); s != Status::kSuccess) return s;
    return detail::launch_backward_gemms(gemms, device, stream);
  }

  constexpr int kWarps = 8;
  kernels::routing_grad_dense<<<unsigned(detail::ceil_div(a.tokens, kWarps)), kWarps * 32, 0,
                                stream>>>(p);
  if (Status s = detail::last_launch_status(); s != Status::kSuccess) return s;
  kernels::grad_x_sparse<<<unsigned(a.tokens), kernels::kGradXThreads, 0, stream>>>(p);
  if (Status s = detail::last_launch_status(); s != Status::kSuccess) return s;
  dim3 grid(unsigned(detail::ceil_div(H, kernels::kWgTile)),
            unsigned(detail::ceil_div(E, kernels::kWgTile)));
  kernels::grad_w_tiled<<<grid, kernels::kWgThreads, 0, stream>>>(p);
  return detail::last_launch_status();
}

}  // namespace moe_routing
