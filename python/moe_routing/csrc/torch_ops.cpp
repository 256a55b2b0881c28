// Native PyTorch ops: moe_routing::route, moe_routing::route_with_stats and
// moe_routing::route_backward, with the schemas and semantics of the Python custom ops of
// moe_routing/ops.py, registered from C++ so that a call
// goes from the dispatcher to the library's C ABI with no Python in between (most of the Python
// ops' host time per call goes to argument handling and ctypes).
//
// The checks run once, here, before anything is allocated or launched, with the messages of
// ops.py (ValueError, naming the argument); a non-zero status of the library raises a
// RuntimeError with its text. Outputs come from PyTorch's caching allocator and every kernel runs
// on the current CUDA stream of the input's device, so CUDA graph capture and torch.compile work.
// The fake (meta) kernels are registered from Python (moe_routing.ops, named by
// set_python_module below); autograd is registered here.

#include <moe_routing/moe_routing.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace {

// Limits of the kernels (router.h), as ops.py states them.
constexpr int64_t kMaxHidden = 65536;
constexpr int64_t kMaxExperts = 512;
constexpr int64_t kMaxTopK = 16;
constexpr int64_t kMaxTokens = 2147483647;
constexpr int64_t kAny = -1;  // a dimension of any size (None in ops.py's messages)

// ---------------------------------------------------------------------------------------------
// Messages as Python writes them (ops.py's texts, which the tests match).

const char* py_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Bool: return "torch.bool";
    case c10::ScalarType::ComplexFloat: return "torch.complex64";
    case c10::ScalarType::ComplexDouble: return "torch.complex128";
    default: return c10::toString(t);
  }
}

std::string py_dtypes(std::initializer_list<c10::ScalarType> dtypes) {
  std::string s;
  for (auto t : dtypes) {
    if (!s.empty()) s += " or ";
    s += py_dtype(t);
  }
  return s;
}

// A tensor's shape as Python prints a tuple: (8, 64), (32,), ().
std::string py_tuple(c10::IntArrayRef shape) {
  std::ostringstream s;
  s << '(';
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

// An expected shape as Python prints the list: [None, 64].
std::string py_list(std::initializer_list<int64_t> shape) {
  std::ostringstream s;
  s << '[';
  size_t i = 0;
  for (int64_t n : shape) {
    s << (i++ ? ", " : "");
    if (n == kAny) s << "None"; else s << n;
  }
  s << ']';
  return s.str();
}

// ---------------------------------------------------------------------------------------------
// Checks (ops.py's, in its order; the messages are built only on failure).

void check_tensor(const char* name, const at::Tensor& t,
                  std::initializer_list<c10::ScalarType> dtypes,
                  std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.dim() == static_cast<int64_t>(shape.size()), name, " must have ",
                    shape.size(), " dimension(s) ", py_list(shape), ", got shape ",
                    py_tuple(t.sizes()));
  bool dtype_ok = false;
  for (auto d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  TORCH_CHECK_VALUE(dtype_ok, name, " must be ", py_dtypes(dtypes), ", got ",
                    py_dtype(t.scalar_type()));
  int64_t i = 0;
  for (int64_t n : shape) {
    TORCH_CHECK_VALUE(n == kAny || t.size(i) == n, name, " must have shape ", py_list(shape),
                      ", got ", py_tuple(t.sizes()));
    ++i;
  }
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (call .contiguous())");
}

void check_config(int64_t H, int64_t E, int64_t K, int64_t n_group, int64_t topk_group,
                  double routed_scaling_factor) {
  TORCH_CHECK_VALUE(H > 0 && H % 8 == 0 && H <= kMaxHidden,
                    "hidden_size must be a positive multiple of 8 up to ", kMaxHidden, ", got ",
                    H);
  TORCH_CHECK_VALUE(E > 0 && E <= kMaxExperts, "n_routed_experts must be in 1..", kMaxExperts,
                    ", got ", E);
  TORCH_CHECK_VALUE(K > 0 && K <= kMaxTopK, "num_experts_per_tok (top_k) must be in 1..",
                    kMaxTopK, ", got ", K);
  TORCH_CHECK_VALUE(n_group > 0 && E % n_group == 0, "n_group (", n_group,
                    ") must be positive and divide n_routed_experts (", E, ")");
  TORCH_CHECK_VALUE(topk_group > 0 && topk_group <= n_group, "topk_group must be in 1..n_group (",
                    n_group, "), got ", topk_group);
  const int64_t per_group = E / n_group;
  TORCH_CHECK_VALUE(!(n_group > 1 && per_group < 2),
                    "groups need at least 2 experts (the group score is the sum of the two "
                    "best), got ", E, " experts in ", n_group, " groups");
  TORCH_CHECK_VALUE(K <= topk_group * per_group, "num_experts_per_tok (", K,
                    ") exceeds the number of candidate experts (topk_group ", topk_group, " x ",
                    per_group, " experts per group)");
  TORCH_CHECK_VALUE(std::isfinite(routed_scaling_factor),
                    "routed_scaling_factor must be finite, got ", routed_scaling_factor);
}

void check_device(const at::Tensor& x, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device() == x.device(), name, " is on ", t.device(), ", but x is on ",
                    x.device());
}

