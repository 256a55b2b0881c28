// Tile shapes, shared-memory layouts and tiled MMAs of the wide fused backward (sm90a): up to 512
// experts and 16 slots a token, where the fused backward's budgets (fused_backward/config.cuh: a
// G stage of 128 tokens, grad_w of every expert in one warpgroup's registers) no longer fit.
//
// Work unit: one 64-token tile of one 64-column slice of hidden columns. Per unit a CTA holds in
// shared memory
//   sX  (h, t)  the x tile, by TMA                                     kStagesX deep
//   sG  (t, e)  the routing gradient G, built by the producer          kStagesG deep
//   sW  (h, e)  wᵀ of the CTA's slice, by TMA once                     (dgrad's A)
// and four warpgroups:
//   0  producer: x's TMA loads (thread 0) and G from the packed rows, two threads a row;
//   1  dgrad   grad_xᵀ(h, t)  = Σ_e wᵀ(h, e) · G(t, e)       A = sW (MN-major), B = sG (K-major)
//              and, above 384 experts, wgrad of the first kDgradWgradE experts;
//   2  wgrad   grad_wᵀ(h, e) += Σ_t xᵀ(h, t) · G(t, e) of kWgradE experts   A = sX, B = sGᵀ
//   3  wgrad   of the next kWgradE experts.
// With 512 threads ptxas compiles every instruction within the entry count of 128 registers a
// thread (setmaxnreg does not raise it: 64 × 256 accumulators, "insufficient registers (128)
// ... register target of 154"), so no warpgroup holds more than 64 × 192 f32 accumulators (96
// registers): 384 experts are 2 × 192, 512 are 128 (beside dgrad's 64 × 64) + 2 × 192. wᵀ's slice
// (48 or 64 KB) stays in shared memory. kExperts is the kernel's width: any E up to it, a
// multiple of 16, runs on it, w's rows beyond E read as zeros (TMA bounds) and grad_w's never
// written.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/fused_backward/schedule.cuh"

namespace moe_routing::kernels::fused_backward_wide {

using namespace cute;

using fused_backward::kWideTopK;  // the slots of a token's row: any K up to 16

template <int kExperts_, int kStagesX_ = 3, int kStagesG_ = 2>
struct Config {
  static constexpr int kExperts = kExperts_;
  static constexpr int kHalfE = kExperts / 2;  // experts per TMA box of wᵀ
  // wgrad's experts: [0, kDgradWgradE) in the dgrad warpgroup, then kWgradE in each wgrad one.
  static constexpr int kDgradWgradE = kExperts > 384 ? kExperts - 384 : 0;
  static constexpr int kWgradE = (kExperts - kDgradWgradE) / 2;
  static constexpr bool kDgradWgrad = kDgradWgradE > 0;
  static constexpr int kTopK = kWideTopK;
  static constexpr int kTileT = 64;
  static constexpr int kTileH = 64;
  static constexpr int kStagesX = kStagesX_;
  static constexpr int kStagesG = kStagesG_;
  static_assert(kExperts % 64 == 0 && kHalfE <= 256, "E / 2: a TMA box of at most 256");
  static_assert(kWgradE % 32 == 0 && kDgradWgradE % 32 == 0,
                "each warpgroup's wgrad experts are whole SW64 atoms");
  static_assert(kWgradE <= 192 && kDgradWgradE <= 128,
                "accumulators within the 128 registers of a 512-thread kernel");
  static_assert(kStagesG >= 2 && kStagesX > kStagesG, "x runs ahead of G");

  // The names the shared pieces of the fused backward read (grad_x_store.cuh, grad_w_sum.cuh,
  // mainloop.cuh): one dgrad warpgroup of whole units, the wgrad warpgroups' grad_w staged in
  // shared memory, the inputs of any dtype and K.
  static constexpr bool kRoleSplit = true;
  static constexpr bool kAnyK = true;
  static constexpr bool kMaskedExperts = true;  // E given at run time (Params::experts)
  // Vectors a thread sums at once in a share of grad_w (grad_w_sum.cuh): 4 sources' worth in
  // flight within 128 registers.
  static constexpr int kSumMaxPer = 4;
  static constexpr int kWgradN = kWgradE;
  static constexpr int kWgradSteps = kTileT / 16;
  static constexpr int kConsumers = 3;  // dgrad + two wgrad warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBuilders = 128;  // two producer threads per G row
  static_assert(kBuilders == 2 * kTileT, "a G row is built by two threads, 8 slots each");
  // The warpgroups that read each x stage (x_empty's arrivals).
  static constexpr int kXReaders = 128 * (kDgradWgrad ? 3 : 2);

  using Elem = cutlass::bfloat16_t;
  using TileT = Int<kTileT>;
  using TileH = Int<kTileH>;
  using Experts = Int<kExperts>;
  using HalfE = Int<kHalfE>;

