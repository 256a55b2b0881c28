// moe-routing: grouped top-k MoE router (DeepSeek-V3 / GLM-4.5 "noaux_tc") for Hopper (sm_90a).
//
// Public C++ API. All pointers are device pointers on the stream's device; all tensors are
// dense row-major. Every entry point validates its arguments before launching anything and
// touches no output when it returns an error.
//
//   x            [T, H]  bf16   activations
//   w            [E, H]  bf16   router weight
//   bias         [E]     f32    expert score correction bias (gets no gradient)
//   topk_idx     [T, K]  i32    chosen experts, best first
//   topk_weights [T, K]  f32    routing weights (normalized, scaled)
//   topk_scores  [T, K]  f32    sigmoid scores at the chosen experts (saved for the backward)
//   scores       [T, E]  f32    optional: all sigmoid scores (auxiliary load-balancing loss)
//   expert_counts [E]    i32    optional: tokens routed to each expert (bias update)
//   grad_topk_weights [T, K] f32, grad_x [T, H] bf16, grad_w [E, H] f32
//
// The backward also reads the tensors as PyTorch holds them, with no conversion kernel: int64
// topk_idx, the scores of all experts [T, E] (of which it reads the K chosen), bf16 scores and
// gradients, and writes grad_w as bf16 (BackwardArgs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace moe_routing {

enum class Status : int32_t {
  kSuccess = 0,
  kInvalidConfig = 1,      // config fields inconsistent (groups, top-k, sizes)
  kInvalidShape = 2,       // token count negative or too large, shapes disagree
  kNullPointer = 3,        // a required pointer is null
  kMisaligned = 4,         // a pointer is not aligned as required
  kBufferTooSmall = 5,     // a buffer holds fewer elements than the shape needs
  kForeignPointer = 6,     // a pointer is not device memory of the stream's device
  kCudaError = 7,          // the CUDA runtime reported an error
  kUnsupported = 8,        // valid, but outside what this build supports
};

const char* status_string(Status status);

// The CUDA error behind the calling thread's last Status::kCudaError, as the runtime names and
// describes it, e.g. "cudaErrorNoDevice: no CUDA-capable device is detected"; "" if this thread
// had none. Like errno, a later successful call leaves it as it was. (Thread-local storage,
// valid until the thread's next call into the library.)
const char* last_cuda_error();

struct RouterConfig {
  int64_t hidden_size = 5120;         // H, a multiple of 8
  int64_t n_routed_experts = 160;     // E
  int64_t num_experts_per_tok = 8;    // K
  int64_t n_group = 1;                // groups of E / n_group experts
  int64_t topk_group = 1;             // groups kept per token
  float routed_scaling_factor = 1.0f;
  bool norm_topk_prob = true;
};

// Limits of this build.
constexpr int64_t kMaxExperts = 512;
constexpr int64_t kMaxTopK = 16;
constexpr int64_t kMaxHidden = 65536;

// A device buffer and its capacity in elements.
template <class T>
struct DeviceSpan {
  T* data = nullptr;
  int64_t len = 0;
};

// Element type of a buffer that may come in more than one.
enum class DType : int32_t { kF32 = 0, kBF16 = 1, kI32 = 2, kI64 = 3 };

template <class T>
constexpr DType dtype_of() {
  using U = std::remove_cv_t<T>;
  static_assert(std::is_same_v<U, float> || std::is_same_v<U, uint16_t> ||
                    std::is_same_v<U, int32_t> || std::is_same_v<U, int64_t>,
                "float, uint16_t (bf16 bits), int32_t or int64_t");
  if constexpr (std::is_same_v<U, float>) return DType::kF32;
  else if constexpr (std::is_same_v<U, uint16_t>) return DType::kBF16;
  else if constexpr (std::is_same_v<U, int32_t>) return DType::kI32;
  else return DType::kI64;
}

constexpr size_t dtype_bytes(DType t) {
  return t == DType::kBF16 ? 2 : t == DType::kI64 ? 8 : 4;
}

