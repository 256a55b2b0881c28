//! What the forward and backward benchmarks share: the command line, the suite and device
//! setup, cuBLAS loading and GEMM calls, the timing methods (back-to-back, single calls, the
//! copy ceiling), the derived figures and the JSON helpers.
// Each benchmark is its own crate and uses only part of this module.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::ffi::c_void;
use std::os::raw::c_int;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{
    CUdeviceptr, CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use moe_routing::{cuda_device_count, RouterConfig};
use moe_routing_dev::suite::{self, Case};
use moe_routing_dev::testing::Rng;

pub type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// Timed rounds per measurement; the median is reported.
pub const ROUNDS: usize = 7;
/// Shortest round: long enough that event resolution (~0.5 µs) and launch jitter vanish.
pub const MIN_ROUND_US: f64 = 2000.0;
/// Upper bound on launches per round (guards against a bogus calibration).
pub const MAX_LAUNCHES: usize = 100_000;
/// Bytes the rotated input sets must exceed in all: twice the H200's 50 MB L2.
pub const MIN_ROTATED_BYTES: f64 = 2.0 * 50.0 * 1024.0 * 1024.0;
/// At least two sets even when one exceeds the L2 many times, so that consecutive calls never
/// share buffers (w and grad_w alone would otherwise stay cached); at most 64.
pub const MIN_SETS: usize = 2;
pub const MAX_SETS: usize = 64;

/// Input sets to rotate among when one call moves `bytes` (what the SOL counts).
pub fn input_sets(bytes: f64) -> usize {
    ((MIN_ROTATED_BYTES / bytes).ceil() as usize).clamp(MIN_SETS, MAX_SETS)
}

// ---------------------------------------------------------------------------------------
// Command line

pub struct Args {
    pub json: PathBuf,
    pub into: Option<PathBuf>,
    pub filter: Option<String>,
    /// `--suite`'s value, checked by the benchmark that has several.
    pub suite: Option<String>,
}

/// `--json PATH`, `--filter NAME` (or a bare NAME, as `cargo bench -- NAME` passes it),
/// `--suite NAME` and, where `accepts_into`, `--into PATH`; other flags (such as cargo's
/// `--bench`) are ignored. The JSON path defaults to `$MOE_ROUTING_BENCH_JSON`, else
/// `target/bench-<name>.json`.
pub fn parse_args(name: &str, accepts_into: bool, usage: &str) -> Result<Args> {
    let (mut json, mut into, mut filter, mut suite) = (None, None, None, None);
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
            "--into" if accepts_into => into = Some(PathBuf::from(value("--into")?)),
            "--filter" => filter = Some(value("--filter")?),
            "--suite" => suite = Some(value("--suite")?),
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
            _ if !flag.starts_with('-') => filter = Some(arg),
            _ => {}
        }
    }
    let json = json
        .or_else(|| std::env::var_os("MOE_ROUTING_BENCH_JSON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(format!("target/bench-{name}.json")));
    Ok(Args {
        json,
        into,
        filter,
        suite,
    })
}

// ---------------------------------------------------------------------------------------
// Setup and output

/// The device's stream and name, and cuBLAS if it loads.
pub struct Session {
    pub stream: Arc<CudaStream>,
    pub device: String,
    pub blas: Option<CudaBlas>,
}

/// `None` (with a message) where there is no CUDA device.
pub fn open_session() -> Result<Option<Session>> {
    if cuda_device_count() == 0 {
        println!("no CUDA device: benchmark skipped");
        return Ok(None);
    }
    let ctx = CudaContext::new(0)?;
    // SAFETY: every buffer of a benchmark is allocated and used on the one stream below, so no
    // cross-stream ordering is needed; and no event may be recorded inside a graph capture.
    unsafe { ctx.disable_event_tracking() };
    // A stream of its own: the legacy default stream cannot be captured into a graph.
    let stream = ctx.new_stream()?;
    let device = ctx.name()?;
    println!("device: {device}");
    let blas = load_cublas(&stream);
    Ok(Some(Session {
        stream,
        device,
        blas,
    }))
}

/// The cases of the suite file at `path` whose names contain `filter`.
pub fn load_cases(path: &Path, filter: Option<&str>) -> Result<Vec<Case>> {
    let cases: Vec<Case> = suite::load(path)?
        .into_iter()
        .filter(|c| filter.is_none_or(|f| c.name.contains(f)))
        .collect();
    if cases.is_empty() {
        println!("no case of {} matches the filter", path.display());
    }
    Ok(cases)
}

/// Writes `json` to `path`, creating its folder.
pub fn write_json(path: &Path, json: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
    println!("results written to {}", path.display());
    Ok(())
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

/// One operand of [`gemm`]: a column-major matrix on the device.
pub struct Operand {
    pub ptr: CUdeviceptr,
    pub ty: cudaDataType,
    /// Leading dimension, in elements.
    pub ld: c_int,
}

impl Operand {
    pub fn bf16(ptr: CUdeviceptr, ld: c_int) -> Self {
        let ty = cudaDataType::CUDA_R_16BF;
        Self { ptr, ty, ld }
    }
    pub fn f32(ptr: CUdeviceptr, ld: c_int) -> Self {
        let ty = cudaDataType::CUDA_R_32F;
        Self { ptr, ty, ld }
    }
}

/// C [m, n] = op(A) [m, k] · op(B) [k, n] by cuBLAS `gemm_ex` (column-major, fp32 compute,
/// alpha 1, beta 0), enqueued on the handle's stream.
///
/// # Safety
/// Each operand addresses a live device allocation of the size that m, n, k, the transposes
/// and its leading dimension imply, kept alive until the GEMM has run.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    blas: &CudaBlas,
    trans_a: cublasOperation_t,
    trans_b: cublasOperation_t,
    m: c_int,
    n: c_int,
    k: c_int,
    a: Operand,
    b: Operand,
    c: Operand,
) -> Result<()> {
    // Host scalars: the handle's default (host) pointer mode, f32 for the 32F compute type.
    let (alpha, beta) = (1.0f32, 0.0f32);
    gemm_ex(
        *blas.handle(),
        trans_a,
        trans_b,
        m,
        n,
        k,
        &alpha as *const f32 as *const c_void,
        a.ptr as *const c_void,
        a.ty,
        a.ld,
        b.ptr as *const c_void,
        b.ty,
        b.ld,
        &beta as *const f32 as *const c_void,
        c.ptr as *mut c_void,
        c.ty,
        c.ld,
        cublasComputeType_t::CUBLAS_COMPUTE_32F,
        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
    )?;
    Ok(())
}

/// T, E and H of a call as cuBLAS dimensions.
pub fn gemm_dims(tokens: usize, cfg: &RouterConfig) -> Result<(c_int, c_int, c_int)> {
    Ok((
        c_int::try_from(tokens)?,
        c_int::try_from(cfg.n_routed_experts)?,
        c_int::try_from(cfg.hidden_size)?,
    ))
}

// ---------------------------------------------------------------------------------------
// Timing

/// A measured time per call and how it was obtained.
#[derive(Clone, Copy)]
pub struct Timing {
    pub us: f64,
    pub launches: usize,
}

/// Set (to anything) to time rounds of calls launched one by one from the host instead of
/// replayed as a graph (the method of the results before graphs; see BENCHMARKS.md).
pub const EAGER_ENV: &str = "MOE_ROUTING_BENCH_EAGER";

fn eager() -> bool {
    std::env::var_os(EAGER_ENV).is_some()
}

/// GPU time per call of `call(i)` (which uses input set `i % sets`): CUDA events around
/// rounds of back-to-back calls, median of [`ROUNDS`] rounds, after warm-up. A round is the
/// calls captured once into a CUDA graph and replayed, so that it times the GPU alone: launched
/// one by one, a baseline of several small kernels and cuBLAS calls is bound by the host's
/// launch rate at small T, not by the GPU.
pub fn time_calls(
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
    let round = |launches: usize, call: &mut dyn FnMut(usize) -> Result<()>| -> Result<f64> {
        start.record(stream)?;
        for i in 0..launches {
            call(i)?;
        }
        end.record(stream)?;
        Ok(f64::from(start.elapsed_ms(&end)?) * 1e3 / launches as f64)
    };

    // Calibrate the launch count on a short round, so that a round lasts >= MIN_ROUND_US.
    let estimate_us = round(sets * 8usize.div_ceil(sets), &mut call)?;
    let launches = ((MIN_ROUND_US / estimate_us.max(1e-3)).ceil() as usize)
        .clamp(1, MAX_LAUNCHES)
        .div_ceil(sets)
        * sets;
    let mut per_call = if eager() {
        (0..ROUNDS)
            .map(|_| round(launches, &mut call))
            .collect::<Result<Vec<f64>>>()?
    } else {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = (0..launches).try_for_each(&mut call);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph?.ok_or("nothing was captured")?;
        graph.launch()?; // the first replay uploads the graph
        stream.synchronize()?;
        let mut replay = |_: usize| -> Result<()> { Ok(graph.launch()?) };
        (0..ROUNDS)
            .map(|_| Ok(round(1, &mut replay)? / launches as f64))
            .collect::<Result<Vec<f64>>>()?
    };
    per_call.sort_by(f64::total_cmp);
    Ok(Timing {
        us: per_call[ROUNDS / 2],
        launches,
    })
}

// ---------------------------------------------------------------------------------------
// Single calls

/// Calls per single-call median.
pub const SINGLE_CALLS: usize = 40;
/// Bytes the flush before each single call writes: twice the H200's 50 MB L2.
pub const FLUSH_BYTES: usize = MIN_ROTATED_BYTES as usize;
/// Flushes queued before the first timed call: the host's head start (see
/// [`time_single_calls`]).
pub const HEAD_START_FLUSHES: usize = 8;

/// What runs before each single call, as some other kernel runs before it in a training step:
/// a kernel that writes [`FLUSH_BYTES`], evicting everything the call could find in L2.
pub struct Flush {
    /// Never read (the flush reads 0 bytes); the copy takes an input all the same.
    none: CudaSlice<u64>,
    buf: CudaSlice<u64>,
}

impl Flush {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            none: stream.alloc_zeros(2)?,
            buf: stream.alloc_zeros(FLUSH_BYTES / 8)?,
        })
    }

    /// Queues the flush on `stream`. Default (write-back) stores: streaming ones would be
    /// evicted first and leave older lines in L2.
    pub fn queue(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        moe_routing_dev::copy(
            stream,
            &self.none,
            &mut self.buf,
            0,
            FLUSH_BYTES,
            0,
            false,
            false,
        )?;
        Ok(())
    }
}

