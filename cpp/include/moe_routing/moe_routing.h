/* moe-routing: stable C ABI of the grouped top-k MoE router (DeepSeek-V3 / GLM-4.5 "noaux_tc")
 * for Hopper (sm_90a). Valid C99 and C++; plain structs and fixed-width integers only.
 *
 * Semantics are those of the C++ API in moe_routing/router.h, which this ABI wraps:
 *
 *   x            [T, H]  bf16 (as uint16 bits)   activations
 *   w            [E, H]  bf16 (as uint16 bits)   router weight
 *   bias         [E]     f32                     expert score correction bias
 *   topk_idx     [T, K]  i32                     chosen experts, best first
 *   topk_weights [T, K]  f32                     routing weights (normalized, scaled)
 *   topk_scores  [T, K]  f32                     sigmoid scores at the chosen experts
 *   scores       [T, E]  f32  (optional)         all sigmoid scores
 *   expert_counts [E]    i32  (optional)         tokens routed to each expert
 *   grad_topk_weights [T, K] f32, grad_x [T, H] bf16 bits, grad_w [E, H] f32
 *
 * All buffers are device memory of the stream's device, dense row-major; each pointer comes
 * with its capacity in elements (bytes for the workspace). Every entry point validates its
 * arguments before launching anything and writes no output when it returns an error.
 * Calls are asynchronous on `stream` (a cudaStream_t; NULL is the legacy default stream).
 *
 * Versioning: MOE_ROUTING_ABI_VERSION changes only when an existing declaration changes
 * incompatibly. Every struct starts with `struct_size`, which the caller sets to sizeof the
 * struct as compiled; a struct may grow by fields appended at its end in a later version,
 * which will keep accepting the sizes of earlier versions. This version accepts the sizes
 * declared here and, for moe_routing_forward_args, also MOE_ROUTING_FORWARD_ARGS_SIZE_V1 (the
 * struct as first released, before its optional outputs were appended: they are then off);
 * for moe_routing_backward_args also MOE_ROUTING_BACKWARD_ARGS_SIZE_V1 (before its dtypes were
 * appended: the first release's dtypes then); for both also *_ARGS_SIZE_V2 (before `flags` and
 * `device` were appended: no flags); it answers MOE_ROUTING_INVALID_CONFIG to any other size.
 * Fields named `reserved` must be zero.
 *
 * Checked device: by default every entry point asks the CUDA runtime, for each buffer, whether
 * it is device memory of the stream's device (about half a microsecond of host time each). A
 * caller that already knows (a framework whose tensors carry their device) may set
 * MOE_ROUTING_FLAG_CHECKED_DEVICE in `flags` and the device index in `device`: the library then
 * takes every buffer and the stream to belong to that device and skips those queries. The
 * other checks (null pointers, alignment, capacities, dtypes) still run. A false claim is
 * undefined behaviour, as a wrong pointer is.
 *
 * Backward workspace: moe_routing_backward_workspace_bytes() bytes of device memory, aligned
 * to 256 bytes, zeroed once when allocated (cudaMemset). The backward leaves it ready for the
 * next call. Use one workspace per stream that runs backwards concurrently.
 */
#ifndef MOE_ROUTING_MOE_ROUTING_H_
#define MOE_ROUTING_MOE_ROUTING_H_

#include <stddef.h>
#include <stdint.h>

#define MOE_ROUTING_ABI_VERSION 1

/* Bits of the args structs' `flags`. */
#define MOE_ROUTING_FLAG_CHECKED_DEVICE 1u /* see "Checked device" above */

/* Version of the library these declarations belong to. */
#define MOE_ROUTING_VERSION_MAJOR 0
#define MOE_ROUTING_VERSION_MINOR 1
#define MOE_ROUTING_VERSION_PATCH 0
#define MOE_ROUTING_VERSION_STRING "0.1.0"

#if defined(__GNUC__) || defined(__clang__)
#define MOE_ROUTING_API __attribute__((visibility("default")))
#else
#define MOE_ROUTING_API
#endif

/* Status codes: the values of moe_routing::Status. */
#define MOE_ROUTING_SUCCESS 0
#define MOE_ROUTING_INVALID_CONFIG 1   /* config inconsistent, or struct_size, reserved, a 0/1 flag
                                          or precision out of range */
