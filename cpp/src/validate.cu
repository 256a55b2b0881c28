#include "validate.h"

#include "launch.h"

#include <cmath>
#include <limits>
#include <string>

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

namespace {

// The device a stream belongs to (the current device for the legacy default stream). While a
// stream captures a graph, -1: the device of the buffers decides (check_all), and a launch on
// a stream of another device fails cleanly.
Status stream_device(cudaStream_t stream, int* device) {
  if (stream) {
    // Asking a capturing stream for its device invalidates the capture: ask whether it
    // captures first (allowed).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaError_t err = cudaStreamIsCapturing(stream, &capture); err != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_error(err);
    }
    if (capture != cudaStreamCaptureStatusNone) {
      *device = -1;
      return Status::kSuccess;
    }
  }
  if (cudaError_t err = stream ? cudaStreamGetDevice(stream, device) : cudaGetDevice(device);
      err != cudaSuccess) {
    (void)cudaGetLastError();
    return cuda_error(err);
  }
  return Status::kSuccess;
}

// One buffer argument: where it is, what it holds, what the shape needs.
struct Buffer {
  const void* ptr;
  int64_t len;    // capacity in elements
  int64_t need;   // elements the shape needs (0: the buffer is not used)
  size_t align;   // bytes
};

// Pass 1: a null pointer passes only when nothing is needed.
Status check_host(const Buffer& b) {
  if (b.need == 0) return Status::kSuccess;
  if (b.ptr == nullptr) return Status::kNullPointer;
  if (reinterpret_cast<uintptr_t>(b.ptr) % b.align != 0) return Status::kMisaligned;
  if (b.len < b.need) return Status::kBufferTooSmall;
  return Status::kSuccess;
}

// Pass 2: device (or managed) memory of `*device`; where that is still unknown (-1: a capturing
// stream), the first buffer checked names it.
Status check_device(const Buffer& b, int* device) {
  if (b.need == 0) return Status::kSuccess;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, b.ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::kForeignPointer;
  }
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (on_device && *device < 0) *device = attr.device;
  return on_device && attr.device == *device ? Status::kSuccess : Status::kForeignPointer;
}

// T·H and T·K must fit the 64-bit index space and T the grid.
Status check_tokens(const RouterConfig& cfg, int64_t tokens) {
  if (tokens < 0 || tokens > int64_t(std::numeric_limits<int32_t>::max()))
    return Status::kInvalidShape;
  if (tokens > std::numeric_limits<int64_t>::max() / cfg.hidden_size) return Status::kInvalidShape;
  return Status::kSuccess;
}

// checked_device >= 0: the caller vouches for the buffers' device and the stream's (the args'
// checked_device), and pass 2 is skipped.
template <size_t N>
Status check_all(const Buffer (&buffers)[N], cudaStream_t stream, int checked_device,
                 int* device) {
  for (const Buffer& b : buffers)
    if (Status s = check_host(b); s != Status::kSuccess) return s;
  if (checked_device >= 0) {
    static const int count = device_count();  // (a device index out of range is no claim)
    if (checked_device >= count) return Status::kInvalidConfig;
    *device = checked_device;
    return Status::kSuccess;
  }
  RelaxedCaptureScope relaxed;
  if (Status s = stream_device(stream, device); s != Status::kSuccess) return s;
  for (const Buffer& b : buffers)
    if (Status s = check_device(b, device); s != Status::kSuccess) return s;
  if (*device < 0) {  // no buffer needed
    if (cudaError_t err = cudaGetDevice(device); err != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_error(err);
    }
  }
  return Status::kSuccess;
}

#define MOE_CHECK(expr)                    \
  do {                                     \
    Status _s = (expr);                    \
    if (_s != Status::kSuccess) return _s; \
  } while (0)

}  // namespace

