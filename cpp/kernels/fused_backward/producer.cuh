// The fused backward's producer warpgroup: per unit, the TMA load of the x tile (thread 0) and
// the routing gradient G, one row per builder thread, into kStagesG shared-memory stages.
//
// G starts all zero (the kernel clears it); a builder then sets its row's K entries and clears
// the ones it set in that stage before. Each unit's routing inputs are loaded a unit ahead and
// packed into a row (PackedRow) at the end of the previous iteration, so that their latency
// hides behind a whole build. x is issued kStagesX - kStagesG + 1 units before it is consumed.
//
// Barriers (pipeline.cuh), per unit n:
//   x_full   1 arrival (the TMA issuer's expect-tx) + the tile's bytes
//   x_empty  wgrad's threads, once their wgmmas have read the tile
//   g_full   kBuilders arrivals (every builder, its row stored and fenced)
//   g_empty  every consumer thread, once both GEMMs have read the stage
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/fused_backward/config.cuh"
#include "kernels/fused_backward/routing_grad_tile.cuh"
#include "kernels/fused_backward/schedule.cuh"
#include "kernels/fused_backward/sync.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

// The producer warpgroup's thread `thread` (0..127) over the CTA's units (`work`).
template <class Cfg, class P>
__device__ __forceinline__ void produce(const P& p, typename Cfg::SharedStorage& smem,
                                        const CtaWork& work, int thread) {
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using XRing = Ring<Cfg::kStagesX>;
  using GRing = Ring<Cfg::kStagesG>;
  constexpr int kTileT = Cfg::kTileT, kTileH = Cfg::kTileH, kExperts = Cfg::kExperts;
  constexpr int kStagesX = Cfg::kStagesX, kStagesG = Cfg::kStagesG;
  const int64_t unit0 = work.unit0;
  const int count = work.count, total = work.total, tiles = work.tiles, cta = work.cta;
  auto rounding_at = [&](int n) {
    return work.residual_at(n) ? GradRounding::kResidual
                               : p.torch_bf16 ? GradRounding::kTorchBf16 : GradRounding::kBf16;
  };
  Tensor sX = make_tensor(make_smem_ptr(smem.x), typename Cfg::SmemLayoutX{});  // (h, t, stage)

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
    const int s = XRing::stage(n);
    XRing::wait_free(smem.x_empty, n);
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
  // Compact rows, 128-column kernels: the first x tiles once past the grid barrier, so that they
  // do not queue ahead of the compaction's loads and the barrier's atomics (backward v32: 0.3-0.7
  // us faster a call; the 64-column kernels 0.1-0.4 us slower so, with w's slice also delayed).
  const bool x_after_barrier = Cfg::kAnyK && !Cfg::kRoleSplit && p.compact != nullptr;
  if (thread == 0 && !x_after_barrier)
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
      const int s = GRing::stage(n);
      if (n + 1 < total) load_routing(n + 1);
      GRing::wait_free(smem.g_empty, n);
      MOE_ROUTING_TRACE(thread == 0 && n < kTraceUnits, kTraceStageFree + n);
      if (thread == 0 && n + kAhead < total) load_x(n + kAhead);
      store_routing_grad_row<kTileT>(g_stages + s * kGStageBytes, thread,
                                     smem.set_experts[s][thread], row);
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes → wgmma reads
      GRing::arrive(smem.g_full, n);
      MOE_ROUTING_TRACE(thread == 0 && n == 0, 9);
      MOE_ROUTING_TRACE(thread == 0 && n < kTraceUnits, kTraceGBuilt + n);
      if (n + 1 < total)
        row = pack_routing_grad_row<kExperts>(loaded, p.routing, p.scale, p.norm,
                                              rounding_at(n + 1));
    }
  };
  // Compact rows: the producers of all CTAs first pack every token's G row once (token t by
  // thread t / ctas % 128 of CTA t % ctas, or with Cfg::kQuadRows by a quad of lanes), into
  // global memory; once all CTAs have (a grid barrier: the grid is at most one CTA per SM, all
  // resident), each unit reads its tile's
  // packed rows (32 bytes a token) instead of gathering and packing them again, as every one
  // of the H / kTileH slices' units did: that per-unit gather and packing kept the PyTorch
  // dtypes 1.6x slower than the training dtypes at T = 1264 (backward v22).
  // `format`: how the inputs are read (kTorch: PyTorch's K = 8 rows; else kAny).
  auto compact_routing_rows = [&](auto format) {
    if constexpr (Cfg::kAnyK) {
      const int64_t ctas = gridDim.x;
      using Torch = TokenRouting<Cfg::kTopK, RowFormat::kTorch>;
      auto by_threads = [&] {  // a thread per token
        for (int64_t t = cta + ctas * thread; t < p.tokens; t += ctas * kTileT) {
          TokenRouting<Cfg::kTopK, decltype(format)::value> r;
          if constexpr (decltype(format)::value == RowFormat::kTorch) r.load_direct(p.routing, t);
          else r.load(p.routing, t, p.tokens, p.top_k);
          store_compact_row(p.compact, t,
                            pack_routing_grad_row<kExperts>(r, p.routing, p.scale, p.norm,
                                                            rounding_at(0)));
          MOE_ROUTING_TRACE(thread == 0 && t == cta, 11);  // its first row stored
        }
      };
      // A quad of lanes per token (load_quad): the CTA's tokens cta + ctas * i, 32 a pass;
      // every lane runs every pass (the quads' shuffles).
      auto by_quads = [&] {
        constexpr int kQuads = kTileT / 4;
        const int quad = thread / 4, sub = thread % 4;
        const int64_t mine = p.tokens > cta ? (p.tokens - cta + ctas - 1) / ctas : 0;
        for (int64_t i0 = 0; i0 < mine; i0 += kQuads) {
          const int64_t i = i0 + quad, t = cta + ctas * i;
          Torch r;
          // Misc stamps: loads issued, back, row packed. (The last two read what they follow,
          // a score no bf16 can be and a valid mask no row has, so that they are not hoisted.)
          MOE_ROUTING_TRACE(thread == 0 && i0 == 0, kTraceMisc + 0);
          r.template load_quad<kExperts>(p.routing, t, i < mine, sub);
          MOE_ROUTING_TRACE(thread == 0 && i0 == 0 && r.score[0] != 0x1ffffu, kTraceMisc + 1);
          const PackedRow<Cfg::kTopK> row =
              pack_routing_grad_row<kExperts>(r, p.routing, p.scale, p.norm, rounding_at(0));
          MOE_ROUTING_TRACE(thread == 0 && i0 == 0 && row.valid != ~0u, kTraceMisc + 2);
          if (i < mine && sub == 0) store_compact_row(p.compact, t, row);
          MOE_ROUTING_TRACE(thread == 0 && i0 == 0, 11);  // its first row stored
        }
      };
      if constexpr (decltype(format)::value == RowFormat::kTorch && Cfg::kQuadRows) {
        if (Torch::template quad_rows<kExperts>(p.routing)) by_quads();
        else by_threads();
      } else {
        by_threads();
      }
      // One release for the CTA (the barrier orders every builder's stores before it); the
      // counters are reset for the next launch once the CTA's units are built
      // (grid_barrier_leave, off the path to the first unit).
      cutlass::arch::NamedBarrier::sync(Cfg::kBuilders, kBarBuilders);
      MOE_ROUTING_TRACE(thread == 0, 12);  // the CTA's rows stored
      // The 64-column kernels' w slice (2-byte gathers by the dgrad warpgroup) from here on, so
      // that it does not queue ahead of the rows' loads (backward v33).
      if constexpr (Cfg::kRoleSplit) cutlass::arch::NamedBarrier::arrive(128 + 128, kBarRowsStored);
      if (thread == 0)
        grid_barrier(p.compact_counters, int(ctas),
                     [] { MOE_ROUTING_TRACE(true, 13); });  // every CTA's arrival seen
      cutlass::arch::NamedBarrier::sync(Cfg::kBuilders, kBarBuilders);
      MOE_ROUTING_TRACE(thread == 0, 14);  // past the barrier (10: unit 0's x stage arrived)
      if (thread == 0 && x_after_barrier)
        for (int n = 0; n < kAhead && n < total; ++n) load_x(n);
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
      if constexpr (Cfg::kCompactAnyRows) {
        if (torch_rows(p.routing, p.top_k))
          compact_routing_rows(std::integral_constant<Format, Format::kTorch>{});
        else
          compact_routing_rows(std::integral_constant<Format, Format::kAny>{});
      } else {
        compact_routing_rows(std::integral_constant<Format, Format::kTorch>{});  // (the host's)
      }
      build_units(std::integral_constant<Format, Format::kCompact>{});
      if (thread == 0) grid_barrier_leave(p.compact_counters, int(gridDim.x));
    } else if (torch_rows(p.routing, p.top_k)) {
      build_units(std::integral_constant<Format, Format::kTorch>{});
    } else {
      build_units(std::integral_constant<Format, Format::kAny>{});
    }
  }
}

}  // namespace moe_routing::kernels::fused_backward