void check_tokens(int64_t T) {
  TORCH_CHECK_VALUE(T <= kMaxTokens, "at most ", kMaxTokens, " tokens are supported, got ", T);
}

// ---------------------------------------------------------------------------------------------
// The library.

void check_abi() {
  // Python loads the library its bindings checked, and this one binds to it by soname; a C++
  // caller may have put another one first.
  static const int32_t abi = moe_routing_abi_version();
  TORCH_CHECK(abi == MOE_ROUTING_ABI_VERSION, "the moe_routing library has C ABI version ", abi,
              ", but its PyTorch ops were built for version ", MOE_ROUTING_ABI_VERSION,
              ": install both from the same release");
}

void check_status(int32_t status, const char* what) {
  // A CUDA error says which (the runtime's name and description).
  const bool cuda = status == MOE_ROUTING_CUDA_ERROR;
  TORCH_CHECK(status == MOE_ROUTING_SUCCESS, what, " failed: ",
              moe_routing_status_string(status), cuda ? ": " : "",
              cuda ? moe_routing_last_cuda_error() : "", " (status ", status, ")");
}

moe_routing_config make_config(int64_t H, int64_t E, int64_t K, int64_t n_group,
                               int64_t topk_group, double routed_scaling_factor,
                               bool norm_topk_prob) {
  moe_routing_config c{};
  c.struct_size = sizeof(c);
  c.norm_topk_prob = norm_topk_prob ? 1 : 0;
  c.hidden_size = H;
  c.n_routed_experts = E;
  c.num_experts_per_tok = K;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return c;
}

// Points an ABI struct's buffer field at `t` and sets its element count. The field keeps its
// declared type (for appended fields the *_dtype fields say what it holds); a const field reads
// `t`, a mutable one writes it.
template <typename P>
void bind(P*& ptr, int64_t& len, const at::Tensor& t) {
  if constexpr (std::is_const_v<P>) ptr = static_cast<P*>(t.const_data_ptr());
  else ptr = static_cast<P*>(t.mutable_data_ptr());
  len = t.numel();
}

// `t`, or a fresh (aligned) copy if its data is not 16-byte aligned (the kernels' vector loads).
at::Tensor aligned16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// The weight as the kernels read it: bf16 (an f32 weight is rounded, as in the Python ops).
at::Tensor bf16_weight(const at::Tensor& weight) {
  return aligned16(weight.scalar_type() == at::kBFloat16 ? weight : weight.to(at::kBFloat16));
}

int32_t abi_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return MOE_ROUTING_DTYPE_F32;
    case c10::ScalarType::BFloat16: return MOE_ROUTING_DTYPE_BF16;
    case c10::ScalarType::Int: return MOE_ROUTING_DTYPE_I32;
    case c10::ScalarType::Long: return MOE_ROUTING_DTYPE_I64;
    default: break;
  }
  TORCH_INTERNAL_ASSERT(false, "unchecked dtype ", t);
  return MOE_ROUTING_DTYPE_DECLARED;
}

// ---------------------------------------------------------------------------------------------
// Backward workspaces: one zeroed buffer per (device, stream), grown when a call needs more. The
// library leaves it zeroed, so no call allocates or clears one. While a graph is being captured,
// a call whose stream has none large enough gets its own (zeroed in the graph, from the graph's
// pool) and nothing is cached: its zeroing runs only when the graph does, and its memory is the
// graph's.

using WorkspaceKey = std::pair<int64_t, uintptr_t>;  // (device index, cudaStream_t)