#define MOE_ROUTING_INVALID_SHAPE 2    /* token count negative or too large */
#define MOE_ROUTING_NULL_POINTER 3     /* a required pointer is null */
#define MOE_ROUTING_MISALIGNED 4       /* a pointer is not aligned as required */
#define MOE_ROUTING_BUFFER_TOO_SMALL 5 /* a buffer holds fewer elements than the shape needs */
#define MOE_ROUTING_FOREIGN_POINTER 6  /* not device memory of the stream's device */
#define MOE_ROUTING_CUDA_ERROR 7       /* the CUDA runtime reported an error (no device, ...) */
#define MOE_ROUTING_UNSUPPORTED 8      /* valid, but outside what this build supports */

/* Backward precision: the values of moe_routing::Precision. */
#define MOE_ROUTING_PRECISION_DEFAULT 0 /* routing gradient as bf16 into the tensor cores */
#define MOE_ROUTING_PRECISION_PRECISE 1 /* fp32-accurate grad_w; grad_x to bf16 rounding */
#define MOE_ROUTING_PRECISION_TORCH_BF16 2 /* routing gradient rounded as eager bf16 PyTorch */

/* Element types of the backward's buffers that come in several (PyTorch's dtypes, read in
 * place). DECLARED (0): the type the field is declared with. */
#define MOE_ROUTING_DTYPE_DECLARED 0
#define MOE_ROUTING_DTYPE_F32 1
#define MOE_ROUTING_DTYPE_BF16 2 /* as uint16 bits */
#define MOE_ROUTING_DTYPE_I32 3
#define MOE_ROUTING_DTYPE_I64 4

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t moe_routing_status;

/* The router's hyper-parameters (moe_routing::RouterConfig). 56 bytes. */
typedef struct moe_routing_config {
  uint32_t struct_size;          /* sizeof(moe_routing_config) */
  int32_t norm_topk_prob;        /* 0 or 1: normalize the selected scores to sum 1 */
  int64_t hidden_size;           /* H, a multiple of 8 */
  int64_t n_routed_experts;      /* E */
  int64_t num_experts_per_tok;   /* K */
  int64_t n_group;               /* groups of E / n_group experts (1: no grouping) */
  int64_t topk_group;            /* groups kept per token */
  float routed_scaling_factor;   /* weights are scaled by this */
  uint32_t reserved;             /* 0 */
} moe_routing_config;

/* Forward inputs and outputs (moe_routing::ForwardArgs). 160 bytes; its first 112 bytes are
 * the struct as first released (MOE_ROUTING_FORWARD_ARGS_SIZE_V1), its first 144 the second
 * (MOE_ROUTING_FORWARD_ARGS_SIZE_V2), its first 152 the third (MOE_ROUTING_FORWARD_ARGS_SIZE_V3),
 * all still accepted. */
#define MOE_ROUTING_FORWARD_ARGS_SIZE_V1 112
#define MOE_ROUTING_FORWARD_ARGS_SIZE_V2 144
#define MOE_ROUTING_FORWARD_ARGS_SIZE_V3 152
typedef struct moe_routing_forward_args {
  uint32_t struct_size; /* sizeof(moe_routing_forward_args) */
  uint32_t reserved;    /* 0 */
  int64_t tokens;       /* T */
  const uint16_t* x;
  int64_t x_len;
  const uint16_t* w;
  int64_t w_len;
  const float* bias;
  int64_t bias_len;
  int32_t* topk_idx;
  int64_t topk_idx_len;
  float* topk_weights;
  int64_t topk_weights_len;
  float* topk_scores;
  int64_t topk_scores_len;
  /* Optional outputs, off when NULL (appended after the first release). */
  float* scores;             /* [T, E] all sigmoid scores */
  int64_t scores_len;
  int32_t* expert_counts;    /* [E] tokens routed to each expert, overwritten */
  int64_t expert_counts_len;
  /* Appended after the second release. */
  uint32_t flags;            /* MOE_ROUTING_FLAG_*; 0: none */
  int32_t device;            /* with MOE_ROUTING_FLAG_CHECKED_DEVICE: the buffers' device */
  /* Appended after the third release. */
  int32_t topk_idx_dtype;    /* DECLARED (int32) or I64 (PyTorch's index dtype): the type
                                topk_idx points to */
  uint32_t reserved2;        /* 0 */
} moe_routing_forward_args;

/* Backward inputs and outputs (moe_routing::BackwardArgs). 192 bytes; its first 152 bytes are
 * the struct as first released (MOE_ROUTING_BACKWARD_ARGS_SIZE_V1), its first 184 the second
 * (MOE_ROUTING_BACKWARD_ARGS_SIZE_V2), both still accepted. A field's dtype other than the
 * declared one (appended fields) makes its pointer one to that type. */
