//! Backward benchmark: the fused `Router::backward` on every case of two suites, the training
//! suite (`benches/shapes/suite.json`) and the public range (`benches/shapes/public_range.json`:
//! the public benchmark's token counts, with its inputs as PyTorch holds them), beside the
//! unfused baseline (elementwise dense routing gradient + two cuBLAS GEMMs), a copy ceiling and
//! the speed of light.
//!
//!     cargo bench --bench backward [-- [--suite training|public|both] [--filter NAME] [--json PATH]]
//!     bench-backward --bench [--suite training|public|both] [--filter NAME] [--json PATH]
//!
//! `--suite` picks the suites (default both); `--filter` keeps the cases whose names contain
//! NAME. Per case, timed as a training step sees the call:
//! - **single call** (`single_us`, the primary figure): each call on its own, after a kernel
//!   that writes twice the 50 MB L2 (so the call finds nothing in cache and follows another
//!   kernel); CUDA events recorded once that kernel is queued and after the call; the median of
//!   40 calls. For the fused backward (`Precision::Default`, and `Precision::Precise`) and the
//!   unfused baseline.
//! - **back to back** (`back_to_back_us`, labelled, beside it; `fused_us`, `precise_us` and
//!   `unfused_us` as before): CUDA events around many calls in a row replayed from a CUDA graph
//!   (`MOE_ROUTING_BENCH_EAGER=1`: launched one by one), median of several rounds, after
//!   warm-up. Consecutive fused calls overlap through programmatic dependent launch and find
//!   L2 warm from the previous call's writes, so a training step does not see this figure.
//! - **ceiling** (`ceiling_us`): the case's SOL bytes (read R, write W) moved with no compute,
//!   timed as the single calls in the same run: the fastest of twelve copy kernels (one pass or
//!   grid-stride, cache hints) and a device-to-device memcpy. Targets are ratios to it
//!   (`single_over_ceiling`); % SOL (`sol_pct`, of the single call) is reported beside them.
//!
//! Every timing rotates among input sets (>= 2x the 50 MB L2 in all, so that no call finds the
//! previous call's data in cache) of random data, never zeros. The public range's fused calls
//! read its PyTorch-dtype buffers in place (`Router::backward_as`); its unfused baseline runs on
//! int32/f32 copies of the same values. Before timing, the baseline is checked against the
//! fused backward.
//!
//! Results go to stdout (a table per suite, then one summary line per suite) and to JSON:
//! `--json PATH`, else `$MOE_ROUTING_BENCH_JSON`, else `target/bench-backward.json`; the
//! training suite's cases at the top level, the public range's under `public_range`. The suites
//! are read from `$MOE_ROUTING_SUITE` and `$MOE_ROUTING_PUBLIC_RANGE` where set. Without a CUDA
//! device the benchmark is skipped (exit 0).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{
    ceiling_method, gemm, gemm_dims, input_sets, load_cases, mean, method, open_session,
    parse_args, show, single_method, time_calls, time_ceiling, time_single_calls, write_json,
    Ceiling, Figures, Flush, JsonObject, Means, Operand, Result, Timing,
};
use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_routing::{BackwardOptions, Precision, Router, Routing, Scores};
use moe_routing_dev::suite::{self, Case, Interface};
use moe_routing_dev::testing::{bf16_to_f64, random_grad, to_f64, Inputs, Rng};

/// The baseline must match the fused backward this closely (‖a − b‖ / ‖b‖), which it can only
/// do if the GEMMs' transposes and leading dimensions are right.
const GRAD_X_TOL: f64 = 2e-2;
const GRAD_W_TOL: f64 = 1e-2;

const USAGE: &str = "usage: bench-backward [--suite training|public|both] [--filter NAME] \
                     [--json PATH]\n\
                     Both precisions are always timed. Other flags (such as cargo's --bench) \
                     are ignored.";

