// The fused backward kernel (sm90a): routing gradient → dgrad and wgrad in one pass over x.
//
// Persistent: one CTA per SM walks its range of units (slice, token tile), see schedule.cuh.
// Warp roles (three warpgroups):
//   producer   warpgroup 0: builds G per unit (sparse update of a zeroed tile), one row
//              per thread; thread 0 also issues the TMA loads of x, ahead of G.
//   consumers  warpgroups 1, 2 (64 hidden columns each): dgrad from the register-resident
//              slice of w into registers → bf16 → transposing stores → TMA store of grad_x;
//              wgrad accumulated in registers over the segment; grad_x is staged while wgrad
//              runs. (Issuing the next unit's dgrad before waiting for this unit's wgrad makes
//              ptxas serialize every wgmma: it cannot track the groups across that loop.)
// grad_w of a slice split over several CTAs is summed in CTA order, so it is bitwise
// deterministic. Where the grid runs in clusters (one per slice), each CTA puts its partial in
// its own shared memory and each sums a share of the slice's rows over the cluster in rank
// order (distributed shared memory); otherwise each CTA writes a partial to global memory and
// the last to finish the slice (ticket) sums them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "kernels/cluster.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/fused_backward/config.cuh"
#include "kernels/fused_backward/routing_grad_tile.cuh"
#include "kernels/fused_backward/schedule.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

template <class TmaX, class TmaGX>
struct Params {
  TmaX tma_x;    // x as (H, T)
  TmaGX tma_gx;  // grad_x as (H, T), stored in boxes of 64 h × kTileT t
  const cutlass::bfloat16_t* w = nullptr;  // [E, H]
  const int32_t* topk_idx = nullptr;
  const float* topk_scores = nullptr;
  const float* grad_topk_weights = nullptr;
  float* grad_w = nullptr;    // [E, H]
  float* partials = nullptr;  // [ctas + slices][E][kTileH]
  int* tickets = nullptr;     // [slices], zero between launches
  int64_t tokens = 0;
  int hidden = 0;
  float scale = 1.0f;
  bool norm = true;
  bool accumulate = false;
  // > 1: the grid is launched in clusters of this many CTAs, one cluster per slice
  // (sched.ctas = cluster · sched.slices), and the cluster sums grad_w in shared memory.
  int cluster = 1;
  LinearSchedule sched{};
};

// Adds one to a grad_w ticket (acquire and release at GPU scope); returns the old count.
__device__ __forceinline__ int ticket_acq_rel(int* ticket) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
  return old;
}

// Named barriers (0 is __syncthreads).
enum : uint32_t { kBarConsumers = 1, kBarStore0 = 2 };