struct Workspaces {
  std::mutex mutex;
  std::map<WorkspaceKey, at::Tensor> cache;
};

Workspaces& workspaces() {
  // Never destroyed: at exit the tensors would be freed after the CUDA allocator is gone.
  static Workspaces* w = new Workspaces();
  return *w;
}

// Needs `like`'s device current (a CUDAGuard), whose current stream is `stream`.
at::Tensor workspace(const at::Tensor& like, cudaStream_t stream, int64_t nbytes) {
  const WorkspaceKey key{like.get_device(), reinterpret_cast<uintptr_t>(stream)};
  Workspaces& w = workspaces();
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    auto it = w.cache.find(key);
    if (it != w.cache.end() && it->second.numel() >= nbytes) return it->second;
  }
  const auto options = like.options().dtype(at::kByte);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return at::zeros({nbytes}, options);
  }
  std::lock_guard<std::mutex> lock(w.mutex);
  at::Tensor& slot = w.cache[key];
  if (!slot.defined() || slot.numel() < nbytes) {
    // (The old one may still be read by queued work on this stream: the caching allocator
    // reuses its memory only in that stream's order.)
    slot = at::zeros({nbytes}, options);
  }
  return slot;
}

// For tests: the cached workspace of (device, stream), or an undefined tensor (None).
at::Tensor cached_workspace(int64_t device, int64_t stream) {
  Workspaces& w = workspaces();
  std::lock_guard<std::mutex> lock(w.mutex);
  auto it = w.cache.find(WorkspaceKey{device, static_cast<uintptr_t>(stream)});
  return it == w.cache.end() ? at::Tensor() : it->second;
}

// ---------------------------------------------------------------------------------------------
// moe_routing::route and moe_routing::route_with_stats

struct Routed {
  at::Tensor topk_idx, topk_weights, topk_scores;
  at::Tensor scores;         // [T, E] f32 where asked for, else undefined
  at::Tensor expert_counts;  // [E] int32 where asked for, else undefined
};

// Both ops' work: the checks, then the outputs (the optional ones only where asked for) and one
// library call that fills them all.
Routed route_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  int64_t top_k, int64_t n_group, int64_t topk_group,
                  double routed_scaling_factor, bool norm_topk_prob, bool return_scores,
                  bool return_counts, bool int64_indices = false) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [T, H], got shape ", py_tuple(x.sizes()));
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be [E, H], got shape ",
                    py_tuple(weight.sizes()));
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0), K = top_k;
  check_tensor("x", x, {at::kBFloat16}, {kAny, H});
  check_tensor("weight", weight, {at::kBFloat16, at::kFloat}, {E, H});
  check_tensor("bias", bias, {at::kFloat}, {E});
  check_config(H, E, K, n_group, topk_group, routed_scaling_factor);
  TORCH_CHECK_VALUE(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  check_device(x, "weight", weight);
  check_device(x, "bias", bias);
  check_tokens(T);

  const c10::cuda::CUDAGuard guard(x.device());
  Routed r;
  r.topk_idx = at::empty({T, K}, x.options().dtype(int64_indices ? at::kLong : at::kInt));
  r.topk_weights = at::empty({T, K}, x.options().dtype(at::kFloat));
  r.topk_scores = at::empty({T, K}, x.options().dtype(at::kFloat));
  if (return_scores) r.scores = at::empty({T, E}, x.options().dtype(at::kFloat));
  if (return_counts) {
    const auto options = x.options().dtype(at::kInt);
    r.expert_counts = T == 0 ? at::zeros({E}, options) : at::empty({E}, options);
  }
  if (T == 0) return r;
  check_abi();
  const at::Tensor xa = aligned16(x);
  const at::Tensor w = bf16_weight(weight);
  const moe_routing_config cfg =
      make_config(H, E, K, n_group, topk_group, routed_scaling_factor, norm_topk_prob);

  moe_routing_forward_args a{};  // (the optional outputs: off unless asked for)
  a.struct_size = sizeof(a);
  a.tokens = T;
  bind(a.x, a.x_len, xa);
  bind(a.w, a.w_len, w);
  bind(a.bias, a.bias_len, bias);
  // (A pointer of the declared type; topk_idx_dtype says what it holds.)
  a.topk_idx = static_cast<int32_t*>(r.topk_idx.mutable_data_ptr());
  a.topk_idx_len = r.topk_idx.numel();
  a.topk_idx_dtype = abi_dtype(r.topk_idx.scalar_type());
  bind(a.topk_weights, a.topk_weights_len, r.topk_weights);
  bind(a.topk_scores, a.topk_scores_len, r.topk_scores);
  if (return_scores) bind(a.scores, a.scores_len, r.scores);
  if (return_counts) bind(a.expert_counts, a.expert_counts_len, r.expert_counts);
  // Every tensor is on x's device (checked above) and the stream is that device's: the library
  // need not ask the runtime about each buffer.
  a.flags = MOE_ROUTING_FLAG_CHECKED_DEVICE;
  a.device = x.get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  check_status(moe_routing_forward(&cfg, &a, stream), "moe_routing_forward");
  return r;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> route(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
    int64_t n_group, int64_t topk_group, double routed_scaling_factor, bool norm_topk_prob,
    bool /*precise_backward: the backward's*/, bool int64_indices) {
  Routed r = route_impl(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
                        norm_topk_prob, false, false, int64_indices);
  return {std::move(r.topk_idx), std::move(r.topk_weights), std::move(r.topk_scores)};
}

// route's outputs, then all scores [T, E] f32 and the token count of each expert [E] int32 from
// the same call; an output not asked for is an empty tensor (shape [0]). int64_indices: topk_idx
// as int64, written so by the kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_with_stats(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
    int64_t n_group, int64_t topk_group, double routed_scaling_factor, bool norm_topk_prob,
    bool /*precise_backward: the backward's*/, bool return_scores, bool return_counts,
    bool int64_indices) {
  Routed r = route_impl(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
                        norm_topk_prob, return_scores, return_counts, int64_indices);
  if (!return_scores) r.scores = at::empty({0}, x.options().dtype(at::kFloat));
  if (!return_counts) r.expert_counts = at::empty({0}, x.options().dtype(at::kInt));
  return {std::move(r.topk_idx), std::move(r.topk_weights), std::move(r.topk_scores),
          std::move(r.scores), std::move(r.expert_counts)};
}