  // (t, e, stage): K-major SW64, dgrad's B; the producer's offsets (RoutingGradRow) are these.
  using SmemLayoutG = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Elem>{},
                                             Shape<TileT, Experts, Int<kStagesG>>{}));
  // (e, t, stage) of kN experts: the same bytes as wgrad's MN-major B, from the first of a
  // warpgroup's experts e0 on (a whole number of SW64 atoms, so that the tensor starting at
  // &G(0, e0) keeps the swizzle).
  template <int kN>
  using SmemLayoutGtPart = decltype(composition(
      SmemLayoutG{}, make_layout(Shape<Int<kN>, TileT, Int<kStagesG>>{},
                                 make_stride(TileT{}, _1{}, Int<kTileT * kExperts>{}))));
  // (h, t, stage): x tile, h contiguous; wgrad's MN-major A; a TMA box is 64 h × kTileT t.
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                             Shape<TileH, TileT, Int<kStagesX>>{},
                                             Step<_2, _1, _3>{}));
  // (h, e): wᵀ's slice, h contiguous (w is [E, H]); dgrad's MN-major A. Loaded as two TMA boxes
  // of 64 h × E/2 e (a box is at most 256 elements a side), each a contiguous half.
  using SmemLayoutW = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                             Shape<TileH, Experts>{}, Step<_2, _1>{}));
  using SmemLayoutWHalf = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                                 Shape<TileH, HalfE>{}, Step<_2, _1>{}));
  static_assert(2 * cosize_v<SmemLayoutWHalf> == cosize_v<SmemLayoutW>, "two halves");
  // (h, t): grad_x staging for the TMA store, one box of 64 h × kTileT t.
  static constexpr int kBoxH = 64;
  static constexpr int kBoxT = kTileT;
  using SmemLayoutGX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                              Shape<TileH, TileT>{}, Step<_2, _1>{}));
  using SmemLayoutGXHalf = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                                  Shape<Int<kBoxH>, Int<kBoxT>>{}));
  static_assert(cosize_v<SmemLayoutGX> == cosize_v<SmemLayoutGXHalf>, "one box");

  using One = Layout<Shape<_1, _1, _1>>;
  using MmaDgrad = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, TileT, _16>, GMMA::Major::MN,
                                 GMMA::Major::K>(),
      One{}));
  using MmaWgrad = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kWgradE>, _16>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
      One{}));
  static_assert(size<1>(typename MmaWgrad::AtomShape_MNK{}) == kWgradE, "wgrad: N");
  // The dgrad warpgroup's share of wgrad (kDgradWgrad; else an unused 32).
  static constexpr int kDgradWgradN = kDgradWgrad ? kDgradWgradE : 32;
  using MmaWgradD = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kDgradWgradN>, _16>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
      One{}));
  static_assert(size<1>(typename MmaDgrad::AtomShape_MNK{}) == kTileT, "dgrad: N");
  using CopyGX = Copy_Atom<SM90_U16x8_STSM_T, Elem>;

  static constexpr int kXBytes = kTileT * kTileH * 2;
  static constexpr int kWHalfBytes = kTileH * kHalfE * 2;
  // Row stride (floats) of the staged grad_w (conflict-free accumulator stores).
  static constexpr int kRedStride = kTileH + 4;
  static_assert(kRedStride % 32 == 4, "conflict-free accumulator stores");

  struct alignas(1024) SharedStorage {
    alignas(1024) Elem x[cosize_v<SmemLayoutX>];
    // g and w adjacent: once the last unit's GEMMs are done, grad_w is staged across both
    // (grad_w_region).
    alignas(1024) Elem g[cosize_v<SmemLayoutG>];
    alignas(1024) Elem w[cosize_v<SmemLayoutW>];
    alignas(1024) Elem gx[cosize_v<SmemLayoutGX>];
    alignas(8) uint64_t x_full[kStagesX];   // x landed (TMA transaction count)
    alignas(8) uint64_t x_empty[kStagesX];  // the warpgroups that read it are done with it
    alignas(8) uint64_t g_full[kStagesG];   // G built (builder threads)
    alignas(8) uint64_t g_empty[kStagesG];  // all three consumer warpgroups done with it
    alignas(8) uint64_t w_full;             // wᵀ's slice landed
    alignas(8) uint64_t grad_w_staged;      // kDgradWgrad: the dgrad warpgroup's grad_w staged
  };
  static_assert(sizeof(SharedStorage::g) % 1024 == 0, "w follows g");
  // grad_w [E][kRedStride] f32, staged over g and w.
  static constexpr int kStagedBytes = kExperts * kRedStride * 4;
  static_assert(kStagedBytes <= int(sizeof(SharedStorage::g) + sizeof(SharedStorage::w)),
                "staged grad_w fits over G and w");
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

}  // namespace moe_routing::kernels::fused_backward_wide
