// Phase timestamps for profiling builds. A program that defines MOE_ROUTING_TRACE(cond, id)
// before including a kernel gets a hook at each phase boundary (`id` names the phase, `cond`
// picks the thread that records it); everywhere else the hooks compile to nothing.
#pragma once

#ifndef MOE_ROUTING_TRACE
#define MOE_ROUTING_TRACE(cond, id) \
  do {                              \
  } while (0)
#endif

namespace moe_routing::kernels {
// Per-unit stamps (unit n < kTraceUnits of a CTA, id base + n), the fused backward's: 16 + n
// the unit done (the kernel's loops), and these.
enum TraceUnitSeries : int {
  kTraceUnits = 48,              // units a series stamps
  kTraceStageFree = 64,          // the producer: G(n)'s stage free
  kTraceGBuilt = 112,            // the producer: G(n) stored and published
  kTraceDgradHasG = 160,         // the dgrad warpgroup (role split): G(n) in
  kTraceDgradStagingFree = 208,  // ... its wgmmas issued, grad_x's staging free
  kTraceDgradDone = 256,         // ... its wgmmas done
  kTraceWgradHasUnit = 304,      // the wgrad warpgroup: x(n) and G(n) in
  kTraceWgradDone = 352,         // ... wgrad(n) done
  kTraceHasX = 400,              // consumer warpgroup 0 (+ 48: 1): x(n) in
  kTraceMisc = 496,              // single stamps (up to 16) where a study needs them
  kTraceIds = 512,               // ids a CTA may stamp
};
}  // namespace moe_routing::kernels
