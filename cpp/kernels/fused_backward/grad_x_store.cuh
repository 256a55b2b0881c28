// grad_x of the fused backward: dgrad's accumulator (h, t) → bf16 → transposing 8×8 matrix
// stores into the staging (h, t), h contiguous → one TMA store per dgrad warpgroup of its
// 64 h × kTileT t box. One staging buffer: a unit's stores into it wait until the previous
// unit's TMA store has read it (staging_free, checked while the unit's GEMMs run).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/fused_backward/config.cuh"
#include "kernels/fused_backward/sync.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

template <class Cfg, class TmaGX, class TiledCopy, class ThrCopy, class TCsGX, class TSgGX,
          class TSsGX>
struct GradXStore {
  using Elem = typename Cfg::Elem;
  const TmaGX& tma_gx;
  TiledCopy copy_gx;
  ThrCopy thr_cp;
  TCsGX tCsGX;  // (CPY, CPY_M, CPY_N): this thread's part of the staging
  TSgGX tSgGX;  // (TMA, box h, tile): grad_x's boxes
  TSsGX tSsGX;  // (TMA): this warpgroup's box of the staging
  int wg;       // dgrad warpgroup (its named barrier, its box)
  bool leader;  // the warpgroup's thread 0 issues (and waits on) the TMA store

  // The staging is free once the previous unit's store has read it. Called while this unit's
  // GEMMs run, so that the warps' wait at the barrier overlaps them.
  __device__ __forceinline__ void staging_free() const {
    if (leader) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, kBarStore0 + wg);
  }

  // acc_d of unit (slice, tile) stored.
  template <class AccD>
  __device__ __forceinline__ void store(const AccD& acc_d, int64_t slice, int64_t tile) {
    Tensor frag = make_tensor_like<Elem>(acc_d);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_d); ++i) frag(i) = Elem(acc_d(i));
    copy(copy_gx, thr_cp.retile_S(frag), tCsGX);
    cutlass::arch::fence_view_async_shared();  // staging writes → TMA store reads
    cutlass::arch::NamedBarrier::sync(128, kBarStore0 + wg);
    if (leader) {
      if constexpr (Cfg::kRoleSplit) copy(tma_gx, tSsGX, tSgGX(_, slice, tile));
      else copy(tma_gx, tSsGX, tSgGX(_, 2 * slice + wg, tile));
      tma_store_arrive();
    }
  }
};

// The store of consumer thread `mma_thread` (dgrad's thread index) of warpgroup `wg`.
template <class Cfg, class P, class MmaD>
__device__ __forceinline__ auto make_grad_x_store(const P& p, typename Cfg::SharedStorage& smem,
                                                  const MmaD& mma_d, int mma_thread, int wg,
                                                  bool leader) {
  Tensor sGX = make_tensor(make_smem_ptr(smem.gx), typename Cfg::SmemLayoutGX{});  // (h, t)
  auto copy_gx = make_tiled_copy_C(typename Cfg::CopyGX{}, mma_d);
  auto thr_cp = copy_gx.get_thread_slice(mma_thread);
  Tensor tCsGX = thr_cp.partition_D(sGX);  // (CPY, CPY_M, CPY_N)
  Tensor sGXh = make_tensor(make_smem_ptr(smem.gx + (Cfg::kRoleSplit ? 0 : wg) *
                                                       cosize_v<typename Cfg::SmemLayoutGXHalf>),
                            typename Cfg::SmemLayoutGXHalf{});  // (h/2, t)
  Tensor mGX = p.tma_gx.get_tma_tensor(make_shape(p.hidden, p.tokens));  // (H, T)
  Tensor gGX = local_tile(mGX, Shape<Int<Cfg::kBoxH>, Int<Cfg::kBoxT>>{},
                          make_coord(_, _));  // (box h, box t, h box, t box)
  auto store_part = tma_partition(p.tma_gx, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sGXh),
                                  group_modes<0, 2>(gGX));
  Tensor tSgGX = get<0>(store_part);  // (TMA, half-slice, tile)
  Tensor tSsGX = get<1>(store_part);  // (TMA)
  return GradXStore<Cfg, std::decay_t<decltype(p.tma_gx)>, decltype(copy_gx), decltype(thr_cp),
                    decltype(tCsGX), decltype(tSgGX), decltype(tSsGX)>{
      p.tma_gx, copy_gx, thr_cp, tCsGX, tSgGX, tSsGX, wg, leader};
}

}  // namespace moe_routing::kernels::fused_backward