/// GPU time of `call(i)` (which uses input set `i % sets`) on its own, as a training step sees
/// it: per call the flush, a CUDA event recorded once the flush is queued, the call and an end
/// event; the median of [`SINGLE_CALLS`] calls' end − start, after warm-up (one call per set).
///
/// All calls are queued before any is waited for, behind [`HEAD_START_FLUSHES`] flushes: the
/// host queues a flush and a call in less time than the GPU takes to run them (a flush alone
/// is ~25 µs), so it stays ahead and the events time the GPU, not the host's launches.
pub fn time_single_calls(
    stream: &Arc<CudaStream>,
    flush: &mut Flush,
    sets: usize,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    for i in 0..sets {
        flush.queue(stream)?;
        call(i)?;
    }
    stream.synchronize()?;
    // Events made by cudarc default to CU_EVENT_DISABLE_TIMING, so ask for timing ones.
    let ctx = stream.context();
    let events = (0..2 * SINGLE_CALLS)
        .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
        .collect::<Result<Vec<_>, _>>()?;
    for _ in 0..HEAD_START_FLUSHES {
        flush.queue(stream)?;
    }
    for (i, pair) in events.chunks(2).enumerate() {
        flush.queue(stream)?;
        pair[0].record(stream)?;
        call(i)?;
        pair[1].record(stream)?;
    }
    let mut us = events
        .chunks(2)
        .map(|pair| Ok(f64::from(pair[0].elapsed_ms(&pair[1])?) * 1e3))
        .collect::<Result<Vec<f64>>>()?;
    Ok(median(&mut us))
}

