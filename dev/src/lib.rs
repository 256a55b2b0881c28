//! What the tests, benches and examples of `moe-routing` share, outside the library and its
//! packages (a dev-dependency, not published):
//!
//! - [`suite`]: the benchmark suites' reader (`benches/shapes/`);
//! - [`testing`]: random inputs, reproducible from a printed seed;
//! - the unfused baselines that the benches time the library against, and the copy behind each
//!   case's ceiling: the composition's non-GEMM steps as a framework runs them around library
//!   GEMMs (cuBLAS, from the benches), and bytes moved with no compute.

pub mod suite;
pub mod testing;

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use half::bf16;
use moe_routing::{Router, Routing};

#[cxx::bridge(namespace = "moe_routing::baseline")]
mod ffi {
    struct BaselineConfig {
        hidden_size: i64,
        n_routed_experts: i64,
        num_experts_per_tok: i64,
        n_group: i64,
        topk_group: i64,
        routed_scaling_factor: f32,
        norm_topk_prob: bool,
    }

    unsafe extern "C++" {
        include!("baseline_bridge.h");

        unsafe fn baseline_routing_grad_dense(
            cfg: &BaselineConfig,
            tokens: i64,
            topk_idx: u64,
            topk_scores: u64,
            grad_topk_weights: u64,
            dense: u64,
            stream: u64,
        ) -> i32;
        #[allow(clippy::too_many_arguments)]
        unsafe fn baseline_route_from_logits(
            cfg: &BaselineConfig,
            tokens: i64,
            logits: u64,
            bias: u64,
            topk_idx: u64,
            topk_weights: u64,
            topk_scores: u64,
            stream: u64,
        ) -> i32;
        #[allow(clippy::too_many_arguments)]
        unsafe fn baseline_copy(
            input: u64,
            output: u64,
            read_bytes: i64,
            write_bytes: i64,
            ctas_per_sm: i32,
            streaming_loads: bool,
            streaming_stores: bool,
            stream: u64,
        ) -> i32;
        fn status_text(status: i32) -> String;
    }
}

/// What went wrong, in words.
#[derive(Debug)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

fn check(code: i32, what: &str) -> Result<(), Error> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error(format!(
            "baseline {what}: {}",
            ffi::status_text(code)
        )))
    }
}

fn len_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn need(have: usize, want: usize, what: &str) -> Result<(), Error> {
    if have < want {
        return Err(Error(format!(
            "{what}: {have} elements, the shape needs {want}"
        )));
    }
    Ok(())
}

/// (E, T·K) of `tokens` tokens.
fn sizes(router: &Router, tokens: usize) -> Result<(usize, usize), Error> {
    let c = router.config();
    if tokens > i32::MAX as usize {
        return Err(Error(format!("tokens {tokens} > 2^31 - 1")));
    }
    Ok((c.n_routed_experts, tokens * c.num_experts_per_tok))
}

fn config(router: &Router) -> ffi::BaselineConfig {
    let c = router.config();
    ffi::BaselineConfig {
        hidden_size: len_i64(c.hidden_size),
        n_routed_experts: len_i64(c.n_routed_experts),
        num_experts_per_tok: len_i64(c.num_experts_per_tok),
        n_group: len_i64(c.n_group),
        topk_group: len_i64(c.topk_group),
        routed_scaling_factor: c.routed_scaling_factor,
        norm_topk_prob: c.norm_topk_prob,
    }
}

/// Keeps the cudarc guards of every buffer alive until the launch has been enqueued.
struct Guards<'a>(Vec<SyncOnDrop<'a>>);

struct Ptr {
    ptr: u64,
}

