// The fused forward kernel (sm90a): logits = x·wᵀ (bf16 → fp32) and the whole routing in one pass.
//
// Grid: kSplit CTAs per kTileT-token tile of tiles [tile0, tile0 + grid / kSplit), in clusters of
// kSplit (cluster size 1, 2, 3, 4, 6, 8 or 16, chosen per T by the host so that the grid fills
// the SMs; a partly filled last wave may go to a second launch with a larger split); the
// cluster owns one tile and splits the hidden dimension among its CTAs.
// Warp roles (three warpgroups, one CTA per SM):
//   producer   (warpgroup 0): one thread issues the TMA loads of x and w.
//   consumers  (warpgroups 1, 2): wgmma 64×E×16 (128-token tiles) or 64×(E/2)×16 (64-token
//                                  tiles), or both (192-token tiles: mainloop.cuh
//                                  consume_tall), fp32 accumulators in registers.
// Then, with no global traffic:
//   barrier 1       the CTA's consumers are past the main loop: its pipeline smem may be
//                   overwritten (CTA-local: no CTA waits for the cluster's slowest main loop)
//   each consumer stores its partial logits (all kTileT rows) into its own CTA's buffer
//   cluster sync 2  every partial is in place
//   the owner of rows [⌊r·kTileT/kSplit⌋, ⌊(r+1)·kTileT/kSplit⌋) (rank r) reads those rows from
//   every CTA of the cluster (16-byte distributed-shared-memory loads, all of a thread's in
//   flight at once: split_sum.cuh), sums them in rank order (the same bits every run) over its
//   own copy of the rows, which no other CTA reads, and routes them. top_k <= 8: the scores
//   (from the accumulators where there is no split, else from the sums), then one warp per
//   token where the CTA has at most 16 rows and the groups are whole lanes (route_redux.cuh),
//   else 2 to 16 lanes per token (route_thread.cuh). top_k > 8: 8 lanes per token, 32 token
//   slots over the 8 consumer warps, two tokens per slot and pass where the CTA has more than
//   32 rows (route.cuh). Above 256 experts (64-token tiles), every top_k takes the few-lanes
//   routing, with lists of 16 where top_k > 8. A CTA leaves only once every CTA is done reading
//   its buffer (arrive / wait).
#pragma once

#include <cooperative_groups.h>
#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "kernels/cluster.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/fused_forward/cluster_sizes.h"
#include "kernels/fused_forward/config.cuh"
#include "kernels/fused_forward/mainloop.cuh"
#include "kernels/fused_forward/route.cuh"
#include "kernels/fused_forward/route_redux.cuh"
#include "kernels/fused_forward/route_thread.cuh"
#include "kernels/fused_forward/split_sum.cuh"

