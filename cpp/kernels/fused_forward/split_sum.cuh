// The fused forward's split-K sum: the rows a CTA owns, summed over its cluster's partial
// logits through distributed shared memory.
//
// Each partial is a [kTileT][kRedStride] fp32 buffer in its CTA's shared memory; the owner of
// rows [row0, row0 + rows) (rank r: [⌊r·kTileT / kSplit⌋, ⌊(r + 1)·kTileT / kSplit⌋)) reads
// those rows from every CTA of the cluster. Every load of a thread is issued before the first
// sum (v6 issued one vector's kSplit loads at a time, 2 to 10 round trips per thread).
#pragma once

#include <cstdint>
#include <cute/tensor.hpp>

#include "kernels/cluster.cuh"
#include "kernels/routing.cuh"

namespace moe_routing::kernels::fused_forward {

// Consumer thread `ct` of kThreads: sums vectors ct, ct + kThreads, ... of the `rows` owned
// rows (at most ⌈kTileT / kSplit⌉) over the kSplit partials in rank order, from zero (the same
// bits every run), into this CTA's copy of the rows. `as_scores`: stores sigmoid of the sums
// instead (and, where `scores` is not null, writes them to the [T, E] scores output for
// tokens below `tokens` and the first `experts` columns, E = experts; `token0` is the first
// owned row's token).
template <int kSplit, int kTileT, int kExperts, int kStride, int kThreads>
__device__ __forceinline__ void split_sum(float* red, int row0, int rows, int ct, bool as_scores,
                                          float* scores, int64_t token0, int64_t tokens,
                                          int experts) {
  constexpr int kMaxRows = (kTileT + kSplit - 1) / kSplit;
  constexpr int kVecsPerRow = kExperts / 4;
  constexpr int kMaxVecs = kMaxRows * kVecsPerRow;
  constexpr int kPerThread = (kMaxVecs + kThreads - 1) / kThreads;
  static_assert(kPerThread * kSplit <= 36, "loads in flight per thread (4 registers each)");
  // Where kSplit divides kTileT every rank owns kMaxRows rows: the bounds are compile-time.
  constexpr bool kEven = kTileT % kSplit == 0;
  const int vecs = kEven ? kMaxVecs : rows * kVecsPerRow;
  auto in_range = [&](int v) { return (kEven && kMaxVecs % kThreads == 0) || v < vecs; };
  float* own = red + row0 * kStride;
  const uint32_t base = cute::cast_smem_ptr_to_uint(own);
  uint32_t rank_base[kSplit];
#pragma unroll
  for (int s = 0; s < kSplit; ++s) rank_base[s] = map_dsmem(base, s);

  float4 part[kPerThread][kSplit];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int v = ct + i * kThreads;
    if (in_range(v)) {
      const uint32_t offset = uint32_t((v / kVecsPerRow * kStride + v % kVecsPerRow * 4) * 4);
#pragma unroll
      for (int s = 0; s < kSplit; ++s) part[i][s] = ld_dsmem_f32x4(rank_base[s] + offset);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int v = ct + i * kThreads;
    if (in_range(v)) {
      const int r = v / kVecsPerRow, c = v % kVecsPerRow * 4;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int s = 0; s < kSplit; ++s)
        sum.x += part[i][s].x, sum.y += part[i][s].y, sum.z += part[i][s].z, sum.w += part[i][s].w;
      if (as_scores) {  // (0 + x: the bits of a sum that starts at zero, as without a split)
        sum = make_float4(sigmoid(0.0f + sum.x), sigmoid(0.0f + sum.y), sigmoid(0.0f + sum.z),
                          sigmoid(0.0f + sum.w));
        const int64_t t = token0 + r;
        if (scores && t < tokens && c < experts) {  // (experts: a multiple of 4)
          float* dst = scores + t * experts + c;
          dst[0] = sum.x, dst[1] = sum.y, dst[2] = sum.z, dst[3] = sum.w;
        }
      }
      *reinterpret_cast<float4*>(own + r * kStride + c) = sum;
    }
  }
}

}  // namespace moe_routing::kernels::fused_forward
