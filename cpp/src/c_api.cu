// The C ABI (moe_routing/moe_routing.h): checks the structs' sizes, converts to the C++ API and
// keeps every exception on this side. Host code only.
#include <cstddef>
#include <exception>
#include <type_traits>

#include "launch.h"
#include "moe_routing/moe_routing.h"
#include "moe_routing/router.h"

namespace {

using moe_routing::Status;

// The layout is the ABI: any change here is a new ABI version.
static_assert(sizeof(void*) == 8, "the C ABI is defined for 64-bit targets");
static_assert(sizeof(moe_routing_config) == 56, "moe_routing_config layout");
static_assert(offsetof(moe_routing_config, hidden_size) == 8, "moe_routing_config layout");
static_assert(offsetof(moe_routing_config, routed_scaling_factor) == 48,
              "moe_routing_config layout");
static_assert(sizeof(moe_routing_forward_args) == 160, "moe_routing_forward_args layout");
static_assert(offsetof(moe_routing_forward_args, topk_idx_dtype) ==
                  MOE_ROUTING_FORWARD_ARGS_SIZE_V3,
              "moe_routing_forward_args: the index dtype appended to the third release's struct");
static_assert(offsetof(moe_routing_forward_args, flags) == MOE_ROUTING_FORWARD_ARGS_SIZE_V2,
              "moe_routing_forward_args: flags appended to the second release's struct");
static_assert(offsetof(moe_routing_forward_args, scores) == MOE_ROUTING_FORWARD_ARGS_SIZE_V1,
              "moe_routing_forward_args: optional outputs appended to the first release's struct");
static_assert(offsetof(moe_routing_forward_args, tokens) == 8, "moe_routing_forward_args layout");
static_assert(offsetof(moe_routing_forward_args, topk_scores_len) == 104,
              "moe_routing_forward_args layout");
static_assert(sizeof(moe_routing_backward_args) == 192, "moe_routing_backward_args layout");
static_assert(offsetof(moe_routing_backward_args, flags) == MOE_ROUTING_BACKWARD_ARGS_SIZE_V2,
              "moe_routing_backward_args: flags appended to the second release's struct");
static_assert(offsetof(moe_routing_backward_args, scores) == MOE_ROUTING_BACKWARD_ARGS_SIZE_V1,
              "moe_routing_backward_args: dtypes appended to the first release's struct");
static_assert(offsetof(moe_routing_backward_args, tokens) == 8,
              "moe_routing_backward_args layout");
static_assert(offsetof(moe_routing_backward_args, workspace_bytes) == 136,
              "moe_routing_backward_args layout");
static_assert(offsetof(moe_routing_backward_args, accumulate_grad_w) == 144,
              "moe_routing_backward_args layout");
static_assert(std::is_standard_layout_v<moe_routing_backward_args>, "plain struct");

// The status codes are the C++ Status values.
static_assert(MOE_ROUTING_SUCCESS == int32_t(Status::kSuccess));
static_assert(MOE_ROUTING_INVALID_CONFIG == int32_t(Status::kInvalidConfig));
static_assert(MOE_ROUTING_INVALID_SHAPE == int32_t(Status::kInvalidShape));
static_assert(MOE_ROUTING_NULL_POINTER == int32_t(Status::kNullPointer));
static_assert(MOE_ROUTING_MISALIGNED == int32_t(Status::kMisaligned));
static_assert(MOE_ROUTING_BUFFER_TOO_SMALL == int32_t(Status::kBufferTooSmall));
static_assert(MOE_ROUTING_FOREIGN_POINTER == int32_t(Status::kForeignPointer));
static_assert(MOE_ROUTING_CUDA_ERROR == int32_t(Status::kCudaError));
static_assert(MOE_ROUTING_UNSUPPORTED == int32_t(Status::kUnsupported));
static_assert(MOE_ROUTING_PRECISION_DEFAULT == int32_t(moe_routing::Precision::kDefault));
static_assert(MOE_ROUTING_PRECISION_PRECISE == int32_t(moe_routing::Precision::kPrecise));
static_assert(MOE_ROUTING_PRECISION_TORCH_BF16 == int32_t(moe_routing::Precision::kTorchBf16));

constexpr int32_t code(Status s) { return static_cast<int32_t>(s); }

// A bool field of the ABI: 0 or 1.
bool flag(int32_t v, bool* out) {
  if (v != 0 && v != 1) return false;
  *out = v == 1;
  return true;
}

Status to_config(const moe_routing_config* c, moe_routing::RouterConfig* out) {
  if (c == nullptr) return Status::kNullPointer;
  if (c->struct_size != sizeof(moe_routing_config) || c->reserved != 0)
    return Status::kInvalidConfig;
  moe_routing::RouterConfig cfg;
  if (!flag(c->norm_topk_prob, &cfg.norm_topk_prob)) return Status::kInvalidConfig;
  cfg.hidden_size = c->hidden_size;
  cfg.n_routed_experts = c->n_routed_experts;
  cfg.num_experts_per_tok = c->num_experts_per_tok;
  cfg.n_group = c->n_group;
  cfg.topk_group = c->topk_group;
  cfg.routed_scaling_factor = c->routed_scaling_factor;
  *out = cfg;
  return Status::kSuccess;
}

// `flags` and `device` (structs that have them): the checked device, or -1.
bool to_checked_device(uint32_t flags, int32_t device, int* out) {
  if ((flags & ~MOE_ROUTING_FLAG_CHECKED_DEVICE) != 0) return false;  // unknown bits
  if (!(flags & MOE_ROUTING_FLAG_CHECKED_DEVICE)) return device == 0 && (*out = -1, true);
  if (device < 0) return false;
  *out = device;
  return true;
}

// A dtype field: DECLARED gives `declared`; else one of `allowed`.
bool to_dtype(int32_t v, moe_routing::DType declared, moe_routing::DType also,
              moe_routing::DType* out) {
  using moe_routing::DType;
  DType t;
  switch (v) {
    case MOE_ROUTING_DTYPE_DECLARED: t = declared; break;
    case MOE_ROUTING_DTYPE_F32: t = DType::kF32; break;
    case MOE_ROUTING_DTYPE_BF16: t = DType::kBF16; break;
    case MOE_ROUTING_DTYPE_I32: t = DType::kI32; break;
    case MOE_ROUTING_DTYPE_I64: t = DType::kI64; break;
    default: return false;
  }
  if (t != declared && t != also) return false;
  *out = t;
  return true;
}

Status to_forward(const moe_routing_forward_args* a, moe_routing::ForwardArgs* out) {
  if (a == nullptr) return Status::kNullPointer;
  const bool v1 = a->struct_size == MOE_ROUTING_FORWARD_ARGS_SIZE_V1;
  const bool v2 = a->struct_size == MOE_ROUTING_FORWARD_ARGS_SIZE_V2;
  const bool v3 = a->struct_size == MOE_ROUTING_FORWARD_ARGS_SIZE_V3;
  if ((!v1 && !v2 && !v3 && a->struct_size != sizeof(moe_routing_forward_args)) ||
      a->reserved != 0)
    return Status::kInvalidConfig;
  moe_routing::ForwardArgs f;
  if (!v1 && !v2 && !to_checked_device(a->flags, a->device, &f.checked_device))
    return Status::kInvalidConfig;
  // An earlier caller's struct ends before the index dtype: int32, its declared one.
  moe_routing::DType idx_t = moe_routing::DType::kI32;
  if (!v1 && !v2 && !v3 &&
      (!to_dtype(a->topk_idx_dtype, moe_routing::DType::kI32, moe_routing::DType::kI64, &idx_t) ||
       a->reserved2 != 0))
    return Status::kInvalidConfig;
  f.tokens = a->tokens;
  f.x = {a->x, a->x_len};
  f.w = {a->w, a->w_len};
  f.bias = {a->bias, a->bias_len};
  f.topk_idx = {a->topk_idx, a->topk_idx_len, idx_t};
  f.topk_weights = {a->topk_weights, a->topk_weights_len};
  f.topk_scores = {a->topk_scores, a->topk_scores_len};
  if (!v1) {  // a first-release caller's struct ends before these fields
    f.scores = {a->scores, a->scores_len};
    f.expert_counts = {a->expert_counts, a->expert_counts_len};
  }
  *out = f;
  return Status::kSuccess;
}


Status to_backward(const moe_routing_backward_args* a, moe_routing::BackwardArgs* out) {
  using moe_routing::DType;
  if (a == nullptr) return Status::kNullPointer;
  const bool v1 = a->struct_size == MOE_ROUTING_BACKWARD_ARGS_SIZE_V1;
  const bool v2 = a->struct_size == MOE_ROUTING_BACKWARD_ARGS_SIZE_V2;
  if ((!v1 && !v2 && a->struct_size != sizeof(moe_routing_backward_args)) || a->reserved != 0)
    return Status::kInvalidConfig;
  int checked_device = -1;
  if (!v1 && !v2 && !to_checked_device(a->flags, a->device, &checked_device))
    return Status::kInvalidConfig;
  if (a->precision != MOE_ROUTING_PRECISION_DEFAULT &&
      a->precision != MOE_ROUTING_PRECISION_PRECISE &&
      a->precision != MOE_ROUTING_PRECISION_TORCH_BF16)
    return Status::kInvalidConfig;
  // A first-release caller's struct ends before the dtypes: its declared ones.
  DType idx_t = DType::kI32, scores_t = DType::kF32, grad_t = DType::kF32, grad_w_t = DType::kF32;
  if (!v1 && (!to_dtype(a->topk_idx_dtype, DType::kI32, DType::kI64, &idx_t) ||
              !to_dtype(a->scores_dtype, DType::kF32, DType::kBF16, &scores_t) ||
              !to_dtype(a->grad_topk_weights_dtype, DType::kF32, DType::kBF16, &grad_t) ||
              !to_dtype(a->grad_w_dtype, DType::kF32, DType::kBF16, &grad_w_t)))
    return Status::kInvalidConfig;
  moe_routing::BackwardArgs b;
  if (!flag(a->accumulate_grad_w, &b.accumulate_grad_w)) return Status::kInvalidConfig;
  b.precision = static_cast<moe_routing::Precision>(a->precision);
  b.tokens = a->tokens;
  b.x = {a->x, a->x_len};
  b.w = {a->w, a->w_len};
  b.topk_idx = {a->topk_idx, a->topk_idx_len, idx_t};
  b.topk_scores = {a->topk_scores, a->topk_scores_len, scores_t};
  if (!v1) b.scores = {a->scores, a->scores_len, scores_t};
  b.grad_topk_weights = {a->grad_topk_weights, a->grad_topk_weights_len, grad_t};
  b.grad_x = {a->grad_x, a->grad_x_len};
  b.grad_w = {a->grad_w, a->grad_w_len, grad_w_t};
  b.workspace = {static_cast<uint8_t*>(a->workspace), a->workspace_bytes};
  b.checked_device = checked_device;
  *out = b;
  return Status::kSuccess;
}

}  // namespace

