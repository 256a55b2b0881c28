//! Backward benchmark: the fused `Router::backward` against the unfused baseline (elementwise
//! dense routing gradient + two cuBLAS GEMMs) on every case of the suite, with speed of light.
//!
//!     cargo bench --bench backward [-- [--filter NAME] [--json PATH]]
//!     bench-backward --bench [--json PATH] [--filter NAME]
//!
//! Per case: fused backward (`Precision::Default`), fused backward (`Precision::Precise`) and
//! the unfused baseline, timed as `../shared/bench/README.md` asks: CUDA events around many
//! back-to-back calls (replayed from a CUDA graph, so that the GPU time is measured, not the
//! host's launch rate; `MOE_ROUTING_BENCH_EAGER=1`: launched one by one), median of several
//! rounds, after warm-up, rotating among enough input sets (>= 2x the 50 MB L2) that no call
//! finds the previous call's data in cache.
//!
//! Results go to stdout (a table) and to JSON: `--json PATH`, else `$MOE_ROUTING_BENCH_JSON`,
//! else `target/bench-backward.json`. The suite is read from `$MOE_ROUTING_SUITE` or
//! `../shared/bench/suite.json`. Without a CUDA device the benchmark is skipped (exit 0).

mod common;

use std::sync::Arc;

use common::{
    case_json, gemm, gemm_dims, input_sets, mean, open_session, parse_args, results_json, show,
    time_calls, write_json, Figures, Means, Operand, Result, Timing,
};
use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_routing::suite::Case;
use moe_routing::testing::{bf16_to_f64, random_grad, to_f64, Inputs, Rng};
use moe_routing::{BackwardOptions, Precision, Router, Routing};

/// The baseline must match the fused backward this closely (‖a − b‖ / ‖b‖), which it can only
/// do if the GEMMs' transposes and leading dimensions are right.
const GRAD_X_TOL: f64 = 2e-2;
const GRAD_W_TOL: f64 = 1e-2;

