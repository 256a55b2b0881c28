// The fused backward kernel (sm90a): routing gradient → dgrad and wgrad in one pass over x.
//
// Warp roles (three warpgroups, one CTA per SM):
//   producer   (warpgroup 0): TMA of w once and of x per tile; builds G per tile.
//   consumers  (warpgroups 1, 2): per tile, dgrad into registers → bf16 → TMA store of grad_x;
//              wgrad accumulated in registers over the CTA's token range.
// After the range, each CTA writes its grad_w partial; the last CTA of an h-slice (ticket in
// global memory) sums the partials in split order, so grad_w is bitwise deterministic.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "kernels/fused_backward/config.cuh"
#include "kernels/fused_backward/routing_grad_tile.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

template <class TmaX, class TmaW, class TmaGX>
struct Params {
  TmaX tma_x;    // x as (H, T)
  TmaW tma_w;    // w as (H, E)
  TmaGX tma_gx;  // grad_x as (H, T)
  const int32_t* topk_idx = nullptr;
  const float* topk_scores = nullptr;
  const float* grad_topk_weights = nullptr;
  float* grad_w = nullptr;    // [E, H]
  float* partials = nullptr;  // [splits, E, H] when splits > 1
  int* tickets = nullptr;     // [H / kTileH], zero between launches
  int64_t tokens = 0;
  int hidden = 0;
  float scale = 1.0f;
  bool norm = true;
  bool accumulate = false;
  int tiles = 0;            // token tiles
  int tiles_per_split = 0;  // token tiles per CTA
  int splits = 1;           // CTAs per h-slice
};

// Named barriers (0 is __syncthreads).
enum : uint32_t { kBarProducer = 1, kBarConsumers = 2, kBarStore0 = 3 };

