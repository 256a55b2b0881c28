// The C++ side of the baselines' bridge (baseline/src/lib.rs): plain integers in, status
// codes out.
#pragma once

#include <cstdint>

#include "rust/cxx.h"

namespace moe_routing::baseline {

struct BaselineConfig;

int32_t baseline_routing_grad_dense(const BaselineConfig& cfg, int64_t tokens, uint64_t topk_idx,
                                    uint64_t topk_scores, uint64_t grad_topk_weights,
                                    uint64_t dense, uint64_t stream);
int32_t baseline_route_from_logits(const BaselineConfig& cfg, int64_t tokens, uint64_t logits,
                                   uint64_t bias, uint64_t topk_idx, uint64_t topk_weights,
                                   uint64_t topk_scores, uint64_t stream);
// The status's name, and for a CUDA error the runtime's text of it.
rust::String status_text(int32_t status);
int32_t baseline_copy(uint64_t in, uint64_t out, int64_t read_bytes, int64_t write_bytes,
                      int32_t ctas_per_sm, bool streaming_loads, bool streaming_stores,
                      uint64_t stream);

}  // namespace moe_routing::baseline
