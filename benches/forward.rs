//! Forward benchmark: the fused `Router::forward` against the unfused baseline (a cuBLAS GEMM
//! x·wᵀ into fp32 logits, then a routing kernel from the logits) on every case of the suite,
//! with speed of light (bytes = 2·T·H + 2·E·H + 12·T·K, flops = 2·T·E·H).
//!
//!     cargo bench --bench forward [-- [--filter NAME] [--json PATH] [--into PATH]]
//!     bench-forward --bench [--json PATH] [--into PATH] [--filter NAME]
//!
//! Per case, as `benches/backward.rs` times the backward:
//! - **single call** (`single_us`, the primary figure): each call on its own, after a kernel
//!   that writes twice the L2 (the flush), as a training step runs it; median of many calls;
//! - **back to back** (`back_to_back_us`, also `fused_us`; labelled): CUDA events around many
//!   back-to-back calls replayed from a CUDA graph (`MOE_ROUTING_BENCH_EAGER=1`: launched one
//!   by one), median of several rounds; consecutive calls overlap through programmatic
//!   dependent launch, which a training step never gives them;
//! - **ceiling** (`ceiling_us`): the case's bytes (read x and w, write the [T, K] outputs)
//!   moved by the fastest plain copy, timed as the single calls in the same run.
//!
//! Every figure rotates among enough input sets (>= 2x the 50 MB L2) that no call finds the
//! previous call's data in cache. Before timing, the baseline is checked against the fused
//! forward.
//!
//! Results go to stdout (a table) and to JSON: `--json PATH`, else `$MOE_ROUTING_BENCH_JSON`,
//! else `target/bench-forward.json`. `--into PATH` also sets the object as the `forward` key
//! of the JSON object in PATH (e.g. `benches/results/h200.json`, written by the backward
//! benchmark), replacing an earlier one. Without a CUDA device the benchmark is skipped.

mod common;

use std::sync::Arc;

use common::{
    case_json, ceiling_method, gemm, gemm_dims, input_sets, json_num, json_str, load_cases, mean,
    open_session, parse_args, results_json, show, single_method, time_calls, time_ceiling,
    time_single_calls, write_json, Ceiling, Figures, Flush, Means, Operand, Result, Timing,
};
use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_routing::{Router, Routing};
use moe_routing_dev::suite::{self, Case};
use moe_routing_dev::testing::{Inputs, Rng};

/// The baseline computes the logits in another summation order, so near ties may order or
/// pick experts differently: at most this fraction of tokens may differ in indices (a wrong
/// transpose or leading dimension makes nearly all differ); the others must agree in weights
/// and scores to this relative error.
const MAX_DIFFERING_ROWS: f64 = 1e-2;
const WEIGHT_TOL: f32 = 1e-4;

