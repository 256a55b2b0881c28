#include "bridge/bridge.h"

#include "bridge/common.h"
#include "moe-routing/src/bridge.rs.h"
#include "moe_routing/router.h"

namespace moe_routing::bridge {
namespace {

template <class T>
DeviceSpan<T> span(const Buffer& b) {
  return {reinterpret_cast<T*>(static_cast<uintptr_t>(b.ptr)), b.len};
}

// (Rust's dtypes are its element types' moe_routing::DType values; validate_backward checks them.)
DeviceInput input(const Buffer& b, int32_t dtype) {
  return {reinterpret_cast<const void*>(static_cast<uintptr_t>(b.ptr)), b.len,
          static_cast<DType>(dtype)};
}

}  // namespace

int32_t validate_config(const Config& cfg) {
  return static_cast<int32_t>(moe_routing::validate_config(to_config(cfg)));
}

int32_t kernel_paths(const Config& cfg, bool& forward_fused, bool& backward_fused) {
  KernelPaths k;
  const Status s = moe_routing::kernel_paths(to_config(cfg), &k);
  forward_fused = k.forward_fused;
  backward_fused = k.backward_fused;
  return static_cast<int32_t>(s);
}

uint64_t backward_workspace_bytes(const Config& cfg, int64_t tokens) {
  return moe_routing::backward_workspace_bytes(to_config(cfg), tokens);
}

int32_t router_forward(const Config& cfg, const ForwardBuffers& b, uint64_t stream) {
  return guarded([&] {
    ForwardArgs a;
    a.tokens = b.tokens;
    a.x = span<const uint16_t>(b.x);
    a.w = span<const uint16_t>(b.w);
    a.bias = span<const float>(b.bias);
    a.topk_idx = DeviceOutput(reinterpret_cast<void*>(static_cast<uintptr_t>(b.topk_idx.ptr)),
                              b.topk_idx.len, static_cast<DType>(b.topk_idx_dtype));
    a.topk_weights = span<float>(b.topk_weights);
    a.topk_scores = span<float>(b.topk_scores);
    a.scores = span<float>(b.scores);
    a.expert_counts = span<int32_t>(b.expert_counts);
    return moe_routing::router_forward(to_config(cfg), a,
                                       reinterpret_cast<cudaStream_t>(stream));
  });
}

int32_t router_backward(const Config& cfg, const BackwardBuffers& b, uint64_t stream) {
  return guarded([&] {
    BackwardArgs a;
    a.tokens = b.tokens;
    a.x = span<const uint16_t>(b.x);
    a.w = span<const uint16_t>(b.w);
    a.topk_idx = input(b.topk_idx, b.topk_idx_dtype);
    (b.scores.ptr ? a.scores : a.topk_scores) =
        input(b.scores.ptr ? b.scores : b.topk_scores, b.scores_dtype);
    a.grad_topk_weights = input(b.grad_topk_weights, b.grad_topk_weights_dtype);
    a.grad_x = span<uint16_t>(b.grad_x);
    a.grad_w = DeviceOutput(reinterpret_cast<void*>(static_cast<uintptr_t>(b.grad_w.ptr)),
                            b.grad_w.len, static_cast<DType>(b.grad_w_dtype));
    a.accumulate_grad_w = b.accumulate_grad_w;
    a.precision = static_cast<Precision>(b.precision);
    a.workspace = span<uint8_t>(b.workspace);
    return moe_routing::router_backward(to_config(cfg), a,
                                        reinterpret_cast<cudaStream_t>(stream));
  });
}

int32_t device_count() { return moe_routing::device_count(); }

rust::String last_cuda_error() { return rust::String(moe_routing::last_cuda_error()); }

rust::Str status_string(int32_t status) {
  return moe_routing::status_string(static_cast<Status>(status));
}

}  // namespace moe_routing::bridge
