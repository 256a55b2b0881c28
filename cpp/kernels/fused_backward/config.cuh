// Tile shapes, shared-memory layouts and tiled MMAs of the fused backward (sm90a).
//
// One CTA owns a kTileH-wide slice of hidden columns and a contiguous range of token tiles.
// Per token tile it holds, in shared memory:
//   sG  (t, e)  the routing gradient G, built by the producer warpgroup from the [T, K] inputs
//   sX  (h, t)  the x tile, by TMA
// and, for the whole range, sW (h, e), its slice of w. Two consumer warpgroups compute
//   dgrad  grad_x(t, h)  = Σ_e G(t, e) · w(e, h)      A = sG (K-major), B = sW (MN-major)
//   wgrad  grad_wᵀ(h, e) += Σ_t x(t, h) · G(t, e)     A = sX (MN-major), B = sGᵀ (MN-major)
// wgrad reads the same sG tile through a transposed view: the K-major SW64 atom of G, read
// column-wise, is the MN-major SW64 atom of Gᵀ.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace moe_routing::kernels::fused_backward {

using namespace cute;

template <int kExperts_, int kTopK_, int kStages_ = 2>
struct Config {
  static constexpr int kExperts = kExperts_;
  static constexpr int kTopK = kTopK_;
  static constexpr int kTileT = 128;  // tokens per tile: 64 per consumer warpgroup in dgrad
  static constexpr int kTileH = 128;  // hidden columns per CTA: 64 per warpgroup in wgrad
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = 2;  // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg moves registers between warpgroups of the CTA: the consumers can only gain what
  // the producer gives up from the 168 per thread of a 384-thread CTA, or they wait forever.
  static constexpr int kProducerRegs = 96;
  static constexpr int kConsumerRegs = 200;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * 168,
                "register reallocation must balance");

  static_assert(kExperts % 32 == 0 && kExperts <= 256, "E: SW64 atoms of 32, wgmma N <= 256");
  static_assert(kTopK % 4 == 0 && kTopK <= 16, "K: rows load as 16-byte vectors");

  using Elem = cutlass::bfloat16_t;
  using TileT = Int<kTileT>;
  using TileH = Int<kTileH>;
  using Experts = Int<kExperts>;
  using Stages = Int<kStages>;

  // (t, e, stage): K-major for dgrad's A.
  using SmemLayoutG = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Elem>{},
                                             Shape<TileT, Experts, Stages>{}));
  // (e, t, stage): the same bytes, as wgrad's MN-major B.
  using SmemLayoutGt = decltype(composition(
      SmemLayoutG{}, make_layout(Shape<Experts, TileT, Stages>{},
                                 make_stride(TileT{}, _1{}, Int<kTileT * kExperts>{}))));
  // (h, t, stage): x tile, h contiguous; wgrad's MN-major A.
  // Atoms ordered t-first so that a TMA box is 64 h × kTileT t.
  using SmemLayoutX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                             Shape<TileH, TileT, Stages>{}, Step<_2, _1, _3>{}));
  // (h, e): the CTA's slice of w, h contiguous; dgrad's MN-major B.
  using SmemLayoutW = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                             Shape<TileH, Experts>{}, Step<_2, _1>{}));
  // (h, t in half, half): grad_x staging for the TMA store, one half per consumer warpgroup.
  using SmemLayoutGX = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                              Shape<TileH, Int<kTileT / 2>, _2>{},
                                              Step<_2, _1, _3>{}));
  // (t, h): the staging seen as dgrad's accumulator tile.
  using SmemLayoutGXt = decltype(composition(
      SmemLayoutGX{}, make_layout(Shape<TileT, TileH>{}, make_stride(TileH{}, _1{}))));

  using MmaDgrad = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, TileH, _16>, GMMA::Major::K,
                                 GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  using MmaWgrad = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Experts, _16>, GMMA::Major::MN,
                                 GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));

  static constexpr int kXBytes = kTileT * kTileH * 2;
  static constexpr int kWBytes = kExperts * kTileH * 2;

  struct alignas(1024) SharedStorage {
    alignas(1024) Elem x[cosize_v<SmemLayoutX>];
    alignas(1024) Elem g[cosize_v<SmemLayoutG>];
    alignas(1024) Elem w[cosize_v<SmemLayoutW>];
    alignas(1024) Elem gx[cosize_v<SmemLayoutGX>];
    alignas(8) uint64_t full[kStages];   // x landed (TMA) and G built (producer threads)
    alignas(8) uint64_t empty[kStages];  // both GEMMs of the tile done
    alignas(8) uint64_t w_full;
    int last_split;  // this CTA reduces grad_w over the token splits
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

}  // namespace moe_routing::kernels::fused_backward
