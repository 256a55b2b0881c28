//! moe-routing: the grouped top-k MoE router of DeepSeek-V3 / GLM-4.5 ("noaux_tc") for
//! Hopper GPUs, forward and backward, with a CPU reference.
//!
//! Forward, per token: `logits = x·wᵀ`, `s = sigmoid(logits)`, `choice = s + bias`; with
//! `n_group > 1` only the `topk_group` groups with the best top-2 sums of `choice` stay
//! candidates; `topk_idx = top_k(choice)`, `topk_weights = s[topk_idx]`, normalized to sum 1
//! if `norm_topk_prob`, times `routed_scaling_factor`. Ties go to the lower index; NaN ranks
//! below every number. The backward gives `grad_x` and `grad_w` from the gradient of the
//! routing weights.

mod bridge;
pub mod config;
pub mod error;
pub mod reference;
pub mod router;

pub use config::{KernelPaths, RouterConfig};
pub use error::{Error, Status};
pub use router::{
    cuda_device_count, BackwardOptions, Dtype, FloatElem, ForwardExtras, IndexElem, Precision,
    Router, Routing, Scores,
};
