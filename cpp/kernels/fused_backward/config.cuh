// Tile shapes, shared-memory layouts and tiled MMAs of the fused backward (sm90a). ("backward v19"
// and the like name the sections of docs/perf-log/backward.md that measured a choice.)
//
// Work unit: one kTileT-token tile of one kTileH-wide slice of hidden columns. Per unit a CTA
// holds in shared memory
//   sX  (h, t)  the x tile, by TMA                                     kStagesX deep
//   sG  (t, e)  the routing gradient G, built by producer threads      kStagesG deep
// and in registers the slice of w as wᵀ (h, e), loaded once per slice. Two consumer
// warpgroups compute
//   dgrad  grad_xᵀ(h, t)  = Σ_e wᵀ(h, e) · G(t, e)    A = wᵀ (registers), B = sG (K-major)
//   wgrad  grad_wᵀ(h, e) += Σ_t xᵀ(h, t) · G(t, e)    A = sX (MN-major),  B = sGᵀ (MN-major)
// kTileH = 128: each warpgroup owns 64 hidden columns of both GEMMs. kTileH = 64 (small T, and
// 256 experts at every T: twice the slices, half the work per unit; kRoleSplit): warpgroup 0
// computes dgrad and warpgroup 1 wgrad, each of the whole unit.
// wgrad reads the same sG tile through a transposed view: the K-major SW64 atom of G, read
// column-wise, is the MN-major SW64 atom of Gᵀ. With w in registers, shared memory holds a
// third x stage instead, and the tensor cores read 40 KB less of it per unit.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/fused_backward/schedule.cuh"
#include "kernels/routing_inputs.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

