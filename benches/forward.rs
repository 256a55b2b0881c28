//! Forward benchmark: the fused `Router::forward` against the unfused baseline (a cuBLAS GEMM
//! x·wᵀ into fp32 logits, then a routing kernel from the logits) on every case of the suite,
//! with speed of light (bytes = 2·T·H + 2·E·H + 12·T·K, flops = 2·T·E·H).
//!
//!     cargo bench --bench forward [-- [--filter NAME] [--json PATH] [--into PATH]]
//!     bench-forward --bench [--json PATH] [--into PATH] [--filter NAME]
//!
//! Timing as in `benches/backward.rs` (and `../shared/bench/README.md`): CUDA events around
//! many back-to-back calls, median of several rounds, after warm-up, rotating among enough input
//! sets (>= 2x the 50 MB L2) that no call finds the previous call's data in cache. Before
//! timing, the baseline is checked against the fused forward.
//!
//! Results go to stdout (a table) and to JSON: `--json PATH`, else `$MOE_ROUTING_BENCH_JSON`,
//! else `target/bench-forward.json`. `--into PATH` also sets the object as the `forward` key
//! of the JSON object in PATH (e.g. `benches/results/h200.json`, written by the backward
//! benchmark), replacing an earlier one. Without a CUDA device the benchmark is skipped.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::io::Write as _;
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::cublas::{result::gemm_ex, sys as cublas_sys, CudaBlas};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_routing::suite::{self, Case};
use moe_routing::testing::{Inputs, Rng};
use moe_routing::{cuda_device_count, Router, Routing};

type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// Timed rounds per measurement; the median is reported.
const ROUNDS: usize = 7;
/// Shortest round: long enough that event resolution (~0.5 µs) and launch jitter vanish.
const MIN_ROUND_US: f64 = 2000.0;
/// Upper bound on launches per round (guards against a bogus calibration).
const MAX_LAUNCHES: usize = 100_000;
/// Bytes the rotated input sets must exceed in all: twice the H200's 50 MB L2.
const MIN_ROTATED_BYTES: f64 = 2.0 * 50.0 * 1024.0 * 1024.0;
/// At least two sets so that consecutive calls never share buffers; at most 64.
const MIN_SETS: usize = 2;
const MAX_SETS: usize = 64;
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
// Command line

struct Args {
    json: PathBuf,
    into: Option<PathBuf>,
    filter: Option<String>,
}