fn main() {
    if let Err(e) = run() {
        eprintln!("bench-backward: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------
// Driver

/// The suites a run times (`--suite`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Suites {
    Training,
    Public,
    Both,
}

impl Suites {
    fn parse(arg: Option<&str>) -> Result<Self> {
        Ok(match arg {
            None | Some("both") => Self::Both,
            Some("training") => Self::Training,
            Some("public") => Self::Public,
            Some(other) => {
                return Err(format!("--suite {other}: expected training, public or both").into())
            }
        })
    }

    fn has(self, suite: Self) -> bool {
        self == Self::Both || self == suite
    }
}

/// One suite's cases and results.
struct SuiteRun {
    label: &'static str,
    path: PathBuf,
    cases: Vec<Case>,
    results: Vec<CaseResult>,
    summary: Summary,
}

fn run() -> Result<()> {
    let args = parse_args("backward", false, USAGE)?;
    let suites = Suites::parse(args.suite.as_deref())?;
    let Some(session) = open_session()? else {
        return Ok(());
    };
    let stream = &session.stream;
    let mut flush = Flush::new(stream)?;
    let all = [
        (
            Suites::Training,
            "training suite",
            suite::default_path(),
            0x5EED_0000,
        ),
        (
            Suites::Public,
            "public range",
            suite::public_range_path(),
            0x5EED_1000,
        ),
    ];
    let mut training = None;
    let mut public = None;
    for (which, label, path, seed) in all {
        if !suites.has(which) {
            continue;
        }
        let cases = load_cases(&path, args.filter.as_deref())?;
        println!("\n{label}: {} case(s) of {}", cases.len(), path.display());
        if cases.iter().any(|c| c.interface == Interface::PyTorch) {
            println!("PyTorch-dtype inputs, called as: {PUBLIC_CALL}");
        }
        if !cases.is_empty() {
            print_header();
        }
        let mut results = Vec::with_capacity(cases.len());
        for (i, case) in cases.iter().enumerate() {
            let r = bench_case(
                stream,
                session.blas.as_ref(),
                &mut flush,
                case,
                seed + i as u64,
            )?;
            print_row(case, &r);
            results.push(r);
        }
        let summary = Summary::of(&cases, &results);
        if !cases.is_empty() {
            summary.print_details();
        }
        let run = SuiteRun {
            label,
            path,
            cases,
            results,
            summary,
        };
        match which {
            Suites::Training => training = Some(run),
            _ => public = Some(run),
        }
    }
    println!("device: {}", session.device);
    write_json(
        &args.json,
        &to_json(&session.device, training.as_ref(), public.as_ref()),
    )?;
    // Last, so that a log's tail holds them.
    for run in training.iter().chain(&public) {
        run.summary.print_line(run.label);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// One case

/// Device buffers of one backward call. Rotating among several keeps each call's reads cold.
/// Every set holds the routing inputs and grad_w in the training dtypes: the training suite's
/// call and both suites' unfused baseline read them (and precise mode's f32 grad_w on the
/// public range: [`call_public`]).
struct InputSet {
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    topk_idx: CudaSlice<i32>,
    topk_scores: CudaSlice<f32>,
    grad_topk_weights: CudaSlice<f32>,
    grad_x: CudaSlice<bf16>,
    grad_w: CudaSlice<f32>,
    /// The public range's routing inputs and grad_w, as PyTorch holds them.
    pytorch: Option<PyTorchSet>,
}

/// The public range's buffers in PyTorch's dtypes.
struct PyTorchSet {
    /// [T, K] int64.
    topk_idx: CudaSlice<i64>,
    /// [T, E] bf16: the sigmoid scores of all experts.
    scores: CudaSlice<bf16>,
    /// [T, K] bf16.
    grad_topk_weights: CudaSlice<bf16>,
    /// [E, H] bf16, written.
    grad_w: CudaSlice<bf16>,
}

impl InputSet {
    fn new(stream: &Arc<CudaStream>, router: &Router, case: &Case, rng: &mut Rng) -> Result<Self> {
        match case.interface {
            Interface::Training => Self::training(stream, router, case.tokens, rng),
            Interface::PyTorch => Self::pytorch(stream, router, case.tokens, rng),
        }
    }

    /// Random inputs; the routing (indices and saved scores) comes from a GPU forward on them.
    fn training(
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
            pytorch: None,
        })
    }

    /// Random inputs in PyTorch's dtypes: K distinct experts per token, sigmoid scores of all
    /// experts (of logits in [-3, 3)), grads uniform in [-1, 1). The training-dtype buffers
    /// hold the same values (the chosen scores gathered, bf16 widened), made once here.
    fn pytorch(
        stream: &Arc<CudaStream>,
        router: &Router,
        tokens: usize,
        rng: &mut Rng,
    ) -> Result<Self> {
        let cfg = router.config();
        let (h, e, k) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
        );
        let inp = Inputs::random(cfg, tokens, rng);
        let idx = random_topk(tokens, e, k, rng);
        let scores: Vec<bf16> = (0..tokens * e)
            .map(|_| bf16::from_f32(1.0 / (1.0 + (-3.0 * rng.uniform()).exp())))
            .collect();
        let grad: Vec<bf16> = random_grad(tokens * k, rng)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let idx32: Vec<i32> = idx.iter().map(|&i| i as i32).collect();
        let chosen: Vec<f32> = (0..tokens * k)
            .map(|j| scores[j / k * e + idx[j] as usize].to_f32())
            .collect();
        let grad32: Vec<f32> = grad.iter().map(|g| g.to_f32()).collect();
        Ok(Self {
            x: stream.clone_htod(&inp.x)?,
            w: stream.clone_htod(&inp.w)?,
            topk_idx: stream.clone_htod(&idx32)?,
            topk_scores: stream.clone_htod(&chosen)?,
            grad_topk_weights: stream.clone_htod(&grad32)?,
            grad_x: stream.alloc_zeros(tokens * h)?,
            grad_w: stream.alloc_zeros(e * h)?,
            pytorch: Some(PyTorchSet {
                topk_idx: stream.clone_htod(&idx)?,
                scores: stream.clone_htod(&scores)?,
                grad_topk_weights: stream.clone_htod(&grad)?,
                grad_w: stream.alloc_zeros(e * h)?,
            }),
        })
    }
}

/// K distinct experts of `e` per token, in random order (partial Fisher-Yates shuffles).
fn random_topk(tokens: usize, e: usize, k: usize, rng: &mut Rng) -> Vec<i64> {
    let mut experts: Vec<i64> = (0..e as i64).collect();
    let mut idx = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        for j in 0..k {
            experts.swap(j, j + rng.below(e - j));
            idx.push(experts[j]);
        }
    }
    idx
}