template <int kExperts_, int kTopK_, int kTileH_ = 128, int kStagesX_ = 3, int kStagesG_ = 2>
struct Config {
  static constexpr int kExperts = kExperts_;
  static constexpr bool kAnyK = kTopK_ == kAnyTopK;  // (schedule.cuh)
  static constexpr int kTopK = kAnyK ? 8 : kTopK_;  // K, or the most K: slots per token
  static constexpr int kTileT = 128;      // tokens per unit
  static constexpr int kTileH = kTileH_;  // hidden columns per unit
  static_assert(kTileH == 128 || kTileH == 64, "a slice is one or two warpgroups' 64 rows");
  // kTileH = 128: the consumer warpgroups split the unit's hidden columns. kTileH = 64: they
  // split the unit's GEMMs by role, not by data: warpgroup 0 computes dgrad of all the unit's
  // tokens (w's fragment, E / 4 registers per thread, and grad_x's accumulators, 64),
  // warpgroup 1 wgrad of all the experts (grad_w's accumulators, E / 2). Split by data (each
  // warpgroup 64 tokens of both GEMMs; with 256 experts half the experts of wgrad), the kernels
  // ran 1-7% slower with 64 to 160 experts and 8-22% slower with 256
  // (docs/perf-log/backward.md v19, v20).
  static constexpr bool kRoleSplit = kTileH == 64;
  static constexpr int kDgradN = kTileT;    // per warpgroup
  static constexpr int kWgradN = kExperts;  // per warpgroup
  static constexpr int kWgradSteps = kTileT / 16;  // k-steps (16 tokens) of wgrad per unit
  // Units ahead of the routing loads that their rows are prefetched into L1 (3: the best of
  // 1, 2, 3 and 5 on an H200), in CTAs of at least kRoutingPrefetchMinUnits units.
  static constexpr int kRoutingPrefetch = 3;
  static constexpr int kRoutingPrefetchMinUnits = 32;
  // The consumer warpgroups may start a launch out of step (warpgroup 1 once warpgroup 0's first
  // grad_x is out): the 128-column any-K kernels, where K < 8 (Params::skew; backward v18:
  // 0.1-3.7% faster on the top-6 shapes; slower with K = 8 at E = 160). (The role-split
  // kernels' warpgroups run out of step by their roles.)
  static constexpr bool kSkew = kAnyK && !kRoleSplit;
  // Compact rows (producer.cuh) for the any-K inputs that are not PyTorch's K = 8 rows: the
  // 64-column kernels from 128 experts (backward v29: dots.llm1's top-6 backward at T = 1024
  // 2.16x -> 1.68x its ceiling; at 64 experts per-unit loading stayed faster): kernels::
  // compacts_any_rows, which the host's plan asks too. The PyTorch format is compacted by every
  // any-K kernel.
  static constexpr bool kCompactAnyRows = kAnyK && compacts_any_rows(kExperts, kTileH);
  // The compaction's PyTorch rows loaded by quads of lanes (routing_grad_tile.cuh load_quad):
  // 0.1-0.5 us faster a call on the 64-column plans, 0.9-2.5 us slower on the 128-column ones
  // (backward v29); measured at 128 and 160 experts (E = 256's producer already spills).
  static constexpr bool kQuadRows = kAnyK && kRoleSplit && kExperts >= 128 && kExperts <= 160;
  static constexpr bool kMaskedExperts = false;  // (fused_backward_wide: E below the kernel's)
  // Vectors a thread sums at once in a share of grad_w (grad_w_sum.cuh): 10, the most of these
  // kernels' shares (E = 160, 128 columns, k = 2), so that theirs are never cut.
  static constexpr int kSumMaxPer = 10;
  static constexpr int kStagesX = kStagesX_;
  static constexpr int kStagesG = kStagesG_;
  static constexpr int kConsumers = 2;  // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Producer warpgroup: one G row per thread.
  static constexpr int kBuilders = 128;
  static_assert(kBuilders == kTileT, "one builder per token of the tile");
  // setmaxnreg moves registers between warpgroups of the CTA: the consumers can only gain what
  // the producer gives up from the 168 per thread of a 384-thread CTA, or they wait forever.
  // kRoleSplit with 256 experts: 56 / 224 (the producer spills 8 bytes) ran 1.4-4% faster at
  // T = 2048-16384 than 72 / 216 (no spills) on DeepSeek-V3's shape (backward
  // v19).
  static constexpr bool kWideRoleSplit = kRoleSplit && kExperts > 192;
  static constexpr int kProducerRegs = kWideRoleSplit ? 56 : 72;
  static constexpr int kConsumerRegs = kWideRoleSplit ? 224 : 216;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * 168,
                "register reallocation must balance");

  static_assert(kExperts % 32 == 0 && kExperts <= 256, "E: SW64 atoms of 32, wgmma N <= 256");
  static_assert(kRoleSplit || kExperts <= 160, "kTileH = 128: two G stages and grad_w in registers");
  static_assert(kExperts <= 256, "previous indices are kept as bytes");
  static_assert(kTopK % 4 == 0 && kTopK <= 16, "K slots: 16-byte vectors of a row");
  static_assert(kStagesG >= 2 && kStagesX >= kStagesG, "x runs at least as far ahead as G");

  using Elem = cutlass::bfloat16_t;
  using TileT = Int<kTileT>;
  using TileH = Int<kTileH>;
  using Experts = Int<kExperts>;

  // (t, e, stage): K-major, dgrad's B. (routing_grad_tile.cuh computes these offsets itself.)
  using SmemLayoutG = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Elem>{},
                                             Shape<TileT, Experts, Int<kStagesG>>{}));
  // (e, t, stage): the same bytes, as wgrad's MN-major B.
  using SmemLayoutGt = decltype(composition(
      SmemLayoutG{}, make_layout(Shape<Int<kWgradN>, TileT, Int<kStagesG>>{},
                                 make_stride(TileT{}, _1{}, Int<kTileT * kExperts>{}))));
  // (h, t, stage): x tile, h contiguous; wgrad's MN-major A.
  // Atoms ordered t-first so that a TMA box is 64 h × kTileT t.
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                             Shape<TileH, TileT, Int<kStagesX>>{},
                                             Step<_2, _1, _3>{}));
  // (h, t): grad_x staging for the TMA store, h contiguous; atoms t-first, so each consumer
  // warpgroup's 64 hidden columns are one contiguous 64 h × kTileT t box.
  using SmemLayoutGX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                              Shape<TileH, TileT>{}, Step<_2, _1>{}));
  // (h, t): one warpgroup's half of the staging (64 h × the unit's tokens), contiguous, the TMA
  // store's box; kRoleSplit: the whole staging, warpgroup 0's 64 h × kTileT t.
  static constexpr int kBoxH = 64;
  static constexpr int kBoxT = kTileT;
  using SmemLayoutGXHalf = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                                  Shape<Int<kBoxH>, Int<kBoxT>>{}));
  static_assert(cosize_v<SmemLayoutGX> == (kRoleSplit ? 1 : 2) * cosize_v<SmemLayoutGXHalf>,
                "one box per dgrad warpgroup");

  // The warpgroups side by side along h (M); kRoleSplit: one.
  using DgradWarpgroups =
      std::conditional_t<kRoleSplit, Layout<Shape<_1, _1, _1>>, Layout<Shape<_2, _1, _1>>>;
  using MmaDgrad = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kDgradN>, _16>,
                                 GMMA::Major::K, GMMA::Major::K>(),
      DgradWarpgroups{}));
  // kRoleSplit: warpgroup 1's alone.
  using WgradWarpgroups =
      std::conditional_t<kRoleSplit, Layout<Shape<_1, _1, _1>>, Layout<Shape<_2, _1, _1>>>;
  using MmaWgrad = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kWgradN>, _16>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
      WgradWarpgroups{}));
  // One wgmma spans a warpgroup's experts: a narrower one would re-read the x tile once per N
  // block. (CuTe selects N = 160 only with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, set by the
  // build.)
  static_assert(size<1>(typename MmaWgrad::AtomShape_MNK{}) == kWgradN, "wgrad: N");
  static_assert(size<1>(typename MmaDgrad::AtomShape_MNK{}) == kDgradN, "dgrad: N");
  // grad_xᵀ accumulator (h, t) → staging with h contiguous: transposing 8×8 matrix stores.
  using CopyGX = Copy_Atom<SM90_U16x8_STSM_T, Elem>;

  static constexpr int kXBytes = kTileT * kTileH * 2;
  // Row stride (floats) of a grad_w partial in shared memory (spread and cluster sums): the
  // accumulator's stores (8 h × 4 e per warp) then hit 32 distinct banks.
  static constexpr int kRedStride = kTileH + 4;
  static_assert(kRedStride % 32 == 4, "conflict-free accumulator stores");

  struct alignas(1024) SharedStorage {
    alignas(1024) Elem x[cosize_v<SmemLayoutX>];
    alignas(1024) Elem g[cosize_v<SmemLayoutG>];
    alignas(1024) Elem gx[cosize_v<SmemLayoutGX>];
    // Experts each builder set in a G stage, so that it clears just those next time.
    alignas(16) uint8_t set_experts[kStagesG][kTileT][kTopK];
    // kAnyK: each builder's row of staged indices, up to kTopK int64 (routing_grad_tile.cuh:
    // stage_indices).
    alignas(16) uint8_t idx_rows[kAnyK ? kTileT : 1][kTopK * 8];
    alignas(8) uint64_t x_full[kStagesX];   // x landed (TMA transaction count)
    alignas(8) uint64_t x_empty[kStagesX];  // wgrad done with it
    alignas(8) uint64_t g_full[kStagesG];   // G built (builder threads)
    alignas(8) uint64_t g_empty[kStagesG];  // both GEMMs done with it
    int last_contributor;  // this CTA reduces grad_w of the slice it just finished
    alignas(8) uint64_t skew;  // kSkew: warpgroup 0's first grad_x is out
    alignas(8) uint64_t grad_w_staged;  // kRoleSplit: warpgroup 1's grad_w is staged in sG
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

}  // namespace moe_routing::kernels::fused_backward