// ---------------------------------------------------------------------------------------------
// moe_routing::route_backward

std::tuple<at::Tensor, at::Tensor> route_backward(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& topk_idx,
    const at::Tensor& topk_scores, const at::Tensor& grad_topk_weights, int64_t n_group,
    int64_t topk_group, double routed_scaling_factor, bool norm_topk_prob, bool precise,
    bool grad_w_bf16, const std::optional<at::Tensor>& grad_w_out) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [T, H], got shape ", py_tuple(x.sizes()));
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be [E, H], got shape ",
                    py_tuple(weight.sizes()));
  TORCH_CHECK_VALUE(topk_idx.dim() == 2, "topk_idx must be [T, K], got shape ",
                    py_tuple(topk_idx.sizes()));
  TORCH_CHECK_VALUE(topk_scores.dim() == 2, "topk_scores must be [T, K] or [T, E], got shape ",
                    py_tuple(topk_scores.sizes()));
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0), K = topk_idx.size(1);
  check_tensor("x", x, {at::kBFloat16}, {kAny, H});
  check_tensor("weight", weight, {at::kBFloat16, at::kFloat}, {E, H});
  check_tensor("topk_idx", topk_idx, {at::kInt, at::kLong}, {T, K});
  // The chosen experts' scores [T, K], or those of all experts [T, E] (read at the chosen).
  const bool all_scores = topk_scores.size(1) != K;
  check_tensor("topk_scores", topk_scores, {at::kFloat, at::kBFloat16}, {T, all_scores ? E : K});
  check_tensor("grad_topk_weights", grad_topk_weights, {at::kFloat, at::kBFloat16}, {T, K});
  TORCH_CHECK_VALUE(!(precise && grad_w_bf16),
                    "grad_w_bf16: precise mode writes grad_w as float32 only");
  // grad_w_out: grad_w is added into it (the library's accumulate mode), and the second output
  // is an empty tensor (an op's outputs may not alias its inputs).
  const bool accumulate = grad_w_out.has_value() && grad_w_out->defined();
  if (accumulate) {
    check_tensor("grad_w_out", *grad_w_out, {at::kFloat}, {E, H});
    TORCH_CHECK_VALUE(!grad_w_bf16,
                      "grad_w_out: grad_w is added into it in float32, so grad_w_bf16 must be "
                      "False");
  }
  check_config(H, E, K, n_group, topk_group, routed_scaling_factor);
  TORCH_CHECK_VALUE(x.is_cuda(), "x must be a CUDA tensor, got device ", x.device());
  check_device(x, "weight", weight);
  check_device(x, "topk_idx", topk_idx);
  check_device(x, "topk_scores", topk_scores);
  check_device(x, "grad_topk_weights", grad_topk_weights);
  if (accumulate) check_device(x, "grad_w_out", *grad_w_out);
  check_tokens(T);

  const c10::cuda::CUDAGuard guard(x.device());
  const auto w_dtype = grad_w_bf16 ? at::kBFloat16 : at::kFloat;
  auto grad_x = at::empty({T, H}, x.options().dtype(at::kBFloat16));
  at::Tensor placeholder;
  if (accumulate) placeholder = at::empty({0}, x.options().dtype(at::kFloat));
  if (accumulate) {
    // Written in place (below, or not at all for no tokens): its version counter is bumped
    // here, as the autograd kernel above this one does no in-place bookkeeping.
    grad_w_out->unsafeGetTensorImpl()->bump_version();
  }
  if (T == 0) {
    return {grad_x, accumulate ? placeholder : at::zeros({E, H}, x.options().dtype(w_dtype))};
  }
  const at::Tensor grad_w =
      accumulate ? *grad_w_out : at::empty({E, H}, x.options().dtype(w_dtype));
  check_abi();
  const at::Tensor xa = aligned16(x);
  const at::Tensor w = bf16_weight(weight);
  const moe_routing_config cfg =
      make_config(H, E, K, n_group, topk_group, routed_scaling_factor, norm_topk_prob);
  const size_t ws_bytes = moe_routing_backward_workspace_bytes(&cfg, T);
  TORCH_CHECK(ws_bytes > 0, "moe_routing_backward_workspace_bytes returned 0 for T=", T, ": ",
              moe_routing_status_string(moe_routing_validate_config(&cfg)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const at::Tensor ws = workspace(x, stream, static_cast<int64_t>(ws_bytes));

  moe_routing_backward_args a{};
  a.struct_size = sizeof(a);
  a.precision = precise ? MOE_ROUTING_PRECISION_PRECISE : MOE_ROUTING_PRECISION_DEFAULT;
  a.tokens = T;
  bind(a.x, a.x_len, xa);
  bind(a.w, a.w_len, w);
  bind(a.topk_idx, a.topk_idx_len, topk_idx);
  if (all_scores) {
    bind(a.scores, a.scores_len, topk_scores);
  } else {
    bind(a.topk_scores, a.topk_scores_len, topk_scores);
  }
  bind(a.grad_topk_weights, a.grad_topk_weights_len, grad_topk_weights);
  bind(a.grad_x, a.grad_x_len, grad_x);
  bind(a.grad_w, a.grad_w_len, grad_w);
  a.workspace = ws.mutable_data_ptr();
  a.workspace_bytes = ws.numel();
  a.accumulate_grad_w = accumulate ? 1 : 0;
  a.topk_idx_dtype = abi_dtype(topk_idx.scalar_type());
  a.scores_dtype = abi_dtype(topk_scores.scalar_type());
  a.grad_topk_weights_dtype = abi_dtype(grad_topk_weights.scalar_type());
  a.grad_w_dtype = abi_dtype(w_dtype);
  a.flags = MOE_ROUTING_FLAG_CHECKED_DEVICE;  // (as in route)
  a.device = x.get_device();
  check_status(moe_routing_backward(&cfg, &a, stream), "moe_routing_backward");
  return {grad_x, accumulate ? placeholder : grad_w};
}

// route_backward as a dispatcher handle, for the autograd kernels' calls of it.
const c10::TypedOperatorHandle<decltype(route_backward)>& route_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_routing::route_backward", "")
                             .typed<decltype(route_backward)>();
  return op;
}

