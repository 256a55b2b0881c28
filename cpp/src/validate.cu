#include "validate.h"

#include <cmath>
#include <limits>

namespace moe_routing {

const char* status_string(Status status) {
  switch (status) {
    case Status::kSuccess: return "success";
    case Status::kInvalidConfig: return "invalid router config";
    case Status::kInvalidShape: return "invalid shape";
    case Status::kNullPointer: return "null pointer";
    case Status::kMisaligned: return "misaligned pointer";
    case Status::kBufferTooSmall: return "buffer too small";
    case Status::kForeignPointer: return "pointer is not device memory of the stream's device";
    case Status::kCudaError: return "CUDA error";
    case Status::kUnsupported: return "unsupported";
  }
  return "unknown status";
}

Status validate_config(const RouterConfig& c) {
  if (c.hidden_size <= 0 || c.hidden_size % 8 != 0 || c.hidden_size > kMaxHidden)
    return Status::kInvalidConfig;
  if (c.n_routed_experts <= 0 || c.n_routed_experts > kMaxExperts) return Status::kInvalidConfig;
  if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > kMaxTopK)
    return Status::kInvalidConfig;
  if (c.n_group <= 0 || c.n_routed_experts % c.n_group != 0) return Status::kInvalidConfig;
  if (c.topk_group <= 0 || c.topk_group > c.n_group) return Status::kInvalidConfig;
  const int64_t per_group = c.n_routed_experts / c.n_group;
  if (c.n_group > 1 && per_group < 2) return Status::kInvalidConfig;  // group score = top-2 sum
  if (c.num_experts_per_tok > c.topk_group * per_group) return Status::kInvalidConfig;
  if (!std::isfinite(c.routed_scaling_factor)) return Status::kInvalidConfig;
  return Status::kSuccess;
}

namespace detail {

Status stream_device(cudaStream_t stream, int* device) {
  cudaError_t err = stream ? cudaStreamGetDevice(stream, device) : cudaGetDevice(device);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::kCudaError;
  }
  return Status::kSuccess;
}

Status check_buffer(const void* ptr, int64_t len, int64_t need, size_t elem, size_t align,
                    int device) {
  if (need == 0) return Status::kSuccess;
  if (ptr == nullptr) return Status::kNullPointer;
  if (reinterpret_cast<uintptr_t>(ptr) % align != 0) return Status::kMisaligned;
  if (len < need) return Status::kBufferTooSmall;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::kForeignPointer;
  }
  const bool on_device =
      attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (!on_device || attr.device != device) return Status::kForeignPointer;
  (void)elem;
  return Status::kSuccess;
}

namespace {

// T·H and T·K must fit the 64-bit index space and T the grid.
Status check_tokens(const RouterConfig& cfg, int64_t tokens) {
  if (tokens < 0 || tokens > int64_t(std::numeric_limits<int32_t>::max()))
    return Status::kInvalidShape;
  if (tokens > std::numeric_limits<int64_t>::max() / cfg.hidden_size) return Status::kInvalidShape;
  return Status::kSuccess;
}

#define MOE_CHECK(expr)                         \
  do {                                          \
    Status _s = (expr);                         \
    if (_s != Status::kSuccess) return _s;      \
  } while (0)

}  // namespace

Status validate_forward(const RouterConfig& cfg, const ForwardArgs& a, int device) {
  MOE_CHECK(validate_config(cfg));
  MOE_CHECK(check_tokens(cfg, a.tokens));
  const int64_t T = a.tokens, H = cfg.hidden_size, E = cfg.n_routed_experts,
                K = cfg.num_experts_per_tok;
  MOE_CHECK(check_buffer(a.x.data, a.x.len, T * H, 2, 16, device));
  MOE_CHECK(check_buffer(a.w.data, a.w.len, T ? E * H : 0, 2, 16, device));
  MOE_CHECK(check_buffer(a.bias.data, a.bias.len, T ? E : 0, 4, 4, device));
  MOE_CHECK(check_buffer(a.topk_idx.data, a.topk_idx.len, T * K, 4, 4, device));
  MOE_CHECK(check_buffer(a.topk_weights.data, a.topk_weights.len, T * K, 4, 4, device));
  MOE_CHECK(check_buffer(a.topk_scores.data, a.topk_scores.len, T * K, 4, 4, device));
  return Status::kSuccess;
}

Status validate_backward(const RouterConfig& cfg, const BackwardArgs& a, int device) {
  MOE_CHECK(validate_config(cfg));
  MOE_CHECK(check_tokens(cfg, a.tokens));
  if (a.precision != Precision::kDefault && a.precision != Precision::kPrecise)
    return Status::kInvalidConfig;
  const int64_t T = a.tokens, H = cfg.hidden_size, E = cfg.n_routed_experts,
                K = cfg.num_experts_per_tok;
  MOE_CHECK(check_buffer(a.x.data, a.x.len, T * H, 2, 16, device));
  MOE_CHECK(check_buffer(a.w.data, a.w.len, T ? E * H : 0, 2, 16, device));
  MOE_CHECK(check_buffer(a.topk_idx.data, a.topk_idx.len, T * K, 4, 4, device));
  MOE_CHECK(check_buffer(a.topk_scores.data, a.topk_scores.len, T * K, 4, 4, device));
  MOE_CHECK(check_buffer(a.grad_topk_weights.data, a.grad_topk_weights.len, T * K, 4, 4, device));
  MOE_CHECK(check_buffer(a.grad_x.data, a.grad_x.len, T * H, 2, 16, device));
  MOE_CHECK(check_buffer(a.grad_w.data, a.grad_w.len, E * H, 4, 16, device));
  const int64_t ws = int64_t(backward_workspace_bytes(cfg, T));
  MOE_CHECK(check_buffer(a.workspace.data, a.workspace.len, ws, 1, 256, device));
  return Status::kSuccess;
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) cudaSetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_)
    cudaSetDevice(previous_);
}

}  // namespace detail

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace moe_routing
