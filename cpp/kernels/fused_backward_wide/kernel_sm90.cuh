// The wide fused backward kernel (sm90a): up to 512 experts and top-16, routing gradient →
// dgrad and wgrad in one pass over x (config.cuh has the tiles and the warpgroups' roles).
//
// Persistent: one CTA per SM walks its range of units (one 64-column slice, or a k-th of one),
// fused_backward/schedule.cuh. Every launch first packs each token's row of G once (rows.cuh: all
// threads of all CTAs, then a grid barrier) while the TMA brings wᵀ's slice and the first x
// tile; then, per unit,
//   producer   warpgroup 0 (producer.cuh): x's TMA loads and G, two threads a row;
//   dgrad      warpgroup 1 (fused_backward/mainloop.cuh issue_dgrad): grad_xᵀ from sW and sG →
//              bf16 → TMA store (fused_backward/grad_x_store.cuh); above 384 experts also wgrad of the first
//              kDgradWgradE experts;
//   wgrad      warpgroups 2, 3 (fused_backward/mainloop.cuh issue_wgrad): grad_wᵀ of kWgradE
//              experts each, accumulated in registers over the CTA's units, the next unit's
//              issued before the previous one's is waited for.
// After the last unit the wgrad warpgroups stage grad_w over the idle G stages and wᵀ, and write
// it: the whole slice (one CTA per slice), or as the CTA's partial, each of the slice's k CTAs
// then summing a share in CTA order (fused_backward/grad_w_sum.cuh, kSpread): deterministic.
// Precise mode is not built here (the host takes the simple path for it).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "kernels/dependent_launch.cuh"
#include "kernels/fused_backward/grad_w_sum.cuh"
#include "kernels/fused_backward/grad_x_store.cuh"
#include "kernels/fused_backward/mainloop.cuh"
#include "kernels/fused_backward/schedule.cuh"
#include "kernels/fused_backward/sync.cuh"
#include "kernels/fused_backward_wide/config.cuh"
#include "kernels/fused_backward_wide/producer.cuh"
#include "kernels/fused_backward_wide/rows.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/routing_inputs.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_backward_wide {

using namespace cute;
using fused_backward::GradWSum;
using fused_backward::LinearSchedule;

template <class TmaX, class TmaGX, class TmaW>
struct Params {
  TmaX tma_x;    // x as (H, T)
  TmaGX tma_gx;  // grad_x as (H, T), stored in boxes of 64 h × kTileT t
  TmaW tma_w;    // w as (H, E), loaded in boxes of 64 h × kExperts / 2 e
  kernels::RoutingInputs routing{};  // indices, scores and their gradients, in their dtypes
  void* grad_w = nullptr;     // [E, H] f32, or bf16 (grad_w_bf16: written, never accumulated)
  float* partials = nullptr;  // kSpread: [ctas + slices][kExperts][kTileH]
  // Per slice, zero between launches (kSpread): partials written; CTAs done reading them.
  int* tickets = nullptr;
  int* readers = nullptr;
  WideRow* rows = nullptr;         // [T]: each token's packed row of G, this launch's
  int* row_counters = nullptr;     // 2 ints, zero between launches: CTAs that packed, that read
  int64_t tokens = 0;
  int hidden = 0;
  int experts = 0;  // E, up to the kernel's kExperts
  int top_k = 0;    // K, 1 ... 16
  float scale = 1.0f;
  bool norm = true;
  bool accumulate = false;
  bool grad_w_bf16 = false;
  bool torch_bf16 = false;  // Precision::kTorchBf16: G rounded as eager PyTorch does
  GradWSum sum = GradWSum::kLastCta;  // kLastCta (one CTA per slice) or kSpread
  int per_slice = 1;                  // kSpread: CTAs per slice, k >= 2
  LinearSchedule sched{};
};

