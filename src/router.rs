//! The GPU router over cudarc device buffers and a stream.
//!
//! Shapes are checked here before anything crosses the bridge; the C++ layer checks them
//! again (alignment, device ownership) before launching, and on any error touches no output.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::bridge::ffi;
use crate::config::RouterConfig;
use crate::error::{Error, Status};

/// Number of CUDA devices this process can use (0 without a driver or a device).
pub fn cuda_device_count() -> usize {
    usize::try_from(ffi::device_count()).unwrap_or(0)
}

/// Precision of the backward's two GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// The routing gradient enters the tensor cores as bf16; fp32 accumulation.
    #[default]
    Default,
    /// fp32-accurate grad_w; grad_x within its own bf16 output rounding (README: errors).
    /// grad_w must be f32.
    Precise,
    /// The routing gradient rounded to bf16 after every elementwise step, in the order of the
    /// eager bf16 PyTorch composition (README: numerics), so that the results match it up to
    /// the GEMMs' accumulation order. Less exact than `Default`.
    TorchBf16,
}

impl Precision {
    fn code(self) -> i32 {
        match self {
            Precision::Default => 0,
            Precision::Precise => 1,
            Precision::TorchBf16 => 2,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// An element type of the backward's inputs that come in several (its `moe_routing::DType`).
pub trait Dtype: sealed::Sealed {
    #[doc(hidden)]
    const CODE: i32;
}
/// Index types of `topk_idx`: i32 or i64.
pub trait IndexElem: Dtype {}
/// Real types of the scores, their gradients and grad_w: f32 or bf16.
pub trait FloatElem: Dtype {}
impl Dtype for f32 {
    const CODE: i32 = 0;
}
impl Dtype for bf16 {
    const CODE: i32 = 1;
}
impl Dtype for i32 {
    const CODE: i32 = 2;
}
impl Dtype for i64 {
    const CODE: i32 = 3;
}
impl IndexElem for i32 {}
impl IndexElem for i64 {}
impl FloatElem for f32 {}
impl FloatElem for bf16 {}

/// The sigmoid scores the backward reads.
pub enum Scores<P> {
    /// At the chosen experts, [tokens, K] (the forward's `topk_scores`).
    Chosen(P),
    /// Of all experts, [tokens, E]: only the K chosen of each token are read.
    All(P),
}

/// How the backward writes its results.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackwardOptions {
    /// Add into the existing fp32 grad_w (main-grad pattern) instead of overwriting it.
    pub accumulate_grad_w: bool,
    pub precision: Precision,
}

/// What the forward returns and the backward consumes, each [tokens, K].
pub struct Routing {
    pub topk_idx: CudaSlice<i32>,
    pub topk_weights: CudaSlice<f32>,
    /// Sigmoid scores at the chosen experts, saved for the backward.
    pub topk_scores: CudaSlice<f32>,
}

impl Routing {
    /// Allocates outputs for `tokens` tokens of `cfg`.
    pub fn alloc(
        stream: &Arc<CudaStream>,
        cfg: &RouterConfig,
        tokens: usize,
    ) -> Result<Self, Error> {
        let n = tokens
            .checked_mul(cfg.num_experts_per_tok)
            .ok_or_else(|| Error::invalid_shape("tokens * K overflows"))?;
        // SAFETY: every element is written by the forward before it is read.
        unsafe {
            Ok(Self {
                topk_idx: stream.alloc::<i32>(n.max(1))?,
                topk_weights: stream.alloc::<f32>(n.max(1))?,
                topk_scores: stream.alloc::<f32>(n.max(1))?,
            })
        }
    }
}

/// Optional outputs of the forward, off by default (they cost bytes).
#[derive(Default)]
pub struct ForwardExtras<'a> {
    /// All sigmoid scores [tokens, E] (auxiliary load-balancing loss).
    pub scores: Option<&'a mut CudaSlice<f32>>,
    /// Tokens routed to each expert [E], overwritten (correction-bias update).
    pub expert_counts: Option<&'a mut CudaSlice<i32>>,
    /// The indices as int64 [tokens, K] (PyTorch's index dtype), written here instead of into
    /// the `Routing`'s int32 `topk_idx`, which is then left untouched.
    pub topk_idx_i64: Option<&'a mut CudaSlice<i64>>,
}

/// A validated router configuration; the entry point of the GPU API.
#[derive(Clone, Debug)]
pub struct Router {
    cfg: RouterConfig,
    ffi_cfg: ffi::Config,
}

fn len_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Keeps the cudarc guards of every buffer alive until the launch has been enqueued.
struct Guards<'a>(Vec<cudarc::driver::SyncOnDrop<'a>>);