std::tuple<at::Tensor, at::Tensor> route_backward_autograd(
    c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& topk_idx, const at::Tensor& topk_scores,
    const at::Tensor& grad_topk_weights, int64_t n_group, int64_t topk_group,
    double routed_scaling_factor, bool norm_topk_prob, bool precise, bool grad_w_bf16,
    const std::optional<at::Tensor>& grad_w_out) {
  const bool accumulate = grad_w_out.has_value() && grad_w_out->defined();
  TORCH_CHECK_VALUE(!(accumulate && grad_w_out->requires_grad() && at::GradMode::is_enabled()),
                    "grad_w_out: a tensor that requires grad cannot be accumulated into");
  std::tuple<at::Tensor, at::Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = route_backward_op().redispatch(
        keys & c10::after_autograd_keyset, x, weight, topk_idx, topk_scores, grad_topk_weights,
        n_group, topk_group, routed_scaling_factor, norm_topk_prob, precise, grad_w_bf16,
        grad_w_out);
  }
  if (torch::autograd::compute_requires_grad(x, weight, topk_scores, grad_topk_weights)) {
    auto node = std::shared_ptr<torch::autograd::NotImplemented>(
        new torch::autograd::NotImplemented(
            "moe_routing::route_backward",
            torch::autograd::collect_next_edges(x, weight, topk_scores, grad_topk_weights)),
        torch::autograd::deleteNode);
    torch::autograd::set_history(std::get<0>(out), node);
    if (!accumulate) torch::autograd::set_history(std::get<1>(out), node);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Autograd of route and route_with_stats: differentiable in x and weight through topk_weights;
// the backward is route_backward (the steps of ops.py's _route_autograd_backward, which the
// ctypes ops use). Registered from C++ so that a forward call runs no Python.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class RouteFunction : public torch::autograd::Function<RouteFunction> {
 public:
  static constexpr size_t kInputs = 13;  // forward's arguments after ctx: one gradient each

  // stats: route_with_stats (five outputs), else route (three).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
                               int64_t n_group, int64_t topk_group, double routed_scaling_factor,
                               bool norm_topk_prob, bool precise, bool return_scores,
                               bool return_counts, bool int64_indices, bool stats) {
    variable_list out = route_below_autograd(x, weight, bias, top_k, n_group, topk_group,
                                             routed_scaling_factor, norm_topk_prob, precise,
                                             return_scores, return_counts, int64_indices, stats);
    ctx->save_for_backward({x, weight, out[0], out[2]});
    ctx->saved_data["n_group"] = n_group;
    ctx->saved_data["topk_group"] = topk_group;
    ctx->saved_data["scale"] = routed_scaling_factor;
    ctx->saved_data["norm"] = norm_topk_prob;
    ctx->saved_data["precise"] = precise;
    variable_list fixed{out[0], out[2]};
    if (stats) fixed.insert(fixed.end(), {out[3], out[4]});
    ctx->mark_non_differentiable(fixed);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &idx = saved[2], &scores = saved[3];
    variable_list result(kInputs);
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    at::Tensor g = grads[1];
    if (!g.defined() || !(need_x || need_w)) return result;
    // bf16 and f32 gradients go to the kernel as they are; a bf16 weight gets its bf16 gradient
    // from the kernel itself (f32 where precise).
    if (g.scalar_type() != at::kFloat && g.scalar_type() != at::kBFloat16) g = g.to(at::kFloat);
    g = g.contiguous();
    const bool precise = ctx->saved_data["precise"].toBool();
    const bool grad_w_bf16 = weight.scalar_type() == at::kBFloat16 && !precise;
    auto [grad_x, grad_w] = route_backward_op().call(
        x, weight, idx, scores, g, ctx->saved_data["n_group"].toInt(),
        ctx->saved_data["topk_group"].toInt(), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["norm"].toBool(), precise, grad_w_bf16, std::nullopt);
    if (need_x) result[0] = grad_x;
    if (need_w) result[1] = grad_w.scalar_type() == weight.scalar_type()
                                ? grad_w
                                : grad_w.to(weight.scalar_type());
    return result;
  }

  // The op's own kernel (below autograd): route's three outputs, or route_with_stats' five.
  static variable_list route_below_autograd(const at::Tensor& x, const at::Tensor& weight,
                                            const at::Tensor& bias, int64_t top_k,
                                            int64_t n_group, int64_t topk_group,
                                            double routed_scaling_factor, bool norm_topk_prob,
                                            bool precise, bool return_scores,
                                            bool return_counts, bool int64_indices,
                                            bool stats) {
    at::AutoDispatchBelowADInplaceOrView below;
    if (stats) {
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("moe_routing::route_with_stats", "")
                                 .typed<decltype(route_with_stats)>();
      auto [a, b, c, d, e] =
          op.call(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
                  norm_topk_prob, precise, return_scores, return_counts, int64_indices);
      return {a, b, c, d, e};
    }
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("moe_routing::route", "")
                               .typed<decltype(route)>();
    auto [a, b, c] = op.call(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
                             norm_topk_prob, precise, int64_indices);
    return {a, b, c};
  }
};