struct CaseResult {
    sets: usize,
    /// Single calls (µs): the fused backward, default and precise, and the unfused baseline.
    single: f64,
    precise_single: f64,
    unfused_single: Option<f64>,
    /// Back to back.
    fused: Timing,
    precise: Timing,
    unfused: Option<Timing>,
    ceiling: Ceiling,
}

fn bench_case(
    stream: &Arc<CudaStream>,
    blas: Option<&CudaBlas>,
    flush: &mut Flush,
    case: &Case,
    seed: u64,
) -> Result<CaseResult> {
    let router = Router::new(case.config)?;
    let (tokens, cfg) = (case.tokens, router.config());
    // One set holds what the SOL counts: x, grad_x, w, grad_w and the routing inputs (the
    // public range's sets hold their training-dtype copies besides).
    let sets = input_sets(case.backward_bytes());
    let mut rng = Rng::new(seed);
    let mut inputs = (0..sets)
        .map(|_| InputSet::new(stream, &router, case, &mut rng))
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
    let mut fused = |i: usize, precision| {
        fused_backward(
            stream,
            &router,
            tokens,
            &mut inputs[i % sets],
            &mut workspace,
            precision,
        )
    };
    let fused_t = time_calls(stream, sets, |i| fused(i, Precision::Default))?;
    let precise_t = time_calls(stream, sets, |i| fused(i, Precision::Precise))?;
    let single = time_single_calls(stream, flush, sets, |i| fused(i, Precision::Default))?;
    let precise_single = time_single_calls(stream, flush, sets, |i| fused(i, Precision::Precise))?;
    let (unfused_t, unfused_single) = match blas {
        Some(blas) => {
            let mut unfused = |i: usize| {
                unfused_backward(
                    stream,
                    blas,
                    &router,
                    tokens,
                    &mut inputs[i % sets],
                    &mut dense,
                )
            };
            (
                Some(time_calls(stream, sets, &mut unfused)?),
                Some(time_single_calls(stream, flush, sets, &mut unfused)?),
            )
        }
        None => (None, None),
    };
    // The case's buffers go before the ceiling's arrive.
    drop((inputs, workspace, dense));
    let ceiling = time_ceiling(
        stream,
        flush,
        case.backward_read_bytes(),
        case.backward_write_bytes(),
        seed ^ 0xC0DE_0000_0000,
    )?;
    Ok(CaseResult {
        sets,
        single,
        precise_single,
        unfused_single,
        fused: fused_t,
        precise: precise_t,
        unfused: unfused_t,
        ceiling,
    })
}

