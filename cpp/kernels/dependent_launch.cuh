// Programmatic dependent launch (sm90): a kernel launched with programmatic stream
// serialization may start while the previous kernel of the stream is still running; its CTAs
// set up shared memory and barriers, then wait for that kernel to finish (and its writes to
// be visible) before they touch global memory. Allowing dependents early lets the next
// kernel's CTAs do the same on SMs this grid leaves free.
#pragma once

namespace moe_routing::kernels {

// Blocks until the grids this one depends on have completed; a no-op without them. Every
// thread that reads or writes global memory calls it first.
__device__ __forceinline__ void wait_for_prior_grids() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets dependent grids launch once every CTA of this grid has called it (or exited).
__device__ __forceinline__ void allow_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace moe_routing::kernels