impl<'a> Guards<'a> {
    fn read<T>(&mut self, s: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> ffi::Buffer {
        let (ptr, guard) = s.device_ptr(stream);
        self.0.push(guard);
        ffi::Buffer {
            ptr,
            len: len_i64(s.len()),
        }
    }
    fn write<T>(&mut self, s: &'a mut impl DevicePtrMut<T>, stream: &'a CudaStream) -> ffi::Buffer {
        let len = len_i64(s.len());
        let (ptr, guard) = s.device_ptr_mut(stream);
        self.0.push(guard);
        ffi::Buffer { ptr, len }
    }
}

fn need(have: usize, want: usize, what: &str) -> Result<(), Error> {
    if have < want {
        return Err(Error::new(
            Status::BufferTooSmall,
            format!("{what}: {have} elements, the shape needs {want}"),
        ));
    }
    Ok(())
}

impl Router {
    pub fn new(cfg: RouterConfig) -> Result<Self, Error> {
        cfg.validate()?;
        Ok(Self {
            ffi_cfg: cfg.to_ffi()?,
            cfg,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    fn sizes(&self, tokens: usize) -> Result<(usize, usize, usize), Error> {
        let c = &self.cfg;
        let th = tokens
            .checked_mul(c.hidden_size)
            .ok_or_else(|| Error::invalid_shape(format!("tokens {tokens} * hidden overflows")))?;
        if tokens > i32::MAX as usize {
            return Err(Error::invalid_shape(format!("tokens {tokens} > 2^31 - 1")));
        }
        Ok((
            th,
            c.n_routed_experts * c.hidden_size,
            tokens * c.num_experts_per_tok,
        ))
    }

    /// Bytes of workspace [`Router::backward`] needs for `tokens` tokens.
    pub fn backward_workspace_bytes(&self, tokens: usize) -> usize {
        ffi::backward_workspace_bytes(&self.ffi_cfg, len_i64(tokens)) as usize
    }

    /// Allocates a workspace for the backward of `tokens` tokens.
    pub fn alloc_workspace(
        &self,
        stream: &Arc<CudaStream>,
        tokens: usize,
    ) -> Result<CudaSlice<u8>, Error> {
        Ok(stream.alloc_zeros::<u8>(self.backward_workspace_bytes(tokens).max(256))?)
    }

    /// Routes `tokens` tokens: x [tokens, H], w [E, H], bias [E] into `out`.
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        tokens: usize,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        bias: &impl DevicePtr<f32>,
        out: &mut Routing,
    ) -> Result<(), Error> {
        self.forward_with(stream, tokens, x, w, bias, out, ForwardExtras::default())
    }

    /// [`Router::forward`] that also writes the optional outputs requested in `extras`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with(
        &self,
        stream: &Arc<CudaStream>,
        tokens: usize,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        bias: &impl DevicePtr<f32>,
        out: &mut Routing,
        extras: ForwardExtras<'_>,
    ) -> Result<(), Error> {
        let (th, eh, tk) = self.sizes(tokens)?;
        let e = self.cfg.n_routed_experts;
        need(x.len(), th, "x")?;
        need(w.len(), eh, "w")?;
        need(bias.len(), e, "bias")?;
        match &extras.topk_idx_i64 {
            Some(i) => need(i.len(), tk, "topk_idx_i64")?,
            None => need(out.topk_idx.len(), tk, "topk_idx")?,
        }
        need(out.topk_weights.len(), tk, "topk_weights")?;
        need(out.topk_scores.len(), tk, "topk_scores")?;
        if let Some(s) = &extras.scores {
            need(s.len(), tokens * e, "scores")?;
        }
        if let Some(c) = &extras.expert_counts {
            need(c.len(), e, "expert_counts")?;
        }
        stream.context().bind_to_thread()?;
        let mut g = Guards(Vec::with_capacity(8));
        let off = || ffi::Buffer { ptr: 0, len: 0 };
        let scores = match extras.scores {
            Some(s) => g.write(s, stream),
            None => off(),
        };
        let expert_counts = match extras.expert_counts {
            Some(c) => g.write(c, stream),
            None => off(),
        };
        let (topk_idx, topk_idx_dtype) = match extras.topk_idx_i64 {
            Some(i) => (g.write(i, stream), <i64 as Dtype>::CODE),
            None => (g.write(&mut out.topk_idx, stream), <i32 as Dtype>::CODE),
        };
        let bufs = ffi::ForwardBuffers {
            tokens: len_i64(tokens),
            x: g.read(x, stream),
            w: g.read(w, stream),
            bias: g.read(bias, stream),
            topk_idx,
            topk_weights: g.write(&mut out.topk_weights, stream),
            topk_scores: g.write(&mut out.topk_scores, stream),
            scores,
            expert_counts,
            topk_idx_dtype,
        };
        // SAFETY: every buffer is a live allocation of the stated length, kept alive (and
        // ordered on `stream`) by the guards until after the launch is enqueued.
        let code = unsafe { ffi::router_forward(&self.ffi_cfg, &bufs, stream.cu_stream() as u64) };
        drop(g);
        Status::from_code(code).into_result(|| format!("forward of {tokens} tokens"))
    }

    /// Gradients of the routing weights: grad_x [tokens, H] (bf16) and grad_w [E, H] (fp32,
    /// written or accumulated), from the forward's saved `routing` and grad_topk_weights.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        stream: &Arc<CudaStream>,
        tokens: usize,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        topk_idx: &impl DevicePtr<i32>,
        topk_scores: &impl DevicePtr<f32>,
        grad_topk_weights: &impl DevicePtr<f32>,
        grad_x: &mut impl DevicePtrMut<bf16>,
        grad_w: &mut impl DevicePtrMut<f32>,
        options: BackwardOptions,
        workspace: &mut impl DevicePtrMut<u8>,
    ) -> Result<(), Error> {
        self.backward_as(
            stream,
            tokens,
            x,
            w,
            topk_idx,
            Scores::Chosen(topk_scores),
            grad_topk_weights,
            grad_x,
            grad_w,
            options,
            workspace,
        )
    }

