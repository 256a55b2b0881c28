// Pipeline state of a ring of kStages shared-memory buffers, each guarded by a pair of mbarriers
// ("full": the buffer holds the n-th item; "empty": its readers are done with it).
//
// Items are numbered n = 0, 1, ... in the order both sides walk them: item n lives in stage
// n % kStages, and its barriers are in phase (n / kStages) & 1 of their use. A producer waits
// on "empty" at the opposite parity, so that a fresh barrier lets the first round through.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace moe_routing::kernels {

template <int kStages>
struct Ring {
  static_assert(kStages >= 1, "stages");
  __device__ __forceinline__ static int stage(int n) { return n % kStages; }
  __device__ __forceinline__ static uint32_t phase(int n) { return (n / kStages) & 1; }
  // Item n's phase of `bars` is complete: on "full", item n is in its stage; on "empty", its
  // readers are done with it.
  __device__ __forceinline__ static void wait(uint64_t* bars, int n) {
    cutlass::arch::ClusterBarrier::wait(&bars[stage(n)], phase(n));
  }
  // Producer: item n's stage is free (item n - kStages is consumed).
  __device__ __forceinline__ static void wait_free(uint64_t* empty, int n) {
    cutlass::arch::ClusterBarrier::wait(&empty[stage(n)], phase(n) ^ 1);
  }
  // Either side: one arrival on item n's barrier of `bars`.
  __device__ __forceinline__ static void arrive(uint64_t* bars, int n) {
    cutlass::arch::ClusterBarrier::arrive(&bars[stage(n)]);
  }
};

}  // namespace moe_routing::kernels