template <class Cfg, class P>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fused_backward_wide_sm90(__grid_constant__ const P p) {
  using Storage = typename Cfg::SharedStorage;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using Barrier = cutlass::arch::ClusterBarrier;
  using GRing = Ring<Cfg::kStagesG>;
  constexpr int kTileT = Cfg::kTileT, kTileH = Cfg::kTileH;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int cta = blockIdx.x;
  const LinearSchedule sched = p.sched;
  const fused_backward::CtaWork work(sched, cta, fused_backward::kPassG);
  const int total = work.total, tiles = work.tiles;
  const int slice = int(work.unit0 / tiles);  // (one segment per CTA)

  // G starts all zero; builders then only touch the entries they set.
  {
    uint4* g = reinterpret_cast<uint4*>(smem.g);
    constexpr int kVecs = int(sizeof(smem.g) / 16);
    for (int i = threadIdx.x; i < kVecs; i += Cfg::kThreads) g[i] = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();  // generic-proxy zeros → wgmma reads
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStagesX; ++s) {
      FullBarrier::init(&smem.x_full[s], 1);  // the TMA issuer's expect-tx
      Barrier::init(&smem.x_empty[s], Cfg::kXReaders);
    }
    for (int s = 0; s < Cfg::kStagesG; ++s) {
      Barrier::init(&smem.g_full[s], Cfg::kBuilders);
      Barrier::init(&smem.g_empty[s], 128 * Cfg::kConsumers);
    }
    FullBarrier::init(&smem.w_full, 1);
    if constexpr (Cfg::kDgradWgrad) Barrier::init(&smem.grad_w_staged, 128);
    cutlass::arch::fence_barrier_init();
  }
  MOE_ROUTING_TRACE(threadIdx.x == 0, 0);
  __syncthreads();
  allow_dependent_grids();
  wait_for_prior_grids();  // global memory from here on
  MOE_ROUTING_TRACE(threadIdx.x == 0, 1);

  // wᵀ's slice and the first x tiles come in while the rows are packed.
  if (threadIdx.x == 0 && total > 0) {
    prefetch_tma_descriptor(p.tma_x.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_gx.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
    load_w_slice<Cfg>(p, smem, slice);
    fused_backward::UnitCursor unit(work.unit0, tiles);
    for (int n = 0; n < kXAhead<Cfg> && n < total; ++n, unit.next(tiles))
      load_x_tile<Cfg>(p, smem, n, unit);
  }
  pack_wide_rows<Cfg>(p, cta, p.torch_bf16 ? GradRounding::kTorchBf16 : GradRounding::kBf16);
  MOE_ROUTING_TRACE(threadIdx.x == 0, 14);  // past the rows' barrier

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    produce_wide<Cfg>(p, smem, work, threadIdx.x);
    fused_backward::grad_w_sum_producer(p, work, threadIdx.x);
    return;
  }
  if (total == 0) return;

  // wgrad of kN experts from e0 on (a warpgroup's share): its MMA's operands, accumulators
  // cleared.
  auto wgrad_of = [&](auto mma, auto n_experts, int e0) {
    constexpr int kN = decltype(n_experts)::value;
    auto thr = mma.get_thread_slice(threadIdx.x % 128);
    Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});  // (h, t, stage)
    Tensor sGt = make_tensor(make_smem_ptr(smem.g + e0 * kTileT),
                             typename Cfg::template SmemLayoutGtPart<kN>{});  // (e, t, stage)
    Tensor tWrX = thr.make_fragment_A(thr.partition_A(sX));     // (MMA, MMA_M, MMA_K, stage)
    Tensor tWrGt = thr.make_fragment_B(thr.partition_B(sGt));   // (MMA, MMA_N, MMA_K, stage)
    Tensor acc = partition_fragment_C(mma, Shape<Int<kTileH>, Int<kN>>{});  // (h, e)
    clear(acc);
    warpgroup_fence_operand(acc);
    return cute::make_tuple(thr, tWrX, tWrGt, acc);
  };

  if (warpgroup == 1) {
    // ------------------------------------------------------------------ dgrad
    const int t = threadIdx.x - 128;
    typename Cfg::MmaDgrad mma_d;
    auto thr_d = mma_d.get_thread_slice(t);
    Tensor sW = make_tensor(make_smem_ptr(smem.w), typename Cfg::SmemLayoutW{});  // (h, e)
    Tensor sG = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutG{});  // (t, e, stage)
    Tensor tDrW = thr_d.make_fragment_A(thr_d.partition_A(sW));  // (MMA, MMA_M, MMA_K)
    Tensor tDrG = thr_d.make_fragment_B(thr_d.partition_B(sG));  // (MMA, MMA_N, MMA_K, stage)
    Tensor acc_d = partition_fragment_C(mma_d, Shape<Int<kTileH>, Int<kTileT>>{});  // (h, t)
    auto grad_x = fused_backward::make_grad_x_store<Cfg>(p, smem, mma_d, t, 0, t == 0);
    // Above 384 experts this warpgroup also accumulates wgrad of the first kDgradWgradE.
    typename Cfg::MmaWgradD mma_wd;
    auto [thr_wd, tWrXd, tWrGtd, acc_wd] = wgrad_of(mma_wd, Int<Cfg::kDgradWgradN>{}, 0);
    FullBarrier::wait(&smem.w_full, 0);
    fused_backward::UnitCursor unit(work.unit0, tiles);
    for (int n = 0; n < total; ++n) {
      const int tile = unit.tile;
      unit.next(tiles);
      if constexpr (Cfg::kDgradWgrad) fused_backward::wait_unit<Cfg>(smem, n, t);
      else GRing::wait(smem.g_full, n);
      MOE_ROUTING_TRACE(t == 0 && n == 0, 2);
      fused_backward::issue_dgrad<Cfg>(mma_d, tDrW, tDrG, acc_d, n);
      if constexpr (Cfg::kDgradWgrad)
        fused_backward::issue_wgrad<Cfg>(mma_wd, tWrXd, tWrGtd, acc_wd, n);
      grad_x.staging_free();
      warpgroup_wait<Cfg::kDgradWgrad ? 1 : 0>();  // dgrad(n) done
      warpgroup_fence_operand(acc_d);
      if constexpr (!Cfg::kDgradWgrad) GRing::arrive(smem.g_empty, n);
      grad_x.store(acc_d, slice, tile);
      if constexpr (Cfg::kDgradWgrad) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_wd);
        fused_backward::release_unit<Cfg>(smem, n);
      }
      MOE_ROUTING_TRACE(t == 0 && n < 48, 16 + n);
    }
    if constexpr (Cfg::kDgradWgrad) {
      // Its share of grad_w staged beside the wgrad warpgroups' (below).
      GRing::wait(smem.g_empty, total - 1);
      fused_backward::stage_accumulators<kTileH, Cfg::kDgradWgradN, Cfg::kRedStride>(
          thr_wd, acc_wd, reinterpret_cast<float*>(smem.g), 0);
      // An mbarrier, not a named barrier's arrive: compute-sanitizer's racecheck does not see
      // `bar.arrive` order the stores before the other warpgroups' `bar.sync` (backward v20).
      Barrier::arrive(&smem.grad_w_staged);  // (release: the staging stores)
    }
    if (t == 0) tma_store_wait<0>();
    MOE_ROUTING_TRACE(t == 0, 5);
    return;
  }

  // -------------------------------------------------------------------- wgrad
  const int ct = threadIdx.x - 256;  // 0..255 over both wgrad warpgroups (GradWWriter's threads)
  const int e0 = Cfg::kDgradWgradE + ct / 128 * Cfg::kWgradE;  // this warpgroup's experts
  typename Cfg::MmaWgrad mma_w;
  auto [thr_w, tWrX, tWrGt, acc_w] = wgrad_of(mma_w, Int<Cfg::kWgradE>{}, e0);
  const fused_backward::GradWWriter<Cfg, P, decltype(thr_w), decltype(acc_w)> grad_w(
      p, smem, thr_w, acc_w, sched, ct, cta);
  for (int n = 0; n < total; ++n) {
    fused_backward::wait_unit<Cfg>(smem, n, ct);
    fused_backward::issue_wgrad<Cfg>(mma_w, tWrX, tWrGt, acc_w, n);
    if (n > 0) {
      warpgroup_wait<1>();  // wgrad(n - 1) done
      fused_backward::release_unit<Cfg>(smem, n - 1);
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_w);
  fused_backward::release_unit<Cfg>(smem, total - 1);
  MOE_ROUTING_TRACE(ct == 0, 3);
  // Every consumer is done with G and wᵀ once the last unit's stage is released by all three
  // warpgroups (they read the stages in unit order): grad_w is staged over them.
  GRing::wait(smem.g_empty, total - 1);
  float* staged = reinterpret_cast<float*>(smem.g);
  grad_w.stage_acc_w(staged, e0);
  cutlass::arch::NamedBarrier::sync(256, fused_backward::kBarConsumers);
  if constexpr (Cfg::kDgradWgrad) Barrier::wait(&smem.grad_w_staged, 0);  // (acquire)
  if (p.sum == GradWSum::kSpread) {
    grad_w.spread_staged(slice, staged);
  } else {  // the whole slice straight to grad_w (after grad_w itself when accumulating)
    grad_w.sum_in_chunks(slice, 0, Cfg::kExperts * (kTileH / 4), 1, Int<1>{},
                         [&](int, int v) { return *grad_w.staged_vec(staged, v); });
  }
  MOE_ROUTING_TRACE(ct == 0, 4);
}

}  // namespace moe_routing::kernels::fused_backward_wide
