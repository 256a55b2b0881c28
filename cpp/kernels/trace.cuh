// Phase timestamps for profiling builds. A program that defines MOE_ROUTING_TRACE(cond, id)
// before including a kernel gets a hook at each phase boundary (`id` names the phase, `cond`
// picks the thread that records it); everywhere else the hooks compile to nothing.
#pragma once

#ifndef MOE_ROUTING_TRACE
#define MOE_ROUTING_TRACE(cond, id) \
  do {                              \
  } while (0)
#endif
