// Tile shapes, shared-memory layouts and the tiled MMA of the fused forward (sm90a).
//
// A cluster of kSplit CTAs owns one tile of kTileT tokens (128; 64 at small T, and at every T
// above 256 experts; 192 where 128-token tiles would leave SMs idle, E = 160) and all E
// experts; CTA r of the cluster covers hidden blocks [r·B/kSplit, (r+1)·B/kSplit) of the
// B = ⌈H/kTileH⌉ blocks.
// Per hidden block, TMA brings (shared memory, h contiguous, K-major SW128):
//   sX  (t, h, stage)  the x tile              wgmma A
//   sW  (e, h, stage)  the w slice, all E rows  wgmma B
// Two consumer warpgroups accumulate logits(t, e) = Σ_h x(t, h)·w(e, h) in fp32 registers:
// 64 tokens × E each in 128-token tiles, 64 tokens × E/2 each in 64-token tiles (whose
// partials, half the bytes, cross the cluster network in half the time). 192-token tiles are
// both at once: rows [0, 128) one 64 × E wgmma per warpgroup (64-row slices of the stage),
// rows [128, 192) 64 × E/2 per warpgroup (120 accumulators per thread). After the main loop
// the pipeline buffers are reused as the reduction buffer: every CTA stores its partial logits
// there, and the CTA that owns a row range reads those rows from every CTA of the cluster
// (distributed shared memory) and sums them in rank order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
// The extended wgmma shapes (64×160), which cute/tensor.hpp includes only with
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED; after it, since they build on its GMMA definitions.
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>

#include "kernels/fused_forward/cluster_sizes.h"  // tile_fits

namespace moe_routing::kernels::fused_forward {

using namespace cute;

// The bf16 → fp32 wgmma with N = E, both operands K-major in shared memory.
template <int kN>
CUTE_HOST_DEVICE constexpr auto wgmma_atom() {
  using namespace SM90::GMMA;
  constexpr auto K = GMMA::Major::K;
  if constexpr (kN == 160) return MMA_64x160x16_F32BF16BF16_SS<K, K>{};
  else if constexpr (kN == 256) return MMA_64x256x16_F32BF16BF16_SS<K, K>{};
  else if constexpr (kN == 128) return MMA_64x128x16_F32BF16BF16_SS<K, K>{};
  else if constexpr (kN == 80) return MMA_64x80x16_F32BF16BF16_SS<K, K>{};
  else if constexpr (kN == 64) return MMA_64x64x16_F32BF16BF16_SS<K, K>{};
  else if constexpr (kN == 32) return MMA_64x32x16_F32BF16BF16_SS<K, K>{};
  else return ss_op_selector<cutlass::bfloat16_t, cutlass::bfloat16_t, float,
                             Shape<_64, Int<kN>, _64>, K, K>();
}

template <int kExperts_, int kTileT_ = 128>
struct Config {
  static constexpr int kExperts = kExperts_;
  static constexpr int kTileT = kTileT_;  // tokens per tile
  static_assert(kTileT == 128 || kTileT == 64 || kTileT == 192,
                "two warpgroups along t, along e, or both");
  static_assert(tile_fits(kExperts, kTileT), "above 256 experts, 64-token tiles");
  static constexpr bool kWide = kExperts > 256;
  // Consumer warpgroups along (t, e): 2 × 1 (64 tokens × E each) or 1 × 2 (64 × E/2); a
  // 192-token tile is a 128-token tile's rows, then a 64-token tile's (kRowsHi).
  static constexpr int kRowsHi = kTileT == 192 ? 64 : 0;
  static constexpr int kWgT = (kTileT - kRowsHi) / 64, kWgE = 2 / kWgT;
  static constexpr int kTileH = 64;   // hidden per stage: one 128-byte swizzle atom of bf16
  // As many stages as fit in 220 KB, at most 6: 6 for E <= 160 (E = 160: 216 KB), 4 for 256,
  // 3 for 384 and 512 (64-token tiles: 168 and 216 KB).
  static constexpr int kStageBytes = (kTileT + kExperts) * kTileH * 2;  // bf16 x and w tiles
  static constexpr int kStages = (220 * 1024) / kStageBytes < 6 ? (220 * 1024) / kStageBytes : 6;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg: the consumers gain only what the producer gives up (168 per thread at 384).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <= 3 * 168,
                "register reallocation must balance");
  // Largest cluster: 16 (non-portable, where the device allows it) leaves 8 rows per CTA.
  static constexpr int kMaxSplit = 16;
  static_assert(kTileT % kMaxSplit == 0, "rows per CTA");

