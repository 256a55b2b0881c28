// The fused backward kernel (sm90a): routing gradient → dgrad and wgrad in one pass over x.
// ("backward v14" and the like: sections of docs/perf-log/backward.md.)
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
//              kRoleSplit (kTileH = 64): warpgroup 1 computes dgrad and stores grad_x,
//              warpgroup 2 wgrad, each of whole units.
// Precise mode sweeps the CTA's units twice: first with G's bf16 rounding residual in G and
// wgrad alone, then as above, into the same grad_w accumulators (Params::passes). Where a CTA
// would have several segments the host launches the two sweeps separately, the second adding
// into grad_w; one kernel function for both: with two, the pair took ~16 us longer at
// T = 4096 than the passes alone (cold instructions).
// grad_w of a slice split over several CTAs is summed in CTA order, so it is bitwise
// deterministic, in one of three ways (GradWSum, schedule.cuh): the slice's last CTA sums the
// partials from global memory; or all k CTAs of the slice each sum a share of them, from
// global memory (all CTAs resident) or from each other's shared memory (clusters). kTileH = 64
// runs one CTA per slice only: its wgrad warpgroup's grad_w is written through shared memory.
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

// Adds one to a grad_w counter, release at GPU scope.
__device__ __forceinline__ void red_release_add(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// Reads a grad_w counter, acquire at GPU scope.
__device__ __forceinline__ int ld_acquire(const int* counter) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// Drops a 128-byte line from L2 without writing it back (its contents become undefined):
// for partials that no one reads again, which would otherwise go to DRAM when evicted.
__device__ __forceinline__ void discard_l2_line(const void* line) {
  asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
}

// Adds one to a grad_w ticket (acquire and release at GPU scope); returns the old count.
__device__ __forceinline__ int ticket_acq_rel(int* ticket) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
  return old;
}

