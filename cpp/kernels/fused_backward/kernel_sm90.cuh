// The fused backward kernel (sm90a): routing gradient → dgrad and wgrad in one pass over x.
// ("backward v14" and the like: sections of docs/perf-log/backward.md.)
//
// Persistent: one CTA per SM walks its range of units (slice, token tile), see schedule.cuh.
// Warp roles (three warpgroups):
//   producer   warpgroup 0 (producer.cuh): builds G per unit, one row per thread; thread 0
//              also issues the TMA loads of x, ahead of G.
//   consumers  warpgroups 1, 2 (64 hidden columns each; mainloop.cuh): dgrad from the
//              register-resident slice of w into registers → bf16 → TMA store of grad_x
//              (grad_x_store.cuh); wgrad accumulated in registers over the segment; grad_x is
//              staged while wgrad runs. (Issuing the next unit's dgrad before waiting for this
//              unit's wgrad makes ptxas serialize every wgmma: it cannot track the groups across
//              that loop.)
//              kRoleSplit (kTileH = 64): warpgroup 1 computes dgrad and stores grad_x,
//              warpgroup 2 wgrad, each of whole units.
// grad_w of a slice split over several CTAs is summed in CTA order, so it is bitwise
// deterministic (grad_w_sum.cuh). kTileH = 64 runs one segment per CTA, a whole slice or one of
// its k parts (kSpread): its wgrad warpgroup's grad_w goes out through shared memory.
// Precise mode sweeps the CTA's units twice: first with G's bf16 rounding residual in G and
// wgrad alone, then as above, into the same grad_w accumulators (Params::passes, CtaWork).
// Where a CTA would have several segments the host launches the two sweeps separately, the
// second adding into grad_w; one kernel function for both: with two, the pair took ~16 us
// longer at T = 4096 than the passes alone (cold instructions).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "kernels/dependent_launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/fused_backward/config.cuh"
#include "kernels/fused_backward/grad_w_sum.cuh"
#include "kernels/fused_backward/grad_x_store.cuh"
#include "kernels/fused_backward/mainloop.cuh"
#include "kernels/fused_backward/producer.cuh"
#include "kernels/fused_backward/routing_grad_tile.cuh"
#include "kernels/fused_backward/schedule.cuh"
#include "kernels/pipeline.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

template <class TmaX, class TmaGX>
struct Params {
  TmaX tma_x;    // x as (H, T)
  TmaGX tma_gx;  // grad_x as (H, T), stored in boxes of 64 h × kTileT t
  const cutlass::bfloat16_t* w = nullptr;  // [E, H]
  kernels::RoutingInputs routing{};  // indices, scores and their gradients, in their dtypes
  void* grad_w = nullptr;     // [E, H] f32, or bf16 (grad_w_bf16: written, never accumulated)
  float* partials = nullptr;  // [ctas + slices][E][kTileH]
  // Per slice, zero between launches: partials written (kLastCta, kSpread); CTAs done
  // reading them (kSpread).
  int* tickets = nullptr;  // [slices]
  int* readers = nullptr;  // [slices]
  int64_t tokens = 0;
  int hidden = 0;
  float scale = 1.0f;
  bool norm = true;
  bool accumulate = false;
  bool grad_w_bf16 = false;
  bool torch_bf16 = false;  // Precision::kTorchBf16: G rounded as eager PyTorch does
  // Sweeps over the CTA's units (kPassG, kPassResidual; both: the residual's first, then G's
  // over the same units again, and the host gives each CTA one segment).
  uint32_t passes = kPassG;
  GradWSum sum = GradWSum::kLastCta;  // schedule.cuh
  // kSpread, kCluster: CTAs per slice, k >= 2 (sched.ctas = k · sched.slices; kCluster: the
  // cluster size, k <= 8).
  int per_slice = 1;
  LinearSchedule sched{};
  int top_k = 0;  // K, 1 ... Config::kTopK (read where Config::kAnyK)
  // RowFormat::kTorch inputs (Config::kAnyK, G's sweep alone): each token's G row packed once per
  // launch into compact[T] (compact_routing_rows), and the units read those. null: not so.
  CompactRow* compact = nullptr;
  int* compact_counters = nullptr;  // 2 ints, zero between launches: CTAs that packed, that read
  bool skew = false;  // Config::kSkew: the consumer warpgroups start out of step (K < 8)
};