impl<'a> Guards<'a> {
    fn read<T>(&mut self, s: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> Ptr {
        let (ptr, guard) = s.device_ptr(stream);
        self.0.push(guard);
        Ptr { ptr }
    }
    fn write<T>(&mut self, s: &'a mut impl DevicePtrMut<T>, stream: &'a CudaStream) -> Ptr {
        let (ptr, guard) = s.device_ptr_mut(stream);
        self.0.push(guard);
        Ptr { ptr }
    }
}

/// The unfused baseline's elementwise step (for benchmarks): the dense routing gradient
/// G [tokens, E] in bf16, zero outside the chosen experts.
pub fn routing_grad_dense(
    router: &Router,
    stream: &Arc<CudaStream>,
    tokens: usize,
    topk_idx: &impl DevicePtr<i32>,
    topk_scores: &impl DevicePtr<f32>,
    grad_topk_weights: &impl DevicePtr<f32>,
    dense: &mut impl DevicePtrMut<bf16>,
) -> Result<(), Error> {
    let (e, tk) = sizes(router, tokens)?;
    need(topk_idx.len(), tk, "topk_idx")?;
    need(topk_scores.len(), tk, "topk_scores")?;
    need(grad_topk_weights.len(), tk, "grad_topk_weights")?;
    need(dense.len(), tokens * e, "dense")?;
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| Error(e.to_string()))?;
    let mut g = Guards(Vec::with_capacity(4));
    let (i, s, gw, d) = (
        g.read(topk_idx, stream).ptr,
        g.read(topk_scores, stream).ptr,
        g.read(grad_topk_weights, stream).ptr,
        g.write(dense, stream).ptr,
    );
    // SAFETY: lengths checked above; guards keep the buffers alive across the launch.
    let code = unsafe {
        ffi::baseline_routing_grad_dense(
            &config(router),
            len_i64(tokens),
            i,
            s,
            gw,
            d,
            stream.cu_stream() as u64,
        )
    };
    drop(g);
    check(code, "routing_grad_dense")
}

/// The unfused forward baseline's routing step (for benchmarks): from fp32 logits
/// [tokens, E] (a library GEMM's x·wᵀ) into `out`, with the forward's selection.
pub fn route_from_logits(
    router: &Router,
    stream: &Arc<CudaStream>,
    tokens: usize,
    logits: &impl DevicePtr<f32>,
    bias: &impl DevicePtr<f32>,
    out: &mut Routing,
) -> Result<(), Error> {
    let (e, tk) = sizes(router, tokens)?;
    need(logits.len(), tokens * e, "logits")?;
    need(bias.len(), e, "bias")?;
    need(out.topk_idx.len(), tk, "topk_idx")?;
    need(out.topk_weights.len(), tk, "topk_weights")?;
    need(out.topk_scores.len(), tk, "topk_scores")?;
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| Error(e.to_string()))?;
    let mut g = Guards(Vec::with_capacity(5));
    let (l, b, i, w, s) = (
        g.read(logits, stream).ptr,
        g.read(bias, stream).ptr,
        g.write(&mut out.topk_idx, stream).ptr,
        g.write(&mut out.topk_weights, stream).ptr,
        g.write(&mut out.topk_scores, stream).ptr,
    );
    // SAFETY: lengths checked above; guards keep the buffers alive across the launch.
    let code = unsafe {
        ffi::baseline_route_from_logits(
            &config(router),
            len_i64(tokens),
            l,
            b,
            i,
            w,
            s,
            stream.cu_stream() as u64,
        )
    };
    drop(g);
    check(code, "route_from_logits")
}

/// A copy with no compute (for benchmarks: the ceiling of a case's bytes, and, with
/// `read_bytes` 0, a write that flushes L2): 16-byte vector i is read from `input` where
/// i < ceil(read_bytes / 16) and written to `output` where i < ceil(write_bytes / 16), the
/// vector read or a nonzero one where none is. Both buffers must hold their byte counts
/// rounded up to 16. `ctas_per_sm` 0: one pass over a grid that covers every vector, else
/// grid-stride over that many CTAs of 256 threads per SM (at most 32); the `streaming_*`
/// flags give loads and stores the evict-first hint.
#[allow(clippy::too_many_arguments)]
pub fn copy<T>(
    stream: &Arc<CudaStream>,
    input: &impl DevicePtr<T>,
    output: &mut impl DevicePtrMut<T>,
    read_bytes: usize,
    write_bytes: usize,
    ctas_per_sm: u32,
    streaming_loads: bool,
    streaming_stores: bool,
) -> Result<(), Error> {
    let elem = std::mem::size_of::<T>();
    need(
        input.len() * elem,
        read_bytes.div_ceil(16) * 16,
        "copy input (bytes)",
    )?;
    need(
        output.len() * elem,
        write_bytes.div_ceil(16) * 16,
        "copy output (bytes)",
    )?;
    if ctas_per_sm > 32 {
        return Err(Error(format!("{ctas_per_sm} CTAs per SM: at most 32")));
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| Error(e.to_string()))?;
    let mut g = Guards(Vec::with_capacity(2));
    let (i, o) = (g.read(input, stream).ptr, g.write(output, stream).ptr);
    // SAFETY: sizes checked above; guards keep the buffers alive across the launch.
    let code = unsafe {
        ffi::baseline_copy(
            i,
            o,
            len_i64(read_bytes),
            len_i64(write_bytes),
            ctas_per_sm as i32,
            streaming_loads,
            streaming_stores,
            stream.cu_stream() as u64,
        )
    };
    drop(g);
    check(code, "copy")
}