#define MOE_ROUTING_BACKWARD_ARGS_SIZE_V1 152
#define MOE_ROUTING_BACKWARD_ARGS_SIZE_V2 184
typedef struct moe_routing_backward_args {
  uint32_t struct_size;      /* sizeof(moe_routing_backward_args) */
  int32_t precision;         /* MOE_ROUTING_PRECISION_* */
  int64_t tokens;            /* T */
  const uint16_t* x;
  int64_t x_len;
  const uint16_t* w;
  int64_t w_len;
  const int32_t* topk_idx;   /* from the forward (topk_idx_dtype) */
  int64_t topk_idx_len;
  const float* topk_scores;  /* from the forward; NULL when `scores` is given */
  int64_t topk_scores_len;
  const float* grad_topk_weights;
  int64_t grad_topk_weights_len;
  uint16_t* grad_x;          /* bf16 bits */
  int64_t grad_x_len;
  float* grad_w;
  int64_t grad_w_len;
  void* workspace;           /* zeroed once when allocated; see above */
  int64_t workspace_bytes;
  int32_t accumulate_grad_w; /* 0: grad_w = result; 1: grad_w += result */
  uint32_t reserved;         /* 0 */
  /* Appended after the first release. */
  const void* scores;        /* [T, E] all sigmoid scores, read at the chosen experts: instead
                                of topk_scores (exactly one of the two); scores_dtype */
  int64_t scores_len;
  int32_t topk_idx_dtype;    /* DECLARED (int32) or I64 */
  int32_t scores_dtype;      /* of topk_scores or scores: DECLARED (f32) or BF16 */
  int32_t grad_topk_weights_dtype; /* DECLARED (f32) or BF16 */
  int32_t grad_w_dtype;      /* DECLARED (f32) or BF16 (written: not with accumulate_grad_w
                                nor PRECISE) */
  /* Appended after the second release. */
  uint32_t flags;            /* MOE_ROUTING_FLAG_*; 0: none */
  int32_t device;            /* with MOE_ROUTING_FLAG_CHECKED_DEVICE: the buffers' device */
} moe_routing_backward_args;

/* MOE_ROUTING_ABI_VERSION of the library linked. */
MOE_ROUTING_API int32_t moe_routing_abi_version(void);

/* Version of the library linked, e.g. "0.1.0" (static storage). */
MOE_ROUTING_API const char* moe_routing_version_string(void);

/* A short English description of a status code (static storage; never NULL). */
MOE_ROUTING_API const char* moe_routing_status_string(int32_t status);

/* The CUDA error behind the calling thread's last MOE_ROUTING_CUDA_ERROR, as the runtime names
 * and describes it, e.g. "cudaErrorNoDevice: no CUDA-capable device is detected"; "" if this
 * thread had none. Like errno, a later successful call leaves it as it was. Never NULL;
 * thread-local storage, valid until the thread's next call into the library. */
MOE_ROUTING_API const char* moe_routing_last_cuda_error(void);

/* Checks the config alone; needs no GPU. */
MOE_ROUTING_API int32_t moe_routing_validate_config(const moe_routing_config* config);

/* Bytes of device workspace the backward needs for `tokens` tokens; 0 if the config is NULL
 * or invalid, or tokens <= 0. Needs no GPU. */
MOE_ROUTING_API size_t moe_routing_backward_workspace_bytes(const moe_routing_config* config,
                                                            int64_t tokens);

/* Routes `args->tokens` tokens: fills topk_idx, topk_weights and topk_scores. */
MOE_ROUTING_API int32_t moe_routing_forward(const moe_routing_config* config,
                                            const moe_routing_forward_args* args,
                                            void* stream);

/* Gradients of x and w from the gradient of the routing weights (bias gets none). */
MOE_ROUTING_API int32_t moe_routing_backward(const moe_routing_config* config,
                                             const moe_routing_backward_args* args,
                                             void* stream);

/* Number of CUDA devices visible; 0 where there is no driver or no device. */
MOE_ROUTING_API int32_t moe_routing_device_count(void);

/* Bits of moe_routing_kernel_paths' answer. */
#define MOE_ROUTING_PATH_FORWARD_FUSED 1u  /* the fused forward (else the simple one) */
#define MOE_ROUTING_PATH_BACKWARD_FUSED 2u /* the fused backward (else the simple one) */

/* Which kernels `config` takes, into *paths (MOE_ROUTING_PATH_* bits): the fused kernels, or
 * the simple CUDA-core ones, which are far slower (for the forward, given 16-byte aligned x and
 * w, as allocators give). Needs no GPU. */
MOE_ROUTING_API int32_t moe_routing_kernel_paths(const moe_routing_config* config,
                                                 uint32_t* paths);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_ROUTING_MOE_ROUTING_H_ */