template <class Cfg, class P>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fused_backward_sm90(__grid_constant__ const P p) {
  using Elem = typename Cfg::Elem;
  using Storage = typename Cfg::SharedStorage;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kTileT = Cfg::kTileT, kTileH = Cfg::kTileH, kExperts = Cfg::kExperts;
  constexpr int kStagesX = Cfg::kStagesX, kStagesG = Cfg::kStagesG;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int cta = blockIdx.x;
  const LinearSchedule sched = p.sched;
  const int64_t unit0 = sched.begin(cta);
  const int count = int(sched.begin(cta + 1) - unit0);
  const int tiles = int(sched.tiles);  // < 2^31 / kTileT

  Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});    // (h, t, stage)
  Tensor sG = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutG{});    // (t, e, stage)
  Tensor sGt = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutGt{});  // (e, t, stage)
  Tensor sGX = make_tensor(make_smem_ptr(smem.gx), typename Cfg::SmemLayoutGX{});  // (h, t)

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
      Barrier::init(&smem.x_empty[s], 128 * Cfg::kConsumers);
    }
    for (int s = 0; s < kStagesG; ++s) {
      Barrier::init(&smem.g_full[s], Cfg::kBuilders);
      Barrier::init(&smem.g_empty[s], 128 * Cfg::kConsumers);
    }
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
    const int thread = threadIdx.x;  // builder of row `thread`; thread 0 also loads x
    Tensor mX = p.tma_x.get_tma_tensor(make_shape(p.hidden, p.tokens));  // (H, T)
    Tensor gX = local_tile(mX, Shape<Int<kTileH>, Int<kTileT>>{},
                           make_coord(_, _));  // (h, t, slice, tile)
    auto [tXgX, tXsX] = tma_partition(p.tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                      group_modes<0, 2>(gX));  // (TMA, slice, tile), (TMA, stage)
    UnitCursor x_unit(unit0, tiles);  // unit of the next x load
    auto load_x = [&](int n) {  // thread 0, units in order
      const int s = n % kStagesX;
      Barrier::wait(&smem.x_empty[s], ((n / kStagesX) & 1) ^ 1);
      FullBarrier::arrive_and_expect_tx(&smem.x_full[s], Cfg::kXBytes);
      copy(p.tma_x.with(smem.x_full[s]), tXgX(_, x_unit.slice, x_unit.tile), tXsX(_, s));
      x_unit.next(tiles);
    };
    // Building G(n) waits for unit n - kStagesG to be released; so is then the x stage of
    // unit n + kAhead: x is issued kAhead + 1 units before it is consumed.
    constexpr int kAhead = kStagesX - kStagesG;
    static_assert(kAhead >= 1, "x must run ahead of G");
    if (thread == 0)
      for (int n = 0; n < kAhead && n < count; ++n) load_x(n);
    const uint32_t g_stages = cute::cast_smem_ptr_to_uint(smem.g);
    constexpr uint32_t kGStageBytes = kTileT * kExperts * 2;
    // Routing inputs are loaded a unit ahead and packed at the end of the previous iteration:
    // their latency hides behind a whole build, and only the packed row stays live.
    TokenRouting<Cfg::kTopK> loaded;
    UnitCursor g_unit(unit0, tiles);  // unit of the next routing load
    auto load_routing = [&] {  // units in order
      loaded.load(p.topk_idx, p.topk_scores, p.grad_topk_weights,
                  int64_t(g_unit.tile) * kTileT + thread, p.tokens);
      g_unit.next(tiles);
    };
    PackedRow<Cfg::kTopK> row{};
    if (count > 0) {
      load_routing();
      row = pack_routing_grad_row<kExperts>(loaded, p.scale, p.norm);
      MOE_ROUTING_TRACE(thread == 0, 8);
    }
    for (int n = 0; n < count; ++n) {
      const int s = n % kStagesG;
      if (n + 1 < count) load_routing();
      Barrier::wait(&smem.g_empty[s], ((n / kStagesG) & 1) ^ 1);
      if (thread == 0 && n + kAhead < count) load_x(n + kAhead);
      store_routing_grad_row<kTileT>(g_stages + s * kGStageBytes, thread,
                                     smem.set_experts[s][thread], row);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes → wgmma reads
      Barrier::arrive(&smem.g_full[s]);
      MOE_ROUTING_TRACE(thread == 0 && n == 0, 9);
      if (n + 1 < count) row = pack_routing_grad_row<kExperts>(loaded, p.scale, p.norm);
    }
    if (p.cluster > 1) {  // the cluster barriers count every thread of the cluster
      cluster_arrive_relaxed();
      cluster_wait();
      cluster_arrive_relaxed();
      cluster_wait();
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // consumer thread
  // Consumer warpgroup (hidden columns [64 wg, 64 wg + 64)), broadcast so that the compiler
  // sees a warp-uniform value (uniform registers, not per-thread ones).
  const int wg = __shfl_sync(0xffffffffu, ct / 128, 0);
  const bool leader = (ct % 128) == 0;
  typename Cfg::MmaDgrad mma_d;
  typename Cfg::MmaWgrad mma_w;
  auto thr_d = mma_d.get_thread_slice(ct);
  auto thr_w = mma_w.get_thread_slice(ct);

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
  Tensor acc_w = partition_fragment_C(mma_w, Shape<Int<kTileH>, Int<kExperts>>{});  // (h, e)

  // grad_x: accumulator → staging (h, t) → TMA store of this warpgroup's 64 h × kTileT box.
  auto copy_gx = make_tiled_copy_C(typename Cfg::CopyGX{}, mma_d);
  auto thr_cp = copy_gx.get_thread_slice(ct);
  Tensor tCsGX = thr_cp.partition_D(sGX);  // (CPY, CPY_M, CPY_N)
  Tensor sGXh = make_tensor(make_smem_ptr(smem.gx + wg * cosize_v<typename Cfg::SmemLayoutGXHalf>),
                            typename Cfg::SmemLayoutGXHalf{});  // (h/2, t)
  Tensor mGX = p.tma_gx.get_tma_tensor(make_shape(p.hidden, p.tokens));  // (H, T)
  Tensor gGX = local_tile(mGX, Shape<Int<kTileH / 2>, Int<kTileT>>{},
                          make_coord(_, _));  // (h/2, t, half-slice, tile)
  auto store_part = tma_partition(p.tma_gx, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sGXh),
                                  group_modes<0, 2>(gGX));
  Tensor tSgGX = get<0>(store_part);  // (TMA, half-slice, tile)
  Tensor tSsGX = get<1>(store_part);  // (TMA)

  auto load_w = [&](int64_t slice) {
    Tensor src = tDgW(_, _, _, slice);
    CUTE_UNROLL
    for (int i = 0; i < size(tDrW); ++i) tDrW(i) = src(i);
  };
  auto wait_unit = [&](int n) {
    Barrier::wait(&smem.x_full[n % kStagesX], (n / kStagesX) & 1);
    MOE_ROUTING_TRACE(ct == 0 && n == 0, 10);
    Barrier::wait(&smem.g_full[n % kStagesG], (n / kStagesG) & 1);
  };
  auto release_unit = [&](int n) {
    Barrier::arrive(&smem.x_empty[n % kStagesX]);
    Barrier::arrive(&smem.g_empty[n % kStagesG]);
  };
  auto issue_dgrad = [&](int n) {
    const int s = n % kStagesG;
    warpgroup_fence_operand(tDrW);
    warpgroup_fence_operand(acc_d);
    warpgroup_arrive();
    mma_d.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tDrW); ++k) {
      gemm(mma_d, tDrW(_, _, k), tDrG(_, _, k, s), acc_d);
      mma_d.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  auto issue_wgrad = [&](int n) {
    const int xs = n % kStagesX, gs = n % kStagesG;
    warpgroup_fence_operand(acc_w);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tWrX); ++k) gemm(mma_w, tWrX(_, _, k, xs), tWrGt(_, _, k, gs), acc_w);
    warpgroup_commit_batch();
  };
  // The staging is free once the previous unit's store has read it: checked while this unit's
  // GEMMs run, so that the warps' wait at the barrier overlaps them.
  auto staging_free = [&] {
    if (leader) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, kBarStore0 + wg);
  };
  auto store_grad_x = [&](int64_t slice, int64_t tile) {
    Tensor frag = make_tensor_like<Elem>(acc_d);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_d); ++i) frag(i) = Elem(acc_d(i));
    copy(copy_gx, thr_cp.retile_S(frag), tCsGX);
    cutlass::arch::fence_view_async_shared();  // staging writes → TMA store reads
    cutlass::arch::NamedBarrier::sync(128, kBarStore0 + wg);
    if (leader) {
      copy(p.tma_gx, tSsGX, tSgGX(_, 2 * slice + wg, tile));
      tma_store_arrive();
    }
  };

  const int64_t H = p.hidden;
  constexpr int kSlotFloats = kExperts * kTileH;
  auto partial = [&](int64_t slice, int c) {
    return p.partials + LinearSchedule::slot(slice, c) * kSlotFloats;  // [E][kTileH]
  };
  // grad_w of a segment: straight to grad_w when the segment is the whole slice, else a
  // partial and a ticket. Returns whether this CTA is the slice's last contributor, which
  // sums the partials once the tensor-core loop is over (only a CTA's first and last segments
  // can be partial: at most two per CTA).
  auto flush_grad_w = [&](int64_t slice, bool whole) -> bool {
    if (whole) {
      Tensor gW = make_tensor(make_gmem_ptr(p.grad_w + slice * kTileH),
                              make_layout(Shape<Int<kTileH>, Int<kExperts>>{},
                                          make_stride(_1{}, H)));  // (h, e)
      Tensor tWgW = thr_w.partition_C(gW);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_w); ++i) tWgW(i) = p.accumulate ? tWgW(i) + acc_w(i) : acc_w(i);
      return false;
    }
    Tensor gP = make_tensor(make_gmem_ptr(partial(slice, cta)),
                            make_layout(Shape<Int<kTileH>, Int<kExperts>>{},
                                        make_stride(_1{}, Int<kTileH>{})));  // (h, e)
    Tensor tWgP = thr_w.partition_C(gP);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i) tWgP(i) = acc_w(i);
    // One release for the CTA: the barrier orders every thread's partial stores before
    // thread 0's acq_rel ticket (cumulativity), so no thread needs a fence of its own. The
    // acquire half lets the last contributor's reads (after the next barrier) see the others'.
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    if (ct == 0) {
      const int contributors = sched.last_cta(slice) - sched.first_cta(slice) + 1;
      smem.last_contributor = ticket_acq_rel(p.tickets + slice) == contributors - 1;
    }
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    // Broadcast from lane 0, so that the compiler sees a warp-uniform value.
    return __shfl_sync(0xffffffffu, smem.last_contributor, 0) != 0;
  };
  // The partials of a slice summed in CTA order: the same bits whichever CTA finishes last.
  // A slot is [E][kTileH], laid out as the slice's rows of grad_w: each thread owns every
  // 256th 16-byte vector of it and, per partial, issues all its loads before adding, so a
  // partial costs one memory round trip rather than one per vector.
  auto reduce_grad_w = [&](int64_t slice) {  // (ordered after the others' partials: see flush)
    constexpr int kVecsPerRow = kTileH / 4;
    constexpr int kVecs = kExperts * kVecsPerRow / 256;  // per consumer thread
    static_assert(kExperts * kVecsPerRow % 256 == 0, "vectors split evenly");
    const int first = sched.first_cta(slice), last = sched.last_cta(slice);
    const int64_t h0 = slice * kTileH;
    auto grad_w_vec = [&](int j) {
      const int i = ct + 256 * j, e = i / kVecsPerRow, h = i % kVecsPerRow * 4;
      return reinterpret_cast<float4*>(p.grad_w + e * H + h0 + h);
    };
    float4 sum[kVecs];
    CUTE_UNROLL
    for (int j = 0; j < kVecs; ++j)
      sum[j] = p.accumulate ? __ldcg(grad_w_vec(j)) : make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c = first; c <= last; ++c) {
      const float4* src = reinterpret_cast<const float4*>(partial(slice, c)) + ct;
      float4 v[kVecs];
      CUTE_UNROLL
      for (int j = 0; j < kVecs; ++j) v[j] = __ldcg(src + 256 * j);
      CUTE_UNROLL
      for (int j = 0; j < kVecs; ++j)
        sum[j].x += v[j].x, sum[j].y += v[j].y, sum[j].z += v[j].z, sum[j].w += v[j].w;
    }
    CUTE_UNROLL
    for (int j = 0; j < kVecs; ++j) __stcg(grad_w_vec(j), sum[j]);
    if (ct == 0) p.tickets[slice] = 0;  // ready for the next launch
  };

  // Cluster mode: the CTA's one segment is its cluster's slice. The partials go through the
  // (now idle) x stages as [E][kRedStride] fp32; CTA r of the cluster then sums vectors
  // [r·V/k, (r+1)·V/k) of the slice over the cluster in rank order and writes them to grad_w.
  auto reduce_grad_w_cluster = [&](int slice) {
    constexpr int kRedStride = Cfg::kRedStride;
    static_assert(kExperts * kRedStride * sizeof(float) <= sizeof(smem.x), "partial fits");
    float* red = reinterpret_cast<float*>(smem.x);
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);  // both warpgroups done with sX
    {
      Tensor cW = make_identity_tensor(Shape<Int<kTileH>, Int<kExperts>>{});  // (h, e) → (h, e)
      Tensor tWcW = thr_w.partition_C(cW);  // like acc_w
      CUTE_UNROLL
      for (int i = 0; i < size(acc_w); ++i)
        red[get<1>(tWcW(i)) * kRedStride + get<0>(tWcW(i))] = acc_w(i);
    }
    cluster_arrive();  // every partial of the cluster in place
    cluster_wait();
    MOE_ROUTING_TRACE(ct == 0, 6);
    constexpr int kVecsPerRow = kTileH / 4, kVecs = kExperts * kVecsPerRow;
    constexpr int kMaxCluster = 8;
    const int k = p.cluster, rank = cluster_rank();
    const int v0 = rank * kVecs / k, v1 = (rank + 1) * kVecs / k;
    const uint32_t base = cute::cast_smem_ptr_to_uint(red);
    constexpr int kPerThread = (kVecs / 2 + 255) / 256;  // k >= 2
    float4 sum[kPerThread];
    CUTE_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      const int v = v0 + ct + 256 * j;
      const int e = v / kVecsPerRow, h = v % kVecsPerRow * 4;
      float4* dst = reinterpret_cast<float4*>(p.grad_w + e * H + slice * kTileH + h);
      sum[j] = p.accumulate && v < v1 ? __ldcg(dst) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int r = 0; r < kMaxCluster && r < k; ++r) {
      float4 part[kPerThread];
      CUTE_UNROLL
      for (int j = 0; j < kPerThread; ++j) {
        const int v = v0 + ct + 256 * j;
        const uint32_t addr = base + uint32_t((v / kVecsPerRow * kRedStride + v % kVecsPerRow * 4) * 4);
        if (v < v1) part[j] = ld_dsmem_f32x4(map_dsmem(addr, r));
      }
      CUTE_UNROLL
      for (int j = 0; j < kPerThread; ++j)
        if (v0 + ct + 256 * j < v1)
          sum[j].x += part[j].x, sum[j].y += part[j].y, sum[j].z += part[j].z, sum[j].w += part[j].w;
    }
    CUTE_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      const int v = v0 + ct + 256 * j;
      const int e = v / kVecsPerRow, h = v % kVecsPerRow * 4;
      if (v < v1) __stcg(reinterpret_cast<float4*>(p.grad_w + e * H + slice * kTileH + h), sum[j]);
    }
    MOE_ROUTING_TRACE(ct == 0, 7);
    cluster_arrive();  // done reading the other CTAs' partials
    cluster_wait();    // and they are done reading this one's
  };

  // A segment (this CTA's units of one slice) starts with the slice's w and a zero grad_w.
  auto begin_segment = [&](int slice) {
    load_w(slice);
    clear(acc_w);
    warpgroup_fence_operand(acc_w);
  };

  int64_t reduce0 = -1, reduce1 = -1;  // slices this CTA sums at the end
  if (count > 0) {
    UnitCursor unit(unit0, tiles);
    int seg_first_tile = unit.tile;
    begin_segment(unit.slice);
    for (int n = 0; n < count; ++n) {
      const int slice = unit.slice, tile = unit.tile;
      unit.next(tiles);
      wait_unit(n);
      MOE_ROUTING_TRACE(ct == 0 && n == 0, 2);
      issue_dgrad(n);
      issue_wgrad(n);
      staging_free();
      warpgroup_wait<1>();  // dgrad(n) done; wgrad(n) may still run
      warpgroup_fence_operand(acc_d);
      store_grad_x(slice, tile);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_w);
      release_unit(n);
      MOE_ROUTING_TRACE(ct == 0 && n < 48, 16 + n);
      const bool segment_ends = n + 1 == count || tile == tiles - 1;
      if (segment_ends && p.cluster == 1) {
        const bool mine = flush_grad_w(slice, seg_first_tile == 0 && tile == tiles - 1);
        const int64_t r0 = mine && reduce0 < 0 ? slice : reduce0;
        reduce1 = mine && reduce0 >= 0 ? slice : reduce1;
        reduce0 = r0;
        MOE_ROUTING_TRACE(ct == 0, 3);
        if (n + 1 < count) {
          seg_first_tile = 0;
          begin_segment(slice + 1);
        }
      }
    }
  }
  warpgroup_wait<0>();  // (all done already; tells the compiler so before the branches below)
  if (p.cluster > 1) reduce_grad_w_cluster(int(unit0 / tiles));
  if (reduce0 >= 0) reduce_grad_w(reduce0);
  if (reduce1 >= 0) reduce_grad_w(reduce1);
  MOE_ROUTING_TRACE(ct == 0, 4);
  if (leader) tma_store_wait<0>();
  MOE_ROUTING_TRACE(ct == 0, 5);
}

}  // namespace moe_routing::kernels::fused_backward