  static_assert(kExperts % 8 == 0 && kExperts >= 8 && kExperts <= 512,
                "E: a warpgroup's wgmma N is a multiple of 8 up to 256; SW128 atoms are 8 rows");

  using Elem = cutlass::bfloat16_t;
  using TileT = Int<kTileT>;
  using TileH = Int<kTileH>;
  using Experts = Int<kExperts>;
  using Stages = Int<kStages>;

  // (t, h, stage) and (e, h, stage): K-major, 128-byte swizzle; a TMA box is one stage.
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<TileT, TileH, Stages>{}));
  // A TMA box has at most 256 rows: above 256 experts a stage of w is two boxes of E/2 rows,
  // the second 1024-byte aligned (E/2 · 128 bytes), so both keep the stage's swizzle phase.
  static constexpr int kWBoxes = kWide ? 2 : 1;
  static constexpr int kWBoxRows = kExperts / kWBoxes;
  static_assert(kWBoxRows <= 256 && kWBoxRows * 128 % 1024 == 0 && kTileT <= 256,
                "TMA boxes of at most 256 rows, each w box 1024-byte aligned in its stage");
  using SmemLayoutWBox = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                                Shape<Int<kWBoxRows>, TileH>{}));
  using SmemLayoutW = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<Experts, TileH, Stages>{}));

  // kTileT × E per CTA, one 64×(E/kWgE)×16 wgmma per warpgroup and k-step. Named directly:
  // ss_op_selector offers N = E only with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED and would
  // otherwise tile E = 160 with five 64×32 atoms, reading A from shared memory five times.
  static_assert(kExperts % (8 * kWgE) == 0, "each warpgroup's share of E is a wgmma N");
  using MmaAtom = decltype(wgmma_atom<kExperts / kWgE>());
  using Mma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<kWgT>, Int<kWgE>, _1>>{}));
  // 192-token tiles: one warpgroup's 64 × E wgmma on its 64-row slice of rows [0, 128), and the
  // two warpgroups' 64 × E/2 on rows [128, 192).
  using MmaRow = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _1, _1>>{}));
  using MmaHi = decltype(make_tiled_mma(wgmma_atom<kExperts / 2>(), Layout<Shape<_1, _2, _1>>{}));
  using Rows64 = Shape<_64, TileH, Stages>;  // a 64-row slice of the x stages
  static_assert(size<1>(typename MMA_Atom<MmaAtom>::Shape_MNK{}) * kWgE == kExperts,
                "one wgmma per warpgroup spans its experts");

  // Reduction buffer (fp32): [kTileT rows][kRedStride], this CTA's partial logits; the rows
  // the CTA owns are then overwritten with their sums, then their scores. Rows 8 banks apart
  // (E % 32 == 0 or 8 or 24 mod 32 with the +8): the accumulator's 8-byte pair stores (4 rows
  // × 32 bytes per half-warp) are conflict free, and so are the few-lanes routing's 16-byte
  // reads at 2 lanes per token (4 tokens × 2 lanes per quarter-warp, route_thread.cuh).
  static constexpr int kRedStride = kExperts + 8;
  // After it, one scratch row per token of a warp-routing pass (64 tokens), or the per-token
  // group keys of the few-lanes routing (kWide: those alone, 32 words a token; at E = 512 the
  // 64 rows would not fit beside the tile's).
  static constexpr int kScratchRows = kWide ? 8 : 64;
  static constexpr int kRedBytes = (kTileT + kScratchRows) * kRedStride * int(sizeof(float));

  struct alignas(1024) SharedStorage {
    // Pipeline buffers during the main loop, reduction buffer after it.
    union alignas(1024) {
      struct {
        alignas(1024) Elem x[cosize_v<SmemLayoutX>];
        alignas(1024) Elem w[cosize_v<SmemLayoutW>];
      } pipe;
      alignas(16) float red[(kTileT + kScratchRows) * kRedStride];
    } buf;
    alignas(16) int counts[kExperts];    // per-expert token counts of the CTA (optional output)
    alignas(16) float bias[kExperts];    // the correction bias, for the routing
    alignas(8) uint64_t full[kStages];   // TMA landed (expect-tx)
    alignas(8) uint64_t empty[kStages];  // both consumer warpgroups done reading
  };
  static_assert(sizeof(SharedStorage::buf) >= kRedBytes, "reduction buffer");
  static_assert(kStageBytes == (cosize_v<SmemLayoutX> + cosize_v<SmemLayoutW>) * 2 / kStages,
                "TMA transaction bytes per stage");
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

}  // namespace moe_routing::kernels::fused_forward
