// The fused backward's host side: which shapes it takes, its workspace, its launch.
#pragma once

#include <cstdint>

#include "fused_kernels.h"
#include "kernels/fused_backward/schedule.cuh"
#include "kernels/routing_inputs.cuh"
#include "moe_routing/router.h"

namespace moe_routing::detail {

// The workspace starts with the fused kernel's counters (zero between launches), so that every
// path leaves them intact: grad_w tickets [kMaxCounterSlices], readers [kMaxCounterSlices], then
// the compact rows' two (kCompactCounterOffset). The rest is per-path scratch.
constexpr int kMaxCounterSlices = 256;
constexpr size_t kCompactCounterOffset = 2 * kMaxCounterSlices * sizeof(int);
constexpr size_t kTicketBytes = kCompactCounterOffset + 256;
// Upper bound on the persistent grid (one CTA per SM), for workspace sizing.
constexpr int kFusedMaxCtas = 160;

// True where the fused kernel handles the shape (others take the simple path), in every
// precision but, for the wide kernels' shapes (more than 256 experts, or 8 a token), precise mode
// (fused_backward_takes).
bool fused_backward_supported(const RouterConfig& cfg);

// True where the fused kernel handles the call: the shape, and for the wide kernels' shapes not
// precise mode.
bool fused_backward_takes(const RouterConfig& cfg, Precision precision);

// The 128-column plan's unit: kTileT tokens by kTileH hidden columns.
constexpr int64_t kTileT = 128, kTileH = 128;

// The wide kernels' shapes (more than 256 experts, or more than 8 experts a token): 64-token
// tiles of 64-column slices, partials of up to kWideMaxExperts experts where k >= 2 CTAs share a
// slice (fewer than ctas + slices, the grid at most kFusedMaxCtas), and a packed row of 64
// bytes per token.
constexpr int64_t kWideMaxExperts = 512;
inline bool fused_backward_wide_shape(const RouterConfig& cfg) {
  return cfg.n_routed_experts > 256 || cfg.num_experts_per_tok > 8;
}

// Scratch bytes after the tickets for the fused kernel: grad_w partials, then (from
// fused_backward_compact_offset) a compact routing row of 32 bytes per token (64: the wide
// kernels).
inline size_t fused_backward_compact_offset(const RouterConfig& cfg, int64_t tokens) {
  size_t partials = 0;
  if (fused_backward_wide_shape(cfg)) {
    // Partials only where k >= 2 CTAs share a slice (plan64: 2 · slices within the grid), of
    // the kernel's width.
    const int64_t slices64 = cfg.hidden_size / 64, tiles64 = (tokens + 63) / 64;
    const int row = fused_backward_wide_row_for(cfg.n_routed_experts);
    const int64_t width = row >= 0 ? kFusedBackwardKernels[row].experts : kWideMaxExperts;
    if (tiles64 >= 2 && 2 * slices64 <= kFusedMaxCtas)
      partials = size_t(kFusedMaxCtas + slices64) * size_t(width * 64) * sizeof(float);
  } else {
    // Partial slots: fewer than ctas + slices (schedule.cuh), ctas <= kFusedMaxCtas. (64-column
    // plans: ctas64 + 2 · slices slots of half the size, ctas64 <= 2 · ctas: they fit.)
    const int64_t slices = cfg.hidden_size / kTileH;
    const int64_t units = (tokens + kTileT - 1) / kTileT * slices;
    const int64_t ctas = units < kFusedMaxCtas ? units : kFusedMaxCtas;
    partials = size_t(ctas + slices) * size_t(cfg.n_routed_experts * kTileH) * sizeof(float);
  }
  return (partials + 255) / 256 * 256;
}
inline size_t fused_backward_scratch_bytes(const RouterConfig& cfg, int64_t tokens) {
  return fused_backward_compact_offset(cfg, tokens) +
         size_t(tokens) * (fused_backward_wide_shape(cfg) ? 64 : 32);
}

Status launch_fused_backward(const RouterConfig& cfg, const BackwardArgs& args, int device,
                             cudaStream_t stream);

// The routing inputs as the kernels read them (validated arguments).
inline kernels::RoutingInputs routing_inputs(const RouterConfig& cfg, const BackwardArgs& a) {
  kernels::RoutingInputs in;
  const bool all = a.scores.data != nullptr;
  const DeviceInput& scores = all ? a.scores : a.topk_scores;
  in.idx = a.topk_idx.data;
  in.scores = scores.data;
  in.grad = a.grad_topk_weights.data;
  in.scores_stride = int(all ? cfg.n_routed_experts : cfg.num_experts_per_tok);
  in.idx_i64 = a.topk_idx.dtype == DType::kI64;
  in.scores_all = all;
  in.scores_bf16 = scores.dtype == DType::kBF16;
  in.grad_bf16 = a.grad_topk_weights.dtype == DType::kBF16;
  const bool k8 = cfg.num_experts_per_tok == 8;
  auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  in.idx_rows16 = k8 && aligned16(in.idx);
  in.grad_rows16 = k8 && aligned16(in.grad);
  return in;
}

// The training dtypes (int32 indices, f32 [T, K] scores and gradients, f32 grad_w, no
// torch_bf16 rounding): the only ones the fixed-K kernels read; every other combination takes
// the any-K kernels.
inline bool training_dtypes(const BackwardArgs& a) {
  return a.topk_idx.dtype == DType::kI32 && a.scores.data == nullptr &&
         a.topk_scores.dtype == DType::kF32 && a.grad_topk_weights.dtype == DType::kF32 &&
         a.grad_w.dtype == DType::kF32 && a.precision != Precision::kTorchBf16;
}

// The [T, K] routing arrays 16-byte aligned, as the fixed-K kernels need (they load each row as
// 16-byte vectors; the scores of all experts are gathered one by one); the API asks only
// element alignment, which the any-K kernels take.
inline bool routing_rows_aligned16(const BackwardArgs& a) {
  return ((reinterpret_cast<uintptr_t>(a.topk_idx.data) |
           reinterpret_cast<uintptr_t>(a.topk_scores.data) |
           reinterpret_cast<uintptr_t>(a.grad_topk_weights.data)) &
          15) == 0;
}

using kernels::fused_backward::GradWSum;
using kernels::fused_backward::kAnyTopK;
using kernels::fused_backward::kWideTopK;

// The persistent grid and how it sums grad_w (schedule.cuh). kSpread and kCluster:
// ctas = per_slice · slices, per_slice >= 2 (kCluster: the cluster size, <= 8). tile_h: the
// slice width, 128, or 64 with one CTA per slice (ctas = H / 64, kLastCta, no partials).
struct BackwardPlan {
  int ctas = 1;
  int per_slice = 1;
  GradWSum sum = GradWSum::kLastCta;
  int tile_h = 128;
  // Every CTA's units lie in one slice (k CTAs per slice, or one per slice).
  bool one_segment_per_cta(int64_t slices) const {
    return tile_h == 64 || sum != GradWSum::kLastCta || ctas == slices;
  }
};

// One instantiation per row of fused_kernels.def (expert count, top-k, slice width), each in its
// own translation unit (instances/fused_backward.cu).
// kTopK: K = 8 (routing rows 16-byte aligned), or kAnyTopK: any K from 1 to 8.
// passes: the kernel's sweeps (kernel_sm90.cuh: kPassG, kPassResidual, or both, which needs one
// segment per CTA: BackwardPlan::one_segment_per_cta).
template <int kExperts, int kTopK, int kTileH>
Status launch_fused_backward_e(const RouterConfig& cfg, const BackwardArgs& args, int device,
                               const BackwardPlan& plan, cudaStream_t stream,
                               uint32_t passes = kernels::fused_backward::kPassG);

// Clusters of `cluster` CTAs that fit on the device at once (0 where none, on error, or for
// 64-column kernels, which take no clusters).
template <int kExperts, int kTopK, int kTileH>
int fused_backward_active_clusters(int cluster, int device);

}  // namespace moe_routing::detail
