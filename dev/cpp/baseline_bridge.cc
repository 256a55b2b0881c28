#include "baseline_bridge.h"

#include "baseline.h"
#include "bridge/common.h"
#include "moe-routing-dev/src/lib.rs.h"

#include <string>

namespace moe_routing::baseline {
using bridge::guarded;
using bridge::to_config;


int32_t baseline_routing_grad_dense(const BaselineConfig& cfg, int64_t tokens, uint64_t topk_idx,
                                    uint64_t topk_scores, uint64_t grad_topk_weights,
                                    uint64_t dense, uint64_t stream) {
  return guarded([&] {
    return baseline::routing_grad_dense_bf16(
        to_config(cfg), tokens, reinterpret_cast<const int32_t*>(topk_idx),
        reinterpret_cast<const float*>(topk_scores),
        reinterpret_cast<const float*>(grad_topk_weights), reinterpret_cast<uint16_t*>(dense),
        reinterpret_cast<cudaStream_t>(stream));
  });
}

int32_t baseline_route_from_logits(const BaselineConfig& cfg, int64_t tokens, uint64_t logits,
                                   uint64_t bias, uint64_t topk_idx, uint64_t topk_weights,
                                   uint64_t topk_scores, uint64_t stream) {
  return guarded([&] {
    return baseline::route_from_logits(
        to_config(cfg), tokens, reinterpret_cast<const float*>(logits),
        reinterpret_cast<const float*>(bias), reinterpret_cast<int32_t*>(topk_idx),
        reinterpret_cast<float*>(topk_weights), reinterpret_cast<float*>(topk_scores),
        reinterpret_cast<cudaStream_t>(stream));
  });
}

int32_t baseline_copy(uint64_t in, uint64_t out, int64_t read_bytes, int64_t write_bytes,
                      int32_t ctas_per_sm, bool streaming_loads, bool streaming_stores,
                      uint64_t stream) {
  return guarded([&] {
    return baseline::copy_bytes(
        reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), read_bytes, write_bytes,
        ctas_per_sm, streaming_loads, streaming_stores, reinterpret_cast<cudaStream_t>(stream));
  });
}

rust::String status_text(int32_t status) {
  std::string text = moe_routing::status_string(static_cast<Status>(status));
  if (static_cast<Status>(status) == Status::kCudaError)
    text += std::string(": ") + moe_routing::last_cuda_error();
  return rust::String(text);
}

}  // namespace moe_routing::baseline