extern "C" {

int32_t moe_routing_abi_version(void) { return MOE_ROUTING_ABI_VERSION; }

const char* moe_routing_version_string(void) { return MOE_ROUTING_VERSION_STRING; }

const char* moe_routing_status_string(int32_t status) {
  if (status < MOE_ROUTING_SUCCESS || status > MOE_ROUTING_UNSUPPORTED) return "unknown status";
  return moe_routing::status_string(static_cast<Status>(status));
}

const char* moe_routing_last_cuda_error(void) { return moe_routing::last_cuda_error(); }

int32_t moe_routing_validate_config(const moe_routing_config* config) {
  try {
    moe_routing::RouterConfig cfg;
    if (Status s = to_config(config, &cfg); s != Status::kSuccess) return code(s);
    return code(moe_routing::validate_config(cfg));
  } catch (const std::exception& e) {
    return code(moe_routing::detail::exception_error(e.what()));
  } catch (...) {
    return code(moe_routing::detail::exception_error(nullptr));
  }
}

int32_t moe_routing_kernel_paths(const moe_routing_config* config, uint32_t* paths) {
  try {
    if (paths == nullptr) return code(Status::kNullPointer);
    moe_routing::RouterConfig cfg;
    if (Status s = to_config(config, &cfg); s != Status::kSuccess) return code(s);
    moe_routing::KernelPaths k;
    if (Status s = moe_routing::kernel_paths(cfg, &k); s != Status::kSuccess) return code(s);
    *paths = (k.forward_fused ? MOE_ROUTING_PATH_FORWARD_FUSED : 0u) |
             (k.backward_fused ? MOE_ROUTING_PATH_BACKWARD_FUSED : 0u);
    return code(Status::kSuccess);
  } catch (const std::exception& e) {
    return code(moe_routing::detail::exception_error(e.what()));
  } catch (...) {
    return code(moe_routing::detail::exception_error(nullptr));
  }
}

size_t moe_routing_backward_workspace_bytes(const moe_routing_config* config, int64_t tokens) {
  try {
    moe_routing::RouterConfig cfg;
    if (to_config(config, &cfg) != Status::kSuccess) return 0;
    return moe_routing::backward_workspace_bytes(cfg, tokens);
  } catch (...) {
    return 0;
  }
}

int32_t moe_routing_forward(const moe_routing_config* config,
                            const moe_routing_forward_args* args, void* stream) {
  try {
    moe_routing::RouterConfig cfg;
    moe_routing::ForwardArgs fwd;
    if (Status s = to_config(config, &cfg); s != Status::kSuccess) return code(s);
    if (Status s = to_forward(args, &fwd); s != Status::kSuccess) return code(s);
    return code(moe_routing::router_forward(cfg, fwd, static_cast<cudaStream_t>(stream)));
  } catch (const std::exception& e) {
    return code(moe_routing::detail::exception_error(e.what()));
  } catch (...) {
    return code(moe_routing::detail::exception_error(nullptr));
  }
}

int32_t moe_routing_backward(const moe_routing_config* config,
                             const moe_routing_backward_args* args, void* stream) {
  try {
    moe_routing::RouterConfig cfg;
    moe_routing::BackwardArgs bwd;
    if (Status s = to_config(config, &cfg); s != Status::kSuccess) return code(s);
    if (Status s = to_backward(args, &bwd); s != Status::kSuccess) return code(s);
    return code(moe_routing::router_backward(cfg, bwd, static_cast<cudaStream_t>(stream)));
  } catch (const std::exception& e) {
    return code(moe_routing::detail::exception_error(e.what()));
  } catch (...) {
    return code(moe_routing::detail::exception_error(nullptr));
  }
}

int32_t moe_routing_device_count(void) {
  try {
    return moe_routing::device_count();
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