// Named barriers (0 is __syncthreads). kSpread: the consumers' partials are out (consumers →
// producer warp 0), the slice's partials are all in (producer warp 0 → consumers).
enum : uint32_t {
  kBarConsumers = 1, kBarStore0 = 2, kBarPartialsOut = 4, kBarPartialsIn = 5, kBarBuilders = 6
};
constexpr uint32_t kSpreadBarThreads = 256 + 32;

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
  // Units of every sweep in order: n = 0 ... total - 1, unit n % count. With both sweeps the
  // residual's comes first: its small products then build up in accumulators of their own
  // size. (Added after G's, into accumulators ~2^9 larger, they lost enough bits in the
  // tensor cores' accumulation to leave grad_w 1.1e-5 off at T = 20000, 3e-6 the other way.)
  const bool g_pass = (p.passes & kPassG) != 0, res_pass = (p.passes & kPassResidual) != 0;
  const int total = count * (int(g_pass) + int(res_pass));
  auto residual_at = [&](int n) { return res_pass && (!g_pass || n < count); };
  auto rounding_at = [&](int n) {
    return residual_at(n) ? GradRounding::kResidual
                          : p.torch_bf16 ? GradRounding::kTorchBf16 : GradRounding::kBf16;
  };
  const int tiles = int(sched.tiles);  // < 2^31 / kTileT

  Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});    // (h, t, stage)
  Tensor sG = make_tensor(make_smem_ptr(smem.g), typename Cfg::SmemLayoutG{});    // (t, e, stage)
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
    const int thread = threadIdx.x;  // builder of row `thread`; thread 0 also loads x
    Tensor mX = p.tma_x.get_tma_tensor(make_shape(p.hidden, p.tokens));  // (H, T)
    Tensor gX = local_tile(mX, Shape<Int<kTileH>, Int<kTileT>>{},
                           make_coord(_, _));  // (h, t, slice, tile)
    auto load_part = tma_partition(p.tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                   group_modes<0, 2>(gX));
    Tensor tXgX = get<0>(load_part);  // (TMA, slice, tile)
    Tensor tXsX = get<1>(load_part);  // (TMA, stage)
    UnitCursor x_unit(unit0, tiles);  // unit of the next x load
    auto load_x = [&](int n) {  // thread 0, units in order
      if (n == count) x_unit = UnitCursor(unit0, tiles);  // the second sweep starts over
      const int s = n % kStagesX;
      Barrier::wait(&smem.x_empty[s], ((n / kStagesX) & 1) ^ 1);
      FullBarrier::arrive_and_expect_tx(&smem.x_full[s], Cfg::kXBytes);
      copy(p.tma_x.with(smem.x_full[s]), tXgX(_, x_unit.slice, x_unit.tile), tXsX(_, s));
      x_unit.next(tiles);
    };
    // Building G(n) waits for unit n - kStagesG to be released; so is then the x stage of
    // unit n + kAhead: x is issued kAhead + 1 units before it is consumed. (Filling every x
    // stage at the start, before the routing loads, delayed those loads and so G: the first
    // unit started 1.5-2 us later.)
    constexpr int kAhead = kStagesX - kStagesG;
    static_assert(kAhead >= 1, "x must run ahead of G");
    if (thread == 0)
      for (int n = 0; n < kAhead && n < total; ++n) load_x(n);
    const uint32_t g_stages = cute::cast_smem_ptr_to_uint(smem.g);
    constexpr uint32_t kGStageBytes = kTileT * kExperts * 2;
    // The units' G, from routing rows in `format` (RowFormat, routing_grad_tile.cuh): the
    // fixed-K kernels read kTraining; the any-K kernels kTorch where the inputs allow it, else
    // kAny (one producer loop per format, chosen once).
    auto build_units = [&](auto format) {
      using Routing = TokenRouting<Cfg::kTopK, decltype(format)::value>;
      constexpr bool kAnyRows = decltype(format)::value == RowFormat::kAny;
      // Routing inputs are loaded a unit ahead and packed at the end of the previous
      // iteration: their latency hides behind a whole build, and only the packed row stays live.
      Routing loaded;
      UnitCursor g_unit(unit0, tiles);  // unit of the next routing load
      // Where a CTA has many units, each routing load is preceded by an L1 prefetch of the rows
      // Cfg::kRoutingPrefetch units further on, so that a load finds its lines in L1 instead of
      // waiting on L2 beside the x stream (backward v14: faster at T >= 12288, slower at
      // T <= 4096, where the prefetches delay the start). Not in the 64-column kernels: small
      // T, and 256 experts at every T, where it made the producer spill and ran slower
      // (backward "After v16").
      // (Compact rows are read through L2 alone.)
      constexpr int kPrefetch =
          Cfg::kRoleSplit || decltype(format)::value == RowFormat::kCompact ? 0
                                                                          : Cfg::kRoutingPrefetch;
      const bool prefetch = count >= Cfg::kRoutingPrefetchMinUnits;  // (read under kPrefetch > 0)
      const int row_slots = kAnyRows ? p.top_k : Cfg::kTopK;
      UnitCursor pf_unit(unit0, tiles);  // unit of the next prefetch
      int pf_next = 0;                   // ... and its index
      auto prefetch_next = [&] {         // units in order
        if (pf_next < total) {
          if (pf_next == count) pf_unit = UnitCursor(unit0, tiles);
          prefetch_token_routing(p.routing, int64_t(pf_unit.tile) * kTileT + thread, p.tokens,
                                 row_slots);
          pf_unit.next(tiles);
          ++pf_next;
        }
      };
      if constexpr (kPrefetch > 0) {
        if (prefetch)  // (unit 0's rows too: its load follows at once, and the walk stays simple)
          for (int i = 0; i < kPrefetch; ++i) prefetch_next();
      }
      // Staged indices: each unit's are copied into shared memory, and its score rows fetched
      // into L2, a unit before its load.
      UnitCursor stage_unit = g_unit;  // unit of the next staging
      int stage_next = 0;              // ... and its index
      auto stage_indices_next = [&](uint32_t after) {  // units in order
        if constexpr (Routing::kMayStage) {
          if (stage_next >= total) return;
          if (stage_next == count) stage_unit = UnitCursor(unit0, tiles);
          const int64_t t = int64_t(stage_unit.tile) * kTileT + thread;
          Routing::stage_indices(p.routing, t, p.tokens, p.top_k,
                                 cute::cast_smem_ptr_to_uint(smem.idx_rows[thread]), after);
          prefetch_score_row_l2(p.routing, t, p.tokens);
          stage_unit.next(tiles);
          ++stage_next;
        }
      };
      auto load_routing = [&](int n) {  // units in order
        if constexpr (kPrefetch > 0) {
          if (prefetch) prefetch_next();  // unit n + kPrefetch
        }
        if (n == count) g_unit = UnitCursor(unit0, tiles);
        const int64_t t = int64_t(g_unit.tile) * kTileT + thread;
        g_unit.next(tiles);
        if constexpr (Routing::kMayStage) {
          if (Routing::staged(p.routing)) {
            if (n == 0) stage_indices_next(0);  // unit 0's, read at once
            stage_indices_next(loaded.load_staged(p.routing, t, p.tokens, p.top_k,
                                                  smem.idx_rows[thread]));  // unit n + 1's
            return;
          }
        }
        if constexpr (decltype(format)::value == RowFormat::kCompact)
          loaded.load(p.compact, t, p.tokens);
        else if constexpr (decltype(format)::value != RowFormat::kTorch)
          loaded.load(p.routing, t, p.tokens, p.top_k);
      };
      PackedRow<Cfg::kTopK> row{};
      if (count > 0) {
        load_routing(0);
        row = pack_routing_grad_row<kExperts>(loaded, p.routing, p.scale, p.norm, rounding_at(0));
        MOE_ROUTING_TRACE(thread == 0, 8);
      }
      for (int n = 0; n < total; ++n) {
        const int s = n % kStagesG;
        if (n + 1 < total) load_routing(n + 1);
        Barrier::wait(&smem.g_empty[s], ((n / kStagesG) & 1) ^ 1);
        if (thread == 0 && n + kAhead < total) load_x(n + kAhead);
        store_routing_grad_row<kTileT>(g_stages + s * kGStageBytes, thread,
                                       smem.set_experts[s][thread], row);
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes → wgmma reads
        Barrier::arrive(&smem.g_full[s]);
        MOE_ROUTING_TRACE(thread == 0 && n == 0, 9);
        if (n + 1 < total)
          row = pack_routing_grad_row<kExperts>(loaded, p.routing, p.scale, p.norm,
                                                rounding_at(n + 1));
      }
    };
    // Compact rows: the producers of all CTAs first pack every token's G row once (token t by
    // thread t / ctas % 128 of CTA t % ctas), into global memory; once all CTAs have (a grid
    // barrier: the grid is at most one CTA per SM, all resident), each unit reads its tile's
    // packed rows (32 bytes a token) instead of gathering and packing them again, as every one
    // of the H / kTileH slices' units did: that per-unit gather and packing kept the PyTorch
    // dtypes 1.6x slower than the training dtypes at T = 1264 (backward v22).
    auto compact_routing_rows = [&] {
      if constexpr (Cfg::kAnyK) {
        const int64_t ctas = gridDim.x;
        for (int64_t t = cta + ctas * thread; t < p.tokens; t += ctas * kTileT) {
          TokenRouting<Cfg::kTopK, RowFormat::kTorch> r;
          r.load_direct(p.routing, t);
          store_compact_row(p.compact, t,
                            pack_routing_grad_row<kExperts>(r, p.routing, p.scale, p.norm,
                                                            rounding_at(0)));
        }
        // One release for the CTA (the barrier orders every builder's stores before it); the
        // last CTA past the wait resets both counters for the next launch.
        cutlass::arch::NamedBarrier::sync(Cfg::kBuilders, kBarBuilders);
        if (thread == 0) {
          int* packed = p.compact_counters;
          red_release_add(packed);
          while (ld_acquire(packed) < int(ctas)) {
          }
          if (ticket_acq_rel(packed + 1) == int(ctas) - 1) packed[0] = 0, packed[1] = 0;
        }
        cutlass::arch::NamedBarrier::sync(Cfg::kBuilders, kBarBuilders);
      }
    };
    using Format = RowFormat;
    if constexpr (!Cfg::kAnyK && Cfg::kRoleSplit) {
      // The [T, K] routing arrays are fetched into L2 at once, each CTA its share, so that the
      // builders' loads, a unit ahead, wait on L2 rather than DRAM (backward v24: 6-8% faster
      // back to back at T = 1264-4096, up to 3% in single calls; the 128-column kernels were
      // 0.5-1.5% slower with it, their L1 prefetch already covering the rows).
      if (thread == 0) {
        constexpr int64_t kRow = Cfg::kTopK * 4;
        const int64_t share = ceil_div(ceil_div(p.tokens, int64_t(gridDim.x)) * kRow, 16) * 16;
        const int64_t begin = share * cta, bytes = p.tokens * kRow;
        if (begin < bytes) {
          const void* arrays[3] = {p.routing.idx, p.routing.scores, p.routing.grad};
          for (const void* a : arrays)
            SM90_BULK_COPY_G2S::PREFETCH::copy(static_cast<const char*>(a) + begin,
                                               int32_t(cute::min(share, bytes - begin)));
        }
      }
    }
    if constexpr (!Cfg::kAnyK) {
      build_units(std::integral_constant<Format, Format::kTraining>{});
    } else {
      if (p.compact != nullptr) {
        compact_routing_rows();
        build_units(std::integral_constant<Format, Format::kCompact>{});
      } else if (torch_rows(p.routing, p.top_k)) {
        build_units(std::integral_constant<Format, Format::kTorch>{});
      } else {
        build_units(std::integral_constant<Format, Format::kAny>{});
      }
    }
    if (p.sum == GradWSum::kCluster) {  // the cluster barriers count every thread of the cluster
      cluster_arrive_relaxed();
      cluster_wait();
      cluster_arrive_relaxed();
      cluster_wait();
    }
    if (p.sum == GradWSum::kSpread && thread < 32) {
      // The slice's counters, off the consumers' path: once the CTA's partial stores are
      // issued (barrier), count them (release) and wait until the slice's k partials are all
      // written (acquire), then let the consumers sum. The last CTA past the wait resets both
      // counters for the next launch, while the consumers' loads are in flight.
      const int slice = int(unit0 / tiles), k = p.per_slice;
      cutlass::arch::NamedBarrier::sync(kSpreadBarThreads, kBarPartialsOut);
      if (thread == 0) {
        red_release_add(p.tickets + slice);
        while (ld_acquire(p.tickets + slice) < k) {
        }
      }
      __syncwarp();
      cutlass::arch::NamedBarrier::arrive(kSpreadBarThreads, kBarPartialsIn);
      if (thread == 0 && ticket_acq_rel(p.readers + slice) == k - 1) {
        p.tickets[slice] = 0;
        p.readers[slice] = 0;
      }
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
  // Thread index within the tiled MMAs and grad_x's copy: both warpgroups' (kRoleSplit: each
  // warpgroup's MMA is its own).
  const int mma_thread = Cfg::kRoleSplit ? ct % 128 : ct;
  typename Cfg::MmaDgrad mma_d;
  typename Cfg::MmaWgrad mma_w;
  auto thr_d = mma_d.get_thread_slice(mma_thread);
  auto thr_w = mma_w.get_thread_slice(mma_thread);
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

  // grad_x: accumulator → staging (h, t) → TMA store of this warpgroup's 64 h × kTileT box.
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
    static_assert(Cfg::kWgradSteps == size<2>(decltype(tWrX){}), "k");
    CUTE_UNROLL
    for (int k = 0; k < Cfg::kWgradSteps; ++k)
      gemm(mma_w, tWrX(_, _, k, xs), tWrGt(_, _, k, gs), acc_w);
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
      if constexpr (Cfg::kRoleSplit) copy(p.tma_gx, tSsGX, tSgGX(_, slice, tile));
      else copy(p.tma_gx, tSsGX, tSgGX(_, 2 * slice + wg, tile));
      tma_store_arrive();
    }
  };

  const int64_t H = p.hidden;
  constexpr int kSlotFloats = kExperts * kTileH;
  constexpr int kVecsPerRow = kTileH / 4;             // 16-byte vectors per row of a slice
  constexpr int kSliceVecs = kExperts * kVecsPerRow;  // ... per slice of grad_w
  static_assert(kSliceVecs % 256 == 0, "a slice's vectors split evenly over the consumers");
  auto partial = [&](int64_t slice, int c) {
    return p.partials + LinearSchedule::slot(slice, c) * kSlotFloats;  // [E][kTileH]
  };

  // Vector v of a slice of grad_w: row e = v / kVecsPerRow.
  auto grad_w_at = [&](int64_t slice, int v) {  // its first element
    return (v / kVecsPerRow) * H + slice * kTileH + v % kVecsPerRow * 4;
  };
  auto grad_w_vec = [&](int64_t slice, int v) {  // f32 grad_w
    return reinterpret_cast<float4*>(static_cast<float*>(p.grad_w) + grad_w_at(slice, v));
  };
  // Vector v written: four floats, or four bf16 (8 bytes).
  auto store_grad_w_vec = [&](int64_t slice, int v, float4 f) {
    if (Cfg::kAnyK && p.grad_w_bf16) {  // (the fixed-K kernels write f32 grad_w alone)
      const __nv_bfloat162 lo = __floats2bfloat162_rn(f.x, f.y);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(f.z, f.w);
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.grad_w) + grad_w_at(slice, v);
      __stcg(reinterpret_cast<uint2*>(out), make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                       *reinterpret_cast<const uint32_t*>(&hi)));
    } else {
      __stcg(grad_w_vec(slice, v), f);
    }
  };

  // Vectors [v0, v1) of a slice of grad_w, summed over `sources` partials in source order
  // (after grad_w itself when accumulating) and written: thread ct takes v0 + ct + 256 j,
  // j < kPer. `part(r, v)` loads vector v of source r; the loads of kBatch sources are issued
  // before any is added, so a batch costs one round trip.
  auto sum_vectors = [&](int64_t slice, int v0, int v1, int sources, auto per, auto batch,
                         auto part) {
    constexpr int kPer = decltype(per)::value, kBatch = decltype(batch)::value;
    float4 sum[kPer];
    CUTE_UNROLL
    for (int j = 0; j < kPer; ++j) {
      const int v = v0 + ct + 256 * j;
      sum[j] = p.accumulate && v < v1 ? __ldcg(grad_w_vec(slice, v))
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int r0 = 0; r0 < sources; r0 += kBatch) {
      float4 in[kBatch][kPer];
      CUTE_UNROLL
      for (int b = 0; b < kBatch; ++b) {
        CUTE_UNROLL
        for (int j = 0; j < kPer; ++j) {
          const int v = v0 + ct + 256 * j;
          in[b][j] = r0 + b < sources && v < v1 ? part(r0 + b, v) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      CUTE_UNROLL
      for (int b = 0; b < kBatch; ++b) {
        if (r0 + b >= sources) break;
        CUTE_UNROLL
        for (int j = 0; j < kPer; ++j) {
          sum[j].x += in[b][j].x, sum[j].y += in[b][j].y;
          sum[j].z += in[b][j].z, sum[j].w += in[b][j].w;
        }
      }
    }
    CUTE_UNROLL
    for (int j = 0; j < kPer; ++j) {
      const int v = v0 + ct + 256 * j;
      if (v < v1) store_grad_w_vec(slice, v, sum[j]);
    }
  };
  // Share `rank` of k (k >= 2) of a slice, summed over the slice's k partials: as many sources
  // in flight as fit the registers.
  auto sum_share = [&](int64_t slice, int k, int rank, auto part) {
    const int v0 = rank * kSliceVecs / k, v1 = (rank + 1) * kSliceVecs / k;
    // Vectors per thread of the largest share of k (k >= 4: at most that of 4).
    constexpr auto per_thread = [](int k) { return ((kSliceVecs + k - 1) / k + 255) / 256; };
    if (k == 2) sum_vectors(slice, v0, v1, k, Int<per_thread(2)>{}, Int<2>{}, part);
    else if (k == 3) sum_vectors(slice, v0, v1, k, Int<per_thread(3)>{}, Int<3>{}, part);
    else sum_vectors(slice, v0, v1, k, Int<per_thread(4)>{}, Int<4>{}, part);
  };

  // grad_w of a segment that is the whole slice, straight to grad_w (kTileH = 128).
  // (Accumulating loads and adds element by element, one round trip each: it runs only where
  // one CTA takes a whole 128-column slice, H > 8448 at small T. Batching the loads, as the
  // kTileH = 64 kernel once did, changed this kernel's register allocation and slowed its
  // main loop by 4% at T = 32768.)
  // (f32 grad_w only: a bf16 one goes through a partial and reduce_grad_w, which writes either,
  // so that this store, and the main loop's registers, stay as they were.)
  auto write_grad_w = [&](int64_t slice) {
    Tensor gW = make_tensor(make_gmem_ptr(static_cast<float*>(p.grad_w) + slice * kTileH),
                            make_layout(Shape<Int<kTileH>, Int<kExperts>>{},
                                        make_stride(_1{}, H)));  // (h, e)
    Tensor tWgW = thr_w.partition_C(gW);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i) tWgW(i) = p.accumulate ? tWgW(i) + acc_w(i) : acc_w(i);
  };
  // grad_w of a part of a slice, as this CTA's partial of it.
  auto write_partial = [&](int64_t slice) {
    Tensor gP = make_tensor(make_gmem_ptr(partial(slice, cta)),
                            make_layout(Shape<Int<kTileH>, Int<kExperts>>{},
                                        make_stride(_1{}, Int<kTileH>{})));  // (h, e)
    Tensor tWgP = thr_w.partition_C(gP);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i) tWgP(i) = acc_w(i);
  };
  // kLastCta, after write_partial: the slice's ticket. Returns whether this CTA is the slice's
  // last contributor, which sums the partials once the tensor-core loop is over (only a CTA's
  // first and last segments can be partial: at most two per CTA).
  auto take_ticket = [&](int64_t slice) -> bool {
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
  // kLastCta: the partials of a slice summed in CTA order, the same bits whichever CTA
  // finishes last (ordered after the others' partials by take_ticket).
  auto reduce_grad_w = [&](int64_t slice) {
    const int first = sched.first_cta(slice), last = sched.last_cta(slice);
    sum_vectors(slice, 0, kSliceVecs, last - first + 1, Int<kSliceVecs / 256>{}, Int<1>{},
                [&](int r, int v) {
                  return __ldcg(reinterpret_cast<const float4*>(partial(slice, first + r)) + v);
                });
    if (ct == 0) p.tickets[slice] = 0;  // ready for the next launch
  };
  // kSpread and kCluster: the CTA's one segment is its slice's share `rank`. Its partial goes
  // to the (now idle) x stages as [E][kRedStride] fp32 first.
  constexpr int kRedStride = Cfg::kRedStride;
  static_assert(Cfg::kRoleSplit || kExperts * kRedStride * sizeof(float) <= sizeof(smem.x),
                "partial fits");
  float* red = reinterpret_cast<float*>(smem.x);
  auto staged_vec = [&](float* staged, int v) {  // vector v of a partial staged at `staged`
    return reinterpret_cast<float4*>(staged + (v / kVecsPerRow) * kRedStride +
                                     v % kVecsPerRow * 4);
  };
  auto red_vec = [&](int v) { return staged_vec(red, v); };
  // acc_w → [E][kRedStride] at `staged`, once both warpgroups are done with the stages.
  auto stage_acc_w = [&](float* staged) {
    Tensor cW = make_identity_tensor(Shape<Int<kTileH>, Int<Cfg::kWgradN>>{});  // (h, e) → (h, e)
    Tensor tWcW = thr_w.partition_C(cW);  // like acc_w
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i)
      staged[get<1>(tWcW(i)) * kRedStride + get<0>(tWcW(i))] = acc_w(i);
  };
  auto stage_partial = [&] {
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);  // both warpgroups done with sX
    stage_acc_w(red);
  };
  // kSpread: the other CTAs' shares of the partial go to global memory (16-byte stores); once
  // the slice's k CTAs have all written theirs (all are resident: the grid is at most one
  // CTA per SM; the producer's warp 0 keeps the count), each sums its share, its own part
  // from shared memory.
  auto reduce_grad_w_spread = [&](int slice) {
    const int k = p.per_slice, first = slice * k, rank = cta - first;
    const int own0 = rank * kSliceVecs / k, own1 = (rank + 1) * kSliceVecs / k;
    stage_partial();
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    float4* mine = reinterpret_cast<float4*>(partial(slice, cta));
    CUTE_UNROLL
    for (int j = 0; j < kSliceVecs / 256; ++j) {
      const int v = ct + 256 * j;
      if (v < own0 || v >= own1) __stcg(mine + v, *red_vec(v));
    }
    // The barrier orders the stores before warp 0's release (it synchronizes with its sync).
    cutlass::arch::NamedBarrier::arrive(kSpreadBarThreads, kBarPartialsOut);
    MOE_ROUTING_TRACE(ct == 0, 3);
    cutlass::arch::NamedBarrier::sync(kSpreadBarThreads, kBarPartialsIn);
    MOE_ROUTING_TRACE(ct == 0, 6);
    sum_share(slice, k, rank, [&](int r, int v) {
      return r == rank ? *red_vec(v)
                       : __ldcg(reinterpret_cast<const float4*>(partial(slice, first + r)) + v);
    });
    MOE_ROUTING_TRACE(ct == 0, 7);
    // The other CTAs' lines of this share are dead once summed (only this CTA reads them):
    // dropped from L2, so that they are not written back to DRAM (6.6 MB per call at
    // H = 5120, 120 CTAs). Lines across a share's ends are left; the barrier: every thread's
    // loads of a line are done.
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    constexpr int kLineVecs = 8;  // 16-byte vectors per 128-byte line
    for (int line = (own0 + kLineVecs - 1) / kLineVecs + ct; line < own1 / kLineVecs; line += 256)
      for (int r = 0; r < k; ++r)
        if (r != rank) discard_l2_line(partial(slice, first + r) + line * kLineVecs * 4);
  };
  // kCluster: CTA r sums its share over the cluster's staged partials in rank order
  // (distributed shared memory).
  auto reduce_grad_w_cluster = [&](int slice) {
    stage_partial();
    cluster_arrive();  // every partial of the cluster in place
    cluster_wait();
    MOE_ROUTING_TRACE(ct == 0, 6);
    sum_share(slice, p.per_slice, cluster_rank(), [&](int r, int v) {
      return ld_dsmem_f32x4(map_dsmem(cute::cast_smem_ptr_to_uint(red_vec(v)), r));
    });
    MOE_ROUTING_TRACE(ct == 0, 7);
    cluster_arrive();  // done reading the other CTAs' partials
    cluster_wait();    // and they are done reading this one's
  };

  // kRoleSplit (the host gives each CTA one whole slice): warpgroup 1's grad_w of the slice,
  // staged as [E][kRedStride] in the idle G stages, then written (after grad_w itself when
  // accumulating) by all consumer threads in 16-byte vectors, a thread's grad_w loads all in
  // flight at once. `stage`: false_type for warpgroup 0, which holds no grad_w (so the compiler
  // keeps no accumulators of wgrad live in its loop). The two instantiations meet through
  // mbarriers, not a named barrier: `bar.sync` is the aligned form, which every participant
  // must reach at the same instruction.
  auto write_grad_w_role_split = [&](int64_t slice, auto stage) {
    static_assert(!Cfg::kRoleSplit || kExperts * kRedStride * sizeof(float) <= sizeof(smem.g),
                  "partial fits");
    float* staged = reinterpret_cast<float*>(smem.g);
    if constexpr (decltype(stage)::value) {
      // Warpgroup 1, once warpgroup 0's last dgrad is done with sG (it reads the stages in unit
      // order, and the producer has built its last G).
      const int last = total - 1;
      Barrier::wait(&smem.g_empty[last % kStagesG], (last / kStagesG) & 1);
      stage_acc_w(staged);
      Barrier::arrive(&smem.grad_w_staged);  // (release: the staging stores)
    }
    Barrier::wait(&smem.grad_w_staged, 0);  // all of it staged (both warpgroups read it)
    auto part = [&](int, int v) { return *staged_vec(staged, v); };
    // In two halves: fewer registers live (more made ptxas spill in the main loop).
    constexpr int kHalf = kSliceVecs / 2;
    static_assert(kHalf % 256 == 0, "whole vectors per thread");
    sum_vectors(slice, 0, kHalf, 1, Int<kHalf / 256>{}, Int<1>{}, part);
    sum_vectors(slice, kHalf, kSliceVecs, 1, Int<kHalf / 256>{}, Int<1>{}, part);
  };

  // A segment (this CTA's units of one slice) starts with the slice's w and a zero grad_w.
  auto begin_segment = [&](int slice) {
    load_w(slice);
    clear(acc_w);
    warpgroup_fence_operand(acc_w);
  };

  int64_t reduce0 = -1, reduce1 = -1;  // kLastCta: slices this CTA sums at the end
  if constexpr (Cfg::kRoleSplit) {
    // Warpgroup 0: dgrad and grad_x of each unit (G alone). Warpgroup 1: wgrad of each unit
    // (x and G), the next unit's issued before the previous one's is waited for (the same
    // accumulators: the wgmmas run in order), so that its tensor work runs back to back while
    // warpgroup 0 stores grad_x. One segment per CTA: its slice.
    if (count > 0) {
      UnitCursor unit(unit0, tiles);
      const int slice = unit.slice;
      if (wg == 0) {
        load_w(slice);
        for (int n = 0; n < total; ++n) {
          if (n == count) unit = UnitCursor(unit0, tiles);  // the second sweep starts over
          const int tile = unit.tile;
          unit.next(tiles);
          const int s = n % kStagesG;
          Barrier::wait(&smem.g_full[s], (n / kStagesG) & 1);
          MOE_ROUTING_TRACE(ct == 0 && n == 0, 2);
          if (!residual_at(n)) {  // (G's residual: wgrad alone)
            issue_dgrad(n);
            staging_free();
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_d);
          }
          Barrier::arrive(&smem.g_empty[s]);
          if (!residual_at(n)) store_grad_x(slice, tile);
          MOE_ROUTING_TRACE(ct == 0 && n < 48, 16 + n);
        }
        write_grad_w_role_split(slice, cute::false_type{});
      } else {
        clear(acc_w);
        warpgroup_fence_operand(acc_w);
        for (int n = 0; n < total; ++n) {
          wait_unit(n);
          issue_wgrad(n);
          if (n > 0) {
            warpgroup_wait<1>();  // wgrad(n - 1) done
            release_unit(n - 1);
          }
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_w);
        release_unit(total - 1);
        write_grad_w_role_split(slice, cute::true_type{});
      }
    }
  } else if (count > 0) {
    UnitCursor unit(unit0, tiles);
    int seg_first_tile = unit.tile;
    begin_segment(unit.slice);
    // Cfg::kSkew: warpgroup 1 issues its first unit once warpgroup 0 has issued its first (its
    // grad_x store included; with two sweeps the first unit is a residual one and has none),
    // so that from then on one warpgroup's wgmmas tend to run while the other stores and
    // waits. An mbarrier, once per launch.
    if (Cfg::kSkew && p.skew && wg == 1) Barrier::wait(&smem.skew, 0);
    for (int n = 0; n < total; ++n) {
      if (n == count) unit = UnitCursor(unit0, tiles);  // the second sweep starts over
      const int slice = unit.slice, tile = unit.tile;
      unit.next(tiles);
      wait_unit(n);
      MOE_ROUTING_TRACE(ct == 0 && n == 0, 2);
      if (residual_at(n)) {  // G's residual: grad_x comes from G
        issue_wgrad(n);
      } else {
        issue_dgrad(n);
        issue_wgrad(n);
        staging_free();
        warpgroup_wait<1>();  // dgrad(n) done; wgrad(n) may still run
        warpgroup_fence_operand(acc_d);
        store_grad_x(slice, tile);
      }
      if (Cfg::kSkew && p.skew && n == 0 && ct == 0) Barrier::arrive(&smem.skew);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_w);
      release_unit(n);
      MOE_ROUTING_TRACE(ct == 0 && n < 48, 16 + n);
      // (Two sweeps: one segment, which ends with the second.)
      const bool segment_ends = n + 1 == total || (total == count && tile == tiles - 1);
      if (segment_ends && p.sum == GradWSum::kLastCta) {
        if (seg_first_tile == 0 && tile == tiles - 1 && !(Cfg::kAnyK && p.grad_w_bf16)) {
          write_grad_w(slice);
        } else {
          write_partial(slice);
          if (take_ticket(slice)) {
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
  }
  warpgroup_wait<0>();  // (all done already; tells the compiler so before the branches below)
  if constexpr (!Cfg::kRoleSplit) {
    if (p.sum == GradWSum::kCluster) reduce_grad_w_cluster(int(unit0 / tiles));
    if (p.sum == GradWSum::kSpread) reduce_grad_w_spread(int(unit0 / tiles));
    if (reduce0 >= 0) reduce_grad_w(reduce0);
    if (reduce1 >= 0) reduce_grad_w(reduce1);
  }
  MOE_ROUTING_TRACE(ct == 0, 4);
  if (leader) tma_store_wait<0>();
  MOE_ROUTING_TRACE(ct == 0, 5);
}

}  // namespace moe_routing::kernels::fused_backward
