// Thread-block clusters (sm90): distributed shared memory and the split cluster barrier.
#pragma once

#include <cstdint>

namespace moe_routing::kernels {

// The address of the same shared-memory bytes in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t map_dsmem(uint32_t smem_addr, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(smem_addr), "r"(rank));
  return out;
}

// A 16-byte load from distributed shared memory.
__device__ __forceinline__ float4 ld_dsmem_f32x4(uint32_t cluster_addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
  return v;
}

// Cluster barrier in two halves: arrive (release: this thread's reads and writes before it are
// done; relaxed: no ordering) and wait (acquire). Every thread of every CTA takes part.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return int(r);
}

}  // namespace moe_routing::kernels