template <class Cfg, class P>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fused_backward_sm90(__grid_constant__ const P p) {
  using Elem = typename Cfg::Elem;
  using Storage = typename Cfg::SharedStorage;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int kTileT = Cfg::kTileT, kTileH = Cfg::kTileH, kExperts = Cfg::kExperts;
  constexpr int kStages = Cfg::kStages;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int hc = blockIdx.x;     // h-slice
  const int split = blockIdx.y;  // token range
  const int tile_begin = split * p.tiles_per_split;
  const int tile_end = min(p.tiles, tile_begin + p.tiles_per_split);
  const int num_tiles = tile_end - tile_begin;

  Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});    // (h, t, stage)
  Tensor sG = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutG{});    // (t, e, stage)
  Tensor sGt = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutGt{});  // (e, t, stage)
  Tensor sW = make_tensor(make_smem_ptr(smem.w), typename Cfg::SmemLayoutW{});    // (h, e)
  Tensor sGX = make_tensor(make_smem_ptr(smem.gx), typename Cfg::SmemLayoutGX{});    // (h, t/2, 2)
  Tensor sGXt = make_tensor(make_smem_ptr(smem.gx), typename Cfg::SmemLayoutGXt{});  // (t, h)

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&smem.full[s], 128 + 1);  // producer threads + the TMA's expect-tx
      EmptyBarrier::init(&smem.empty[s], 128 * Cfg::kConsumers);
    }
    FullBarrier::init(&smem.w_full, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    const int thread = threadIdx.x;
    Tensor mX = p.tma_x.get_tma_tensor(make_shape(p.hidden, p.tokens));          // (H, T)
    Tensor gX = local_tile(mX, Shape<Int<kTileH>, Int<kTileT>>{}, make_coord(hc, _));  // (h, t, tile)
    auto [tXgX, tXsX] = tma_partition(p.tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                      group_modes<0, 2>(gX));  // (TMA, tile), (TMA, stage)
    if (thread == 0) {
      Tensor mW = p.tma_w.get_tma_tensor(make_shape(p.hidden, kExperts));           // (H, E)
      Tensor gW = local_tile(mW, Shape<Int<kTileH>, Int<kExperts>>{}, make_coord(hc, 0));  // (h, e)
      auto [tWgW, tWsW] = tma_partition(p.tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW),
                                        group_modes<0, 2>(gW));
      FullBarrier::arrive_and_expect_tx(&smem.w_full, Cfg::kWBytes);
      copy(p.tma_w.with(smem.w_full), tWgW, tWsW);
    }
    TokenRouting<Cfg::kTopK> next;
    auto load = [&](int tile) {
      next.load(p.topk_idx, p.topk_scores, p.grad_topk_weights, int64_t(tile) * kTileT + thread,
                p.tokens);
    };
    if (num_tiles > 0) load(tile_begin);
    for (int n = 0; n < num_tiles; ++n) {
      const int s = n % kStages;
      const uint32_t phase = (n / kStages) & 1;
      const TokenRouting<Cfg::kTopK> cur = next;
      if (n + 1 < num_tiles) load(tile_begin + n + 1);  // in flight while we wait
      EmptyBarrier::wait(&smem.empty[s], phase ^ 1);
      if (thread == 0) {
        FullBarrier::arrive_and_expect_tx(&smem.full[s], Cfg::kXBytes);
        copy(p.tma_x.with(smem.full[s]), tXgX(_, tile_begin + n), tXsX(_, s));
      }
      build_routing_grad_tile<kTileT, kExperts>(sG(_, _, s), thread, cur, p.scale, p.norm,
                                                kBarProducer);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes → wgmma reads
      FullBarrier::arrive(&smem.full[s]);
    }
  } else {
    // ------------------------------------------------------------------ consumers
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int ct = threadIdx.x - 128;  // consumer thread
    const int wg = ct / 128;           // consumer warpgroup
    typename Cfg::MmaDgrad mma_d;
    typename Cfg::MmaWgrad mma_w;
    auto thr_d = mma_d.get_thread_slice(ct);
    auto thr_w = mma_w.get_thread_slice(ct);

    Tensor tDsG = thr_d.partition_A(sG);    // (MMA, MMA_M, MMA_K, stage)
    Tensor tDsW = thr_d.partition_B(sW);    // (MMA, MMA_N, MMA_K)
    Tensor tWsX = thr_w.partition_A(sX);    // (MMA, MMA_M, MMA_K, stage)
    Tensor tWsGt = thr_w.partition_B(sGt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tDrG = thr_d.make_fragment_A(tDsG);
    Tensor tDrW = thr_d.make_fragment_B(tDsW);
    Tensor tWrX = thr_w.make_fragment_A(tWsX);
    Tensor tWrGt = thr_w.make_fragment_B(tWsGt);

    Tensor acc_d = partition_fragment_C(mma_d, Shape<Int<kTileT>, Int<kTileH>>{});    // (t, h)
    Tensor acc_w = partition_fragment_C(mma_w, Shape<Int<kTileH>, Int<kExperts>>{});  // (h, e)
    Tensor tDsGX = thr_d.partition_C(sGXt);  // this thread's (t, h) staging slots
    clear(acc_w);

    // grad_x store: (TMA, half) ← staging, (TMA, 2·tile + half) → global.
    Tensor mGX = p.tma_gx.get_tma_tensor(make_shape(p.hidden, p.tokens));
    Tensor gGX = local_tile(mGX, Shape<Int<kTileH>, Int<kTileT / 2>>{}, make_coord(hc, _));
    auto [tSgGX, tSsGX] = tma_partition(p.tma_gx, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sGX),
                                        group_modes<0, 2>(gGX));
    const bool store_leader = (ct % 128) == 0;

    FullBarrier::wait(&smem.w_full, 0);
    for (int n = 0; n < num_tiles; ++n) {
      const int s = n % kStages;
      const uint32_t phase = (n / kStages) & 1;
      FullBarrier::wait(&smem.full[s], phase);

      warpgroup_fence_operand(acc_d);
      warpgroup_fence_operand(acc_w);
      warpgroup_arrive();
      mma_d.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tDrG); ++k) {
        gemm(mma_d, tDrG(_, _, k, s), tDrW(_, _, k), acc_d);
        mma_d.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tWrX); ++k) gemm(mma_w, tWrX(_, _, k, s), tWrGt(_, _, k, s), acc_w);
      warpgroup_commit_batch();

      // dgrad done: stage grad_x while wgrad runs on.
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_d);
      if (store_leader) tma_store_wait<0>();  // the staging's previous store has read it
      cutlass::arch::NamedBarrier::sync(128, kBarStore0 + wg);
      Tensor tDrGX = make_fragment_like<Elem>(acc_d);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_d); ++i) tDrGX(i) = Elem(acc_d(i));
      copy(AutoVectorizingCopy{}, tDrGX, tDsGX);  // bf16 pairs: adjacent h
      cutlass::arch::fence_view_async_shared();  // staging writes → TMA store reads
      cutlass::arch::NamedBarrier::sync(128, kBarStore0 + wg);
      if (store_leader) {
        copy(p.tma_gx, tSsGX(_, wg), tSgGX(_, 2 * (tile_begin + n) + wg));
        tma_store_arrive();
      }

      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_w);
      EmptyBarrier::arrive(&smem.empty[s]);
    }
    if (store_leader) tma_store_wait<0>();

    // ---------------------------------------------------------------- grad_w
    const int64_t H = p.hidden;
    const int h0 = hc * kTileH;
    auto view = [&](float* base) {  // (h, e) of this CTA's slice
      return make_tensor(make_gmem_ptr(base + h0),
                         make_layout(Shape<Int<kTileH>, Int<kExperts>>{}, make_stride(_1{}, H)));
    };
    if (p.splits == 1) {
      Tensor tWgW = thr_w.partition_C(view(p.grad_w));
      CUTE_UNROLL
      for (int i = 0; i < size(acc_w); ++i)
        tWgW(i) = p.accumulate ? tWgW(i) + acc_w(i) : acc_w(i);
      return;
    }
    Tensor tWgP = thr_w.partition_C(view(p.partials + int64_t(split) * kExperts * H));
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i) tWgP(i) = acc_w(i);
    __threadfence();
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    if (ct == 0) smem.last_split = atomicAdd(p.tickets + hc, 1) == p.splits - 1;
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    if (!smem.last_split) return;
    __threadfence();
    // Sum the partials in split order: the same bits whichever CTA finishes last.
    constexpr int kVecsPerRow = kTileH / 4;
    for (int i = ct; i < kExperts * kVecsPerRow; i += 256) {
      const int e = i / kVecsPerRow, h = h0 + (i % kVecsPerRow) * 4;
      float4* dst = reinterpret_cast<float4*>(p.grad_w + e * H + h);
      float4 sum = p.accumulate ? *dst : make_float4(0.f, 0.f, 0.f, 0.f);
      for (int sp = 0; sp < p.splits; ++sp) {
        float4 v = __ldcg(reinterpret_cast<const float4*>(p.partials + (int64_t(sp) * kExperts + e) * H + h));
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
      *dst = sum;
    }
    if (ct == 0) p.tickets[hc] = 0;  // ready for the next launch
  }
}

}  // namespace moe_routing::kernels::fused_backward
