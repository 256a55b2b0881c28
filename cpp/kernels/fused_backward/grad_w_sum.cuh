// grad_w of the fused backward: each CTA's wgrad accumulators (acc_w, a slice's (h, e) in
// registers) written out, and the partials of a slice cut over several CTAs summed, bitwise
// deterministically in CTA order, in one of the GradWSum modes (schedule.cuh):
//   kLastCta  write_partial + take_ticket; the slice's last contributor runs reduce_grad_w.
//   kSpread   send_spread, then sum_spread: all k CTAs of the slice sum a share each, from
//             global memory, counted by the producer's warp 0 (grad_w_sum_producer). The two
//             halves may run apart (the kernel's last unit between).
//   kCluster  reduce_grad_w_cluster: the same from each other's shared memory.
// A segment that is a whole slice goes straight to grad_w (write_grad_w); the role-split kernels
// (kTileH = 64, one segment per CTA: kLastCta with one CTA per slice, or kSpread) through shared
// memory (stage_role_split, write_role_split).
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/cluster.cuh"
#include "kernels/fused_backward/config.cuh"
#include "kernels/fused_backward/schedule.cuh"
#include "kernels/fused_backward/sync.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/trace.cuh"

namespace moe_routing::kernels::fused_backward {

using namespace cute;

// The producer warpgroup's part in the sums, once its last G is built.
template <class P>
__device__ __forceinline__ void grad_w_sum_producer(const P& p, const CtaWork& work, int thread) {
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
    const int slice = int(work.unit0 / work.tiles), k = p.per_slice;
    cutlass::arch::NamedBarrier::sync(kSpreadBarThreads, kBarPartialsOut);
    MOE_ROUTING_TRACE(thread == 0, kTraceMisc + 4);  // the consumers' partials out
    if (thread == 0) {
      red_release_add(p.tickets + slice);
      while (ld_acquire(p.tickets + slice) < k) {
      }
    }
    MOE_ROUTING_TRACE(thread == 0, kTraceMisc + 5);  // the slice's k partials all out
    __syncwarp();
    cutlass::arch::NamedBarrier::arrive(kSpreadBarThreads, kBarPartialsIn);
    if (thread == 0 && ticket_acq_rel(p.readers + slice) == k - 1) {
      p.tickets[slice] = 0;
      p.readers[slice] = 0;
    }
  }
}

// A warpgroup's wgrad accumulators (h, e) of kN experts from e0 on, partitioned by thr_w, into
// rows e of kStride floats at `staged`.
template <int kTileH, int kN, int kStride, class ThrMmaW, class AccW>
__device__ __forceinline__ void stage_accumulators(const ThrMmaW& thr_w, const AccW& acc_w,
                                                   float* staged, int e0) {
  Tensor cW = make_identity_tensor(Shape<Int<kTileH>, Int<kN>>{});  // (h, e) → (h, e)
  Tensor tWcW = thr_w.partition_C(cW);                              // like acc_w
  CUTE_UNROLL
  for (int i = 0; i < size(acc_w); ++i)
    staged[(e0 + get<1>(tWcW(i))) * kStride + get<0>(tWcW(i))] = acc_w(i);
}

// The consumer threads' grad_w: thread ct (0..255) of the two consumer warpgroups, whose wgrad
// accumulators are acc_w (partitioned by thr_w).
template <class Cfg, class P, class ThrMmaW, class AccW>
struct GradWWriter {
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kTileH = Cfg::kTileH, kExperts = Cfg::kExperts;
  static constexpr int kStagesG = Cfg::kStagesG;
  static constexpr int kSlotFloats = kExperts * kTileH;
  static constexpr int kVecsPerRow = kTileH / 4;             // 16-byte vectors per row of a slice
  static constexpr int kSliceVecs = kExperts * kVecsPerRow;  // ... per slice of grad_w
  static_assert(kSliceVecs % 256 == 0, "a slice's vectors split evenly over the consumers");
  // kSpread and kCluster: the CTA's one segment is its slice's share `rank`. Its partial goes
  // to the (now idle) x stages as [E][kRedStride] fp32 first.
  static constexpr int kRedStride = Cfg::kRedStride;
  static_assert(Cfg::kRoleSplit ||
                    kExperts * kRedStride * sizeof(float) <= sizeof(Cfg::SharedStorage::x),
                "partial fits");

