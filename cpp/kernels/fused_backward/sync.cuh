// Synchronization of the fused backward beyond its pipelines: the GPU-scope counters that order
// grad_w partials and compact rows between CTAs, and the CTA's named barriers.
#pragma once

namespace moe_routing::kernels::fused_backward {

// Adds one to a counter, release at GPU scope.
__device__ __forceinline__ void red_release_add(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// Reads a counter, acquire at GPU scope.
__device__ __forceinline__ int ld_acquire(const int* counter) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// Adds one to a ticket (acquire and release at GPU scope); returns the old count.
__device__ __forceinline__ int ticket_acq_rel(int* ticket) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
  return old;
}

// One thread of each of a grid's `ctas` CTAs (all resident), once its CTA's stores are ordered
// before it: arrives (release) and waits until every CTA has (acquire). counters: 2 ints, zero
// between launches; the same thread calls grid_barrier_leave later in the launch. `seen()`
// runs once every arrival is seen (a trace hook).
template <class Seen>
__device__ __forceinline__ void grid_barrier(int* counters, int ctas, Seen&& seen) {
  red_release_add(counters);
  while (ld_acquire(counters) < ctas) {
  }
  seen();
}
// The thread of grid_barrier, any time after it and before the launch ends: the last CTA to
// leave resets both counters for the next launch. (Its ticket is a round trip to L2: right
// after the wait it held every CTA's rows back by ~0.6 us, backward v31.)
__device__ __forceinline__ void grid_barrier_leave(int* counters, int ctas) {
  if (ticket_acq_rel(counters + 1) == ctas - 1) counters[0] = 0, counters[1] = 0;
}

// Drops a 128-byte line from L2 without writing it back (its contents become undefined):
// for partials that no one reads again, which would otherwise go to DRAM when evicted.
__device__ __forceinline__ void discard_l2_line(const void* line) {
  asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
}

// Named barriers (0 is __syncthreads). kSpread: the consumers' partials are out (consumers →
// producer warp 0), the slice's partials are all in (producer warp 0 → consumers).
// kBarRowsStored: the CTA's compact rows are stored (producer → the role-split dgrad warpgroup,
// which loads w's slice only then).
enum : uint32_t {
  kBarConsumers = 1, kBarStore0 = 2, kBarPartialsOut = 4, kBarPartialsIn = 5, kBarBuilders = 6,
  kBarRowsStored = 7
};
constexpr uint32_t kSpreadBarThreads = 256 + 32;

}  // namespace moe_routing::kernels::fused_backward