    /// [`Router::backward`] on the inputs as PyTorch holds them, read in place by the kernel:
    /// int32 or int64 `topk_idx`, the scores at the chosen experts [tokens, K] or of all
    /// experts [tokens, E] (f32 or bf16), f32 or bf16 `grad_topk_weights`; grad_w written as
    /// f32 or bf16 (bf16: not accumulated, not with `Precision::Precise`).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_as<I: IndexElem, S: FloatElem, G: FloatElem, W: FloatElem>(
        &self,
        stream: &Arc<CudaStream>,
        tokens: usize,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        topk_idx: &impl DevicePtr<I>,
        scores: Scores<&impl DevicePtr<S>>,
        grad_topk_weights: &impl DevicePtr<G>,
        grad_x: &mut impl DevicePtrMut<bf16>,
        grad_w: &mut impl DevicePtrMut<W>,
        options: BackwardOptions,
        workspace: &mut impl DevicePtrMut<u8>,
    ) -> Result<(), Error> {
        let (th, eh, tk) = self.sizes(tokens)?;
        need(x.len(), th, "x")?;
        need(w.len(), eh, "w")?;
        need(topk_idx.len(), tk, "topk_idx")?;
        match &scores {
            Scores::Chosen(s) => need(s.len(), tk, "topk_scores")?,
            Scores::All(s) => need(s.len(), tokens * self.cfg.n_routed_experts, "scores")?,
        }
        need(grad_topk_weights.len(), tk, "grad_topk_weights")?;
        need(grad_x.len(), th, "grad_x")?;
        need(grad_w.len(), eh, "grad_w")?;
        need(
            workspace.len(),
            self.backward_workspace_bytes(tokens),
            "workspace",
        )?;
        if W::CODE == bf16::CODE {
            if options.accumulate_grad_w {
                return Err(Error::new(
                    Status::Unsupported,
                    "grad_w: bf16 is written, never accumulated (accumulate into f32)",
                ));
            }
            if options.precision == Precision::Precise {
                return Err(Error::new(
                    Status::Unsupported,
                    "grad_w: Precision::Precise writes f32 grad_w, not bf16",
                ));
            }
        }
        stream.context().bind_to_thread()?;
        let mut g = Guards(Vec::with_capacity(9));
        let off = || ffi::Buffer { ptr: 0, len: 0 };
        let (topk_scores, all_scores) = match scores {
            Scores::Chosen(s) => (g.read(s, stream), off()),
            Scores::All(s) => (off(), g.read(s, stream)),
        };
        let bufs = ffi::BackwardBuffers {
            tokens: len_i64(tokens),
            x: g.read(x, stream),
            w: g.read(w, stream),
            topk_idx: g.read(topk_idx, stream),
            topk_scores,
            grad_topk_weights: g.read(grad_topk_weights, stream),
            grad_x: g.write(grad_x, stream),
            grad_w: g.write(grad_w, stream),
            accumulate_grad_w: options.accumulate_grad_w,
            precision: options.precision.code(),
            workspace: g.write(workspace, stream),
            scores: all_scores,
            topk_idx_dtype: I::CODE,
            scores_dtype: S::CODE,
            grad_topk_weights_dtype: G::CODE,
            grad_w_dtype: W::CODE,
        };
        // SAFETY: as in `forward`.
        let code = unsafe { ffi::router_backward(&self.ffi_cfg, &bufs, stream.cu_stream() as u64) };
        drop(g);
        Status::from_code(code).into_result(|| format!("backward of {tokens} tokens"))
    }
}