  const P& p;
  typename Cfg::SharedStorage& smem;
  const ThrMmaW& thr_w;
  AccW& acc_w;
  const LinearSchedule& sched;
  int ct, cta;
  int64_t H;   // p.hidden
  float* red;  // the staged partial (kSpread, kCluster)

  __device__ GradWWriter(const P& p_, typename Cfg::SharedStorage& smem_, const ThrMmaW& thr_w_,
                         AccW& acc_w_, const LinearSchedule& sched_, int ct_, int cta_)
      : p(p_), smem(smem_), thr_w(thr_w_), acc_w(acc_w_), sched(sched_), ct(ct_), cta(cta_),
        H(p_.hidden), red(reinterpret_cast<float*>(smem_.x)) {}

  __device__ __forceinline__ auto partial(int64_t slice, int c) const {
    return p.partials + LinearSchedule::slot(slice, c) * kSlotFloats;  // [E][kTileH]
  }

  // Vector v of a slice of grad_w: row e = v / kVecsPerRow.
  __device__ __forceinline__ auto grad_w_at(int64_t slice, int v) const {  // its first element
    return (v / kVecsPerRow) * H + slice * kTileH + v % kVecsPerRow * 4;
  }
  __device__ __forceinline__ auto grad_w_vec(int64_t slice, int v) const {  // f32 grad_w
    return reinterpret_cast<float4*>(static_cast<float*>(p.grad_w) + grad_w_at(slice, v));
  }
  // Vector v written: four floats, or four bf16 (8 bytes).
  __device__ __forceinline__ void store_grad_w_vec(int64_t slice, int v, float4 f) const {
    if (Cfg::kAnyK && p.grad_w_bf16) {  // (the fixed-K kernels write f32 grad_w alone)
      const __nv_bfloat162 lo = __floats2bfloat162_rn(f.x, f.y);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(f.z, f.w);
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.grad_w) + grad_w_at(slice, v);
      __stcg(reinterpret_cast<uint2*>(out), make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                       *reinterpret_cast<const uint32_t*>(&hi)));
    } else {
      __stcg(grad_w_vec(slice, v), f);
    }
  }

  // Vectors [v0, v1) of a slice of grad_w, summed over `sources` partials in source order
  // (after grad_w itself when accumulating) and written: thread ct takes v0 + ct + 256 j,
  // j < kPer. `part(r, v)` loads vector v of source r; the loads of kBatch sources are issued
  // before any is added, so a batch costs one round trip. (Cfg::kMaskedExperts: the kernel's
  // rows beyond the E it runs for, Params::experts, are neither read nor written.)
  template <int kPer, int kBatch, class Part>
  __device__ __forceinline__ void sum_vectors(int64_t slice, int v0, int v1, int sources,
                                              Int<kPer>, Int<kBatch>, Part&& part) const {
    if constexpr (Cfg::kMaskedExperts) v1 = cute::min(v1, p.experts * kVecsPerRow);
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
  }
  // The vectors [v0, v1) of share `rank` of k of a slice.
  struct Share {
    int v0, v1;
    __device__ Share(int rank, int k) : v0(rank * kSliceVecs / k), v1((rank + 1) * kSliceVecs / k) {}
  };
  // kSpread: the slice's first CTA and this CTA's rank among its k.
  __device__ __forceinline__ int spread_first(int slice) const { return slice * p.per_slice; }
  __device__ __forceinline__ int spread_rank(int slice) const { return cta - spread_first(slice); }

  // Share `rank` of k (k >= 2) of a slice, summed over the slice's k partials: as many sources
  // in flight as fit the registers.
  template <class Part>
  __device__ __forceinline__ void sum_share(int64_t slice, int k, int rank, Part&& part) const {
    const auto [v0, v1] = Share(rank, k);
    // Vectors per thread of the largest share of k (k >= 4: at most that of 4).
    constexpr auto per_thread = [](int k) { return ((kSliceVecs + k - 1) / k + 255) / 256; };
    if constexpr (per_thread(2) > kMaxPer) {
      sum_in_chunks(slice, v0, v1, k, Int<2>{}, part);  // (wide slices: fused_backward_wide)
    } else {
      if (k == 2) sum_vectors(slice, v0, v1, k, Int<per_thread(2)>{}, Int<2>{}, part);
      else if (k == 3) sum_vectors(slice, v0, v1, k, Int<per_thread(3)>{}, Int<3>{}, part);
      else sum_vectors(slice, v0, v1, k, Int<per_thread(4)>{}, Int<4>{}, part);
    }
  }
  // Vectors a thread sums at once where a share is larger (Config::kSumMaxPer).
  static constexpr int kMaxPer = Cfg::kSumMaxPer;
  // sum_vectors over [v0, v1) in chunks of kMaxPer vectors a thread, so that a batch's loads
  // stay within the registers.
  template <int kBatch, class Part>
  __device__ __forceinline__ void sum_in_chunks(int64_t slice, int v0, int v1, int sources,
                                                Int<kBatch>, Part&& part) const {
    for (int c0 = v0; c0 < v1; c0 += 256 * kMaxPer)
      sum_vectors(slice, c0, cute::min(v1, c0 + 256 * kMaxPer), sources, Int<kMaxPer>{},
                  Int<kBatch>{}, part);
  }

  // grad_w of a segment that is the whole slice, straight to grad_w (kTileH = 128).
  // (Accumulating loads and adds element by element, one round trip each: it runs only where
  // one CTA takes a whole 128-column slice, H > 8448 at small T. Batching the loads, as the
  // kTileH = 64 kernel once did, changed this kernel's register allocation and slowed its
  // main loop by 4% at T = 32768.)
  // (f32 grad_w only: a bf16 one goes through a partial and reduce_grad_w, which writes either,
  // so that this store, and the main loop's registers, stay as they were.)
  __device__ __forceinline__ void write_grad_w(int64_t slice) const {
    Tensor gW = make_tensor(make_gmem_ptr(static_cast<float*>(p.grad_w) + slice * kTileH),
                            make_layout(Shape<Int<kTileH>, Int<kExperts>>{},
                                        make_stride(_1{}, H)));  // (h, e)
    Tensor tWgW = thr_w.partition_C(gW);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i) tWgW(i) = p.accumulate ? tWgW(i) + acc_w(i) : acc_w(i);
  }
  // grad_w of a part of a slice, as this CTA's partial of it.
  __device__ __forceinline__ void write_partial(int64_t slice) const {
    Tensor gP = make_tensor(make_gmem_ptr(partial(slice, cta)),
                            make_layout(Shape<Int<kTileH>, Int<kExperts>>{},
                                        make_stride(_1{}, Int<kTileH>{})));  // (h, e)
    Tensor tWgP = thr_w.partition_C(gP);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_w); ++i) tWgP(i) = acc_w(i);
  }
  // kLastCta, after write_partial: the slice's ticket. Returns whether this CTA is the slice's
  // last contributor, which sums the partials once the tensor-core loop is over (only a CTA's
  // first and last segments can be partial: at most two per CTA).
  __device__ __forceinline__ bool take_ticket(int64_t slice) const {
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
  }
  // kLastCta: the partials of a slice summed in CTA order, the same bits whichever CTA
  // finishes last (ordered after the others' partials by take_ticket).
  __device__ __forceinline__ void reduce_grad_w(int64_t slice) const {
    const int first = sched.first_cta(slice), last = sched.last_cta(slice);
    sum_vectors(slice, 0, kSliceVecs, last - first + 1, Int<kSliceVecs / 256>{}, Int<1>{},
                [&](int r, int v) {
                  return __ldcg(reinterpret_cast<const float4*>(partial(slice, first + r)) + v);
                });
    if (ct == 0) p.tickets[slice] = 0;  // ready for the next launch
  }
  // Vector v of a partial staged at `staged`.
  __device__ __forceinline__ auto staged_vec(float* staged, int v) const {
    return reinterpret_cast<float4*>(staged + (v / kVecsPerRow) * kRedStride +
                                     v % kVecsPerRow * 4);
  }
  __device__ __forceinline__ auto red_vec(int v) const { return staged_vec(red, v); }
  // acc_w → [E][kRedStride] at `staged`, once both warpgroups are done with the stages. e0: the
  // first expert of acc_w (fused_backward_wide: each wgrad warpgroup holds a share of them).
  __device__ __forceinline__ void stage_acc_w(float* staged, int e0 = 0) const {
    stage_accumulators<kTileH, Cfg::kWgradN, kRedStride>(thr_w, acc_w, staged, e0);
  }
  __device__ __forceinline__ void stage_partial() const {
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);  // both warpgroups done with sX
    stage_acc_w(red);
  }
  // kSpread: the other CTAs' shares of the partial go to global memory (16-byte stores); once
  // the slice's k CTAs have all written theirs (all are resident: the grid is at most one
  // CTA per SM; the producer's warp 0 keeps the count), each sums its share, its own part
  // from shared memory (sum_spread(slice, red)). This first half: the partial staged (red) and
  // its other shares sent.
  __device__ __forceinline__ void send_spread(int slice) const {
    stage_partial();
    cutlass::arch::NamedBarrier::sync(256, kBarConsumers);
    send_staged(slice, red);
  }
  // kSpread, once the CTA's partial is staged at `staged` ([E][kRedStride]).
  __device__ __forceinline__ void spread_staged(int slice, float* staged) const {
    send_staged(slice, staged);
    sum_spread(slice, staged);
  }
  // The other CTAs' shares of the staged partial stored, and counted (the producer's warp 0).
  __device__ __forceinline__ void send_staged(int slice, float* staged) const {
    const auto [own0, own1] = Share(spread_rank(slice), p.per_slice);
    float4* mine = reinterpret_cast<float4*>(partial(slice, cta));
    CUTE_UNROLL
    for (int j = 0; j < kSliceVecs / 256; ++j) {
      const int v = ct + 256 * j;
      if (v < own0 || v >= own1) __stcg(mine + v, *staged_vec(staged, v));
    }
    // The barrier orders the stores before warp 0's release (it synchronizes with its sync).
    cutlass::arch::NamedBarrier::arrive(kSpreadBarThreads, kBarPartialsOut);
    MOE_ROUTING_TRACE(ct == 0, 3);
  }
  // Once the slice's k partials are all out: this CTA's share summed over them.
  __device__ __forceinline__ void sum_spread(int slice, float* staged) const {
    const int k = p.per_slice, first = spread_first(slice), rank = spread_rank(slice);
    const auto [own0, own1] = Share(rank, k);
    cutlass::arch::NamedBarrier::sync(kSpreadBarThreads, kBarPartialsIn);
    MOE_ROUTING_TRACE(ct == 0, 6);
    sum_share(slice, k, rank, [&](int r, int v) {
      return r == rank ? *staged_vec(staged, v)
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
  }
  // kCluster: CTA r sums its share over the cluster's staged partials in rank order
  // (distributed shared memory).
  __device__ __forceinline__ void reduce_grad_w_cluster(int slice) const {
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
  }

  // kRoleSplit: warpgroup 1's grad_w of the CTA's segment, staged as [E][kRedStride] in the idle
  // G stages by warpgroup 1 (stage_role_split), then written by all consumer threads
  // (write_role_split): the whole slice straight to grad_w (after grad_w itself when
  // accumulating; kLastCta, one CTA per slice), or, kSpread (k CTAs per slice), as this CTA's
  // partial, its share summed over the slice's k partials. The two warpgroups meet through an
  // mbarrier (grad_w_staged), and reach write_role_split's named barriers (kSpread) from the
  // same instructions: `bar.sync` is the aligned form.
  // Warpgroup 1, once warpgroup 0's last dgrad (unit `last`) is done with sG (it reads the stages
  // in unit order, and the producer has built its last G).
  __device__ __forceinline__ void stage_role_split(int last) const {
    static_assert(!Cfg::kRoleSplit || kExperts * kRedStride * sizeof(float) <= sizeof(smem.g),
                  "partial fits");
    Ring<kStagesG>::wait(smem.g_empty, last);
    stage_acc_w(reinterpret_cast<float*>(smem.g));
    Barrier::arrive(&smem.grad_w_staged);  // (release: the staging stores)
  }
  // Both consumer warpgroups, from one call site.
  __device__ __forceinline__ void write_role_split(int64_t slice) const {
    float* staged = reinterpret_cast<float*>(smem.g);
    Barrier::wait(&smem.grad_w_staged, 0);  // all of it staged (both warpgroups read it)
    if (p.sum == GradWSum::kSpread) {
      spread_staged(int(slice), staged);
      return;
    }
    // A thread's grad_w loads all in flight at once, in two halves: fewer registers live (more
    // made ptxas spill in the main loop).
    auto part = [&](int, int v) { return *staged_vec(staged, v); };
    constexpr int kHalf = kSliceVecs / 2;
    static_assert(kHalf % 256 == 0, "whole vectors per thread");
    sum_vectors(slice, 0, kHalf, 1, Int<kHalf / 256>{}, Int<1>{}, part);
    sum_vectors(slice, kHalf, kSliceVecs, 1, Int<kHalf / 256>{}, Int<1>{}, part);
  }
};

}  // namespace moe_routing::kernels::fused_backward