fn parse_args() -> Result<Args> {
    let (mut json, mut into, mut filter) = (None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "--json" => json = Some(PathBuf::from(value("--json")?)),
            "--into" => into = Some(PathBuf::from(value("--into")?)),
            "--filter" => filter = Some(value("--filter")?),
            "-h" | "--help" => {
                println!(
                    "usage: bench-forward [--json PATH] [--into PATH] [--filter NAME]\n\
                     Other flags (such as cargo's --bench) are ignored."
                );
                std::process::exit(0);
            }
            _ if !flag.starts_with('-') => filter = Some(arg),
            _ => {}
        }
    }
    let json = json
        .or_else(|| std::env::var_os("MOE_ROUTING_BENCH_JSON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("target/bench-forward.json"));
    Ok(Args { json, into, filter })
}

// ---------------------------------------------------------------------------------------
// Driver

fn run() -> Result<()> {
    let args = parse_args()?;
    if cuda_device_count() == 0 {
        println!("no CUDA device: benchmark skipped");
        return Ok(());
    }
    let cases: Vec<Case> = suite::load(&suite::default_path())?
        .into_iter()
        .filter(|c| args.filter.as_deref().is_none_or(|f| c.name.contains(f)))
        .collect();
    if cases.is_empty() {
        println!("no suite case matches the filter: nothing to time");
    }

    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let device = ctx.name()?;
    println!("device: {device}");
    let blas = load_cublas(&stream);

    print_header();
    let mut results = Vec::with_capacity(cases.len());
    for (i, case) in cases.iter().enumerate() {
        let r = bench_case(&stream, blas.as_ref(), case, 0xF0_0000 + i as u64)?;
        print_row(case, &r);
        results.push(r);
    }
    let summary = Summary::of(&cases, &results);
    summary.print(&device);
    let json = to_json(&device, &cases, &results, &summary);
    if let Some(dir) = args.json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.json, &json)
        .map_err(|e| format!("writing {}: {e}", args.json.display()))?;
    println!("results written to {}", args.json.display());
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

/// Creates the cuBLAS handle, or `None` (with a message) when libcublas cannot be loaded:
/// cudarc loads it at first use and panics if it is not found, so the panic is caught here
/// and the fused kernel is still timed.
fn load_cublas(stream: &Arc<CudaStream>) -> Option<CudaBlas> {
    // Silence the default hook for this one call; the message is reported below instead.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let created = catch_unwind(AssertUnwindSafe(|| CudaBlas::new(stream.clone())));
    std::panic::set_hook(hook);
    let why = match created {
        Ok(Ok(blas)) => return Some(blas),
        Ok(Err(e)) => format!("creating the cuBLAS handle failed: {e}"),
        Err(panic) => panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "cuBLAS could not be loaded".into()),
    };
    println!(
        "warning: unfused baseline skipped: {why}\n\
         warning: libcublas was not found; put the directory that holds libcublas.so.13 \
         (e.g. a Python package's site-packages/nvidia/cu13/lib or nvidia/cublas/lib) on \
         LD_LIBRARY_PATH. The fused kernel is still timed; unfused fields are null."
    );
    None
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

/// A measured time per call and how it was obtained.
#[derive(Clone, Copy)]
struct Timing {
    us: f64,
    launches: usize,
}

struct CaseResult {
    sets: usize,
    fused: Timing,
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
    let sets =
        ((MIN_ROTATED_BYTES / case.forward_bytes()).ceil() as usize).clamp(MIN_SETS, MAX_SETS);
    let mut rng = Rng::new(seed);
    let mut inputs = (0..sets)
        .map(|_| InputSet::new(stream, &router, tokens, &mut rng))
        .collect::<Result<Vec<_>>>()?;
    // Scratch of the baseline, not part of any input set: written and read within one call.
    let mut logits = stream.alloc_zeros::<f32>(tokens * cfg.n_routed_experts)?;

    if let Some(blas) = blas {
        verify_baseline(stream, blas, &router, case, &mut inputs[0], &mut logits)?;
    }
    let fused_t = time_calls(stream, sets, |i| {
        let set = &mut inputs[i % sets];
        router.forward(stream, tokens, &set.x, &set.w, &set.bias, &mut set.out)?;
        Ok(())
    })?;
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
    Ok(CaseResult {
        sets,
        fused: fused_t,
        unfused: unfused_t,
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
    use cublas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};

    let cfg = router.config();
    let t = c_int::try_from(tokens)?;
    let e = c_int::try_from(cfg.n_routed_experts)?;
    let h = c_int::try_from(cfg.hidden_size)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (alpha, beta) = (
        &alpha as *const f32 as *const c_void,
        &beta as *const f32 as *const c_void,
    );
    {
        // The guards keep the buffers alive and ordered on `stream` until the GEMM is enqueued.
        let (x, _x) = set.x.device_ptr(stream);
        let (w, _w) = set.w.device_ptr(stream);
        let (l, _l) = logits.device_ptr_mut(stream);
        let handle = *blas.handle();
        let compute = cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        // SAFETY: every pointer addresses a live device allocation of the size the shapes
        // imply; alpha and beta are host f32 values, as the default (host) pointer mode and
        // the 32F compute type need.
        unsafe {
            gemm_ex(
                handle,
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                e,
                t,
                h,
                alpha,
                w as *const c_void,
                CUDA_R_16BF,
                h,
                x as *const c_void,
                CUDA_R_16BF,
                h,
                beta,
                l as *mut c_void,
                CUDA_R_32F,
                e,
                compute,
                algo,
            )?;
        }
    }
    router.baseline_route_from_logits(stream, tokens, logits, &set.bias, &mut set.out)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Timing

/// GPU time per call of `call(i)` (which uses input set `i % sets`): CUDA events around
/// rounds of back-to-back calls, median of [`ROUNDS`] rounds, after warm-up.
fn time_calls(
    stream: &Arc<CudaStream>,
    sets: usize,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<Timing> {
    // Warm-up: one call on every set (module loading, cuBLAS heuristics, first touch).
    for i in 0..sets {
        call(i)?;
    }
    stream.synchronize()?;

    // Events made by cudarc default to CU_EVENT_DISABLE_TIMING, so ask for timing ones.
    let ctx = stream.context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    // Launch counts are multiples of `sets`, so every round starts on set 0 right after a
    // round that ended on the last set: no two consecutive calls share a set.
    let mut round = |launches: usize| -> Result<f64> {
        start.record(stream)?;
        for i in 0..launches {
            call(i)?;
        }
        end.record(stream)?;
        Ok(f64::from(start.elapsed_ms(&end)?) * 1e3 / launches as f64)
    };

    // Calibrate the launch count on a short round, so that a round lasts >= MIN_ROUND_US.
    let estimate_us = round(sets * 8usize.div_ceil(sets))?;
    let launches = ((MIN_ROUND_US / estimate_us.max(1e-3)).ceil() as usize)
        .clamp(1, MAX_LAUNCHES)
        .div_ceil(sets)
        * sets;
    let mut per_call = (0..ROUNDS)
        .map(|_| round(launches))
        .collect::<Result<Vec<f64>>>()?;
    per_call.sort_by(f64::total_cmp);
    Ok(Timing {
        us: per_call[ROUNDS / 2],
        launches,
    })
}

// ---------------------------------------------------------------------------------------
// Report

/// Derived figures of one case.
struct Figures {
    sol_us: f64,
    fused_tbps: f64,
    sol_pct: f64,
    speedup: Option<f64>,
}

impl Figures {
    fn of(case: &Case, r: &CaseResult) -> Self {
        let sol_us = case.forward_sol_s() * 1e6;
        Self {
            sol_us,
            fused_tbps: case.forward_bytes() / (r.fused.us * 1e-6) / 1e12,
            sol_pct: sol_us / r.fused.us * 100.0,
            speedup: r.unfused.map(|u| u.us / r.fused.us),
        }
    }
}

fn print_header() {
    println!(
        "{:<16} {:>6} {:>10} {:>11} {:>8} {:>6} {:>6} {:>8} {:>5}",
        "case", "T", "fused µs", "unfused µs", "SOL µs", "TB/s", "%SOL", "speedup", "sets"
    );
}

fn print_row(case: &Case, r: &CaseResult) {
    let f = Figures::of(case, r);
    let or_dash = |v: Option<f64>, digits: usize, suffix: &str| {
        v.map_or("—".to_string(), |v| format!("{v:.digits$}{suffix}"))
    };
    println!(
        "{:<16} {:>6} {:>10.2} {:>11} {:>8.2} {:>6.2} {:>5.1}% {:>8} {:>5}",
        case.name,
        case.tokens,
        r.fused.us,
        or_dash(r.unfused.map(|u| u.us), 2, ""),
        f.sol_us,
        f.fused_tbps,
        f.sol_pct,
        or_dash(f.speedup, 2, "x"),
        r.sets,
    );
    let _ = std::io::stdout().flush();
}

fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values
        .into_iter()
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

struct Summary {
    sol_pct: Option<f64>,
    speedup: Option<f64>,
    fused_us: Option<f64>,
    unfused_us: Option<f64>,
}

impl Summary {
    fn of(cases: &[Case], results: &[CaseResult]) -> Self {
        let figures: Vec<Figures> = cases
            .iter()
            .zip(results)
            .map(|(c, r)| Figures::of(c, r))
            .collect();
        // Baseline means only when every case has the baseline.
        let all_unfused = results.iter().all(|r| r.unfused.is_some());
        Self {
            sol_pct: mean(figures.iter().map(|f| f.sol_pct)),
            speedup: mean(figures.iter().filter_map(|f| f.speedup)).filter(|_| all_unfused),
            fused_us: mean(results.iter().map(|r| r.fused.us)),
            unfused_us: mean(results.iter().filter_map(|r| r.unfused.map(|u| u.us)))
                .filter(|_| all_unfused),
        }
    }

    fn print(&self, device: &str) {
        let show = |v: Option<f64>, digits: usize| {
            v.map_or("—".to_string(), |v| format!("{v:.digits$}"))
        };
        println!("mean fused %SOL:          {}%", show(self.sol_pct, 1));
        println!("mean speedup vs unfused:  {}x", show(self.speedup, 2));
        println!("mean fused µs:            {}", show(self.fused_us, 2));
        println!("mean unfused µs:          {}", show(self.unfused_us, 2));
        println!("device: {device}");
    }
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A number, or null when absent or not finite (JSON has no NaN or infinity).
fn json_num(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.4}"),
        _ => "null".into(),
    }
}

fn to_json(device: &str, cases: &[Case], results: &[CaseResult], s: &Summary) -> String {
    let method = format!(
        "CUDA events, median of {ROUNDS} rounds of N back-to-back calls, S input sets rotated \
         (>= 100 MB); per case N is `launches` (a round lasts >= {} ms) and S is `sets`",
        MIN_ROUND_US / 1e3
    );
    let rows: Vec<String> = cases
        .iter()
        .zip(results)
        .map(|(case, r)| {
            let f = Figures::of(case, r);
            format!(
                "{{\"name\": {}, \"tokens\": {}, \"fused_us\": {}, \"unfused_us\": {}, \
                 \"sol_us\": {}, \"fused_tbps\": {}, \"sol_pct\": {}, \"speedup\": {}, \
                 \"sets\": {}, \"launches\": {}}}",
                json_str(&case.name),
                case.tokens,
                json_num(Some(r.fused.us)),
                json_num(r.unfused.map(|u| u.us)),
                json_num(Some(f.sol_us)),
                json_num(Some(f.fused_tbps)),
                json_num(Some(f.sol_pct)),
                json_num(f.speedup),
                r.sets,
                r.fused.launches,
            )
        })
        .collect();
    format!(
        "{{\"device\": {}, \"method\": {}, \"pass\": \"forward\",\n \"cases\": [\n  {}\n ],\n \
         \"mean_sol_pct\": {}, \"mean_speedup\": {}, \"mean_fused_us\": {}, \
         \"mean_unfused_us\": {}}}\n",
        json_str(device),
        json_str(&method),
        rows.join(",\n  "),
        json_num(s.sol_pct),
        json_num(s.speedup),
        json_num(s.fused_us),
        json_num(s.unfused_us),
    )
}