/// The fused backward on `set`, in its suite's interface, overwriting its grad_w.
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
    if set.pytorch.is_some() {
        return call_public(stream, router, tokens, set, workspace, options);
    }
    training_backward(stream, router, tokens, set, workspace, options)
}

/// `Router::backward` on the training-dtype buffers of `set`.
fn training_backward(
    stream: &Arc<CudaStream>,
    router: &Router,
    tokens: usize,
    set: &mut InputSet,
    workspace: &mut CudaSlice<u8>,
    options: BackwardOptions,
) -> Result<()> {
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

/// How [`call_public`] passes the public range's inputs (printed, and `call` in the JSON).
const PUBLIC_CALL: &str = "Router::backward_as on the PyTorch-dtype buffers in place: int64 \
                           topk_idx, Scores::All [T, E] bf16, bf16 grad_topk_weights, grad_w \
                           bf16 (precise mode: grad_w f32, the only grad_w it writes)";

/// The public range's call: `Router::backward_as` on `set.pytorch`, the inputs as PyTorch holds
/// them, read in place (no conversion).
fn call_public(
    stream: &Arc<CudaStream>,
    router: &Router,
    tokens: usize,
    set: &mut InputSet,
    workspace: &mut CudaSlice<u8>,
    options: BackwardOptions,
) -> Result<()> {
    let p = set.pytorch.as_mut().ok_or("not a public-range input set")?;
    let (idx, scores, grad) = (&p.topk_idx, Scores::All(&p.scores), &p.grad_topk_weights);
    let (x, w, grad_x) = (&set.x, &set.w, &mut set.grad_x);
    if options.precision == Precision::Precise {
        // Precise mode writes grad_w in f32 only.
        let grad_w = &mut set.grad_w;
        router.backward_as(
            stream, tokens, x, w, idx, scores, grad, grad_x, grad_w, options, workspace,
        )?;
    } else {
        let grad_w = &mut p.grad_w;
        router.backward_as(
            stream, tokens, x, w, idx, scores, grad, grad_x, grad_w, options, workspace,
        )?;
    }
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
    // The training-dtype call on either suite's set: it checks the baseline, not the dtypes.
    training_backward(
        stream,
        router,
        case.tokens,
        set,
        workspace,
        BackwardOptions::default(),
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

    moe_routing_dev::routing_grad_dense(
        router,
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

/// Derived figures of one case.
struct Row {
    sol_us: f64,
    /// Of the single call.
    sol_pct: f64,
    single_over_ceiling: f64,
    /// Unfused / fused, single calls.
    single_speedup: Option<f64>,
    /// Of the back-to-back figures (their TB/s, % SOL and speedup).
    back_to_back: Figures,
}

fn row(case: &Case, r: &CaseResult) -> Row {
    let back_to_back = Figures::new(
        case.backward_sol_s(),
        case.backward_bytes(),
        r.fused,
        r.unfused,
    );
    Row {
        sol_us: back_to_back.sol_us,
        sol_pct: back_to_back.sol_us / r.single * 100.0,
        single_over_ceiling: r.single / r.ceiling.us,
        single_speedup: r.unfused_single.map(|u| u / r.single),
        back_to_back,
    }
}

fn print_header() {
    println!(
        "{:<16} {:>6} {:>10} {:>11} {:>7} {:>8} {:>6} {:>8} {:>11} {:>11} {:>8} {:>5}  {}",
        "case",
        "T",
        "single µs",
        "ceiling µs",
        "/ceil",
        "SOL µs",
        "%SOL",
        "b2b µs",
        "precise µs",
        "unfused µs",
        "speedup",
        "sets",
        "ceiling by"
    );
    println!(
        "(single calls, but b2b: back to back; precise and unfused single; speedup: unfused / \
         fused, single)"
    );
}

fn print_row(case: &Case, r: &CaseResult) {
    let f = row(case, r);
    println!(
        "{:<16} {:>6} {:>10.2} {:>11.2} {:>6.2}x {:>8.2} {:>5.1}% {:>8.2} {:>11.2} {:>11} {:>8} \
         {:>5}  {}",
        case.name,
        case.tokens,
        r.single,
        r.ceiling.us,
        f.single_over_ceiling,
        f.sol_us,
        f.sol_pct,
        r.fused.us,
        r.precise_single,
        show(r.unfused_single, 2, ""),
        show(f.single_speedup, 2, "x"),
        r.sets,
        r.ceiling.variant,
    );
    common::flush();
}

/// A suite's means.
struct Summary {
    cases: usize,
    single_us: Option<f64>,
    single_over_ceiling: Option<f64>,
    max_single_over_ceiling: Option<f64>,
    /// Of the single calls.
    sol_pct: Option<f64>,
    ceiling_us: Option<f64>,
    /// Baseline means only where every case has the baseline (as in [`Means`]).
    unfused_single_us: Option<f64>,
    single_speedup: Option<f64>,
    precise_single_ratio: Option<f64>,
    /// Of the back-to-back figures.
    back_to_back: Means,
    precise_ratio: Option<f64>,
}

impl Summary {
    fn of(cases: &[Case], results: &[CaseResult]) -> Self {
        let rows: Vec<Row> = cases.iter().zip(results).map(|(c, r)| row(c, r)).collect();
        let all_unfused = results.iter().all(|r| r.unfused_single.is_some());
        let b2b: Vec<Figures> = cases
            .iter()
            .zip(results)
            .map(|(c, r)| row(c, r).back_to_back)
            .collect();
        Self {
            cases: cases.len(),
            single_us: mean(results.iter().map(|r| r.single)),
            single_over_ceiling: mean(rows.iter().map(|f| f.single_over_ceiling)),
            max_single_over_ceiling: rows.iter().map(|f| f.single_over_ceiling).reduce(f64::max),
            sol_pct: mean(rows.iter().map(|f| f.sol_pct)),
            ceiling_us: mean(results.iter().map(|r| r.ceiling.us)),
            unfused_single_us: mean(results.iter().filter_map(|r| r.unfused_single))
                .filter(|_| all_unfused),
            single_speedup: mean(rows.iter().filter_map(|f| f.single_speedup))
                .filter(|_| all_unfused),
            precise_single_ratio: mean(results.iter().map(|r| r.precise_single / r.single)),
            back_to_back: Means::of(&b2b),
            precise_ratio: mean(results.iter().map(|r| r.precise.us / r.fused.us)),
        }
    }

    /// Below the suite's table.
    fn print_details(&self) {
        println!(
            "single calls: mean fused {} µs, unfused {} µs, speedup {}x, precise/fused {}; \
             mean ceiling {} µs",
            show(self.single_us, 2, ""),
            show(self.unfused_single_us, 2, ""),
            show(self.single_speedup, 2, ""),
            show(self.precise_single_ratio, 3, ""),
            show(self.ceiling_us, 2, ""),
        );
        let b = &self.back_to_back;
        println!(
            "back to back: mean fused {} µs ({}% SOL), unfused {} µs, speedup {}x, \
             precise/fused {}",
            show(b.fused_us, 2, ""),
            show(b.sol_pct, 1, ""),
            show(b.unfused_us, 2, ""),
            show(b.speedup, 2, ""),
            show(self.precise_ratio, 3, ""),
        );
    }

    /// The suite's result on one line.
    fn print_line(&self, label: &str) {
        println!(
            "{label:<15} mean single {} µs, single/ceiling mean {}x max {}x, mean {}% SOL \
             ({} cases)",
            show(self.single_us, 2, ""),
            show(self.single_over_ceiling, 2, ""),
            show(self.max_single_over_ceiling, 2, ""),
            show(self.sol_pct, 1, ""),
            self.cases,
        );
    }

    /// The means as JSON fields (in an object's order).
    fn json(&self, o: JsonObject) -> JsonObject {
        let b = &self.back_to_back;
        o.num("mean_single_us", self.single_us)
            .num("mean_single_over_ceiling", self.single_over_ceiling)
            .num("max_single_over_ceiling", self.max_single_over_ceiling)
            .num("mean_sol_pct", self.sol_pct)
            .num("mean_ceiling_us", self.ceiling_us)
            .num("mean_unfused_single_us", self.unfused_single_us)
            .num("mean_single_speedup", self.single_speedup)
            .num("mean_precise_single_ratio", self.precise_single_ratio)
            .num("mean_back_to_back_sol_pct", b.sol_pct)
            .num("mean_speedup", b.speedup)
            .num("mean_fused_us", b.fused_us)
            .num("mean_unfused_us", b.unfused_us)
            .num("mean_precise_ratio", self.precise_ratio)
    }
}

/// One case of the results file: the single-call figures first, then the back-to-back ones
/// under their earlier names (`fused_us` is `back_to_back_us`).
fn case_json(case: &Case, r: &CaseResult) -> String {
    let f = row(case, r);
    let b = &f.back_to_back;
    JsonObject::new()
        .str("name", &case.name)
        .int("tokens", case.tokens)
        .num("single_us", Some(r.single))
        .num("back_to_back_us", Some(r.fused.us))
        .num("ceiling_us", Some(r.ceiling.us))
        .num("sol_us", Some(f.sol_us))
        .num("single_over_ceiling", Some(f.single_over_ceiling))
        .num("sol_pct", Some(f.sol_pct))
        .str("ceiling_variant", &r.ceiling.variant)
        .num("precise_single_us", Some(r.precise_single))
        .num("unfused_single_us", r.unfused_single)
        .num("single_speedup", f.single_speedup)
        .num("fused_us", Some(r.fused.us))
        .num("precise_us", Some(r.precise.us))
        .num("unfused_us", r.unfused.map(|u| u.us))
        .num("fused_tbps", Some(b.fused_tbps))
        .num("speedup", b.speedup)
        .int("sets", r.sets)
        .int("launches", r.fused.launches)
        .line()
}

/// `cases` as a JSON array, one case per line at `indent`.
fn cases_json(run: Option<&SuiteRun>, indent: &str) -> String {
    let rows: Vec<String> = run.map_or(Vec::new(), |run| {
        run.cases
            .iter()
            .zip(&run.results)
            .map(|(c, r)| case_json(c, r))
            .collect()
    });
    if rows.is_empty() {
        return "[]".into();
    }
    format!(
        "[\n{indent} {}\n{indent}]",
        rows.join(&format!(",\n{indent} "))
    )
}

/// `path` relative to the crate where it lies in it (as the default suites do), so that results
/// files do not depend on where the crate was checked out.
fn shown_path(path: &Path) -> String {
    path.strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The results file: the methods, the training suite's cases and means at the top level (as
/// before the public range was added), the public range's in `public_range` (null where a
/// suite was not run; its means are null too).
fn to_json(device: &str, training: Option<&SuiteRun>, public: Option<&SuiteRun>) -> String {
    let means = |run: Option<&SuiteRun>| match run {
        Some(run) => run.summary.json(JsonObject::new()),
        None => Summary::of(&[], &[]).json(JsonObject::new()),
    };
    let head = JsonObject::new()
        .str("device", device)
        .str("method", &method())
        .str("single_method", &single_method())
        .str("ceiling_method", &ceiling_method())
        .str("pass", "backward")
        .str(
            "suite",
            &training.map_or(String::new(), |r| shown_path(&r.path)),
        );
    let public_json = match public {
        Some(run) => {
            let head = JsonObject::new()
                .str("suite", &shown_path(&run.path))
                .str("call", PUBLIC_CALL);
            format!(
                "{{{},\n  \"cases\": {},\n  {}}}",
                head.fields(),
                cases_json(Some(run), "  "),
                means(Some(run)).fields()
            )
        }
        None => "null".into(),
    };
    format!(
        "{{{},\n \"cases\": {},\n {},\n \"public_range\": {}}}\n",
        head.fields(),
        cases_json(training, " "),
        means(training).fields(),
        public_json,
    )
}
