// The fused backward's host side: which shapes it takes, its workspace, its launch.
#pragma once

#include "moe_routing/router.h"

namespace moe_routing::detail {

// The workspace starts with the fused kernel's grad_w tickets (zero between launches), so that
// every path leaves them intact; the rest is per-path scratch.
constexpr size_t kTicketBytes = 2048;
// Upper bound on the persistent grid (one CTA per SM), for workspace sizing.
constexpr int kFusedMaxCtas = 160;

// True where the fused kernel handles the shape (others take the simple path).
bool fused_backward_supported(const RouterConfig& cfg, Precision precision);

// Scratch bytes after the tickets for the fused kernel (grad_w partials).
size_t fused_backward_scratch_bytes(const RouterConfig& cfg, int64_t tokens);

Status launch_fused_backward(const RouterConfig& cfg, const BackwardArgs& args, int device,
                             cudaStream_t stream);

// One instantiation per (expert count, top-k), each in its own translation unit. `cluster`:
// 1, or the CTAs per slice when the grid runs in clusters of them (ctas = cluster · slices,
// cluster <= 8).
template <int kExperts, int kTopK>
Status launch_fused_backward_e(const RouterConfig& cfg, const BackwardArgs& args, int device,
                               int ctas, int cluster, cudaStream_t stream);

// Clusters of `cluster` CTAs that fit on the device at once (0 where none or on error).
template <int kExperts, int kTopK>
int fused_backward_active_clusters(int cluster, int device);

}  // namespace moe_routing::detail
