/* The C ABI from C99. moe_routing_example_c_abi_check(): version, status strings, config and
 * argument checks, none of which needs a GPU. moe_routing_example_c_forward/_backward(): the
 * example's forward and backward through the C ABI. Linked into router_example; built alone
 * (MOE_ROUTING_C_ABI_CHECK_MAIN) as c_abi_check, which runs the checks. */
#include <stdio.h>
#include <string.h>

#include <moe_routing/moe_routing.h>

#include "c_abi_check.h"

/* GLM-4.5: H 5120, E 160, top-8 of 8 groups keeping 4, scale 2.5, normalized. */
static moe_routing_config glm45(void) {
  moe_routing_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.hidden_size = 5120;
  cfg.n_routed_experts = 160;
  cfg.num_experts_per_tok = 8;
  cfg.n_group = 8;
  cfg.topk_group = 4;
  cfg.routed_scaling_factor = 2.5f;
  cfg.norm_topk_prob = 1;
  return cfg;
}

static int expect_status(const char* what, int32_t got, int32_t want) {
  if (got == want) return 0;
  fprintf(stderr, "C ABI: %s: got %d (%s), want %d (%s)\n", what, (int)got,
          moe_routing_status_string(got), (int)want, moe_routing_status_string(want));
  return 1;
}

int moe_routing_example_c_abi_check(void) {
  int failures = 0;
  moe_routing_config cfg;
  moe_routing_forward_args fwd;
  moe_routing_backward_args bwd;

  if (moe_routing_abi_version() != MOE_ROUTING_ABI_VERSION) {
    fprintf(stderr, "C ABI: library ABI %d, header ABI %d\n", (int)moe_routing_abi_version(),
            MOE_ROUTING_ABI_VERSION);
    ++failures;
  }
  if (strcmp(moe_routing_version_string(), MOE_ROUTING_VERSION_STRING) != 0) {
    fprintf(stderr, "C ABI: library %s, header %s\n", moe_routing_version_string(),
            MOE_ROUTING_VERSION_STRING);
    ++failures;
  }
  if (strcmp(moe_routing_status_string(MOE_ROUTING_SUCCESS), "success") != 0 ||
      strcmp(moe_routing_status_string(MOE_ROUTING_NULL_POINTER), "null pointer") != 0 ||
      strcmp(moe_routing_status_string(99), "unknown status") != 0) {
    fprintf(stderr, "C ABI: unexpected status strings\n");
    ++failures;
  }

  cfg = glm45();
  failures += expect_status("valid config", moe_routing_validate_config(&cfg),
                            MOE_ROUTING_SUCCESS);
  if (moe_routing_backward_workspace_bytes(&cfg, 256) == 0) {
    fprintf(stderr, "C ABI: no backward workspace size for a valid config\n");
    ++failures;
  }
  failures += expect_status("null config", moe_routing_validate_config(NULL),
                            MOE_ROUTING_NULL_POINTER);

  cfg.n_group = 7; /* does not divide 160 */
  failures += expect_status("n_group 7", moe_routing_validate_config(&cfg),
                            MOE_ROUTING_INVALID_CONFIG);
  cfg.n_group = 8;
  cfg.struct_size = sizeof cfg - 8;
  failures += expect_status("short struct_size", moe_routing_validate_config(&cfg),
                            MOE_ROUTING_INVALID_CONFIG);
  cfg.struct_size = sizeof cfg;

  /* Argument structs are checked before anything reaches the GPU. */
  memset(&fwd, 0, sizeof fwd);
  memset(&bwd, 0, sizeof bwd);
  fwd.struct_size = sizeof fwd + 8;
  bwd.struct_size = sizeof bwd;
  bwd.precision = 5;
  failures += expect_status("forward, null args", moe_routing_forward(&cfg, NULL, NULL),
                            MOE_ROUTING_NULL_POINTER);
  failures += expect_status("forward, null config", moe_routing_forward(NULL, &fwd, NULL),
                            MOE_ROUTING_NULL_POINTER);
  failures += expect_status("forward, long struct_size", moe_routing_forward(&cfg, &fwd, NULL),
                            MOE_ROUTING_INVALID_CONFIG);
  failures += expect_status("backward, null args", moe_routing_backward(&cfg, NULL, NULL),
                            MOE_ROUTING_NULL_POINTER);
  failures += expect_status("backward, bad precision", moe_routing_backward(&cfg, &bwd, NULL),
                            MOE_ROUTING_INVALID_CONFIG);

  if (failures == 0)
    printf("C ABI %d of moe-routing %s: ok (%d CUDA devices)\n", (int)moe_routing_abi_version(),
           moe_routing_version_string(), (int)moe_routing_device_count());
  return failures;
}

int32_t moe_routing_example_c_forward(int64_t tokens, const uint16_t* x, const uint16_t* w,
                                      const float* bias, int32_t* topk_idx, float* topk_weights,
                                      float* topk_scores, void* stream) {
  const moe_routing_config cfg = glm45();
  const int64_t H = cfg.hidden_size, E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
  moe_routing_forward_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.tokens = tokens;
  a.x = x;
  a.x_len = tokens * H;
  a.w = w;
  a.w_len = E * H;
  a.bias = bias;
  a.bias_len = E;
  a.topk_idx = topk_idx;
  a.topk_idx_len = tokens * K;
  a.topk_weights = topk_weights;
  a.topk_weights_len = tokens * K;
  a.topk_scores = topk_scores;
  a.topk_scores_len = tokens * K;
  return moe_routing_forward(&cfg, &a, stream);
}

int32_t moe_routing_example_c_backward(int64_t tokens, const uint16_t* x, const uint16_t* w,
                                       const int32_t* topk_idx, const float* topk_scores,
                                       const float* grad_topk_weights, uint16_t* grad_x,
                                       float* grad_w, void* workspace, size_t workspace_bytes,
                                       void* stream) {
  const moe_routing_config cfg = glm45();
  const int64_t H = cfg.hidden_size, E = cfg.n_routed_experts, K = cfg.num_experts_per_tok;
  moe_routing_backward_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = sizeof a;
  a.precision = MOE_ROUTING_PRECISION_DEFAULT;
  a.tokens = tokens;
  a.x = x;
  a.x_len = tokens * H;
  a.w = w;
  a.w_len = E * H;
  a.topk_idx = topk_idx;
  a.topk_idx_len = tokens * K;
  a.topk_scores = topk_scores;
  a.topk_scores_len = tokens * K;
  a.grad_topk_weights = grad_topk_weights;
  a.grad_topk_weights_len = tokens * K;
  a.grad_x = grad_x;
  a.grad_x_len = tokens * H;
  a.grad_w = grad_w;
  a.grad_w_len = E * H;
  a.workspace = workspace;
  a.workspace_bytes = (int64_t)workspace_bytes;
  a.accumulate_grad_w = 0;
  return moe_routing_backward(&cfg, &a, stream);
}

#ifdef MOE_ROUTING_C_ABI_CHECK_MAIN
int main(void) { return moe_routing_example_c_abi_check() == 0 ? 0 : 1; }
#endif
