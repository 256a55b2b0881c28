/* The example's C part (c_abi_check.c, compiled as C): checks of the C ABI, and the same
   forward and backward as main.cpp through it. */
#ifndef MOE_ROUTING_EXAMPLE_C_ABI_CHECK_H
#define MOE_ROUTING_EXAMPLE_C_ABI_CHECK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int moe_routing_example_c_abi_check(void);
int32_t moe_routing_example_c_forward(int64_t tokens, const uint16_t* x, const uint16_t* w,
                                      const float* bias, int32_t* topk_idx, float* topk_weights,
                                      float* topk_scores, void* stream);
int32_t moe_routing_example_c_backward(int64_t tokens, const uint16_t* x, const uint16_t* w,
                                       const int32_t* topk_idx, const float* topk_scores,
                                       const float* grad_topk_weights, uint16_t* grad_x,
                                       float* grad_w, void* workspace, size_t workspace_bytes,
                                       void* stream);

#ifdef __cplusplus
}
#endif

#endif
