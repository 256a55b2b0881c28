//! Router configuration, with the field names of HF transformers' GLM-4.5 / DeepSeek-V3 configs.

use crate::bridge::ffi;
use crate::error::{Error, Status};

/// Which kernels a config takes ([`RouterConfig::kernel_paths`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelPaths {
    /// The fused forward (else the simple one).
    pub forward_fused: bool,
    /// The fused backward (else the simple one).
    pub backward_fused: bool,
}

/// Shape and semantics of one grouped top-k router.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    /// H: width of a token's activation; a multiple of 8.
    pub hidden_size: usize,
    /// E: routed experts (at most 512).
    pub n_routed_experts: usize,
    /// K: experts chosen per token (at most 16).
    pub num_experts_per_tok: usize,
    /// Expert groups (E / n_group experts each); 1 disables group selection.
    pub n_group: usize,
    /// Groups kept per token before the top-k.
    pub topk_group: usize,
    /// Factor applied to the routing weights.
    pub routed_scaling_factor: f32,
    /// Normalize the K weights to sum to 1 (before scaling).
    pub norm_topk_prob: bool,
}

impl RouterConfig {
    /// The GLM-4.5 router: hidden 5120, 160 experts, top-8, scaled by 2.5, normalized.
    ///
    /// ```
    /// use moe_routing::{RouterConfig, Status};
    /// let cfg = RouterConfig::glm45(8, 4); // 8 groups of 20 experts, 4 kept per token
    /// assert!(cfg.validate().is_ok());
    /// // 8 experts cannot come from 1 kept group of 5.
    /// let bad = RouterConfig { n_routed_experts: 40, topk_group: 1, ..cfg };
    /// assert_eq!(bad.validate().unwrap_err().kind, Status::InvalidConfig);
    /// ```
    pub fn glm45(n_group: usize, topk_group: usize) -> Self {
        Self {
            hidden_size: 5120,
            n_routed_experts: 160,
            num_experts_per_tok: 8,
            n_group,
            topk_group,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
        }
    }

    /// Checks the fields against each other and against this build's limits.
    pub fn validate(&self) -> Result<(), Error> {
        let status = ffi::validate_config(&self.to_ffi()?);
        Status::from_code(status).into_result(|| format!("{self:?}"))
    }

    /// Which kernels this config takes (validated first): the fused ones, or the simple
    /// CUDA-core ones, which are far slower. The fused forward also needs 16-byte aligned x and
    /// w, as allocators give. Needs no GPU.
    ///
    /// ```
    /// use moe_routing::RouterConfig;
    /// let paths = RouterConfig::glm45(8, 4).kernel_paths().unwrap();
    /// assert!(paths.forward_fused && paths.backward_fused);
    /// ```
    pub fn kernel_paths(&self) -> Result<KernelPaths, Error> {
        let (mut forward_fused, mut backward_fused) = (false, false);
        let status = ffi::kernel_paths(&self.to_ffi()?, &mut forward_fused, &mut backward_fused);
        Status::from_code(status).into_result(|| format!("{self:?}"))?;
        Ok(KernelPaths {
            forward_fused,
            backward_fused,
        })
    }

    pub(crate) fn to_ffi(self) -> Result<ffi::Config, Error> {
        let c = |v: usize, name: &str| {
            i64::try_from(v).map_err(|_| Error::invalid_config(format!("{name} = {v} overflows")))
        };
        Ok(ffi::Config {
            hidden_size: c(self.hidden_size, "hidden_size")?,
            n_routed_experts: c(self.n_routed_experts, "n_routed_experts")?,
            num_experts_per_tok: c(self.num_experts_per_tok, "num_experts_per_tok")?,
            n_group: c(self.n_group, "n_group")?,
            topk_group: c(self.topk_group, "topk_group")?,
            routed_scaling_factor: self.routed_scaling_factor,
            norm_topk_prob: self.norm_topk_prob,
        })
    }
}
