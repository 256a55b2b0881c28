// The fused backward's consumer main loop, per unit n (its x tile and G in their stages):
//   dgrad  grad_xᵀ(h, t)  = Σ_e wᵀ(h, e) · G(t, e)    A = wᵀ (registers), B = sG
//   wgrad  grad_wᵀ(h, e) += Σ_t xᵀ(h, t) · G(t, e)    A = sX, B = sGᵀ
// each issued as one wgmma batch. The kernel orders them (and waits on them): see its loops.
//
// Barriers (pipeline.cuh), per unit n: x_full and g_full are waited on here; x_empty (wgrad's
// threads) and g_empty (every consumer thread) are arrived on once the unit's wgmmas have read
// the stages.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "kernels/fused_backward/config.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

// wᵀ of `slice` into dgrad's register fragment (tDgW: the thread's partition of every slice).
template <class TDgW, class TDrW>
__device__ __forceinline__ void load_w_slice(const TDgW& tDgW, TDrW& tDrW, int64_t slice) {
  Tensor src = tDgW(_, _, _, slice);
  CUTE_UNROLL
  for (int i = 0; i < size(tDrW); ++i) tDrW(i) = src(i);
}

// Unit n's x tile and G are in their stages.
template <class Cfg>
__device__ __forceinline__ void wait_unit(typename Cfg::SharedStorage& smem, int n, int ct) {
  Ring<Cfg::kStagesX>::wait(smem.x_full, n);
  MOE_ROUTING_TRACE(ct == 0 && n == 0, 10);
  MOE_ROUTING_TRACE(ct % 128 == 0 && n < kTraceUnits, kTraceHasX + kTraceUnits * (ct / 128) + n);
  Ring<Cfg::kStagesG>::wait(smem.g_full, n);
}

// This thread is done with unit n's stages (both GEMMs have read them).
template <class Cfg>
__device__ __forceinline__ void release_unit(typename Cfg::SharedStorage& smem, int n) {
  Ring<Cfg::kStagesX>::arrive(smem.x_empty, n);
  Ring<Cfg::kStagesG>::arrive(smem.g_empty, n);
}

// dgrad of unit n into acc_d (overwritten), one batch. tDrW: wᵀ's slice as a register fragment,
// or as shared-memory descriptors (fused_backward_wide).
template <class Cfg, class MmaD, class TDrW, class TDrG, class AccD>
__device__ __forceinline__ void issue_dgrad(MmaD& mma_d, TDrW& tDrW, const TDrG& tDrG,
                                            AccD& acc_d, int n) {
  const int s = Ring<Cfg::kStagesG>::stage(n);
  if constexpr (std::is_same_v<typename TDrW::value_type, typename Cfg::Elem>)
    warpgroup_fence_operand(tDrW);  // (registers)
  warpgroup_fence_operand(acc_d);
  warpgroup_arrive();
  mma_d.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tDrW); ++k) {
    gemm(mma_d, tDrW(_, _, k), tDrG(_, _, k, s), acc_d);
    mma_d.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// wgrad of unit n added into acc_w, one batch.
template <class Cfg, class MmaW, class TWrX, class TWrGt, class AccW>
__device__ __forceinline__ void issue_wgrad(MmaW& mma_w, const TWrX& tWrX, const TWrGt& tWrGt,
                                            AccW& acc_w, int n) {
  const int xs = Ring<Cfg::kStagesX>::stage(n), gs = Ring<Cfg::kStagesG>::stage(n);
  warpgroup_fence_operand(acc_w);
  warpgroup_arrive();
  static_assert(Cfg::kWgradSteps == size<2>(TWrX{}), "k");
  CUTE_UNROLL
  for (int k = 0; k < Cfg::kWgradSteps; ++k) gemm(mma_w, tWrX(_, _, k, xs), tWrGt(_, _, k, gs), acc_w);
  warpgroup_commit_batch();
}

}  // namespace moe_routing::kernels::fused_backward