template <class Cfg, class P>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fused_backward_sm90(__grid_constant__ const P p) {
  using Storage = typename Cfg::SharedStorage;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using Barrier = cutlass::arch::ClusterBarrier;
  using GRing = Ring<Cfg::kStagesG>;
  constexpr int kTileT = Cfg::kTileT, kTileH = Cfg::kTileH, kExperts = Cfg::kExperts;
  constexpr int kStagesX = Cfg::kStagesX, kStagesG = Cfg::kStagesG;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int cta = blockIdx.x;
  const LinearSchedule sched = p.sched;
  const CtaWork work(sched, cta, p.passes);
  const int64_t unit0 = work.unit0;
  const int count = work.count, total = work.total, tiles = work.tiles;

  // G starts all zero; builders then only touch the entries they set.
  {
    uint4* g = reinterpret_cast<uint4*>(smem.g);
    constexpr int kVecs = int(sizeof(smem.g) / 16);
    for (int i = threadIdx.x; i < kVecs; i += Cfg::kThreads) g[i] = make_uint4(0, 0, 0, 0);
    uint4* rec = reinterpret_cast<uint4*>(&smem.set_experts[0][0][0]);
    constexpr int kRecVecs = int(sizeof(smem.set_experts) / 16);
    for (int i = threadIdx.x; i < kRecVecs; i += Cfg::kThreads) rec[i] = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();  // generic-proxy zeros → wgmma reads
  }
  if (threadIdx.x == 0) {
    // Descriptors are parameters, not outputs of the previous kernel: fetch them before waiting.
    prefetch_tma_descriptor(p.tma_x.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_gx.get_tma_descriptor());
    for (int s = 0; s < kStagesX; ++s) {
      FullBarrier::init(&smem.x_full[s], 1);  // the TMA issuer's expect-tx
      // kRoleSplit: wgrad's warpgroup alone reads x.
      Barrier::init(&smem.x_empty[s], 128 * (Cfg::kRoleSplit ? 1 : Cfg::kConsumers));
    }
    for (int s = 0; s < kStagesG; ++s) {
      Barrier::init(&smem.g_full[s], Cfg::kBuilders);
      Barrier::init(&smem.g_empty[s], 128 * Cfg::kConsumers);
    }
    if (Cfg::kSkew && p.skew) Barrier::init(&smem.skew, 1);
    if constexpr (Cfg::kRoleSplit) Barrier::init(&smem.grad_w_staged, 128);
    cutlass::arch::fence_barrier_init();
  }
  MOE_ROUTING_TRACE(threadIdx.x == 0, 0);
  __syncthreads();
  allow_dependent_grids();
  wait_for_prior_grids();  // global memory from here on
  MOE_ROUTING_TRACE(threadIdx.x == 0, 1);

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    produce<Cfg>(p, smem, work, threadIdx.x);
    grad_w_sum_producer(p, work, threadIdx.x);
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // consumer thread
  // Consumer warpgroup (hidden columns [64 wg, 64 wg + 64)), broadcast so that the compiler
  // sees a warp-uniform value (uniform registers, not per-thread ones).
  const int wg = __shfl_sync(0xffffffffu, ct / 128, 0);
  const bool leader = (ct % 128) == 0;
  // Thread index within the tiled MMAs and grad_x's copy: both warpgroups' (kRoleSplit: each
  // warpgroup's MMA is its own).
  const int mma_thread = Cfg::kRoleSplit ? ct % 128 : ct;
  typename Cfg::MmaDgrad mma_d;
  typename Cfg::MmaWgrad mma_w;
  auto thr_d = mma_d.get_thread_slice(mma_thread);
  auto thr_w = mma_w.get_thread_slice(mma_thread);
  Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});    // (h, t, stage)
  Tensor sG = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutG{});    // (t, e, stage)
  Tensor sGt = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutGt{});  // (e, t, stage)

  // wᵀ (h, e) of every slice, and this thread's share of it as dgrad's register A.
  Tensor mWt = make_tensor(make_gmem_ptr(p.w), make_shape(p.hidden, Int<kExperts>{}),
                           make_stride(_1{}, int64_t(p.hidden)));  // (H, E)
  Tensor gWt = local_tile(mWt, Shape<Int<kTileH>, Int<kExperts>>{},
                          make_coord(_, 0));   // (h, e, slice)
  Tensor tDgW = thr_d.partition_A(gWt);        // (MMA, MMA_M, MMA_K, slice)
  Tensor tDrW = thr_d.partition_fragment_A(gWt(_, _, 0));  // (MMA, MMA_M, MMA_K)

  Tensor tDsG = thr_d.partition_B(sG);    // (MMA, MMA_N, MMA_K, stage)
  Tensor tDrG = thr_d.make_fragment_B(tDsG);
  Tensor tWsX = thr_w.partition_A(sX);    // (MMA, MMA_M, MMA_K, stage)
  Tensor tWsGt = thr_w.partition_B(sGt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tWrX = thr_w.make_fragment_A(tWsX);
  Tensor tWrGt = thr_w.make_fragment_B(tWsGt);

  Tensor acc_d = partition_fragment_C(mma_d, Shape<Int<kTileH>, Int<kTileT>>{});    // (h, t)
  Tensor acc_w = partition_fragment_C(mma_w, Shape<Int<kTileH>, Int<Cfg::kWgradN>>{});  // (h, e)

  auto grad_x = make_grad_x_store<Cfg>(p, smem, mma_d, mma_thread, wg, leader);
  const GradWWriter<Cfg, P, decltype(thr_w), decltype(acc_w)> grad_w(p, smem, thr_w, acc_w,
                                                                      sched, ct, cta);

  // A segment (this CTA's units of one slice) starts with the slice's w and a zero grad_w.
  auto begin_segment = [&](int slice) {
    load_w_slice(tDgW, tDrW, slice);
    clear(acc_w);
    warpgroup_fence_operand(acc_w);
  };

  int64_t reduce0 = -1, reduce1 = -1;  // kLastCta: slices this CTA sums at the end
  // kSpread (kTileH = 128): the last unit's wgrad is issued before its dgrad, and the CTA's
  // partial goes out while that dgrad runs and its grad_x is stored.
  const bool send_early = !Cfg::kRoleSplit && p.sum == GradWSum::kSpread && count > 0 &&
                          !work.residual_at(total - 1);
  if constexpr (Cfg::kRoleSplit) {
    // Warpgroup 0: dgrad and grad_x of each unit (G alone). Warpgroup 1: wgrad of each unit
    // (x and G), the next unit's issued before the previous one's is waited for (the same
    // accumulators: the wgmmas run in order), so that its tensor work runs back to back while
    // warpgroup 0 stores grad_x. One segment per CTA: its slice, or (kSpread) a part of it.
    // With compact rows warpgroup 0 gathers w's slice once the CTA's rows are stored (backward
    // v33: issued at the start, those gathers held the rows' loads back ~0.9 us).
    if (Cfg::kAnyK && p.compact != nullptr && wg == 0)
      cutlass::arch::NamedBarrier::sync(128 + 128, kBarRowsStored);
    if (count > 0) {
      UnitCursor unit(unit0, tiles);
      const int slice = unit.slice;
      if (wg == 0) {
        load_w_slice(tDgW, tDrW, slice);
        for (int n = 0; n < total; ++n) {
          if (n == count) unit = UnitCursor(unit0, tiles);  // the second sweep starts over
          const int tile = unit.tile;
          unit.next(tiles);
          GRing::wait(smem.g_full, n);
          MOE_ROUTING_TRACE(ct == 0 && n == 0, 2);
          MOE_ROUTING_TRACE(ct == 0 && n < kTraceUnits, kTraceDgradHasG + n);
          if (!work.residual_at(n)) {  // (G's residual: wgrad alone)
            issue_dgrad<Cfg>(mma_d, tDrW, tDrG, acc_d, n);
            grad_x.staging_free();
            MOE_ROUTING_TRACE(ct == 0 && n < kTraceUnits, kTraceDgradStagingFree + n);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_d);
          }
          MOE_ROUTING_TRACE(ct == 0 && n < kTraceUnits, kTraceDgradDone + n);
          GRing::arrive(smem.g_empty, n);
          if (!work.residual_at(n)) grad_x.store(acc_d, slice, tile);
          MOE_ROUTING_TRACE(ct == 0 && n < kTraceUnits, 16 + n);
        }
      } else {
        clear(acc_w);
        warpgroup_fence_operand(acc_w);
        for (int n = 0; n < total; ++n) {
          wait_unit<Cfg>(smem, n, ct);
          MOE_ROUTING_TRACE(ct == 128 && n < kTraceUnits, kTraceWgradHasUnit + n);
          issue_wgrad<Cfg>(mma_w, tWrX, tWrGt, acc_w, n);
          if (n > 0) {
            warpgroup_wait<1>();  // wgrad(n - 1) done
            MOE_ROUTING_TRACE(ct == 128 && n - 1 < kTraceUnits, kTraceWgradDone + n - 1);
            release_unit<Cfg>(smem, n - 1);
          }
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_w);
        release_unit<Cfg>(smem, total - 1);
        grad_w.stage_role_split(total - 1);
      }
      grad_w.write_role_split(slice);
    }
  } else if (count > 0) {
    // Unit n's grad_x, once its staging is free and every wgmma batch but the last `pending`
    // (Int) is done: dgrad(n) the last but `pending`.
    auto store_dgrad = [&](auto pending, int slice, int tile) {
      grad_x.staging_free();
      warpgroup_wait<decltype(pending)::value>();
      warpgroup_fence_operand(acc_d);
      grad_x.store(acc_d, slice, tile);
    };
    UnitCursor unit(unit0, tiles);
    int seg_first_tile = unit.tile;
    begin_segment(unit.slice);
    // Cfg::kSkew: warpgroup 1 issues its first unit once warpgroup 0 has issued its first (its
    // grad_x store included; with two sweeps the first unit is a residual one and has none),
    // so that from then on one warpgroup's wgmmas tend to run while the other stores and
    // waits. An mbarrier, once per launch.
    if (Cfg::kSkew && p.skew && wg == 1) Barrier::wait(&smem.skew, 0);
    const int looped = send_early ? total - 1 : total;
    for (int n = 0; n < looped; ++n) {
      if (n == count) unit = UnitCursor(unit0, tiles);  // the second sweep starts over
      const int slice = unit.slice, tile = unit.tile;
      unit.next(tiles);
      wait_unit<Cfg>(smem, n, ct);
      MOE_ROUTING_TRACE(ct == 0 && n == 0, 2);
      if (work.residual_at(n)) {  // G's residual: grad_x comes from G
        issue_wgrad<Cfg>(mma_w, tWrX, tWrGt, acc_w, n);
      } else {
        issue_dgrad<Cfg>(mma_d, tDrW, tDrG, acc_d, n);
        issue_wgrad<Cfg>(mma_w, tWrX, tWrGt, acc_w, n);
        store_dgrad(Int<1>{}, slice, tile);  // wgrad(n) may still run
      }
      if (Cfg::kSkew && p.skew && n == 0 && ct == 0) Barrier::arrive(&smem.skew);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_w);
      release_unit<Cfg>(smem, n);
      MOE_ROUTING_TRACE(ct == 0 && n < kTraceUnits, 16 + n);
      // (Two sweeps: one segment, which ends with the second.)
      const bool segment_ends = n + 1 == total || (total == count && tile == tiles - 1);
      if (segment_ends && p.sum == GradWSum::kLastCta) {
        if (seg_first_tile == 0 && tile == tiles - 1 && !(Cfg::kAnyK && p.grad_w_bf16)) {
          grad_w.write_grad_w(slice);
        } else {
          grad_w.write_partial(slice);
          if (grad_w.take_ticket(slice)) {
            if (reduce0 < 0) reduce0 = slice;
            else reduce1 = slice;
          }
        }
        MOE_ROUTING_TRACE(ct == 0, 3);
        if (n + 1 < total) {
          seg_first_tile = 0;
          begin_segment(slice + 1);
        }
      }
    }
    if (send_early) {  // the last unit: wgrad, the partial out, then dgrad and grad_x
      const int n = total - 1;
      if (n == count) unit = UnitCursor(unit0, tiles);
      const int slice = unit.slice, tile = unit.tile;
      wait_unit<Cfg>(smem, n, ct);
      issue_wgrad<Cfg>(mma_w, tWrX, tWrGt, acc_w, n);
      if (Cfg::kSkew && p.skew && n == 0 && ct == 0) Barrier::arrive(&smem.skew);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_w);
      grad_w.send_spread(slice);
      issue_dgrad<Cfg>(mma_d, tDrW, tDrG, acc_d, n);
      store_dgrad(Int<0>{}, slice, tile);
      release_unit<Cfg>(smem, n);
      MOE_ROUTING_TRACE(ct == 0 && n < kTraceUnits, 16 + n);
    }
  }
  warpgroup_wait<0>();  // (all done already; tells the compiler so before the branches below)
  if constexpr (!Cfg::kRoleSplit) {
    if (p.sum == GradWSum::kCluster) grad_w.reduce_grad_w_cluster(int(unit0 / tiles));
    if (p.sum == GradWSum::kSpread) {
      if (!send_early) grad_w.send_spread(int(unit0 / tiles));
      grad_w.sum_spread(int(unit0 / tiles), grad_w.red);
    }
    if (reduce0 >= 0) grad_w.reduce_grad_w(reduce0);
    if (reduce1 >= 0) grad_w.reduce_grad_w(reduce1);
  }
  MOE_ROUTING_TRACE(ct == 0, 4);
  if (leader) tma_store_wait<0>();
  MOE_ROUTING_TRACE(ct == 0, 5);
}

}  // namespace moe_routing::kernels::fused_backward