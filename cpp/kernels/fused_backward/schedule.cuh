// Persistent schedule of the fused backward: the units (slice, token tile), numbered slice by
// slice, are cut into `ctas` contiguous ranges of nearly equal length, one per CTA. The host
// picks ctas = k · slices where it can (fused_backward.cu), which cuts every slice at the same
// points; otherwise a range may end inside one slice and continue into the next. Each
// (slice, CTA) pair is a segment; a slice with several segments gets one grad_w partial per
// segment, summed in CTA order (deterministic).
#pragma once

#include <cstdint>

namespace moe_routing::kernels::fused_backward {

struct LinearSchedule {
  int64_t tiles = 0;   // token tiles per slice
  int64_t slices = 0;  // hidden slices
  int ctas = 1;

  __host__ __device__ int64_t units() const { return tiles * slices; }
  // First unit of CTA c (c = ctas gives the end).
  __host__ __device__ int64_t begin(int c) const { return int64_t(c) * units() / ctas; }
  // The CTA whose range holds unit u.
  __host__ __device__ int cta_of(int64_t u) const {
    int c = int(u * ctas / units());
    while (c + 1 < ctas && begin(c + 1) <= u) ++c;
    while (c > 0 && begin(c) > u) --c;
    return c;
  }
  // CTAs contributing to slice s, first and last.
  __host__ __device__ int first_cta(int64_t s) const { return cta_of(s * tiles); }
  __host__ __device__ int last_cta(int64_t s) const { return cta_of(s * tiles + tiles - 1); }
  // Partial slot of (slice s, CTA c): unique, since a later CTA never works on an earlier
  // slice; fewer than ctas + slices slots.
  __host__ __device__ static int64_t slot(int64_t s, int c) { return s + c; }
};

// How the grad_w partials of a slice cut over several CTAs are summed (the order is fixed in
// every mode: CTA order, so the bits do not depend on timing).
//   kLastCta  each CTA writes its partial to global memory and takes a ticket; the slice's
//             last contributor sums them all. Any schedule.
//   kSpread   ctas = k · slices; each CTA writes its partial, waits until the slice's k
//             partials are written, then sums 1/k of the slice over them. Needs a slice's
//             k CTAs resident together: the host uses it only for a grid of at most one CTA
//             per SM. A slice's CTAs are consecutive, so a partition with fewer SMs (MPS,
//             green contexts) still finishes where CTAs start in order, as they did on an
//             H200 with twice as many CTAs as SMs (backward version log); CUDA does not promise
//             that order, and a cooperative launch, which does, cost 2.5-3 us per call.
//   kCluster  ctas = k · slices, launched in clusters of k: as kSpread, with the partials in
//             each CTA's shared memory, read through distributed shared memory.
enum class GradWSum : int { kLastCta = 0, kSpread = 1, kCluster = 2 };

// Sweeps of the kernel over its units (both: the residual's first). kPassG: G as bf16, dgrad
// and wgrad, grad_x stored.
// kPassResidual (precise mode): G - bf16(G) as bf16 (exact in fp32 before the rounding), wgrad
// alone, so that grad_w gets the part of G that the bf16 G leaves out; grad_x is not stored.
enum : uint32_t { kPassG = 1, kPassResidual = 2 };

// A CTA's work in one launch: its range [unit0, unit0 + count) of the schedule, swept once or
// twice (Params::passes). Item n = 0 ... total - 1 is unit unit0 + n % count; with both sweeps
// the residual's comes first: its small products then build up in accumulators of their own
// size. (Added after G's, into accumulators ~2^9 larger, they lost enough bits in the tensor
// cores' accumulation to leave grad_w 1.1e-5 off at T = 20000, 3e-6 the other way.)
struct CtaWork {
  int cta = 0;
  int64_t unit0 = 0;
  int count = 0;
  int total = 0;
  int tiles = 0;  // token tiles per slice (< 2^31 / kTileT)
  bool g_pass = true, res_pass = false;

  __device__ CtaWork(const LinearSchedule& sched, int cta_, uint32_t passes)
      : cta(cta_), unit0(sched.begin(cta_)), count(int(sched.begin(cta_ + 1) - unit0)),
        tiles(int(sched.tiles)), g_pass((passes & kPassG) != 0),
        res_pass((passes & kPassResidual) != 0) {
    total = count * (int(g_pass) + int(res_pass));
  }
  // Item n is of the residual's sweep (wgrad alone).
  __device__ bool residual_at(int n) const { return res_pass && (!g_pass || n < count); }
};

// The top-k of a Config: K, fixed (a multiple of 4: each token's routing row loads as 16-byte
// vectors, so the rows must be 16-byte aligned), or kAnyTopK: any K up to 8, given at run time
// (Params::top_k), the rows loaded element by element (4-byte aligned).
constexpr int kAnyTopK = 0;
// The top-k of the wide kernels (fused_backward_wide, more than 256 experts): any K up to 16.
constexpr int kWideTopK = 16;

// Walks a CTA's units in order as (slice, tile): one division where it starts, none per unit
// (64-bit divisions and their registers stay out of the loops).
struct UnitCursor {
  int slice = 0;
  int tile = 0;
  __device__ UnitCursor(int64_t unit, int64_t tiles)
      : slice(int(unit / tiles)), tile(int(unit % tiles)) {}
  __device__ void next(int tiles) {
    if (++tile == tiles) tile = 0, ++slice;
  }
};

}  // namespace moe_routing::kernels::fused_backward
