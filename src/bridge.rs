//! The cxx bridge to the C++ API (`cpp/include/moe_routing/router.h`). Device buffers cross as
//! (address, length in elements); the functions that launch work are `unsafe`: the caller
//! guarantees the addresses are live device allocations of at least that length.

#[cxx::bridge(namespace = "moe_routing::bridge")]
pub(crate) mod ffi {
    #[derive(Clone, Copy, Debug)]
    struct Config {
        hidden_size: i64,
        n_routed_experts: i64,
        num_experts_per_tok: i64,
        n_group: i64,
        topk_group: i64,
        routed_scaling_factor: f32,
        norm_topk_prob: bool,
    }

    struct Buffer {
        ptr: u64,
        len: i64,
    }

    struct ForwardBuffers {
        tokens: i64,
        x: Buffer,
        w: Buffer,
        bias: Buffer,
        topk_idx: Buffer,
        topk_weights: Buffer,
        topk_scores: Buffer,
        /// Optional outputs: ptr 0 is off.
        scores: Buffer,
        expert_counts: Buffer,
        /// moe_routing::DType of topk_idx (int32 or int64).
        topk_idx_dtype: i32,
    }

    struct BackwardBuffers {
        tokens: i64,
        x: Buffer,
        w: Buffer,
        topk_idx: Buffer,
        topk_scores: Buffer,
        grad_topk_weights: Buffer,
        grad_x: Buffer,
        grad_w: Buffer,
        accumulate_grad_w: bool,
        precision: i32,
        workspace: Buffer,
        /// All scores [T, E], instead of topk_scores (ptr 0: off).
        scores: Buffer,
        /// moe_routing::DType values of topk_idx, the scores, grad_topk_weights and grad_w.
        topk_idx_dtype: i32,
        scores_dtype: i32,
        grad_topk_weights_dtype: i32,
        grad_w_dtype: i32,
    }

    unsafe extern "C++" {
        include!("bridge/bridge.h");

        fn validate_config(cfg: &Config) -> i32;
        fn kernel_paths(cfg: &Config, forward_fused: &mut bool, backward_fused: &mut bool) -> i32;
        fn backward_workspace_bytes(cfg: &Config, tokens: i64) -> u64;
        unsafe fn router_forward(cfg: &Config, bufs: &ForwardBuffers, stream: u64) -> i32;
        unsafe fn router_backward(cfg: &Config, bufs: &BackwardBuffers, stream: u64) -> i32;
        fn device_count() -> i32;
        fn status_string(status: i32) -> &'static str;
        fn last_cuda_error() -> String;
    }
}