/// The median of `v` (the mean of the middle two for an even count); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    assert!(!v.is_empty(), "median of nothing");
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The single-call method, as the JSON's `single_method` says it.
pub fn single_method() -> String {
    format!(
        "one call at a time: a kernel writing {} MB (L2 flush), a CUDA event recorded after it \
         is queued, the call, an end event; median of {SINGLE_CALLS} calls' end - start, input \
         sets rotated as in the back-to-back figures",
        FLUSH_BYTES / (1024 * 1024)
    )
}

// ---------------------------------------------------------------------------------------
// Ceiling

/// The fastest plain copy of a case's bytes, and which copy it was.
#[derive(Clone, Debug)]
pub struct Ceiling {
    pub us: f64,
    pub variant: String,
}

/// Copy kernels tried (as research/ceiling tries them): CTAs of 256 threads per SM (0: one pass
/// over a grid that covers every vector), streaming loads, streaming stores.
pub const COPY_VARIANTS: [(u32, bool, bool); 12] = [
    (0, true, true),
    (0, false, true),
    (0, false, false),
    (2, true, true),
    (2, false, true),
    (2, false, false),
    (4, true, true),
    (4, false, true),
    (4, false, false),
    (8, true, true),
    (8, false, true),
    (8, false, false),
];

fn copy_variant_name((per_sm, load_cs, store_cs): (u32, bool, bool)) -> String {
    let grid = match per_sm {
        0 => "pass".to_string(),
        n => format!("{n}/SM"),
    };
    let hints = match (load_cs, store_cs) {
        (true, true) => "cs",
        (false, true) => "ld",
        (false, false) => "ld+st",
        (true, false) => "cs-ld",
    };
    format!("{grid},{hints}")
}

