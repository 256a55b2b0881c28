// The fused forward's main loop: TMA producer and wgmma consumers over the CTA's hidden blocks.
//
// Barriers per stage, block n in stage n % kStages (pipeline.cuh's Ring):
//   full   1 arrival (the producer's expect-tx) + the stage's TMA bytes
//   empty  128·kConsumers arrivals (every consumer thread, once its wgmmas read the stage)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/fused_forward/config.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_forward {

using namespace cute;
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// One thread: loads x and w of hidden blocks [kb_begin, kb_end) of token tile `tile`. w has
// `experts` rows (<= kExperts: the stage's rows beyond them arrive as zeros).
template <class Cfg, class TmaX, class TmaW>
__device__ void produce(typename Cfg::SharedStorage& smem, const TmaX& tma_x, const TmaW& tma_w,
                        int64_t tokens, int hidden, int experts, int tile, int kb_begin,
                        int kb_end) {
  using Stages = Ring<Cfg::kStages>;
  Tensor sX = make_tensor(make_smem_ptr(smem.buf.pipe.x), typename Cfg::SmemLayoutX{});  // (t, h, stage)
  Tensor mX = tma_x.get_tma_tensor(make_shape(tokens, hidden));                         // (T, H)
  Tensor mW = tma_w.get_tma_tensor(make_shape(experts, hidden));                         // (E, H)
  Tensor gX = local_tile(mX, Shape<typename Cfg::TileT, typename Cfg::TileH>{},
                         make_coord(tile, _));  // (t, h, kb)
  constexpr int kWBoxRows = Cfg::kWBoxRows, kWBoxes = Cfg::kWBoxes;
  Tensor gW = local_tile(mW, Shape<Int<kWBoxRows>, typename Cfg::TileH>{},
                         make_coord(_, _));  // (e, h, box, kb)
  auto [tXgX, tXsX] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                    group_modes<0, 2>(gX));  // (TMA, kb), (TMA, stage)
  for (int n = 0; kb_begin + n < kb_end; ++n) {
    const int s = Stages::stage(n);
    Stages::wait_free(smem.empty, n);
    // Out-of-bounds rows (token tail, masked experts) and columns (hidden tail) arrive as
    // zeros and count in full toward the transaction bytes.
    FullBarrier::arrive_and_expect_tx(&smem.full[s], Cfg::kStageBytes);
    // x is read once: evict first; w is read by every token tile: keep it in L2.
    copy(tma_x.with(smem.full[s], 0, TMA::CacheHintSm90::EVICT_FIRST), tXgX(_, kb_begin + n),
         tXsX(_, s));
    CUTE_UNROLL
    for (int b = 0; b < kWBoxes; ++b) {
      // Box b of the stage: rows [b · kWBoxRows, (b + 1) · kWBoxRows), contiguous in it (the
      // atoms of 8 rows stack along e, the stages after them), 1024-byte aligned: the
      // swizzle, of absolute address bits, is the stage's.
      Tensor sWb = make_tensor(
          make_smem_ptr(smem.buf.pipe.w + (s * Cfg::kExperts + b * kWBoxRows) * Cfg::kTileH),
          typename Cfg::SmemLayoutWBox{});  // (e, h)
      auto [tWgW, tWsW] = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sWb),
                                        group_modes<0, 2>(gW(_, _, b, _)));  // (TMA, kb), (TMA)
      copy(tma_w.with(smem.full[s], 0, TMA::CacheHintSm90::EVICT_LAST), tWgW(_, kb_begin + n),
           tWsW);
    }
  }
}

// The consumers' pipeline over `blocks` hidden blocks: per block, wait for its stage, issue(s)
// its wgmmas as one batch, keep one batch in flight and give the previous block's stage back.
// fence(): warpgroup_fence_operand on every accumulator.
template <class Cfg, class Fence, class Issue>
__device__ __forceinline__ void consume_blocks(typename Cfg::SharedStorage& smem, int ct,
                                               int blocks, Fence&& fence, Issue&& issue) {
  using Stages = Ring<Cfg::kStages>;
  for (int n = 0; n < blocks; ++n) {
    const int s = Stages::stage(n);
    Stages::wait(smem.full, n);
    MOE_ROUTING_TRACE(ct == 0 && n == 0, 2);
    fence();
    warpgroup_arrive();
    issue(s);
    warpgroup_commit_batch();
    // One batch in flight: the previous block's wgmmas are done, so its stage goes back.
    warpgroup_wait<1>();
    fence();
    if (n > 0) Stages::arrive(smem.empty, n - 1);
  }
  warpgroup_wait<0>();
  fence();
  // The last stage is not released: the producer has nothing left to load.
}