namespace moe_routing::kernels::fused_forward {

using namespace cute;

template <class TmaX, class TmaW>
struct Params {
  TmaX tma_x;  // x as (T, H)
  TmaW tma_w;  // w as (E, H), E = route.experts <= kExperts (the rows beyond arrive as zeros)
  const float* bias = nullptr;
  void* topk_idx = nullptr;  // [T, K] int32, or int64 where idx_i64
  bool idx_i64 = false;
  float* topk_weights = nullptr;
  float* topk_scores = nullptr;
  float* scores = nullptr;   // [T, E] or null
  int32_t* counts = nullptr;  // [E] (zeroed by the host) or null
  int64_t tokens = 0;
  int hidden = 0;
  int hblocks = 0;  // ⌈H / kTileH⌉ >= cluster size
  int tile0 = 0;    // token tile of the first cluster
  RouteParams route{};
};

enum : uint32_t { kBarConsumers = 1 };  // named barrier (0 is __syncthreads)

// Calls f(Int<split>) where split is an entry of kClusterSizes (cluster_sizes.h): every listed
// cluster size has its instantiation, and no other.
template <class F, size_t... I>
__device__ __forceinline__ void with_cluster_size(int split, F&& f, std::index_sequence<I...>) {
  (void)((split == Int<kClusterSizes[I]>::value ? (f(Int<kClusterSizes[I]>{}), true) : false) ||
         ...);
}
template <class F>
__device__ __forceinline__ void with_cluster_size(int split, F&& f) {
  with_cluster_size(split, f, std::make_index_sequence<kNumClusterSizes>{});
}

constexpr int kRouteWidth = 8;  // lanes per token in the routing epilogue

template <class Cfg, class P>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fused_forward_sm90(__grid_constant__ const P p) {
  namespace cg = cooperative_groups;
  using Storage = typename Cfg::SharedStorage;
  constexpr int kTileT = Cfg::kTileT, kExperts = Cfg::kExperts, kStride = Cfg::kRedStride;
  using Route = TokenRoute<kExperts, kRouteWidth>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(smem_raw);

  cg::cluster_group cluster = cg::this_cluster();
  const int split = int(cluster.num_blocks());  // grid.x is a multiple of it (host)
  const int rank = int(cluster.block_rank());
  const int tile = p.tile0 + int(blockIdx.x) / split;
  const int kb_begin = rank * p.hblocks / split;
  const int kb_end = (rank + 1) * p.hblocks / split;  // non-empty: split <= hblocks
  // Rows this CTA routes: [row0_local, row0_local + rows), kTileT / split of them (±1 where the
  // cluster size does not divide kTileT).
  const int row0_local = rank * kTileT / split;
  const int rows = (rank + 1) * kTileT / split - row0_local;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    // Descriptors are parameters, not outputs of the previous kernel: fetch them before waiting.
    prefetch_tma_descriptor(p.tma_x.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
    for (int s = 0; s < Cfg::kStages; ++s) {
      FullBarrier::init(&smem.full[s], 1);
      EmptyBarrier::init(&smem.empty[s], 128 * Cfg::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  for (int e = threadIdx.x; e < kExperts; e += Cfg::kThreads) smem.counts[e] = 0;
  MOE_ROUTING_TRACE(threadIdx.x == 0, 0);
  __syncthreads();
  allow_dependent_grids();
  wait_for_prior_grids();  // global memory from here on
  MOE_ROUTING_TRACE(threadIdx.x == 0, 1);

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0)
      produce<Cfg>(smem, p.tma_x, p.tma_w, p.tokens, p.hidden, p.route.experts, tile, kb_begin,
                   kb_end);
    cluster.sync();  // 2: partials in place; the producer has nothing more to do
    cluster_arrive_relaxed();  // 3: (nothing read from other CTAs)
    cluster_wait();
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // 0..255
  // The bias for the routing, an expert or two per thread: loaded now, its latency hidden behind
  // the main loop, stored to shared memory after it (barrier 1 orders the store before the
  // routing's reads).
  constexpr int kBiasPer = (kExperts + 128 * Cfg::kConsumers - 1) / (128 * Cfg::kConsumers);
  float bias_e[kBiasPer];
  CUTE_UNROLL
  for (int i = 0; i < kBiasPer; ++i) {
    const int e = ct + i * 128 * Cfg::kConsumers;
    // Masked experts (e >= E): a NaN bias. Their choice values are NaN, which ranks below
    // every number and, on ties, after every lower index: never chosen over a real expert.
    bias_e[i] = e < p.route.experts ? p.bias[e] : __uint_as_float(0x7FC00000u);
  }
  typename Cfg::Mma mma;
  // 192-token tiles: rows [0, 128) in `acc` (as a 128-token tile's), rows [128, 192) in acc_hi.
  constexpr int kRowsHi = Cfg::kRowsHi, kRowsLo = kTileT - kRowsHi;
  using RowsLo = Int<kRowsLo>;
  typename Cfg::MmaHi mma_hi;
  using HiShape = Shape<_64, typename Cfg::Experts>;
  using AccHi = std::conditional_t<(kRowsHi > 0),
                                   decltype(partition_fragment_C(mma_hi, HiShape{})), int>;
  Tensor acc = partition_fragment_C(mma, Shape<RowsLo, typename Cfg::Experts>{});  // (MMA, MMA_M, MMA_N)
  AccHi acc_hi;  // (MMA, MMA_M, MMA_N) of rows [128, 192)
  if constexpr (kRowsHi > 0) consume_tall<Cfg>(smem, ct, kb_begin, kb_end, acc, acc_hi);
  else consume<Cfg>(smem, ct, kb_begin, kb_end, acc);
  CUTE_UNROLL
  for (int i = 0; i < kBiasPer; ++i) {
    const int e = ct + i * 128 * Cfg::kConsumers;
    if (e < kExperts) smem.bias[e] = bias_e[i];
  }
  MOE_ROUTING_TRACE(ct == 0, 3);

  // 1: both consumer warpgroups are done with the pipeline buffers (every TMA load has landed
  // and been read), so the partials may overwrite them. CTA-local: no other CTA writes this
  // CTA's shared memory before barrier 2, so each CTA stores its partial without waiting for
  // the slowest main loop of the cluster.
  cutlass::arch::NamedBarrier::sync(128 * Cfg::kConsumers, kBarConsumers);
  MOE_ROUTING_TRACE(ct == 0, 4);

  // Partial logits → this CTA's buffer, rows as in the tile, by coordinate: no assumption on
  // the accumulator's register layout beyond pairs of adjacent experts (8-byte stores).
  float* red = smem.buf.red;
  using ThreadRoute = fused_forward::ThreadRoute<kExperts>;
  // Above 256 experts every top_k takes the few-lanes routing (the 8-lane one would hold 48-64
  // experts a lane in registers), with lists of 16 where top_k > 8, but for few rows at 512
  // experts and top_k > 8 (a warp per token, below).
  using LongRoute = fused_forward::ThreadRoute<kExperts, 16>;
  const bool thread_route =
      (p.route.top_k <= ThreadRoute::kMaxTopK || Cfg::kWide) &&
      p.route.n_group <= ThreadRoute::kMaxGroups;
  // Without a split the accumulators are the logits: the few-lanes routing takes their scores,
  // computed here from registers (0 + x: the bits of a sum that starts at zero).
  const bool scores_now = thread_route && split == 1;
  {
    Tensor cC = make_identity_tensor(Shape<RowsLo, typename Cfg::Experts>{});  // (t, e) → (t, e)
    Tensor tCcC = mma.get_thread_slice(ct).partition_C(cC);  // (MMA, MMA_M, MMA_N), like acc
    static_assert(decltype(size(tCcC))::value == decltype(size(acc))::value, "coordinates");
    static_assert(size<0, 0>(decltype(tCcC){}) == 2, "accumulator pairs run along e");
    auto store_frag = [&](auto& frag, auto& coords, float* dst, auto transform) {
      CUTE_UNROLL
      for (int i = 0; i < size(frag); i += 2) {
        const int m = get<0>(coords(i)), e = get<1>(coords(i));
        *reinterpret_cast<float2*>(dst + m * kStride + e) =
            make_float2(transform(frag(i)), transform(frag(i + 1)));
      }
    };
    auto store = [&](auto transform) {
      store_frag(acc, tCcC, red, transform);
      if constexpr (kRowsHi > 0) {
        Tensor cH = make_identity_tensor(HiShape{});  // (t, e) → (t, e)
        Tensor tHcH = mma_hi.get_thread_slice(ct).partition_C(cH);  // like acc_hi
        static_assert(decltype(size(tHcH))::value == decltype(size(acc_hi))::value, "coordinates");
        store_frag(acc_hi, tHcH, red + kRowsLo * kStride, transform);
      }
    };
    if (scores_now) store([](float x) { return sigmoid(0.0f + x); });
    else store([](float x) { return x; });
  }

  cluster.sync();  // 2: every partial is in place
  MOE_ROUTING_TRACE(ct == 0, 5);

  // This CTA's rows, summed over the cluster in rank order into its own copy of them; for the
  // few-lanes routing, as scores (and to the optional full-scores output).
  const int64_t row0 = int64_t(tile) * kTileT + row0_local;
  auto sum_split = [&](auto split_c) {
    constexpr int kSplit = decltype(split_c)::value;
    split_sum<kSplit, kTileT, kExperts, kStride, 128 * Cfg::kConsumers>(
        red, row0_local, rows, ct, thread_route, p.scores, row0, p.tokens, p.route.experts);
  };
  static_assert(is_cluster_size(Cfg::kMaxSplit), "the largest cluster is instantiated");
  with_cluster_size(split, [&](auto k) {
    if constexpr (decltype(k)::value > 1) sum_split(k);  // 1: the accumulators were the sums
  });
  cluster_arrive();  // 3: done reading the other CTAs' buffers (waited for before leaving)
  cutlass::arch::NamedBarrier::sync(128 * Cfg::kConsumers, kBarConsumers);  // sums → routing
  MOE_ROUTING_TRACE(ct == 0, 6);

  const RouteOut out{p.topk_idx, p.topk_weights, p.topk_scores, p.scores,
                     p.counts ? smem.counts : nullptr, p.idx_i64};
  if (thread_route) {
    // The scores are in place (from the accumulators or the split sum, bias loaded before the
    // main loop, both before the barrier above); without a split, the optional full-scores
    // output from them. Then a few lanes per token (route_thread.cuh).
    float* own = red + row0_local * kStride;
    if (split == 1 && p.scores) {
      const int vecs_per_row = p.route.experts / 4;  // (the masked experts have no scores)
      for (int v = ct; v < rows * vecs_per_row; v += 128 * Cfg::kConsumers) {
        const int r = v / vecs_per_row, c = v % vecs_per_row * 4;
        const float4 sv = *reinterpret_cast<const float4*>(own + r * kStride + c);
        const int64_t t = row0 + r;
        if (t < p.tokens) {
          float* dst = p.scores + t * p.route.experts + c;
          dst[0] = sv.x, dst[1] = sv.y, dst[2] = sv.z, dst[3] = sv.w;
        }
      }
    }
    MOE_ROUTING_TRACE(ct == 0, 9);
    static_assert(ThreadRoute::kMaxGroups * kTileT <= Cfg::kScratchRows * kStride, "group keys");
    // As many lanes per token as the 256 consumer threads allow (a power of two). Whole warps
    // take part (the lanes of a token shuffle with full masks): where the cluster size does not
    // divide kTileT (kUneven: 3 or 6 CTAs, 21 to 43 rows), the last warp's spare lane groups
    // route a copy of the last row, with group keys of their own and no outputs.
    // `base`: the first of the rows routed (a second pass where a CTA has more rows than 128).
    auto route = [&](auto lanes, auto uneven, int base = 0) {
      constexpr int kLanes = decltype(lanes)::value;
      constexpr bool kUneven = decltype(uneven)::value;
      const int r = base + ct / kLanes;
      if (kUneven ? (r & ~(32 / kLanes - 1)) < rows : r < rows) {
        const int row = kUneven && r >= rows ? rows - 1 : r;
        uint32_t* group_keys = reinterpret_cast<uint32_t*>(red + kTileT * kStride) + r;
        auto run = [&](auto route_c) {
          decltype(route_c)::template run<kLanes>(own + row * kStride, smem.bias, group_keys,
                                                  kTileT, p.route, out, row0 + r,
                                                  (!kUneven || r < rows) && row0 + r < p.tokens,
                                                  ct % kLanes);
        };
        if constexpr (Cfg::kWide) {
          if (p.route.top_k > ThreadRoute::kMaxTopK) run(LongRoute{});
          else run(ThreadRoute{});
        } else {
          run(ThreadRoute{});
        }
      }
    };
    // At most 16 rows (small T, large clusters): one warp per token, one or two tokens per
    // warp at once (route_redux.cuh), whose chain is shorter than a few lanes' lists. At 512
    // experts only where top_k > 8, whose lists of 16 are the longer chain (an H100, 512 top-16,
    // 8 / 16 rows: 14.9 / 16.9 us -> 6.1 / 10.4); at top-8 (Kimi-K2: 16 rows 4.2 -> 4.6 us) and
    // from 32 rows (512 top-16: 64 rows 17.6 -> 34.1 us) the lists win. Not compiled into the
    // 384-expert kernel: there its mere presence slowed Kimi-K2's lists (T = 4096: 52.9 -> 55.7
    // us) (forward v17).
    constexpr int kWarps = 4 * Cfg::kConsumers;
    constexpr int kMaxLanes = ThreadRoute::kMaxLanes;
    const int lanes = (128 * Cfg::kConsumers) / rows;
    bool warp_per_token = false;
    constexpr bool kRedux = kExperts % 32 == 0 && (!Cfg::kWide || kExperts == 512);
    if constexpr (kRedux)  // (groups of whole lanes: no masked experts)
      warp_per_token = rows <= 2 * kWarps && p.route.experts == kExperts &&
                       (!Cfg::kWide || p.route.top_k > ThreadRoute::kMaxTopK) &&
                       ReduxRoute<kExperts>::supports(p.route);
    if (warp_per_token) {
      if constexpr (kRedux) {
        auto route_warps = [&](auto tok) {
          ReduxRoute<kExperts>::template run_rows<decltype(tok)::value>(
              own, kStride, rows, row0, p.tokens, ct / 32, kWarps, smem.bias, p.route, out);
        };
        if (rows <= kWarps) route_warps(Int<1>{});
        else route_warps(Int<2>{});
      }
    } else if (rows > 64 * Cfg::kConsumers) {
      // 192 rows (192-token tiles unsplit): 128 at 2 lanes each, then the rest at 4.
      static_assert(kTileT <= 96 * Cfg::kConsumers, "two passes");
      route(Int<cute::min(2, kMaxLanes)>{}, cute::false_type{});
      route(Int<cute::min(4, kMaxLanes)>{}, cute::false_type{}, 64 * Cfg::kConsumers);
    } else if (kTileT % split != 0) {
      if (lanes >= 8 && kMaxLanes >= 8) route(Int<cute::min(8, kMaxLanes)>{}, cute::true_type{});
      else route(Int<cute::min(4, kMaxLanes)>{}, cute::true_type{});
    } else if (lanes >= 16 && kMaxLanes >= 16) {
      route(Int<cute::min(16, kMaxLanes)>{}, cute::false_type{});
    } else if (lanes >= 8 && kMaxLanes >= 8) {
      route(Int<cute::min(8, kMaxLanes)>{}, cute::false_type{});
    } else if (lanes >= 4 && kMaxLanes >= 4) {
      route(Int<cute::min(4, kMaxLanes)>{}, cute::false_type{});
    } else {
      route(Int<cute::min(2, kMaxLanes)>{}, cute::false_type{});
    }
  } else if constexpr (!Cfg::kWide) {  // (kWide: n_group <= 32, so always the above)
    const int warp = ct / 32, lane = ct % 32;
    const int slot = warp * (32 / kRouteWidth) + lane / kRouteWidth;  // token slot in a pass
    const int sub = lane % kRouteWidth;
    float bias[Route::kPer];
    CUTE_UNROLL
    for (int i = 0; i < Route::kPer; ++i) bias[i] = smem.bias[sub + kRouteWidth * i];
    int gid[Route::kPer];
    Route::groups(p.route, gid);
    constexpr int kSlots = Cfg::kConsumers * 4 * (32 / kRouteWidth);  // token slots: 32
    static_assert(2 * kSlots == Cfg::kScratchRows, "one scratch row per token of a pass");
    // A pass routes kTok tokens per slot (uniform trip count: shuffles inside). Two where the
    // CTA has the rows for it and the registers (up to 20 experts per lane; more would spill).
    auto pass = [&](auto tok, int r0) {
      constexpr int kTok = decltype(tok)::value;
      float logit[kTok][Route::kPer];
      float* choice_row[kTok];
      int64_t t[kTok];
      bool valid[kTok];
      CUTE_UNROLL
      for (int u = 0; u < kTok; ++u) {
        const int r = r0 + u * kSlots + slot;
        const bool in = r < rows;
        t[u] = row0 + r;
        valid[u] = in && t[u] < p.tokens;
        choice_row[u] = red + (kTileT + u * kSlots + slot) * kStride;  // scratch after the rows
        CUTE_UNROLL
        for (int i = 0; i < Route::kPer; ++i)  // (0 + x: the bits of a sum that starts at zero)
          logit[u][i] = in ? 0.0f + red[(row0_local + r) * kStride + sub + kRouteWidth * i] : 0.0f;
      }
      Route::template run<kTok>(logit, bias, gid, choice_row, p.route, out, t, valid);
    };
    if constexpr (Route::kPer <= 20) {
      if (rows > kSlots) {
        for (int r0 = 0; r0 < rows; r0 += 2 * kSlots) pass(Int<2>{}, r0);
      } else {
        pass(Int<1>{}, 0);
      }
    } else {
      for (int r0 = 0; r0 < rows; r0 += kSlots) pass(Int<1>{}, r0);
    }
  }

  if (p.counts) {
    cutlass::arch::NamedBarrier::sync(128 * Cfg::kConsumers, kBarConsumers);
    for (int e = ct; e < kExperts; e += 128 * Cfg::kConsumers)
      if (smem.counts[e]) atomicAdd(p.counts + e, smem.counts[e]);
  }
  MOE_ROUTING_TRACE(ct == 0, 7);
  cluster_wait();  // 3: no CTA reads this one's buffer any more
  MOE_ROUTING_TRACE(ct == 0, 8);
}

}  // namespace moe_routing::kernels::fused_forward