/// The ceiling of a case that reads `read_bytes` and writes `write_bytes`: each of
/// [`COPY_VARIANTS`] (vector i read where below the reads, written where below the writes) and
/// a device-to-device memcpy of (R + W) / 2 bytes, timed as [`time_single_calls`] on input
/// sets of random bits rotated as the case's are; the least of their medians.
pub fn time_ceiling(
    stream: &Arc<CudaStream>,
    flush: &mut Flush,
    read_bytes: f64,
    write_bytes: f64,
    seed: u64,
) -> Result<Ceiling> {
    let (reads, writes) = (read_bytes.ceil() as usize, write_bytes.ceil() as usize);
    // Rounded down to 64 KB: research/ceiling saw sizes of odd multiples of 16 bytes take a path
    // 1.5-1.6x slower; the bytes less only make the ceiling more generous.
    let half = (reads + writes) / 2 / 65536 * 65536;
    let words = reads.max(writes).max(half).div_ceil(16) * 2; // whole 16-byte vectors
    let sets = input_sets((reads + writes) as f64);
    let mut rng = Rng::new(seed);
    let bits: Vec<u64> = (0..words).map(|_| rng.next_u64()).collect();
    let mut bufs = (0..sets)
        .map(|_| Ok((stream.clone_htod(&bits)?, stream.alloc_zeros::<u64>(words)?)))
        .collect::<Result<Vec<_>>>()?;
    drop(bits);

    let mut best = Ceiling {
        us: f64::INFINITY,
        variant: String::new(),
    };
    for variant in COPY_VARIANTS {
        let (per_sm, load_cs, store_cs) = variant;
        let us = time_single_calls(stream, flush, sets, |i| {
            let (src, dst) = &mut bufs[i % sets];
            moe_routing_dev::copy(stream, &*src, dst, reads, writes, per_sm, load_cs, store_cs)?;
            Ok(())
        })?;
        if us < best.us {
            best = Ceiling {
                us,
                variant: copy_variant_name(variant),
            };
        }
    }
    let us = time_single_calls(stream, flush, sets, |i| {
        let (src, dst) = &mut bufs[i % sets];
        stream.memcpy_dtod(&src.slice(..half / 8), &mut dst.slice_mut(..half / 8))?;
        Ok(())
    })?;
    if us < best.us {
        best = Ceiling {
            us,
            variant: "memcpy".into(),
        };
    }
    Ok(best)
}

