// The wide fused backward's dgrad, per unit n (its G in its stage, wᵀ's slice resident):
//   grad_xᵀ(h, t) = Σ_e wᵀ(h, e) · G(t, e)    A = sW (MN-major), B = sG (K-major)
// one wgmma batch of E / 16 k-steps. (wgrad is the fused backward's issue_wgrad, each warpgroup
// on its half of the experts.)
#pragma once

#include <cute/tensor.hpp>

#include "kernels/pipeline.cuh"

namespace moe_routing::kernels::fused_backward_wide {

using namespace cute;

template <class Cfg, class MmaD, class TDrW, class TDrG, class AccD>
__device__ __forceinline__ void issue_dgrad(MmaD& mma_d, const TDrW& tDrW, const TDrG& tDrG,
                                            AccD& acc_d, int n) {
  const int s = Ring<Cfg::kStagesG>::stage(n);
  static_assert(decltype(size<2>(tDrW))::value == Cfg::kExperts / 16, "k-steps: every expert");
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

}  // namespace moe_routing::kernels::fused_backward_wide