Status validate_forward(const RouterConfig& cfg, const ForwardArgs& a, cudaStream_t stream,
                        int* device) {
  MOE_CHECK(validate_config(cfg));
  MOE_CHECK(check_tokens(cfg, a.tokens));
  if (a.topk_idx.dtype != DType::kI32 && a.topk_idx.dtype != DType::kI64)
    return Status::kInvalidConfig;
  const int64_t T = a.tokens, H = cfg.hidden_size, E = cfg.n_routed_experts,
                K = cfg.num_experts_per_tok;
  const Buffer buffers[] = {
      {a.x.data, a.x.len, T * H, 16},
      {a.w.data, a.w.len, T ? E * H : 0, 16},
      {a.bias.data, a.bias.len, T ? E : 0, 4},
      {a.topk_idx.data, a.topk_idx.len, T * K, dtype_bytes(a.topk_idx.dtype)},
      {a.topk_weights.data, a.topk_weights.len, T * K, 4},
      {a.topk_scores.data, a.topk_scores.len, T * K, 4},
      {a.scores.data, a.scores.len, a.scores.data ? T * E : 0, 4},
      {a.expert_counts.data, a.expert_counts.len, a.expert_counts.data ? E : 0, 4},
  };
  return check_all(buffers, stream, a.checked_device, device);
}

Status validate_backward(const RouterConfig& cfg, const BackwardArgs& a, cudaStream_t stream,
                         int* device) {
  MOE_CHECK(validate_config(cfg));
  MOE_CHECK(check_tokens(cfg, a.tokens));
  if (a.precision != Precision::kDefault && a.precision != Precision::kPrecise &&
      a.precision != Precision::kTorchBf16)
    return Status::kInvalidConfig;
  // Dtypes: indices int32 or int64; scores and gradients f32 or bf16; grad_w f32, or bf16
  // written (a bf16 sum would round at every call).
  const auto is_float = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  if (a.topk_idx.dtype != DType::kI32 && a.topk_idx.dtype != DType::kI64)
    return Status::kInvalidConfig;
  if (!is_float(a.topk_scores.dtype) || !is_float(a.scores.dtype) ||
      !is_float(a.grad_topk_weights.dtype) || !is_float(a.grad_w.dtype))
    return Status::kInvalidConfig;
  // bf16 grad_w: written, never accumulated, and not in precise mode (fp32-accurate grad_w,
  // which may take a second launch that adds into it).
  if (a.grad_w.dtype == DType::kBF16 &&
      (a.accumulate_grad_w || a.precision == Precision::kPrecise))
    return Status::kUnsupported;
  const int64_t T = a.tokens, H = cfg.hidden_size, E = cfg.n_routed_experts,
                K = cfg.num_experts_per_tok;
  // Exactly one of the scores' two forms (both null: the chosen ones are missing).
  const bool all_scores = a.scores.data != nullptr;
  if (all_scores && a.topk_scores.data != nullptr) return Status::kInvalidConfig;
  const auto elem = [](const DeviceInput& b) { return dtype_bytes(b.dtype); };
  const Buffer buffers[] = {
      {a.x.data, a.x.len, T * H, 16},
      {a.w.data, a.w.len, T ? E * H : 0, 16},
      {a.topk_idx.data, a.topk_idx.len, T * K, elem(a.topk_idx)},
      {a.topk_scores.data, a.topk_scores.len, all_scores ? 0 : T * K, elem(a.topk_scores)},
      {a.scores.data, a.scores.len, all_scores ? T * E : 0, elem(a.scores)},
      {a.grad_topk_weights.data, a.grad_topk_weights.len, T * K, elem(a.grad_topk_weights)},
      {a.grad_x.data, a.grad_x.len, T * H, 16},
      // (16-byte f32 vectors, 8-byte bf16 ones)
      {a.grad_w.data, a.grad_w.len, E * H, 4 * dtype_bytes(a.grad_w.dtype)},
      {a.workspace.data, a.workspace.len, int64_t(backward_workspace_bytes(cfg, T)), 256},
  };
  return check_all(buffers, stream, a.checked_device, device);
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

const char* last_cuda_error() { return detail::last_cuda_error_text().c_str(); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace moe_routing