/// The ceiling's method, as the JSON's `ceiling_method` says it.
pub fn ceiling_method() -> String {
    format!(
        "per case, the case's SOL bytes moved with no compute (read R, write W), timed as the \
         single calls: the least median of {} copy kernels (16-byte vectors, 4 loads in flight \
         per thread; one pass or grid-stride on 2, 4 or 8 CTAs of 256 threads per SM; \
         streaming or default cache hints) and a device-to-device memcpy of (R + W) / 2 bytes; \
         sources of random bits; `ceiling_variant` names the fastest",
        COPY_VARIANTS.len()
    )
}

// ---------------------------------------------------------------------------------------
// Back-to-back method

/// The timing method, as the JSON's `method` says it.
pub fn method() -> String {
    format!(
        "CUDA events, median of {ROUNDS} rounds of N back-to-back calls {}, S input sets \
         rotated (>= 100 MB); per case N is `launches` (a round lasts >= {} ms) and S is `sets`",
        if eager() {
            "launched one by one from the host"
        } else {
            "captured once into a CUDA graph and replayed"
        },
        MIN_ROUND_US / 1e3
    )
}

// ---------------------------------------------------------------------------------------
// Report

/// Derived figures of one case, from its speed of light and bytes per call.
pub struct Figures {
    pub fused_us: f64,
    pub unfused_us: Option<f64>,
    pub sol_us: f64,
    pub fused_tbps: f64,
    pub sol_pct: f64,
    pub speedup: Option<f64>,
}

impl Figures {
    pub fn new(sol_s: f64, bytes: f64, fused: Timing, unfused: Option<Timing>) -> Self {
        let sol_us = sol_s * 1e6;
        Self {
            fused_us: fused.us,
            unfused_us: unfused.map(|u| u.us),
            sol_us,
            fused_tbps: bytes / (fused.us * 1e-6) / 1e12,
            sol_pct: sol_us / fused.us * 100.0,
            speedup: unfused.map(|u| u.us / fused.us),
        }
    }
}

/// The suite means both benchmarks report.
pub struct Means {
    pub sol_pct: Option<f64>,
    pub speedup: Option<f64>,
    pub fused_us: Option<f64>,
    pub unfused_us: Option<f64>,
}

impl Means {
    pub fn of(figures: &[Figures]) -> Self {
        // Baseline means only when every case has the baseline, or they would average a
        // different subset of cases than the fused means.
        let all_unfused = figures.iter().all(|f| f.unfused_us.is_some());
        Self {
            sol_pct: mean(figures.iter().map(|f| f.sol_pct)),
            speedup: mean(figures.iter().filter_map(|f| f.speedup)).filter(|_| all_unfused),
            fused_us: mean(figures.iter().map(|f| f.fused_us)),
            unfused_us: mean(figures.iter().filter_map(|f| f.unfused_us)).filter(|_| all_unfused),
        }
    }

