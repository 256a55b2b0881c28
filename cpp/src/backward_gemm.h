// The simple backward's two GEMMs on the tensor cores (CUTLASS sm90 kernels), for the shapes
// that have no fused kernel: from the dense routing gradient G [T, E] as bf16 (and its bf16
// rounding residual, for precise grad_w),
//   grad_x [T, H] bf16 = G · w              (M = T, N = H, K = E)
//   grad_w [E, H]      = Gᵀ · x (+ grad_w)  (M = E, N = H, K = T; f32, or bf16 written)
// each a data-parallel persistent kernel: every output tile is one CTA's whole sum, so the
// bits do not depend on timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_routing/router.h"

namespace moe_routing::detail {

struct BackwardGemms {
  const __nv_bfloat16* g = nullptr;   // [T, E] bf16, G rounded
  const __nv_bfloat16* g_lo = nullptr;  // [T, E] bf16, G - bf16(G) (precise), or null
  const __nv_bfloat16* x = nullptr;   // [T, H]
  const __nv_bfloat16* w = nullptr;   // [E, H]
  __nv_bfloat16* grad_x = nullptr;    // [T, H]
  void* grad_w = nullptr;             // [E, H] f32, or bf16 where grad_w_bf16
  bool grad_w_bf16 = false;           // (written, never accumulated; not with g_lo)
  bool accumulate = false;            // f32 grad_w: added into
  int64_t tokens = 0;
  int experts = 0, hidden = 0;
};

// Whether the GEMMs take these shapes: TMA wants 16-byte aligned rows (E and H multiples of 8)
// and bases; bf16 grad_w is written alone (not accumulated, not with the residual).
bool backward_gemms_supported(const BackwardGemms& a, int device);

// Both GEMMs, grad_x's then grad_w's (then the residual's, added), on `stream`.
Status launch_backward_gemms(const BackwardGemms& a, int device, cudaStream_t stream);

}  // namespace moe_routing::detail