// Consumer thread `ct` (0..255): accumulates its part of logits(t, e) over the CTA's blocks.
// Needs kb_end > kb_begin (the accumulator starts with a zero-scaled wgmma).
template <class Cfg, class Acc>
__device__ void consume(typename Cfg::SharedStorage& smem, int ct, int kb_begin, int kb_end,
                        Acc& acc) {
  Tensor sX = make_tensor(make_smem_ptr(smem.buf.pipe.x), typename Cfg::SmemLayoutX{});  // (t, h, stage)
  Tensor sW = make_tensor(make_smem_ptr(smem.buf.pipe.w), typename Cfg::SmemLayoutW{});  // (e, h, stage)
  typename Cfg::Mma mma;
  auto thr = mma.get_thread_slice(ct);
  Tensor tCsX = thr.partition_A(sX);  // (MMA, MMA_M, MMA_K, stage)
  Tensor tCsW = thr.partition_B(sW);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tCrX = thr.make_fragment_A(tCsX);  // smem descriptors
  Tensor tCrW = thr.make_fragment_B(tCsW);

  mma.accumulate_ = GMMA::ScaleOut::Zero;
  consume_blocks<Cfg>(
      smem, ct, kb_end - kb_begin, [&] { warpgroup_fence_operand(acc); },
      [&](int s) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tCrX); ++k) {
          gemm(mma, tCrX(_, _, k, s), tCrW(_, _, k, s), acc);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
      });
}

// 192-token tiles (Cfg::kRowsHi = 64), as consume: warpgroup wg's 64 × E wgmma on rows
// [64·wg, 64·wg + 64) into acc_lo, both warpgroups' 64 × E/2 on rows [128, 192) into acc_hi.
template <class Cfg, class AccLo, class AccHi>
__device__ void consume_tall(typename Cfg::SharedStorage& smem, int ct, int kb_begin, int kb_end,
                             AccLo& acc_lo, AccHi& acc_hi) {
  static_assert(Cfg::kRowsHi == 64 && Cfg::kTileT == 192, "192-token tiles");
  Tensor sX = make_tensor(make_smem_ptr(smem.buf.pipe.x), typename Cfg::SmemLayoutX{});  // (t, h, stage)
  Tensor sW = make_tensor(make_smem_ptr(smem.buf.pipe.w), typename Cfg::SmemLayoutW{});  // (e, h, stage)
  Tensor sXlo = local_tile(sX, typename Cfg::Rows64{}, make_coord(ct / 128, 0, 0));  // (64, h, stage)
  Tensor sXhi = local_tile(sX, typename Cfg::Rows64{}, make_coord(2, 0, 0));         // (64, h, stage)
  typename Cfg::MmaRow mma_lo;
  typename Cfg::MmaHi mma_hi;
  auto thr_lo = mma_lo.get_thread_slice(ct % 128);
  auto thr_hi = mma_hi.get_thread_slice(ct);
  Tensor tLrX = thr_lo.make_fragment_A(thr_lo.partition_A(sXlo));  // (MMA, MMA_M, MMA_K, stage)
  Tensor tLrW = thr_lo.make_fragment_B(thr_lo.partition_B(sW));    // (MMA, MMA_N, MMA_K, stage)
  Tensor tHrX = thr_hi.make_fragment_A(thr_hi.partition_A(sXhi));
  Tensor tHrW = thr_hi.make_fragment_B(thr_hi.partition_B(sW));

  mma_lo.accumulate_ = GMMA::ScaleOut::Zero;
  mma_hi.accumulate_ = GMMA::ScaleOut::Zero;
  consume_blocks<Cfg>(
      smem, ct, kb_end - kb_begin,
      [&] {
        warpgroup_fence_operand(acc_lo);
        warpgroup_fence_operand(acc_hi);
      },
      [&](int s) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tLrX); ++k) {
          gemm(mma_lo, tLrX(_, _, k, s), tLrW(_, _, k, s), acc_lo);
          gemm(mma_hi, tHrX(_, _, k, s), tHrW(_, _, k, s), acc_hi);
          mma_lo.accumulate_ = GMMA::ScaleOut::One;
          mma_hi.accumulate_ = GMMA::ScaleOut::One;
        }
      });
}

}  // namespace moe_routing::kernels::fused_forward