    pub fn print(&self) {
        println!("mean fused %SOL:          {}%", show(self.sol_pct, 1, ""));
        println!("mean speedup vs unfused:  {}x", show(self.speedup, 2, ""));
        println!("mean fused µs:            {}", show(self.fused_us, 2, ""));
        println!("mean unfused µs:          {}", show(self.unfused_us, 2, ""));
    }
}

/// `v` with `digits` decimals and `suffix`, or a dash.
pub fn show(v: Option<f64>, digits: usize, suffix: &str) -> String {
    v.map_or("—".to_string(), |v| format!("{v:.digits$}{suffix}"))
}

/// Results arrive case by case over minutes; show each as soon as it is known.
pub fn flush() {
    let _ = std::io::stdout().flush();
}

pub fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values
        .into_iter()
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// `s` as a JSON string literal.
pub fn json_str(s: &str) -> String {
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
pub fn json_num(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.4}"),
        _ => "null".into(),
    }
}

/// A JSON object written field by field, in order.
#[derive(Default)]
pub struct JsonObject(Vec<String>);

impl JsonObject {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn str(mut self, key: &str, v: &str) -> Self {
        self.0.push(format!("{}: {}", json_str(key), json_str(v)));
        self
    }
    pub fn num(mut self, key: &str, v: Option<f64>) -> Self {
        self.0.push(format!("{}: {}", json_str(key), json_num(v)));
        self
    }
    pub fn int(mut self, key: &str, v: usize) -> Self {
        self.0.push(format!("{}: {v}", json_str(key)));
        self
    }
    /// `v` as written (an object or array already in JSON).
    pub fn raw(mut self, key: &str, v: &str) -> Self {
        self.0.push(format!("{}: {v}", json_str(key)));
        self
    }
    /// The fields without the braces, to be framed by the caller.
    pub fn fields(&self) -> String {
        self.0.join(", ")
    }
    /// The object on one line.
    pub fn line(&self) -> String {
        format!("{{{}}}", self.fields())
    }
}

/// One case of the results file; `extra` (such as the backward's `precise_us`) follows
/// `fused_us`.
pub fn case_json(
    case: &Case,
    fused: Timing,
    extra: Option<(&str, f64)>,
    unfused: Option<Timing>,
    f: &Figures,
    sets: usize,
) -> String {
    let extra = extra.map_or(String::new(), |(k, v)| {
        format!(", \"{k}\": {}", json_num(Some(v)))
    });
    format!(
        "{{\"name\": {}, \"tokens\": {}, \"fused_us\": {}{extra}, \"unfused_us\": {}, \
         \"sol_us\": {}, \"fused_tbps\": {}, \"sol_pct\": {}, \"speedup\": {}, \
         \"sets\": {}, \"launches\": {}}}",
        json_str(&case.name),
        case.tokens,
        json_num(Some(fused.us)),
        json_num(unfused.map(|u| u.us)),
        json_num(Some(f.sol_us)),
        json_num(Some(f.fused_tbps)),
        json_num(Some(f.sol_pct)),
        json_num(f.speedup),
        sets,
        fused.launches,
    )
}

/// The results file of one pass: device, method, the cases and the means; `extra` (such as
/// the backward's `mean_precise_ratio`) comes last.
pub fn results_json(
    device: &str,
    pass: &str,
    cases: &[String],
    m: &Means,
    extra: Option<(&str, Option<f64>)>,
) -> String {
    let extra = extra.map_or(String::new(), |(k, v)| {
        format!(", \"{k}\": {}", json_num(v))
    });
    format!(
        "{{\"device\": {}, \"method\": {}, \"pass\": {},\n \"cases\": [\n  {}\n ],\n \
         \"mean_sol_pct\": {}, \"mean_speedup\": {}, \"mean_fused_us\": {}, \
         \"mean_unfused_us\": {}{extra}}}\n",
        json_str(device),
        json_str(&method()),
        json_str(pass),
        cases.join(",\n  "),
        json_num(m.sol_pct),
        json_num(m.speedup),
        json_num(m.fused_us),
        json_num(m.unfused_us),
    )
}