// Where neither x nor weight needs a gradient, the op's kernel alone, with no autograd node.
variable_list route_any(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        int64_t top_k, int64_t n_group, int64_t topk_group,
                        double routed_scaling_factor, bool norm_topk_prob, bool precise,
                        bool return_scores, bool return_counts, bool int64_indices,
                        bool stats) {
  if (!torch::autograd::compute_requires_grad(x, weight))
    return RouteFunction::route_below_autograd(x, weight, bias, top_k, n_group, topk_group,
                                               routed_scaling_factor, norm_topk_prob, precise,
                                               return_scores, return_counts, int64_indices,
                                               stats);
  return RouteFunction::apply(x, weight, bias, top_k, n_group, topk_group,
                              routed_scaling_factor, norm_topk_prob, precise, return_scores,
                              return_counts, int64_indices, stats);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_autograd(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
    int64_t n_group, int64_t topk_group, double routed_scaling_factor, bool norm_topk_prob,
    bool precise, bool int64_indices) {
  variable_list out = route_any(x, weight, bias, top_k, n_group, topk_group,
                                routed_scaling_factor, norm_topk_prob, precise, false, false,
                                int64_indices, false);
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_with_stats_autograd(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t top_k,
    int64_t n_group, int64_t topk_group, double routed_scaling_factor, bool norm_topk_prob,
    bool precise, bool return_scores, bool return_counts, bool int64_indices) {
  variable_list out = route_any(x, weight, bias, top_k, n_group, topk_group,
                                routed_scaling_factor, norm_topk_prob, precise, return_scores,
                                return_counts, int64_indices, true);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

// The schemas of the Python custom ops (Python ints are SymInt there).
TORCH_LIBRARY(moe_routing, m) {
  m.set_python_module("moe_routing.ops");
  m.def(
      "route(Tensor x, Tensor weight, Tensor bias, SymInt top_k, SymInt n_group, "
      "SymInt topk_group, float routed_scaling_factor, bool norm_topk_prob, "
      "bool precise_backward=False, bool int64_indices=False) -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "route_with_stats(Tensor x, Tensor weight, Tensor bias, SymInt top_k, SymInt n_group, "
      "SymInt topk_group, float routed_scaling_factor, bool norm_topk_prob, "
      "bool precise_backward=False, bool return_scores=False, bool return_counts=False, "
      "bool int64_indices=False) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  // (The alias set of the mutable argument is named after its position, as Python's
  // custom_op names it.)
  m.def(
      "route_backward(Tensor x, Tensor weight, Tensor topk_idx, Tensor topk_scores, "
      "Tensor grad_topk_weights, SymInt n_group, SymInt topk_group, "
      "float routed_scaling_factor, bool norm_topk_prob, bool precise=False, "
      "bool grad_w_bf16=False, Tensor(a11!)? grad_w_out=None) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("_cached_workspace(int device, int stream) -> Tensor", &cached_workspace);
}

TORCH_LIBRARY_IMPL(moe_routing, CUDA, m) {
  m.impl("route", &route);
  m.impl("route_with_stats", &route_with_stats);
  m.impl("route_backward", &route_backward);
}

// CPU tensors get the same checks, and the same ValueError for the device, as in ops.py.
TORCH_LIBRARY_IMPL(moe_routing, CPU, m) {
  m.impl("route", &route);
  m.impl("route_with_stats", &route_with_stats);
  m.impl("route_backward", &route_backward);
}

// Autograd, from C++: route and route_with_stats through RouteFunction (none where no gradient
// is needed); route_backward is not differentiable: where an input needs a gradient, its
// outputs get a node that raises when backpropagated through. Each kernel is reached unboxed
// (PyTorch's boxed not-implemented fallback, which does the same for route_backward, boxes
// its twelve arguments on every call).
TORCH_LIBRARY_IMPL(moe_routing, Autograd, m) {
  m.impl("route", &route_autograd);
  m.impl("route_with_stats", &route_with_stats_autograd);
  m.impl("route_backward", &route_backward_autograd);
}
