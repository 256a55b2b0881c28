// The fused forward's routing epilogue for top_k <= 8 (<= 16 above 256 experts): kLanes
// threads per token (2 to 16, adjacent lanes), the token's scores in a row of shared memory.
// Each thread scans a share of the groups, then its share of the kept groups (or of all experts
// where there is one group), with register compares only; the shares' top-k lists are then
// merged across the token's lanes (log2 kLanes shuffle rounds). The chains of a thread are
// serial, so the work is spread over as many warps as the tile allows. Same selection as
// rank_key (larger first, lower index on ties, NaN below everything) and the same weights as
// the other paths.
#pragma once

#include <cstdint>

#include "kernels/fused_forward/route.cuh"

namespace moe_routing::kernels::fused_forward {

// Order-preserving 32-bit key of a choice score c: larger c ranks higher; NaN is 1, below every
// other value (the keys 1 ... 0x007FFFFE belong to negative NaN bit patterns only, so no value
// maps there); 0 means "nothing". Within a thread, ties are broken by scan order: the scans run
// in ascending expert (or group) index and replace only on a strictly larger key.
__device__ __forceinline__ uint32_t choice_key(float c) {
  const uint32_t u = __float_as_uint(c);
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return c != c ? 1u : ord;
}

// Larger first, then the lower index (rank_key's order), for merging lists of different lanes.
__device__ __forceinline__ uint64_t merge_key(uint32_t key, int idx) {
  return (uint64_t(key) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(idx));
}

// The choice score of a key (its inverse): 0 for "nothing" (the +0.0 of an empty slot), NaN
// for 1.
__device__ __forceinline__ float key_value(uint32_t key) {
  if (key <= 1u) return key == 0u ? 0.0f : __uint_as_float(0x7FC00000u);
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// Position of the n-th (from 0) set bit of mask, which has more than n.
__device__ __forceinline__ int nth_set_bit(uint32_t mask, int n) {
  for (int i = 0; i < n; ++i) mask &= mask - 1;
  return __ffs(mask) - 1;
}

// kMaxTopK_: the longest list a lane keeps, 8 or 16 (top_k > 8, above 256 experts only: the
// insert's compares and selects grow with it).
template <int kExperts, int kMaxTopK_ = 8>
struct ThreadRoute {
  static constexpr int kMaxTopK = kMaxTopK_;
  static_assert(kMaxTopK == 8 || kMaxTopK == 16, "a list of 8 or 16");
  static constexpr int kMaxGroups = 32;
  static_assert(kExperts % 4 == 0, "rows are read as 16-byte vectors");
  // Most lanes per token: a power of two up to 16 whose expert shares are whole vectors.
  static constexpr int kMaxLanes = kExperts % 64 == 0 ? 16 : kExperts % 32 == 0 ? 8
                                 : kExperts % 16 == 0 ? 4 : kExperts % 8 == 0 ? 2 : 1;

  // Token t (lane `sub` of its kLanes lanes; every lane of the warp calls this): its scores s
  // (E floats, 16-byte aligned, shared memory) → its top_k experts, weights and scores, written
  // where `valid`. `bias`: E floats in shared memory. `group_keys`: the token's kMaxGroups words
  // of shared scratch, `stride` words apart. p.top_k <= kMaxTopK, p.n_group <= kMaxGroups.
  template <int kLanes>
  __device__ __forceinline__ static void run(const float* s, const float* bias,
                                             uint32_t* group_keys, int stride,
                                             const RouteParams& p, const RouteOut& out, int64_t t,
                                             bool valid, int sub) {
    static_assert(kLanes >= 1 && kLanes <= kMaxLanes && (kLanes & (kLanes - 1)) == 0, "lanes");
    const int per_group = p.experts / p.n_group;

    // Groups kept: the topk_group best by group score, the sum of the group's two best choice
    // scores (ranked as in top-k); ties to the lower group. Lane `sub` scores groups sub,
    // sub + kLanes, ...
    uint32_t kept = 1u;
    if (p.n_group > 1) {
      for (int g = sub; g < p.n_group; g += kLanes) {
        // The two largest keys, with multiplicity (equal keys are equal values): unsigned
        // min/max only.
        uint32_t k1 = 0, k2 = 0;
        const int e0 = g * per_group;
        auto scan = [&](float c) {
          const uint32_t k = choice_key(c);
          k2 = umax(k2, umin(k1, k));
          k1 = umax(k1, k);
        };
        if (per_group % 4 == 0) {  // 16-byte vectors: a quarter of the shared-memory loads
          const float4* s4 = reinterpret_cast<const float4*>(s + e0);
          const float4* b4 = reinterpret_cast<const float4*>(bias + e0);
#pragma unroll 2
          for (int v = 0; v < per_group / 4; ++v) {
            const float4 sv = s4[v], bv = b4[v];
            scan(sv.x + bv.x), scan(sv.y + bv.y), scan(sv.z + bv.z), scan(sv.w + bv.w);
          }
        } else {
#pragma unroll 4  // loads of several members in flight
          for (int e = e0; e < e0 + per_group; ++e) scan(s[e] + bias[e]);
        }
        group_keys[g * stride] = choice_key(key_value(k1) + key_value(k2));
      }
      __syncwarp();
      // Group g is kept where fewer than topk_group groups rank above it (a larger key, or an
      // equal key and a lower index): independent compares, each lane for its own groups,
      // the lanes' masks then or-ed together.
      kept = 0;
      for (int g = sub; g < p.n_group; g += kLanes) {
        const uint32_t kg = group_keys[g * stride];
        int above = 0;
        for (int h = 0; h < p.n_group; ++h) {
          const uint32_t kh = group_keys[h * stride];
          above += kh > kg || (kh == kg && h < g);
        }
        if (above < p.topk_group) kept |= 1u << g;
      }
#pragma unroll
      for (int o = 1; o < kLanes; o <<= 1) kept |= __shfl_xor_sync(0xFFFFFFFFu, kept, o);
    }

    // Top-k of the kept groups' experts in this lane's share: a sorted list of kMaxTopK (key,
    // expert), each candidate compared with every entry at once (independent compares, then
    // selects). Unconditional: with many tokens per warp some lane almost always inserts.
    uint32_t key[kMaxTopK];
    int idx[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) key[j] = 0, idx[j] = 0;
    auto insert = [&](float c, int e) {
      const uint32_t k = choice_key(c);
      bool gt[kMaxTopK];
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) gt[j] = k > key[j];
#pragma unroll
      for (int j = kMaxTopK - 1; j > 0; --j) {
        key[j] = gt[j] ? (gt[j - 1] ? key[j - 1] : k) : key[j];
        idx[j] = gt[j] ? (gt[j - 1] ? idx[j - 1] : e) : idx[j];
      }
      key[0] = gt[0] ? k : key[0];
      idx[0] = gt[0] ? e : idx[0];
    };
    if (p.n_group > 1) {
      // Only the kept groups' experts, in ascending order, cut into kLanes nearly equal
      // contiguous shares (as many lanes work as there are, whatever topk_group is).
      const int total = p.topk_group * per_group;
      const int p0 = sub * total / kLanes, p1 = (sub + 1) * total / kLanes;
      int g = nth_set_bit(kept, p0 / per_group), off = p0 % per_group;
      auto advance = [&](int n) {  // n members on; past the group's end, the next kept group
        if ((off += n) == per_group) {
          off = 0;
          g = __ffs(kept & ~((2u << g) - 1u)) - 1;
        }
      };
      if (per_group % 4 == 0 && total % (4 * kLanes) == 0) {
        // 16-byte vectors: shares and groups start at multiples of 4.
#pragma unroll 2
        for (int q = p0; q < p1; q += 4) {
          const int e = g * per_group + off;
          const float4 sv = *reinterpret_cast<const float4*>(s + e);
          const float4 bv = *reinterpret_cast<const float4*>(bias + e);
          insert(sv.x + bv.x, e), insert(sv.y + bv.y, e + 1);
          insert(sv.z + bv.z, e + 2), insert(sv.w + bv.w, e + 3);
          advance(4);
        }
      } else {
#pragma unroll 4
        for (int q = p0; q < p1; ++q) {
          const int e = g * per_group + off;
          insert(s[e] + bias[e], e);
          advance(1);
        }
      }
    } else {
      // Every expert: lane sub takes every kLanes-th 16-byte vector from the sub-th on (in
      // ascending order), so that a quarter-warp's reads fall in distinct banks; the masked
      // experts past p.experts (a multiple of 4) not at all.
      constexpr int kVecs = kExperts / 4 / kLanes;
      static_assert(kExperts % (4 * kLanes) == 0, "whole vectors per lane");
      const float4* s4 = reinterpret_cast<const float4*>(s) + sub;
      const float4* b4 = reinterpret_cast<const float4*>(bias) + sub;
      const int vecs = p.experts / 4;
#pragma unroll 2
      for (int v = 0; v < kVecs; ++v) {
        if (v * kLanes + sub >= vecs) break;
        const float4 sv = s4[v * kLanes], bv = b4[v * kLanes];
        const int e = 4 * (v * kLanes + sub);
        insert(sv.x + bv.x, e);
        insert(sv.y + bv.y, e + 1);
        insert(sv.z + bv.z, e + 2);
        insert(sv.w + bv.w, e + 3);
      }
    }

    // Merge the lanes' lists: per round, the top kMaxTopK of two sorted lists is the
    // elementwise max of one and the other reversed (a bitonic sequence), sorted by a
    // half-cleaner network. Every lane ends with the same list.
    if constexpr (kLanes > 1) {
      uint64_t m[kMaxTopK];
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) m[j] = merge_key(key[j], idx[j]);
#pragma unroll
      for (int o = 1; o < kLanes; o <<= 1) {
        uint64_t other[kMaxTopK];
#pragma unroll
        for (int j = 0; j < kMaxTopK; ++j) other[j] = __shfl_xor_sync(0xFFFFFFFFu, m[j], o);
#pragma unroll
        for (int j = 0; j < kMaxTopK; ++j) {
          const uint64_t b = other[kMaxTopK - 1 - j];
          m[j] = b > m[j] ? b : m[j];
        }
#pragma unroll
        for (int d = kMaxTopK / 2; d > 0; d >>= 1) {
#pragma unroll
          for (int j = 0; j < kMaxTopK; ++j) {
            if ((j & d) == 0) {
              const uint64_t hi = m[j] > m[j + d] ? m[j] : m[j + d];
              const uint64_t lo = m[j] > m[j + d] ? m[j + d] : m[j];
              m[j] = hi, m[j + d] = lo;
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) idx[j] = key_index(m[j]);
    }

    // Weights in selection order (the sum's order is fixed: the same bits every run).
    float sel[kMaxTopK];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      sel[j] = j < p.top_k ? s[idx[j]] : 0.0f;
      sum += sel[j];
    }
    if (!valid) return;
    auto weight = [&](float v) { return topk_weight(v, sum, p); };
    // top_k = kMaxTopK: lane sub writes entries [sub·n, (sub + 1)·n), n = kMaxTopK / kLanes, as
    // one 8- or 16-byte vector per output, where the outputs are aligned for it: whole sectors
    // per warp, a quarter of the store instructions of one entry per store.
    constexpr int kPerLane = kMaxTopK / kLanes;
    if constexpr (kPerLane == 4 || kPerLane == 2) {
      constexpr uintptr_t kAlign = kPerLane * 4 - 1;
      if (p.top_k == kMaxTopK && !out.idx_i64 && ((reinterpret_cast<uintptr_t>(out.topk_idx) |
                                   reinterpret_cast<uintptr_t>(out.topk_weights) |
                                   reinterpret_cast<uintptr_t>(out.topk_scores)) & kAlign) == 0) {
        int iv[kPerLane];
        float sv[kPerLane];
#pragma unroll
        for (int u = 0; u < kPerLane; ++u) iv[u] = idx[u], sv[u] = sel[u];
#pragma unroll
        for (int q = 1; q < kLanes; ++q) {  // register indices stay compile-time
          if (sub == q) {
#pragma unroll
            for (int u = 0; u < kPerLane; ++u) iv[u] = idx[q * kPerLane + u], sv[u] = sel[q * kPerLane + u];
          }
        }
        float wv[kPerLane];
#pragma unroll
        for (int u = 0; u < kPerLane; ++u) wv[u] = weight(sv[u]);
        const int64_t o = t * kMaxTopK + sub * kPerLane;
        if constexpr (kPerLane == 4) {
          *reinterpret_cast<int4*>(static_cast<int32_t*>(out.topk_idx) + o) =
              make_int4(iv[0], iv[1], iv[2], iv[3]);
          *reinterpret_cast<float4*>(out.topk_weights + o) = make_float4(wv[0], wv[1], wv[2], wv[3]);
          *reinterpret_cast<float4*>(out.topk_scores + o) = make_float4(sv[0], sv[1], sv[2], sv[3]);
        } else {
          *reinterpret_cast<int2*>(static_cast<int32_t*>(out.topk_idx) + o) =
              make_int2(iv[0], iv[1]);
          *reinterpret_cast<float2*>(out.topk_weights + o) = make_float2(wv[0], wv[1]);
          *reinterpret_cast<float2*>(out.topk_scores + o) = make_float2(sv[0], sv[1]);
        }
        if (out.counts) {
#pragma unroll
          for (int u = 0; u < kPerLane; ++u) atomicAdd(out.counts + iv[u], 1);
        }
        return;
      }
    }
    // Else lane sub writes entries sub, sub + kLanes, ...
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      if (j < p.top_k && j % kLanes == sub) {
        const int64_t o = t * p.top_k + j;
        out.store_idx(o, idx[j]);
        out.topk_weights[o] = weight(sel[j]);
        out.topk_scores[o] = sel[j];
        if (out.counts) atomicAdd(out.counts + idx[j], 1);
      }
    }
  }
};

}  // namespace moe_routing::kernels::fused_forward