fn main() {
    if let Err(e) = run() {
        eprintln!("bench-backward: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------
// Driver

fn run() -> Result<()> {
    let args = parse_args(
        "backward",
        false,
        "usage: bench-backward [--json PATH] [--filter NAME]\n\
         Both precisions are always timed. Other flags (such as cargo's --bench) are ignored.",
    )?;
    let Some(session) = open_session(&args)? else {
        return Ok(());
    };
    let (cases, stream) = (&session.cases, &session.stream);
    print_header();
    let mut results = Vec::with_capacity(cases.len());
    for (i, case) in cases.iter().enumerate() {
        let r = bench_case(stream, session.blas.as_ref(), case, 0x5EED_0000 + i as u64)?;
        print_row(case, &r);
        results.push(r);
    }
    let summary = Summary::of(cases, &results);
    summary.print(&session.device);
    write_json(
        &args.json,
        &to_json(&session.device, cases, &results, &summary),
    )
}

// ---------------------------------------------------------------------------------------
// One case

/// Device buffers of one backward call. Rotating among several keeps each call's reads cold.
struct InputSet {
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    topk_idx: CudaSlice<i32>,
    topk_scores: CudaSlice<f32>,
    grad_topk_weights: CudaSlice<f32>,
    grad_x: CudaSlice<bf16>,
    grad_w: CudaSlice<f32>,
}

impl InputSet {
    /// Random inputs; the routing (indices and saved scores) comes from a GPU forward on them.
    fn new(
        stream: &Arc<CudaStream>,
        router: &Router,
        tokens: usize,
        rng: &mut Rng,
    ) -> Result<Self> {
        let cfg = router.config();
        let inp = Inputs::random(cfg, tokens, rng);
        let (x, w) = (stream.clone_htod(&inp.x)?, stream.clone_htod(&inp.w)?);
        let bias = stream.clone_htod(&inp.bias)?;
        let mut routing = Routing::alloc(stream, cfg, tokens)?;
        router.forward(stream, tokens, &x, &w, &bias, &mut routing)?;
        let k = cfg.num_experts_per_tok;
        Ok(Self {
            x,
            w,
            topk_idx: routing.topk_idx,
            topk_scores: routing.topk_scores,
            grad_topk_weights: stream.clone_htod(&random_grad(tokens * k, rng))?,
            grad_x: stream.alloc_zeros(tokens * cfg.hidden_size)?,
            grad_w: stream.alloc_zeros(cfg.n_routed_experts * cfg.hidden_size)?,
        })
    }
}

struct CaseResult {
    sets: usize,
    fused: Timing,
    precise: Timing,
    unfused: Option<Timing>,
}

fn bench_case(
    stream: &Arc<CudaStream>,
    blas: Option<&CudaBlas>,
    case: &Case,
    seed: u64,
) -> Result<CaseResult> {
    let router = Router::new(case.config)?;
    let (tokens, cfg) = (case.tokens, router.config());
    // One set holds exactly what the SOL counts: x, grad_x, w, grad_w and the [T, K] inputs.
    let sets = input_sets(case.backward_bytes());
    let mut rng = Rng::new(seed);
    let mut inputs = (0..sets)
        .map(|_| InputSet::new(stream, &router, tokens, &mut rng))
        .collect::<Result<Vec<_>>>()?;
    // Scratch, not part of any input set: written and consumed within one call.
    let mut workspace = router.alloc_workspace(stream, tokens)?;
    let mut dense = stream.alloc_zeros::<bf16>(tokens * cfg.n_routed_experts)?;

    if let Some(blas) = blas {
        verify_baseline(
            stream,
            blas,
            &router,
            case,
            &mut inputs[0],
            &mut workspace,
            &mut dense,
        )?;
    }
    let mut time_fused = |precision| {
        time_calls(stream, sets, |i| {
            fused_backward(
                stream,
                &router,
                tokens,
                &mut inputs[i % sets],
                &mut workspace,
                precision,
            )
        })
    };
    let fused_t = time_fused(Precision::Default)?;
    let precise_t = time_fused(Precision::Precise)?;
    let unfused_t = match blas {
        Some(blas) => Some(time_calls(stream, sets, |i| {
            unfused_backward(
                stream,
                blas,
                &router,
                tokens,
                &mut inputs[i % sets],
                &mut dense,
            )
        })?),
        None => None,
    };
    Ok(CaseResult {
        sets,
        fused: fused_t,
        precise: precise_t,
        unfused: unfused_t,
    })
}

/// The fused backward on `set`, overwriting its grad_w.
fn fused_backward(
    stream: &Arc<CudaStream>,
    router: &Router,
    tokens: usize,
    set: &mut InputSet,
    workspace: &mut CudaSlice<u8>,
    precision: Precision,
) -> Result<()> {
    let options = BackwardOptions {
        precision,
        ..Default::default()
    };
    router.backward(
        stream,
        tokens,
        &set.x,
        &set.w,
        &set.topk_idx,
        &set.topk_scores,
        &set.grad_topk_weights,
        &mut set.grad_x,
        &mut set.grad_w,
        options,
        workspace,
    )?;
    Ok(())
}

/// Runs the fused (default precision) and the unfused backward on `set` and checks that they
/// agree; panics otherwise, since a wrong baseline would make every speedup meaningless.
fn verify_baseline(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    router: &Router,
    case: &Case,
    set: &mut InputSet,
    workspace: &mut CudaSlice<u8>,
    dense: &mut CudaSlice<bf16>,
) -> Result<()> {
    fused_backward(
        stream,
        router,
        case.tokens,
        set,
        workspace,
        Precision::Default,
    )?;
    let fused_x = bf16_to_f64(&stream.clone_dtoh(&set.grad_x)?);
    let fused_w = to_f64(&stream.clone_dtoh(&set.grad_w)?);
    // Clear the outputs so that a GEMM that writes nothing cannot pass.
    stream.memset_zeros(&mut set.grad_x)?;
    stream.memset_zeros(&mut set.grad_w)?;
    unfused_backward(stream, blas, router, case.tokens, set, dense)?;
    let err_x = rel_l2(&bf16_to_f64(&stream.clone_dtoh(&set.grad_x)?), &fused_x);
    let err_w = rel_l2(&to_f64(&stream.clone_dtoh(&set.grad_w)?), &fused_w);
    // `!(a < b)` so that NaN fails too.
    if !(err_x < GRAD_X_TOL && err_w < GRAD_W_TOL) {
        panic!(
            "{}: the unfused baseline disagrees with the fused backward: relative L2 error of \
             grad_x {err_x:.3e} (limit {GRAD_X_TOL:e}), grad_w {err_w:.3e} (limit \
             {GRAD_W_TOL:e}); the cuBLAS transposes or leading dimensions are wrong",
            case.name
        );
    }
    Ok(())
}

/// ‖a − b‖₂ / ‖b‖₂ in f64.
fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_l2: length mismatch");
    let diff: f64 = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum();
    let norm: f64 = b.iter().map(|q| q * q).sum();
    (diff / norm).sqrt()
}

/// The unfused baseline: the dense bf16 routing gradient G [T, E], then two cuBLAS GEMMs with
/// fp32 accumulation: grad_x [T, H] (bf16) = G · w and grad_w [E, H] (fp32) = Gᵀ · x.
///
/// All tensors are row-major and cuBLAS is column-major: a row-major [R, C] matrix is the
/// column-major [C, R] matrix (its transpose) with leading dimension C, so the row-major
/// product C = A · B is computed as the column-major Cᵀ = Bᵀ · Aᵀ.
fn unfused_backward(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    router: &Router,
    tokens: usize,
    set: &mut InputSet,
    dense: &mut CudaSlice<bf16>,
) -> Result<()> {
    use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};

    router.baseline_routing_grad_dense(
        stream,
        tokens,
        &set.topk_idx,
        &set.topk_scores,
        &set.grad_topk_weights,
        dense,
    )?;
    let (t, e, h) = gemm_dims(tokens, router.config())?;
    // The guards keep the buffers alive and ordered on `stream` until both GEMMs are enqueued.
    let (g, _g) = dense.device_ptr(stream);
    let (x, _x) = set.x.device_ptr(stream);
    let (w, _w) = set.w.device_ptr(stream);
    let (grad_x, _grad_x) = set.grad_x.device_ptr_mut(stream);
    let (grad_w, _grad_w) = set.grad_w.device_ptr_mut(stream);
    // SAFETY: every pointer addresses a live device allocation of the size the shapes imply
    // (checked by the router for G, by construction for the rest).
    unsafe {
        // grad_x [T, H] = G [T, E] · w [E, H]; column-major: grad_xᵀ [H, T] = wᵀ [H, E] · Gᵀ [E, T],
        // where wᵀ and Gᵀ are w and G as stored (leading dimensions H and E).
        gemm(
            blas,
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            h,
            t,
            e,
            Operand::bf16(w, h),
            Operand::bf16(g, e),
            Operand::bf16(grad_x, h),
        )?;
        // grad_w [E, H] = Gᵀ [E, T] · x [T, H]; column-major: grad_wᵀ [H, E] = xᵀ [H, T] · G [T, E],
        // where xᵀ is x as stored (leading dimension H) and G is the stored Gᵀ [E, T] transposed.
        gemm(
            blas,
            CUBLAS_OP_N,
            CUBLAS_OP_T,
            h,
            e,
            t,
            Operand::bf16(x, h),
            Operand::bf16(g, e),
            Operand::f32(grad_w, h),
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Report

fn figures(case: &Case, r: &CaseResult) -> Figures {
    Figures::new(
        case.backward_sol_s(),
        case.backward_bytes(),
        r.fused,
        r.unfused,
    )
}

fn print_header() {
    println!(
        "{:<16} {:>6} {:>10} {:>11} {:>11} {:>8} {:>6} {:>6} {:>8} {:>5}",
        "case",
        "T",
        "fused µs",
        "precise µs",
        "unfused µs",
        "SOL µs",
        "TB/s",
        "%SOL",
        "speedup",
        "sets"
    );
}

fn print_row(case: &Case, r: &CaseResult) {
    let f = figures(case, r);
    println!(
        "{:<16} {:>6} {:>10.2} {:>11.2} {:>11} {:>8.2} {:>6.2} {:>5.1}% {:>8} {:>5}",
        case.name,
        case.tokens,
        r.fused.us,
        r.precise.us,
        show(r.unfused.map(|u| u.us), 2, ""),
        f.sol_us,
        f.fused_tbps,
        f.sol_pct,
        show(f.speedup, 2, "x"),
        r.sets,
    );
    common::flush();
}

struct Summary {
    means: Means,
    precise_ratio: Option<f64>,
}

impl Summary {
    fn of(cases: &[Case], results: &[CaseResult]) -> Self {
        let figures: Vec<Figures> = cases
            .iter()
            .zip(results)
            .map(|(c, r)| figures(c, r))
            .collect();
        Self {
            means: Means::of(&figures),
            precise_ratio: mean(results.iter().map(|r| r.precise.us / r.fused.us)),
        }
    }

    fn print(&self, device: &str) {
        self.means.print();
        println!(
            "mean precise/fused ratio: {}",
            show(self.precise_ratio, 3, "")
        );
        println!("device: {device}");
    }
}

fn to_json(device: &str, cases: &[Case], results: &[CaseResult], s: &Summary) -> String {
    let rows: Vec<String> = cases
        .iter()
        .zip(results)
        .map(|(case, r)| {
            let f = figures(case, r);
            let precise = Some(("precise_us", r.precise.us));
            case_json(case, r.fused, precise, r.unfused, &f, r.sets)
        })
        .collect();
    let precise_ratio = Some(("mean_precise_ratio", s.precise_ratio));
    results_json(device, "backward", &rows, &s.means, precise_ratio)
}
