// The wide fused backward's producer warpgroup: the TMA loads of wᵀ's slice and of each unit's x
// tile (thread 0), and G per unit from the packed rows (rows.cuh), two threads a row, into
// kStagesG shared-memory stages.
//
// Barriers (pipeline.cuh), per unit n:
//   x_full   1 arrival (the TMA issuer's expect-tx) + the tile's bytes
//   x_empty  both wgrad warpgroups' threads, once their wgmmas have read the tile
//   g_full   kBuilders arrivals (every builder, its half row stored and fenced)
//   g_empty  every consumer thread, once all three warpgroups' GEMMs have read the stage
// and once per launch w_full (expect-tx of the slice's bytes).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/fused_backward/schedule.cuh"
#include "kernels/fused_backward_wide/config.cuh"
#include "kernels/fused_backward_wide/rows.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_backward_wide {

using namespace cute;
using fused_backward::CtaWork;
using fused_backward::UnitCursor;

// Thread 0: unit n's x tile (unit (slice, tile)), once its stage is free.
template <class Cfg, class P>
__device__ __forceinline__ void load_x_tile(const P& p, typename Cfg::SharedStorage& smem, int n,
                                            const UnitCursor& unit) {
  using XRing = Ring<Cfg::kStagesX>;
  Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});  // (h, t, stage)
  Tensor mX = p.tma_x.get_tma_tensor(make_shape(p.hidden, p.tokens));           // (H, T)
  Tensor gX = local_tile(mX, Shape<Int<Cfg::kTileH>, Int<Cfg::kTileT>>{},
                         make_coord(_, _));  // (h, t, slice, tile)
  auto part = tma_partition(p.tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                            group_modes<0, 2>(gX));
  const int s = XRing::stage(n);
  XRing::wait_free(smem.x_empty, n);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.x_full[s], Cfg::kXBytes);
  copy(p.tma_x.with(smem.x_full[s]), get<0>(part)(_, unit.slice, unit.tile), get<1>(part)(_, s));
}

// Thread 0: wᵀ of `slice`, two boxes of 64 h × E/2 e (rows beyond E arrive as zeros).
template <class Cfg, class P>
__device__ __forceinline__ void load_w_slice(const P& p, typename Cfg::SharedStorage& smem,
                                             int slice) {
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.w_full,
                                                                 2 * Cfg::kWHalfBytes);
  Tensor mW = p.tma_w.get_tma_tensor(make_shape(p.hidden, p.experts));  // (H, E)
  Tensor gW = local_tile(mW, Shape<Int<Cfg::kTileH>, Int<Cfg::kHalfE>>{},
                         make_coord(_, _));  // (h, e, slice, half)
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    Tensor sW = make_tensor(make_smem_ptr(smem.w + half * cosize_v<typename Cfg::SmemLayoutWHalf>),
                            typename Cfg::SmemLayoutWHalf{});  // (h, e)
    auto part = tma_partition(p.tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW),
                              group_modes<0, 2>(gW));
    copy(p.tma_w.with(smem.w_full), get<0>(part)(_, slice, half), get<1>(part));
  }
}

// x is issued kAhead units before G: the kernel issues units [0, kAhead) before the rows are
// packed, the producer the rest.
template <class Cfg>
constexpr int kXAhead = Cfg::kStagesX - Cfg::kStagesG;

// The producer warpgroup's thread `thread` (0..127) over the CTA's units, once every row is
// packed.
template <class Cfg, class P>
__device__ __forceinline__ void produce_wide(const P& p, typename Cfg::SharedStorage& smem,
                                             const CtaWork& work, int thread) {
  using GRing = Ring<Cfg::kStagesG>;
  constexpr int kTileT = Cfg::kTileT;
  constexpr int kAhead = kXAhead<Cfg>;
  static_assert(kAhead >= 1, "x must run ahead of G");
  static_assert(Cfg::kStagesG == 2, "units in pairs, one per G stage");
  const int total = work.total, tiles = work.tiles;
  const int row = thread / 2, q = thread % 2;
  const uint32_t g_stages = cute::cast_smem_ptr_to_uint(smem.g);
  constexpr uint32_t kGStageBytes = kTileT * Cfg::kExperts * 2;
  UnitCursor x_unit(work.unit0, tiles);  // unit of the next x load
  for (int n = 0; n < kAhead; ++n) x_unit.next(tiles);

  // Each unit's half rows are loaded a unit ahead: their latency hides behind a whole build.
  UnitCursor g_unit(work.unit0, tiles);
  WideRowHalf next;
  auto load_rows = [&] {
    next.load(p.rows, int64_t(g_unit.tile) * kTileT + row, p.tokens, q);
    g_unit.next(tiles);
  };
  // Unit n into its stage; `prev`: the experts this thread set in that stage last time.
  auto build = [&](int n, uint4& prev) {
    const WideRowHalf cur = next;
    if (n + 1 < total) load_rows();
    GRing::wait_free(smem.g_empty, n);
    // (Unit n - kStagesG is released, and with it the x stage of unit n + kAhead.)
    if (thread == 0 && n + kAhead < total) {
      load_x_tile<Cfg>(p, smem, n + kAhead, x_unit);
      x_unit.next(tiles);
    }
    store_wide_half<kTileT>(g_stages + GRing::stage(n) * kGStageBytes, row, prev, cur);
    prev = cur.experts;
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes → wgmma reads
    GRing::arrive(smem.g_full, n);
    MOE_ROUTING_TRACE(thread == 0 && n == 0, 9);
  };
  const uint4 none = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  uint4 prev0 = none, prev1 = none;  // stage 0's, stage 1's
  if (total > 0) load_rows();
  for (int n = 0; n < total; n += 2) {
    build(n, prev0);
    if (n + 1 < total) build(n + 1, prev1);
  }
}

}  // namespace moe_routing::kernels::fused_backward_wide