fn main() {
    if let Err(e) = run() {
        eprintln!("bench-forward: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------
// Driver

fn run() -> Result<()> {
    let args = parse_args(
        "forward",
        true,
        "usage: bench-forward [--json PATH] [--into PATH] [--filter NAME]\n\
         Other flags (such as cargo's --bench) are ignored.",
    )?;
    let Some(session) = open_session()? else {
        return Ok(());
    };
    let cases = &load_cases(&suite::default_path(), args.filter.as_deref())?;
    let stream = &session.stream;
    let flush = &mut Flush::new(stream)?;
    print_header();
    let mut results = Vec::with_capacity(cases.len());
    for (i, case) in cases.iter().enumerate() {
        let r = bench_case(
            stream,
            flush,
            session.blas.as_ref(),
            case,
            0xF0_0000 + i as u64,
        )?;
        print_row(case, &r);
        results.push(r);
    }
    let summary = summary(cases, &results);
    summary.print();
    let ratios = results.iter().map(|r| r.single / r.ceiling.us);
    println!(
        "single calls: mean {} µs, single/ceiling mean {}x max {}x",
        show(mean(results.iter().map(|r| r.single)), 2, ""),
        show(mean(ratios.clone()), 2, ""),
        show(ratios.reduce(f64::max), 2, ""),
    );
    println!("device: {}", session.device);
    let json = to_json(&session.device, cases, &results, &summary);
    write_json(&args.json, &json)?;
    if let Some(into) = &args.into {
        let text = std::fs::read_to_string(into)
            .map_err(|e| format!("reading {}: {e}", into.display()))?;
        let merged = with_forward_section(&text, json.trim_end())
            .ok_or_else(|| format!("{} does not hold a JSON object", into.display()))?;
        std::fs::write(into, merged).map_err(|e| format!("writing {}: {e}", into.display()))?;
        println!("forward section set in {}", into.display());
    }
    Ok(())
}

/// `text` (a JSON object) with `"forward": section` as its last key, replacing a `forward`
/// key this function added earlier (always last, on a line of its own).
fn with_forward_section(text: &str, section: &str) -> Option<String> {
    const KEY: &str = ",\n \"forward\": ";
    let body = match text.find(KEY) {
        Some(i) => &text[..i],
        None => text.trim_end().strip_suffix('}')?.trim_end(),
    };
    if !body.trim_start().starts_with('{') {
        return None;
    }
    Some(format!("{body}{KEY}{section}\n}}\n"))
}

// ---------------------------------------------------------------------------------------
// One case

/// Device buffers of one forward call. Rotating among several keeps each call's reads cold.
struct InputSet {
    x: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    bias: CudaSlice<f32>,
    out: Routing,
}

impl InputSet {
    fn new(
        stream: &Arc<CudaStream>,
        router: &Router,
        tokens: usize,
        rng: &mut Rng,
    ) -> Result<Self> {
        let cfg = router.config();
        let inp = Inputs::random(cfg, tokens, rng);
        Ok(Self {
            x: stream.clone_htod(&inp.x)?,
            w: stream.clone_htod(&inp.w)?,
            bias: stream.clone_htod(&inp.bias)?,
            out: Routing::alloc(stream, cfg, tokens)?,
        })
    }
}

struct CaseResult {
    sets: usize,
    /// One call on its own (µs).
    single: f64,
    /// Back to back.
    fused: Timing,
    unfused: Option<Timing>,
    ceiling: Ceiling,
}

fn bench_case(
    stream: &Arc<CudaStream>,
    flush: &mut Flush,
    blas: Option<&CudaBlas>,
    case: &Case,
    seed: u64,
) -> Result<CaseResult> {
    let router = Router::new(case.config)?;
    let (tokens, cfg) = (case.tokens, router.config());
    let sets = input_sets(case.forward_bytes());
    let mut rng = Rng::new(seed);
    let mut inputs = (0..sets)
        .map(|_| InputSet::new(stream, &router, tokens, &mut rng))
        .collect::<Result<Vec<_>>>()?;
    // Scratch of the baseline, not part of any input set: written and read within one call.
    let mut logits = stream.alloc_zeros::<f32>(tokens * cfg.n_routed_experts)?;

    if let Some(blas) = blas {
        verify_baseline(stream, blas, &router, case, &mut inputs[0], &mut logits)?;
    }
    let mut fused = |i: usize| -> Result<()> {
        let set = &mut inputs[i % sets];
        router.forward(stream, tokens, &set.x, &set.w, &set.bias, &mut set.out)?;
        Ok(())
    };
    let fused_t = time_calls(stream, sets, &mut fused)?;
    let single = time_single_calls(stream, flush, sets, &mut fused)?;
    let unfused_t = match blas {
        Some(blas) => Some(time_calls(stream, sets, |i| {
            unfused_forward(
                stream,
                blas,
                &router,
                tokens,
                &mut inputs[i % sets],
                &mut logits,
            )
        })?),
        None => None,
    };
    // The case's buffers go before the ceiling's arrive.
    drop((inputs, logits));
    let ceiling = time_ceiling(
        stream,
        flush,
        case.forward_read_bytes(),
        case.forward_write_bytes(),
        seed ^ 0xC0DE_0000_0000,
    )?;
    Ok(CaseResult {
        sets,
        single,
        fused: fused_t,
        unfused: unfused_t,
        ceiling,
    })
}

/// Runs the fused and the unfused forward on `set` (outputs poisoned before each) and checks
/// that they agree; panics otherwise, since a wrong baseline would make every speedup
/// meaningless.
fn verify_baseline(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    router: &Router,
    case: &Case,
    set: &mut InputSet,
    logits: &mut CudaSlice<f32>,
) -> Result<()> {
    let tokens = case.tokens;
    let k = router.config().num_experts_per_tok;
    let poison = |stream: &Arc<CudaStream>, out: &mut Routing| -> Result<()> {
        stream.memset_zeros(&mut out.topk_idx)?;
        stream.memset_zeros(&mut out.topk_weights)?;
        stream.memset_zeros(&mut out.topk_scores)?;
        Ok(())
    };
    poison(stream, &mut set.out)?;
    router.forward(stream, tokens, &set.x, &set.w, &set.bias, &mut set.out)?;
    let fused = (
        stream.clone_dtoh(&set.out.topk_idx)?,
        stream.clone_dtoh(&set.out.topk_weights)?,
        stream.clone_dtoh(&set.out.topk_scores)?,
    );
    poison(stream, &mut set.out)?;
    unfused_forward(stream, blas, router, tokens, set, logits)?;
    let unfused = (
        stream.clone_dtoh(&set.out.topk_idx)?,
        stream.clone_dtoh(&set.out.topk_weights)?,
        stream.clone_dtoh(&set.out.topk_scores)?,
    );
    let mut differing = 0usize;
    for t in 0..tokens {
        let r = t * k..(t + 1) * k;
        if fused.0[r.clone()] != unfused.0[r.clone()] {
            differing += 1;
            continue;
        }
        for j in r {
            for (a, b) in [(fused.1[j], unfused.1[j]), (fused.2[j], unfused.2[j])] {
                // False for NaN too.
                let close = (a - b).abs() <= WEIGHT_TOL * b.abs().max(1e-6);
                if !close {
                    panic!(
                        "{}: token {t}: the unfused baseline's weight/score {b} differs from \
                         the fused forward's {a}",
                        case.name
                    );
                }
            }
        }
    }
    if differing as f64 > MAX_DIFFERING_ROWS * tokens as f64 {
        panic!(
            "{}: the unfused baseline picks other experts than the fused forward on {differing} \
             of {tokens} tokens; the cuBLAS transposes or leading dimensions are wrong",
            case.name
        );
    }
    Ok(())
}

/// The unfused baseline: logits [T, E] (fp32) = x [T, H] · wᵀ by cuBLAS (bf16 inputs, fp32
/// accumulation), then the routing from the logits (sigmoid, bias, groups, top-k, weights).
///
/// Row-major x [T, H] and w [E, H] are the column-major [H, T] and [H, E] (leading dimension
/// H); row-major logits [T, E] is the column-major [E, T] = wᵀᵀ·x = op_T(w) · op_N(x).
fn unfused_forward(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    router: &Router,
    tokens: usize,
    set: &mut InputSet,
    logits: &mut CudaSlice<f32>,
) -> Result<()> {
    use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};

    let (t, e, h) = gemm_dims(tokens, router.config())?;
    {
        // The guards keep the buffers alive and ordered on `stream` until the GEMM is enqueued.
        let (x, _x) = set.x.device_ptr(stream);
        let (w, _w) = set.w.device_ptr(stream);
        let (l, _l) = logits.device_ptr_mut(stream);
        // SAFETY: every pointer addresses a live device allocation of the size the shapes
        // imply.
        unsafe {
            gemm(
                blas,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                e,
                t,
                h,
                Operand::bf16(w, h),
                Operand::bf16(x, h),
                Operand::f32(l, e),
            )?;
        }
    }
    moe_routing_dev::route_from_logits(router, stream, tokens, logits, &set.bias, &mut set.out)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Report

fn figures(case: &Case, r: &CaseResult) -> Figures {
    Figures::new(
        case.forward_sol_s(),
        case.forward_bytes(),
        r.fused,
        r.unfused,
    )
}

fn print_header() {
    println!(
        "{:<16} {:>6} {:>10} {:>10} {:>10} {:>8} {:>11} {:>8} {:>6} {:>6} {:>8} {:>5}",
        "case",
        "T",
        "single µs",
        "b2b µs",
        "ceiling µs",
        "single/c",
        "unfused µs",
        "SOL µs",
        "TB/s",
        "%SOL",
        "speedup",
        "sets"
    );
    println!(
        "(single: one call after an L2 flush; b2b: back to back, through programmatic dependent \
         launch; %SOL, TB/s, unfused and speedup: back to back)"
    );
}

fn print_row(case: &Case, r: &CaseResult) {
    let f = figures(case, r);
    println!(
        "{:<16} {:>6} {:>10.2} {:>10.2} {:>10.2} {:>8.2} {:>11} {:>8.2} {:>6.2} {:>5.1}% {:>8} {:>5}",
        case.name,
        case.tokens,
        r.single,
        r.fused.us,
        r.ceiling.us,
        r.single / r.ceiling.us,
        show(r.unfused.map(|u| u.us), 2, ""),
        f.sol_us,
        f.fused_tbps,
        f.sol_pct,
        show(f.speedup, 2, "x"),
        r.sets,
    );
    common::flush();
}

fn summary(cases: &[Case], results: &[CaseResult]) -> Means {
    let figures: Vec<Figures> = cases
        .iter()
        .zip(results)
        .map(|(c, r)| figures(c, r))
        .collect();
    Means::of(&figures)
}

/// `object` (a JSON object's text) with `fields` (", \"key\": value" pairs) added at its end.
fn with_fields(object: &str, fields: &str) -> String {
    let body = object.trim_end();
    let body = body.strip_suffix('}').expect("a JSON object");
    format!("{body}{fields}}}\n")
}

fn to_json(device: &str, cases: &[Case], results: &[CaseResult], s: &Means) -> String {
    let rows: Vec<String> = cases
        .iter()
        .zip(results)
        .map(|(case, r)| {
            let row = case_json(case, r.fused, None, r.unfused, &figures(case, r), r.sets);
            let fields = format!(
                ", \"single_us\": {}, \"back_to_back_us\": {}, \"ceiling_us\": {}, \
                 \"single_over_ceiling\": {}, \"ceiling_variant\": {}",
                json_num(Some(r.single)),
                json_num(Some(r.fused.us)),
                json_num(Some(r.ceiling.us)),
                json_num(Some(r.single / r.ceiling.us)),
                json_str(&r.ceiling.variant),
            );
            with_fields(&row, &fields).trim_end().to_string()
        })
        .collect();
    let ratios: Vec<f64> = results.iter().map(|r| r.single / r.ceiling.us).collect();
    let fields = format!(
        ", \"single_method\": {}, \"ceiling_method\": {}, \"mean_single_us\": {}, \
         \"mean_ceiling_us\": {}, \"mean_single_over_ceiling\": {}, \
         \"max_single_over_ceiling\": {}",
        json_str(&single_method()),
        json_str(&ceiling_method()),
        json_num(mean(results.iter().map(|r| r.single))),
        json_num(mean(results.iter().map(|r| r.ceiling.us))),
        json_num(mean(ratios.iter().copied())),
        json_num(ratios.iter().copied().reduce(f64::max)),
    );
    with_fields(&results_json(device, "forward", &rows, s, None), &fields)
}
