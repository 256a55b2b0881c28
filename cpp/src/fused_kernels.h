// The fused kernels the library builds (fused_kernels.def) as constexpr tables, and the
// questions the dispatchers ask of them.
#pragma once

#include "kernels/fused_backward/schedule.cuh"  // kAnyTopK

namespace moe_routing::detail {

using kernels::fused_backward::kAnyTopK;
using kernels::fused_backward::kWideTopK;

struct FusedForwardKernel {
  int experts;
  bool tall_tiles;
};
struct FusedBackwardKernel {
  int experts;
  int top_k;
  int tile_h;
};

#define FUSED_FORWARD(experts, tall_tiles) FusedForwardKernel{experts, tall_tiles},
#define FUSED_BACKWARD(experts, top_k, tile_h)
inline constexpr FusedForwardKernel kFusedForwardKernels[] = {
#include "fused_kernels.def"
};
#undef FUSED_FORWARD
#undef FUSED_BACKWARD

#define FUSED_FORWARD(experts, tall_tiles)
#define FUSED_BACKWARD(experts, top_k, tile_h) FusedBackwardKernel{experts, top_k, tile_h},
inline constexpr FusedBackwardKernel kFusedBackwardKernels[] = {
#include "fused_kernels.def"
};
#undef FUSED_FORWARD
#undef FUSED_BACKWARD

inline constexpr int kNumFusedForward =
    int(sizeof(kFusedForwardKernels) / sizeof(FusedForwardKernel));
inline constexpr int kNumFusedBackward =
    int(sizeof(kFusedBackwardKernels) / sizeof(FusedBackwardKernel));

// The forward row of E, -1 where it has none.
constexpr int fused_forward_row(long long experts) {
  for (int i = 0; i < kNumFusedForward; ++i)
    if (kFusedForwardKernels[i].experts == experts) return i;
  return -1;
}

// The forward row that serves E: its own, else the narrowest wider one, the row's experts
// beyond E masked (E a multiple of 16); -1 where none.
constexpr int fused_forward_row_for(long long experts) {
  if (experts < 16 || experts % 16 != 0) return -1;
  int best = -1;
  for (int i = 0; i < kNumFusedForward; ++i) {
    const int e = kFusedForwardKernels[i].experts;
    if (e >= experts && (best < 0 || e < kFusedForwardKernels[best].experts)) best = i;
  }
  return best;
}

// The backward row of (E, top_k, tile_h), top_k 8 or kAnyTopK; -1 where it has none.
constexpr int fused_backward_row(long long experts, int top_k, int tile_h) {
  for (int i = 0; i < kNumFusedBackward; ++i) {
    const FusedBackwardKernel& k = kFusedBackwardKernels[i];
    if (k.experts == experts && k.top_k == top_k && k.tile_h == tile_h) return i;
  }
  return -1;
}

// The backward kernels of E with tile_h-wide slices (any K).
constexpr bool has_fused_backward(long long experts, int tile_h) {
  return fused_backward_row(experts, kAnyTopK, tile_h) >= 0;
}

// The wide backward row that serves E (a multiple of 16; more than 256 experts, or fewer at
// more than 8 a token): the narrowest one at least as wide, its experts beyond E masked; -1
// where none.
constexpr int fused_backward_wide_row_for(long long experts) {
  if (experts < 16 || experts % 16 != 0) return -1;
  int best = -1;
  for (int i = 0; i < kNumFusedBackward; ++i) {
    const FusedBackwardKernel& k = kFusedBackwardKernels[i];
    if (k.top_k == kWideTopK && k.experts >= experts &&
        (best < 0 || k.experts < kFusedBackwardKernels[best].experts))
      best = i;
  }
  return best;
}

namespace fused_kernels_check {
constexpr bool backward_rows_complete() {
  for (const FusedBackwardKernel& k : kFusedBackwardKernels) {
    if (k.top_k == kWideTopK) {  // the wide kernels: more than 256 experts, 64-column slices
      if (k.experts <= 256 || k.tile_h != 64) return false;
      continue;
    }
    if ((k.top_k != 8 && k.top_k != kAnyTopK) || (k.tile_h != 64 && k.tile_h != 128)) return false;
    if (!has_fused_backward(k.experts, k.tile_h)) return false;  // an any-K kernel beside K = 8
    if (k.tile_h == 128 && !has_fused_backward(k.experts, 64)) return false;  // (small T)
  }
  return true;
}
constexpr bool rows_unique() {
  for (int i = 0; i < kNumFusedForward; ++i)
    if (fused_forward_row(kFusedForwardKernels[i].experts) != i) return false;
  for (int i = 0; i < kNumFusedBackward; ++i) {
    const FusedBackwardKernel& k = kFusedBackwardKernels[i];
    if (fused_backward_row(k.experts, k.top_k, k.tile_h) != i) return false;
  }
  return true;
}
static_assert(backward_rows_complete(),
              "fused_kernels.def: top_k 8 or kAnyTopK, tile_h 64 or 128; an any-K row beside each "
              "K = 8 one, and 64-wide rows for each E with 128-wide ones; wide rows (kWideTopK) "
              "above 256 experts, tile_h 64");
static_assert(rows_unique(), "fused_kernels.def: a row twice");
}  // namespace fused_kernels_check

}  // namespace moe_routing::detail