// A device buffer whose element type is given at run time, with its capacity in elements.
// Made from a typed pointer or DeviceSpan, which names the type (uint16_t: bf16 bits).
template <class Void>  // const void (inputs) or void (outputs)
struct DeviceTensor {
  Void* data = nullptr;
  int64_t len = 0;
  DType dtype = DType::kF32;
  DeviceTensor() = default;
  DeviceTensor(Void* d, int64_t n, DType t) : data(d), len(n), dtype(t) {}
  template <class T>
  DeviceTensor(T* d, int64_t n) : data(d), len(n), dtype(dtype_of<T>()) {}
  template <class T>
  DeviceTensor(DeviceSpan<T> s) : DeviceTensor(s.data, s.len) {}
};
using DeviceInput = DeviceTensor<const void>;
using DeviceOutput = DeviceTensor<void>;

struct ForwardArgs {
  int64_t tokens = 0;
  DeviceSpan<const uint16_t> x;  // bf16 bits
  DeviceSpan<const uint16_t> w;  // bf16 bits
  DeviceSpan<const float> bias;
  DeviceOutput topk_idx;  // [T, K] kI32, or kI64 (as PyTorch keeps indices)
  DeviceSpan<float> topk_weights;
  DeviceSpan<float> topk_scores;
  // Optional outputs, off while `data` is null (they cost bytes): the full sigmoid scores
  // [T, E] and the per-expert token counts [E] (overwritten, exact integers).
  DeviceSpan<float> scores;
  DeviceSpan<int32_t> expert_counts;
  // >= 0: the caller has checked that every buffer is device memory of this CUDA device and
  // that the stream belongs to it, and the library skips its own per-buffer runtime queries
  // (host time); the other checks still run. A false claim is undefined behaviour. -1: checked
  // here.
  int checked_device = -1;
};

// Forward selection semantics (every path): experts rank by score + bias, larger first; equal
// values rank the lower expert index first; NaN ranks below every number (so a NaN is never
// chosen over a finite value, and a token whose scores are all NaN still gets K distinct
// indices, the lowest of its kept groups). Groups rank the same way by their top-2 sum.

enum class Precision : int32_t {
  kDefault = 0,  // routing gradient enters the tensor cores as bf16, fp32 accumulation
  kPrecise = 1,  // fp32-accurate grad_w; grad_x within its bf16 output rounding
  // The routing gradient rounded to bf16 after every elementwise step, in the order of the
  // eager bf16 PyTorch composition (README: numerics), so that results match that composition
  // up to the GEMMs' accumulation order. Less exact than kDefault.
  kTorchBf16 = 2,
};

struct BackwardArgs {
  int64_t tokens = 0;
  DeviceSpan<const uint16_t> x;
  DeviceSpan<const uint16_t> w;
  DeviceInput topk_idx;           // [T, K] kI32 or kI64
  // The sigmoid scores: at the chosen experts [T, K] (the forward's topk_scores), or of all
  // experts [T, E] (`scores`), of which the K chosen are read. Exactly one of the two; kF32 or
  // kBF16.
  DeviceInput topk_scores;
  DeviceInput scores;
  DeviceInput grad_topk_weights;  // [T, K] kF32 or kBF16
  DeviceSpan<uint16_t> grad_x;    // bf16 bits
  DeviceOutput grad_w;            // [E, H] kF32, or kBF16 (written, never accumulated)
  bool accumulate_grad_w = false;  // grad_w += result (main-grad pattern) instead of =
  Precision precision = Precision::kDefault;
  DeviceSpan<uint8_t> workspace;  // backward_workspace_bytes() bytes, 256-byte aligned
  int checked_device = -1;        // as ForwardArgs::checked_device
};

// Checks the config alone.
Status validate_config(const RouterConfig& cfg);

// Which kernels a (valid) config takes: the fused ones, or the simple CUDA-core ones, which are
// far slower. The fused forward also needs 16-byte aligned x and w, as allocators give. Needs
// no GPU.
struct KernelPaths {
  bool forward_fused = false;
  bool backward_fused = false;
};
Status kernel_paths(const RouterConfig& cfg, KernelPaths* paths);

// Bytes of device workspace the backward needs for `tokens` tokens.
size_t backward_workspace_bytes(const RouterConfig& cfg, int64_t tokens);

Status router_forward(const RouterConfig& cfg, const ForwardArgs& args, cudaStream_t stream);
Status router_backward(const RouterConfig& cfg, const BackwardArgs& args, cudaStream_t stream);

// Number of CUDA devices visible (0 where there is no driver or no device).
int device_count();

}  // namespace moe_routing
