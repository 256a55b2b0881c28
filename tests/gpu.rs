//! GPU tests: the CUDA kernels against the f64 CPU reference, on every suite case and on
//! small shapes, plus validation, determinism and the zero-token case.
//!
//! Own harness: with no CUDA device every test reports "skipped" (never "passed").
//! `gpu [FILTER]` runs the tests whose name contains FILTER.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_routing::reference;
use moe_routing::suite::{self, Case};
use moe_routing::testing::{bf16_to_f64, fresh_seed, random_grad, to_f64, Inputs, Rng};
use moe_routing::{
    cuda_device_count, BackwardOptions, ForwardExtras, Precision, Router, RouterConfig, Routing,
    Status,
};

const GRAD_X_TOL: f64 = 1e-2;
const GRAD_W_TOL: f64 = 5e-3;
const PRECISE_GRAD_X_TOL: f64 = 4e-3;
const PRECISE_GRAD_W_TOL: f64 = 1e-5;

#[path = "gpu/dtypes.rs"]
mod dtypes;

type Test = (&'static str, fn(&Arc<CudaStream>));

fn main() {
    let tests: &[Test] = &[
        ("forward_small_shapes", forward_small_shapes),
        ("forward_fused_shapes", forward_fused_shapes),
        (
            "forward_plans_per_expert_count",
            forward_plans_per_expert_count,
        ),
        ("forward_ties_and_nan", forward_ties_and_nan),
        ("forward_near_ties_exact", forward_near_ties_exact),
        ("forward_optional_outputs", forward_optional_outputs),
        ("forward_is_deterministic", forward_is_deterministic),
        ("round_trip", round_trip),
        ("backward_small_shapes", backward_small_shapes),
        ("backward_is_deterministic", backward_is_deterministic),
        ("backward_grad_w_sums", backward_grad_w_sums),
        ("backward_fused_expert_counts", backward_fused_expert_counts),
        ("backward_fused_any_top_k", backward_fused_any_top_k),
        (
            "backward_unaligned_routing_rows",
            backward_unaligned_routing_rows,
        ),
        ("backward_dtypes_small", dtypes::backward_dtypes_small),
        ("zero_tokens", zero_tokens),
        (
            "invalid_arguments_touch_nothing",
            invalid_arguments_touch_nothing,
        ),
        ("randomized_equivalence", randomized_equivalence),
        ("extreme_inputs", extreme_inputs),
        ("graph_capture", graph_capture),
        ("two_streams", two_streams),
        ("huge_batch", huge_batch),
        ("suite_forward", suite_forward),
        ("suite_backward", suite_backward),
        ("suites_in_pytorch_dtypes", dtypes::suites_in_pytorch_dtypes),
    ];
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let selected: Vec<&Test> = tests
        .iter()
        .filter(|(n, _)| filter.as_deref().is_none_or(|f| n.contains(f)))
        .collect();
    if cuda_device_count() == 0 {
        for (name, _) in &selected {
            println!("test {name} ... skipped (no CUDA device)");
        }
        println!("gpu: 0 passed, 0 failed, {} skipped", selected.len());
        return;
    }
    let ctx = CudaContext::new(0).expect("CUDA context");
    let stream = ctx.default_stream();
    let (mut passed, mut failed) = (0, 0);
    for (name, test) in &selected {
        let t0 = std::time::Instant::now();
        let ok = catch_unwind(AssertUnwindSafe(|| test(&stream))).is_ok();
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "test {name} ... {} ({secs:.1} s)",
            if ok { "ok" } else { "FAILED" }
        );
        if ok {
            passed += 1
        } else {
            failed += 1
        }
    }
    println!("gpu: {passed} passed, {failed} failed, 0 skipped");
    if failed > 0 {
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------

fn upload<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).unwrap()
}

fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    d: &CudaSlice<T>,
) -> Vec<T> {
    s.clone_dtoh(d).unwrap()
}

/// Bit patterns, for comparisons that must be exact (NaN included).
trait Bits: Copy {
    fn bits(self) -> u64;
}
impl Bits for f64 {
    fn bits(self) -> u64 {
        self.to_bits()
    }
}
impl Bits for f32 {
    fn bits(self) -> u64 {
        self.to_bits().into()
    }
}
impl Bits for bf16 {
    fn bits(self) -> u64 {
        self.to_bits().into()
    }
}
impl Bits for i32 {
    fn bits(self) -> u64 {
        self as u32 as u64
    }
}

fn bits<T: Bits>(v: &[T]) -> Vec<u64> {
    v.iter().map(|&a| a.bits()).collect()
}

/// Device buffer filled with NaN (all bits set) so that unwritten outputs show.
fn poisoned<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    // SAFETY: filled right below, before any read.
    let mut d = unsafe { s.alloc::<T>(n).unwrap() };
    poison(s, &mut d);
    d
}

/// Sets every byte of `d` to 0xFF (NaN for floats, -1 for integers).
fn poison<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, d: &mut CudaSlice<T>) {
    let bytes = d.len() * std::mem::size_of::<T>();
    let (ptr, _guard) = d.device_ptr_mut(s);
    // SAFETY: `ptr` addresses `bytes` bytes of the live allocation `d`.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, s.cu_stream()).unwrap() };
}

struct Forward {
    idx: Vec<i32>,
    weights: Vec<f32>,
    scores: Vec<f32>,
    dev: Routing,
}

fn gpu_forward(s: &Arc<CudaStream>, router: &Router, tokens: usize, inp: &Inputs) -> Forward {
    let cfg = router.config();
    let (x, w, bias) = (upload(s, &inp.x), upload(s, &inp.w), upload(s, &inp.bias));
    let n = (tokens * cfg.num_experts_per_tok).max(1);
    let mut out = Routing {
        topk_idx: poisoned(s, n),
        topk_weights: poisoned(s, n),
        topk_scores: poisoned(s, n),
    };
    router.forward(s, tokens, &x, &w, &bias, &mut out).unwrap();
    s.synchronize().unwrap();
    Forward {
        idx: download(s, &out.topk_idx),
        weights: download(s, &out.topk_weights),
        scores: download(s, &out.topk_scores),
        dev: out,
    }
}

/// Compares a GPU forward with the reference; returns the number of near-tie rows that
/// differ. Rows that are not near ties must match exactly in indices.
fn check_forward(
    cfg: &RouterConfig,
    tokens: usize,
    inp: &Inputs,
    got: &Forward,
    label: &str,
) -> (usize, f64) {
    let want = reference::forward(cfg, tokens, &inp.x, &inp.w, &inp.bias);
    let k = cfg.num_experts_per_tok;
    let mut tie_rows = 0;
    for t in 0..tokens {
        let (g, r) = (
            &got.idx[t * k..(t + 1) * k],
            &want.topk_idx[t * k..(t + 1) * k],
        );
        if g != r {
            assert!(
                want.near_tie[t],
                "{label}: token {t}: indices {g:?}, reference {r:?}"
            );
            tie_rows += 1;
        }
    }
    // Weights and scores on rows whose indices agree.
    let rows: Vec<usize> = (0..tokens)
        .filter(|&t| got.idx[t * k..(t + 1) * k] == want.topk_idx[t * k..(t + 1) * k])
        .collect();
    let pick = |v: &[f32]| -> Vec<f64> {
        rows.iter()
            .flat_map(|&t| v[t * k..(t + 1) * k].iter().map(|&a| a as f64))
            .collect()
    };
    let ew = reference::rel_err(&pick(&got.weights), &pick(&want.topk_weights));
    let es = reference::rel_err(&pick(&got.scores), &pick(&want.topk_scores));
    assert!(
        ew < 1e-5 && es < 1e-5,
        "{label}: weights err {ew:e}, scores err {es:e}"
    );
    (tie_rows, ew.max(es))
}

struct Grads {
    grad_x: Vec<f64>,
    grad_w: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
fn gpu_backward(
    s: &Arc<CudaStream>,
    router: &Router,
    tokens: usize,
    inp: &Inputs,
    idx: &CudaSlice<i32>,
    scores: &CudaSlice<f32>,
    grad_out: &[f32],
    options: BackwardOptions,
    grad_w_init: Option<&[f32]>,
) -> Grads {
    let (x, w) = (upload(s, &inp.x), upload(s, &inp.w));
    let g = upload(s, grad_out);
    let routing = (idx, scores, &g);
    gpu_backward_on(s, router, tokens, (&x, &w), routing, options, grad_w_init)
}

/// The backward on device inputs (any views of them), into poisoned or given outputs.
fn gpu_backward_on(
    s: &Arc<CudaStream>,
    router: &Router,
    tokens: usize,
    (x, w): (&impl DevicePtr<bf16>, &impl DevicePtr<bf16>),
    (idx, scores, grads): (
        &impl DevicePtr<i32>,
        &impl DevicePtr<f32>,
        &impl DevicePtr<f32>,
    ),
    options: BackwardOptions,
    grad_w_init: Option<&[f32]>,
) -> Grads {
    let cfg = router.config();
    let mut grad_x: CudaSlice<bf16> = poisoned(s, (tokens * cfg.hidden_size).max(1));
    let eh = cfg.n_routed_experts * cfg.hidden_size;
    let mut grad_w: CudaSlice<f32> = match grad_w_init {
        Some(v) => upload(s, v),
        None => poisoned(s, eh),
    };
    let mut ws = router.alloc_workspace(s, tokens).unwrap();
    router
        .backward(
            s,
            tokens,
            x,
            w,
            idx,
            scores,
            grads,
            &mut grad_x,
            &mut grad_w,
            options,
            &mut ws,
        )
        .unwrap();
    s.synchronize().unwrap();
    let gx = download(s, &grad_x);
    Grads {
        grad_x: bf16_to_f64(&gx[..tokens * cfg.hidden_size]),
        grad_w: to_f64(&download(s, &grad_w)),
    }
}

fn l2(v: &[f64]) -> f64 {
    v.iter().map(|a| a * a).sum::<f64>().sqrt()
}

/// ‖a − b‖₂ (infinite if `a` has a non-finite value).
fn abs_err(a: &[f64], b: &[f64]) -> f64 {
    if a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(p, q)| (p - q) * (p - q))
        .sum::<f64>()
        .sqrt()
}

/// Worst backward errors of one precision mode over accumulate on and off.
#[derive(Clone, Copy, Default)]
struct Worst {
    grad_x: f64,
    grad_w: f64,
}

/// Runs forward then backward on the GPU and checks both against the reference; returns the
/// worst errors of the default and of the precise mode.
fn check_case(
    s: &Arc<CudaStream>,
    cfg: &RouterConfig,
    tokens: usize,
    seed: u64,
    label: &str,
) -> [Worst; 2] {
    let mut rng = Rng::new(seed);
    let router = Router::new(*cfg).unwrap();
    let inp = Inputs::random(cfg, tokens, &mut rng);
    let fwd = gpu_forward(s, &router, tokens, &inp);
    check_forward(cfg, tokens, &inp, &fwd, label);
    let k = cfg.num_experts_per_tok;
    let grad_out = random_grad(tokens * k, &mut rng);
    let want = reference::backward(
        cfg,
        tokens,
        &inp.x,
        &inp.w,
        &fwd.idx[..tokens * k],
        &fwd.scores[..tokens * k],
        &grad_out,
    );
    // With one expert per token and normalization every weight is s/(s + 1e-20) = 1: the
    // gradient is zero up to rounding, and a relative error means nothing. The scale of the
    // terms that cancel is the gradient without the normalization.
    let degenerate_scale = (k == 1 && cfg.norm_topk_prob).then(|| {
        let plain = RouterConfig {
            norm_topk_prob: false,
            ..*cfg
        };
        let terms = reference::backward(
            &plain,
            tokens,
            &inp.x,
            &inp.w,
            &fwd.idx[..tokens * k],
            &fwd.scores[..tokens * k],
            &grad_out,
        );
        (l2(&terms.grad_x).max(1e-30), l2(&terms.grad_w).max(1e-30))
    });
    let mut worst = [Worst::default(); 2];
    for (mode, precision) in [Precision::Default, Precision::Precise]
        .into_iter()
        .enumerate()
    {
        // Precise mode: fp32-accurate grad_w; grad_x within its bf16 output rounding.
        let (tol_x, tol_w) = match precision {
            Precision::Precise => (PRECISE_GRAD_X_TOL, PRECISE_GRAD_W_TOL),
            Precision::Default | Precision::TorchBf16 => (GRAD_X_TOL, GRAD_W_TOL),
        };
        for accumulate in [false, true] {
            let eh = cfg.n_routed_experts * cfg.hidden_size;
            let init: Vec<f32> = (0..eh).map(|_| rng.uniform()).collect();
            let opts = BackwardOptions {
                accumulate_grad_w: accumulate,
                precision,
            };
            let got = gpu_backward(
                s,
                &router,
                tokens,
                &inp,
                &fwd.dev.topk_idx,
                &fwd.dev.topk_scores,
                &grad_out,
                opts,
                accumulate.then_some(&init[..]),
            );
            let want_w: Vec<f64> = if accumulate {
                want.grad_w
                    .iter()
                    .zip(&init)
                    .map(|(a, &b)| a + b as f64)
                    .collect()
            } else {
                want.grad_w.clone()
            };
            let (ex, ew) = match &degenerate_scale {
                // The exact gradient vanishes: bound the cancellation noise by the size of
                // the terms that cancel.
                Some((sx, sw)) => (
                    abs_err(&got.grad_x, &want.grad_x) / sx,
                    abs_err(&got.grad_w, &want_w) / sw,
                ),
                None => (
                    reference::rel_err(&got.grad_x, &want.grad_x),
                    reference::rel_err(&got.grad_w, &want_w),
                ),
            };
            assert!(
                ex <= tol_x,
                "{label} {opts:?}: grad_x err {ex:e} (seed {seed})"
            );
            assert!(
                ew <= tol_w,
                "{label} {opts:?}: grad_w err {ew:e} (seed {seed})"
            );
            worst[mode].grad_x = worst[mode].grad_x.max(ex);
            worst[mode].grad_w = worst[mode].grad_w.max(ew);
        }
    }
    worst
}

/// DeepSeek-V3's router (256 experts, top-8, 8 groups keep 4, scaled by 2.5, normalized) with
/// the given hidden size (7168 in the model).
fn deepseek_v3(hidden_size: usize) -> RouterConfig {
    RouterConfig {
        hidden_size,
        n_routed_experts: 256,
        num_experts_per_tok: 8,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
    }
}

fn small_configs() -> Vec<(RouterConfig, usize)> {
    let base = RouterConfig {
        hidden_size: 256,
        n_routed_experts: 64,
        num_experts_per_tok: 6,
        n_group: 8,
        topk_group: 3,
        routed_scaling_factor: 1.5,
        norm_topk_prob: true,
    };
    vec![
        (base, 1),
        (base, 7),
        (
            RouterConfig {
                norm_topk_prob: false,
                ..base
            },
            129,
        ),
        (
            RouterConfig {
                n_group: 1,
                topk_group: 1,
                num_experts_per_tok: 16,
                ..base
            },
            127,
        ),
        (deepseek_v3(2048), 300),
        (
            RouterConfig {
                hidden_size: 72,
                n_routed_experts: 512,
                num_experts_per_tok: 16,
                n_group: 16,
                topk_group: 16,
                ..base
            },
            33,
        ),
    ]
}

fn forward_small_shapes(s: &Arc<CudaStream>) {
    for (i, (cfg, tokens)) in small_configs().into_iter().enumerate() {
        let seed = fresh_seed() ^ i as u64;
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
        let fwd = gpu_forward(s, &router, tokens, &inp);
        check_forward(
            &cfg,
            tokens,
            &inp,
            &fwd,
            &format!("{cfg:?} T={tokens} seed {seed}"),
        );
    }
}

fn backward_small_shapes(s: &Arc<CudaStream>) {
    for (i, (cfg, tokens)) in small_configs().into_iter().enumerate() {
        let seed = fresh_seed() ^ (i as u64) << 8;
        check_case(s, &cfg, tokens, seed, &format!("{cfg:?} T={tokens}"));
    }
}

// The fused backward sums grad_w over the CTAs of a hidden slice in one of three ways, picked
// by shape and device (fused_backward.cu). On an H200: H = 1024, T = 1024 sums in clusters of
// 8, and H = 7168, T = 4096 in clusters of 2; H = 1024, T = 2048 spreads the sum over 16 CTAs
// through global memory, and H = 5120, T = 1536 over 3; H = 20480 (more slices than SMs) has
// the last CTA of a slice sum it; H = 10240, T = 256 (one CTA per 128-column slice) needs no
// sum, and H = 5120, T = 512 takes 64-column slices, one CTA each, whose wgrad warpgroup
// writes grad_w. Each is checked against the reference and for bitwise-equal repeats,
// in both precisions (precise mode: two sweeps in one launch, or at H = 20480, where a CTA's
// units span slices, two launches, the second accumulating).
fn backward_grad_w_sums(s: &Arc<CudaStream>) {
    for (i, (hidden_size, tokens)) in [
        (1024, 1024),
        (1024, 2048),
        (7168, 4096),
        (20480, 256),
        (10240, 256),
        (5120, 512),
        (5120, 1536),
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = RouterConfig {
            hidden_size,
            ..RouterConfig::glm45(8, 4)
        };
        let seed = fresh_seed() ^ (i as u64) << 12;
        check_case(
            s,
            &cfg,
            tokens,
            seed,
            &format!("H={hidden_size} T={tokens}"),
        );
        assert_deterministic(s, &cfg, tokens, &[Precision::Default, Precision::Precise]);
    }
}

/// The fused backward's other expert counts: 256 (DeepSeek-V3: 64-column slices, one consumer
/// warpgroup taking dgrad and the other wgrad) and 128 (GLM-4.5-Air: the same kernels as 160,
/// 64-column slices at small T, 128-column ones with grad_w summed over a slice's CTAs above),
/// against the reference in both precisions, accumulating or not, and bitwise repeatable.
fn backward_fused_expert_counts(s: &Arc<CudaStream>) {
    let v3 = deepseek_v3(7168);
    let glm45_air = RouterConfig {
        hidden_size: 4096,
        n_routed_experts: 128,
        num_experts_per_tok: 8,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 1.0,
        norm_topk_prob: true,
    };
    // 256 experts with few slices (16 of 64 columns), one group.
    let narrow = RouterConfig {
        hidden_size: 1024,
        n_group: 1,
        topk_group: 1,
        ..v3
    };
    for (i, (cfg, tokens)) in [
        (v3, 1),
        (v3, 300),
        (v3, 2000),
        (narrow, 3001),
        (glm45_air, 7),
        (glm45_air, 1000),
        (glm45_air, 3001),
    ]
    .into_iter()
    .enumerate()
    {
        check_fused_case(s, &cfg, tokens, fresh_seed() ^ (i as u64) << 16);
    }
}

/// One shape on the fused kernels: against the reference in both precisions, accumulating or
/// not, and bitwise repeatable. The fused kernels take G as bf16 in the default mode (grad_w
/// ~1e-3 off); the simple path's fp32 G would leave ~1e-6, so a shape that fell back to it
/// fails.
fn check_fused_case(s: &Arc<CudaStream>, cfg: &RouterConfig, tokens: usize, seed: u64) {
    let label = format!("{cfg:?} T={tokens}");
    let [default, _] = check_case(s, cfg, tokens, seed, &label);
    assert!(
        default.grad_w > 1e-4,
        "{label}: grad_w err {:e}, not the fused kernel's",
        default.grad_w
    );
    if tokens > 1 {
        assert_deterministic(s, cfg, tokens, &[Precision::Default, Precision::Precise]);
    }
}

/// The fused backward for any K up to 8 (its any-K kernels, which load the routing rows element
/// by element): Moonlight's router (64 experts, top-6), dots.llm1's (128, top-6), K = 7 and
/// K = 1 on 160 experts, K = 4 on 256, and 64 experts at K = 8 (they have no K = 8 kernels of
/// their own), at small T (64-column slices) and above (128-column ones, grad_w summed over a
/// slice's CTAs); each by check_fused_case.
fn backward_fused_any_top_k(s: &Arc<CudaStream>) {
    let moonlight = RouterConfig {
        hidden_size: 2048,
        n_routed_experts: 64,
        num_experts_per_tok: 6,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.446,
        norm_topk_prob: true,
    };
    let dots = RouterConfig {
        hidden_size: 4096,
        n_routed_experts: 128,
        routed_scaling_factor: 2.5,
        ..moonlight
    };
    let glm45_k7 = RouterConfig {
        num_experts_per_tok: 7,
        ..RouterConfig::glm45(8, 4)
    };
    let glm45_k1 = RouterConfig {
        num_experts_per_tok: 1,
        norm_topk_prob: false, // (normalized, one expert's weight is 1: no gradient)
        ..RouterConfig::glm45(1, 1)
    };
    let v3_k4 = RouterConfig {
        num_experts_per_tok: 4,
        ..deepseek_v3(1024)
    };
    let e64_k8 = RouterConfig {
        num_experts_per_tok: 8,
        n_group: 8,
        topk_group: 4,
        ..moonlight
    };
    for (i, (cfg, tokens)) in [
        (moonlight, 5),
        (moonlight, 700),
        (moonlight, 3001),
        (dots, 300),
        (dots, 3001),
        (glm45_k7, 1000),
        (glm45_k7, 3001),
        (glm45_k1, 2000),
        (v3_k4, 1500),
        (e64_k8, 2048),
    ]
    .into_iter()
    .enumerate()
    {
        check_fused_case(s, &cfg, tokens, fresh_seed() ^ (i as u64) << 20);
    }
}

/// Routing rows that are not 16-byte aligned (views one element into their buffers, as a
/// caller's slices may be) cannot take the K = 8 kernels' vector loads: the call takes the any-K
/// kernels, and gives the same bits as with aligned rows.
fn backward_unaligned_routing_rows(s: &Arc<CudaStream>) {
    for (i, (cfg, tokens)) in [
        (RouterConfig::glm45(8, 4), 300),
        (RouterConfig::glm45(8, 4), 3001),
        (deepseek_v3(1024), 700),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(fresh_seed() ^ (i as u64) << 24);
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut rng);
        let fwd = gpu_forward(s, &router, tokens, &inp);
        let tk = tokens * cfg.num_experts_per_tok;
        let grad_out = random_grad(tk, &mut rng);
        // Each routing input again, one element into a buffer of its own.
        let shifted = |v: &[f32]| {
            let mut buf = vec![0.0f32; tk + 1];
            buf[1..].copy_from_slice(&v[..tk]);
            upload(s, &buf)
        };
        let mut idx = vec![0i32; tk + 1];
        idx[1..].copy_from_slice(&fwd.idx[..tk]);
        let (idx, scores, grads) = (upload(s, &idx), shifted(&fwd.scores), shifted(&grad_out));
        let (x, w, g) = (upload(s, &inp.x), upload(s, &inp.w), upload(s, &grad_out));
        for precision in [Precision::Default, Precision::Precise] {
            let opts = BackwardOptions {
                accumulate_grad_w: false,
                precision,
            };
            let aligned_rows = (&fwd.dev.topk_idx, &fwd.dev.topk_scores, &g);
            let aligned = gpu_backward_on(s, &router, tokens, (&x, &w), aligned_rows, opts, None);
            let shifted_rows = (&idx.slice(1..), &scores.slice(1..), &grads.slice(1..));
            let got = gpu_backward_on(s, &router, tokens, (&x, &w), shifted_rows, opts, None);
            let label = format!("{cfg:?} T={tokens} {precision:?}");
            assert!(
                bits(&got.grad_x) == bits(&aligned.grad_x),
                "{label}: grad_x differs"
            );
            assert!(
                bits(&got.grad_w) == bits(&aligned.grad_w),
                "{label}: grad_w differs"
            );
        }
    }
}

fn backward_is_deterministic(s: &Arc<CudaStream>) {
    let cfg = RouterConfig::glm45(8, 4);
    assert_deterministic(s, &cfg, 3001, &[Precision::Default, Precision::Precise]);
}

// Two backward calls on the same inputs give the same bits.
fn assert_deterministic(
    s: &Arc<CudaStream>,
    cfg: &RouterConfig,
    tokens: usize,
    modes: &[Precision],
) {
    let cfg = *cfg;
    let mut rng = Rng::new(fresh_seed());
    let router = Router::new(cfg).unwrap();
    let inp = Inputs::random(&cfg, tokens, &mut rng);
    let fwd = gpu_forward(s, &router, tokens, &inp);
    let grad_out = random_grad(tokens * cfg.num_experts_per_tok, &mut rng);
    for &precision in modes {
        let opts = BackwardOptions {
            accumulate_grad_w: false,
            precision,
        };
        let a = gpu_backward(
            s,
            &router,
            tokens,
            &inp,
            &fwd.dev.topk_idx,
            &fwd.dev.topk_scores,
            &grad_out,
            opts,
            None,
        );
        let b = gpu_backward(
            s,
            &router,
            tokens,
            &inp,
            &fwd.dev.topk_idx,
            &fwd.dev.topk_scores,
            &grad_out,
            opts,
            None,
        );
        assert!(
            bits(&a.grad_x) == bits(&b.grad_x),
            "grad_x differs between runs ({cfg:?} T={tokens} {precision:?})"
        );
        assert!(
            bits(&a.grad_w) == bits(&b.grad_w),
            "grad_w differs between runs ({cfg:?} T={tokens} {precision:?})"
        );
    }
}

fn zero_tokens(s: &Arc<CudaStream>) {
    let cfg = RouterConfig::glm45(8, 4);
    let router = Router::new(cfg).unwrap();
    let inp = Inputs::random(&cfg, 0, &mut Rng::new(1));
    let fwd = gpu_forward(s, &router, 0, &inp);
    // Written as zeros.
    let g = gpu_backward(
        s,
        &router,
        0,
        &inp,
        &fwd.dev.topk_idx,
        &fwd.dev.topk_scores,
        &[0.5],
        BackwardOptions::default(),
        None,
    );
    assert!(
        g.grad_w.iter().all(|&v| v == 0.0),
        "grad_w not zeroed for T=0"
    );
    // Left as is when accumulating.
    let init: Vec<f32> = (0..cfg.n_routed_experts * cfg.hidden_size)
        .map(|i| i as f32)
        .collect();
    let opts = BackwardOptions {
        accumulate_grad_w: true,
        ..Default::default()
    };
    let g = gpu_backward(
        s,
        &router,
        0,
        &inp,
        &fwd.dev.topk_idx,
        &fwd.dev.topk_scores,
        &[0.5],
        opts,
        Some(&init),
    );
    assert!(
        g.grad_w.iter().zip(&init).all(|(&a, &b)| a == b as f64),
        "grad_w changed for T=0"
    );
}

fn invalid_arguments_touch_nothing(s: &Arc<CudaStream>) {
    let cfg = RouterConfig::glm45(8, 4);
    let router = Router::new(cfg).unwrap();
    let tokens = 64;
    let inp = Inputs::random(&cfg, tokens, &mut Rng::new(fresh_seed()));
    let (x, w, bias) = (upload(s, &inp.x), upload(s, &inp.w), upload(s, &inp.bias));
    let fresh_out = |n: usize| Routing {
        topk_idx: poisoned(s, n),
        topk_weights: poisoned(s, n),
        topk_scores: poisoned(s, n),
    };
    let untouched = |out: &Routing| {
        s.synchronize().unwrap();
        assert!(
            download(s, &out.topk_idx).iter().all(|&v| v == -1),
            "topk_idx written on error"
        );
    };
    let expect = |r: Result<(), moe_routing::Error>, kind: Status| {
        let e = r.expect_err("invalid call succeeded");
        assert_eq!(e.kind, kind, "{e}");
    };

    // Shapes that disagree: x too short for the token count.
    let mut out = fresh_out(tokens * 8);
    expect(
        router.forward(s, tokens + 1, &x, &w, &bias, &mut out),
        Status::BufferTooSmall,
    );
    untouched(&out);
    // Output too small.
    let mut small = fresh_out(tokens * 8 - 1);
    expect(
        router.forward(s, tokens, &x, &w, &bias, &mut small),
        Status::BufferTooSmall,
    );
    untouched(&small);
    // Misaligned x: a view starting one element in.
    let x_off = x.slice(1..);
    expect(
        router.forward(s, tokens - 1, &x_off, &w, &bias, &mut out),
        Status::Misaligned,
    );
    untouched(&out);
    // Too many tokens for the grid.
    expect(
        router.forward(s, 1 << 31, &x, &w, &bias, &mut out),
        Status::InvalidShape,
    );

    // Config errors.
    let bad = [
        RouterConfig { n_group: 7, ..cfg },
        RouterConfig {
            topk_group: 9,
            ..cfg
        },
        RouterConfig {
            num_experts_per_tok: 41,
            topk_group: 2,
            ..cfg
        },
        RouterConfig {
            hidden_size: 5121,
            ..cfg
        },
        RouterConfig {
            n_routed_experts: 1024,
            ..cfg
        },
        RouterConfig {
            num_experts_per_tok: 17,
            ..cfg
        },
        RouterConfig {
            routed_scaling_factor: f32::NAN,
            ..cfg
        },
    ];
    for b in bad {
        assert_eq!(
            Router::new(b).unwrap_err().kind,
            Status::InvalidConfig,
            "{b:?}"
        );
    }

    // Backward: workspace too small, grad_w misaligned; grads untouched.
    let fwd = gpu_forward(s, &router, tokens, &inp);
    let g = upload(s, &random_grad(tokens * 8, &mut Rng::new(3)));
    let mut gx: CudaSlice<bf16> = poisoned(s, tokens * cfg.hidden_size);
    let mut gw: CudaSlice<f32> = poisoned(s, cfg.n_routed_experts * cfg.hidden_size + 1);
    let mut ws_small = s.alloc_zeros::<u8>(16).unwrap();
    let opts = BackwardOptions::default();
    let r = router.backward(
        s,
        tokens,
        &x,
        &w,
        &fwd.dev.topk_idx,
        &fwd.dev.topk_scores,
        &g,
        &mut gx,
        &mut gw,
        opts,
        &mut ws_small,
    );
    expect(r, Status::BufferTooSmall);
    let mut ws = router.alloc_workspace(s, tokens).unwrap();
    let mut gw_off = gw.slice_mut(1..);
    let r = router.backward(
        s,
        tokens,
        &x,
        &w,
        &fwd.dev.topk_idx,
        &fwd.dev.topk_scores,
        &g,
        &mut gx,
        &mut gw_off,
        opts,
        &mut ws,
    );
    expect(r, Status::Misaligned);
    s.synchronize().unwrap();
    let gxh = download(s, &gx);
    assert!(
        gxh.iter().all(|v| v.to_bits() == 0xFFFF),
        "grad_x written on error"
    );
    let gwh = download(s, &gw);
    assert!(
        gwh.iter().all(|v| v.to_bits() == 0xFFFF_FFFF),
        "grad_w written on error"
    );
}

/// The suite's cases; `MOE_ROUTING_SUITE_CASES=name,name,...` keeps only those (e.g. for runs
/// under compute-sanitizer).
fn suite_cases() -> Vec<Case> {
    let path = suite::default_path();
    let cases = suite::load(&path).unwrap_or_else(|e| panic!("suite: {e}"));
    match std::env::var("MOE_ROUTING_SUITE_CASES") {
        Ok(names) => {
            let keep: Vec<&str> = names.split(',').map(str::trim).collect();
            let picked: Vec<Case> = cases
                .into_iter()
                .filter(|c| keep.contains(&c.name.as_str()))
                .collect();
            assert!(
                !picked.is_empty(),
                "MOE_ROUTING_SUITE_CASES={names} names no suite case"
            );
            picked
        }
        Err(_) => cases,
    }
}

fn suite_forward(s: &Arc<CudaStream>) {
    for case in suite_cases() {
        let seed = fresh_seed();
        let router = Router::new(case.config).unwrap();
        let inp = Inputs::random(&case.config, case.tokens, &mut Rng::new(seed));
        let fwd = gpu_forward(s, &router, case.tokens, &inp);
        let (ties, err) = check_forward(
            &case.config,
            case.tokens,
            &inp,
            &fwd,
            &format!("{} seed {seed}", case.name),
        );
        println!("  forward  {:<14} near-tie rows differing: {ties:>3}   weights/scores rel err {err:.2e}", case.name);
    }
}

fn suite_backward(s: &Arc<CudaStream>) {
    for case in suite_cases() {
        let seed = fresh_seed();
        let [d, p] = check_case(s, &case.config, case.tokens, seed, &case.name);
        println!(
            "  backward {:<14} rel err default: grad_x {:.2e} grad_w {:.2e} | precise: grad_x {:.2e} grad_w {:.2e}",
            case.name, d.grad_x, d.grad_w, p.grad_x, p.grad_w
        );
    }
}

/// Random shapes within the supported bounds, GPU against the CPU reference: forward indices,
/// both precisions, accumulate on and off. The seed of a failing case is in its message.
fn randomized_equivalence(s: &Arc<CudaStream>) {
    let base_seed = fresh_seed();
    let mut rng = Rng::new(base_seed);
    let shapes = [
        (5120, 160),
        (7168, 256),
        (2048, 64),
        (1024, 128),
        (256, 32),
        (72, 512),
    ];
    for case in 0..24 {
        let (hidden_size, n_routed_experts) = shapes[rng.below(shapes.len())];
        // Groups of at least 2 experts that divide E.
        let groups: Vec<usize> = (1..=n_routed_experts)
            .filter(|g| n_routed_experts % g == 0 && (*g == 1 || n_routed_experts / g >= 2))
            .filter(|g| *g <= 64)
            .collect();
        let n_group = groups[rng.below(groups.len())];
        let topk_group = 1 + rng.below(n_group);
        let candidates = topk_group * (n_routed_experts / n_group);
        let num_experts_per_tok = 1 + rng.below(candidates.min(16));
        let cfg = RouterConfig {
            hidden_size,
            n_routed_experts,
            num_experts_per_tok,
            n_group,
            topk_group,
            routed_scaling_factor: [1.0, 2.5, 0.5][rng.below(3)],
            norm_topk_prob: rng.below(2) == 1,
        };
        let tokens = [1, 7, 127, 129, 1 + rng.below(1500)][case % 5];
        let seed = rng.next_u64();
        let label = format!("random case {case} {cfg:?} T={tokens} seed {seed} (base {base_seed})");
        check_case(s, &cfg, tokens, seed, &label);
    }
}

/// NaN and Inf in x, w, bias and the incoming gradient. Selection: a NaN score ranks below
/// every number and a token whose scores are all NaN still gets K distinct experts; indices
/// must equal the reference's (near ties aside). Weights: equal where the reference's are
/// finite, NaN where they are NaN. A NaN gradient makes exactly the reference's grad_x rows
/// and grad_w rows NaN.
fn extreme_inputs(s: &Arc<CudaStream>) {
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    for cfg in [RouterConfig::glm45(8, 4), RouterConfig::glm45(1, 1)] {
        let router = Router::new(cfg).unwrap();
        let (h, k) = (cfg.hidden_size, cfg.num_experts_per_tok);
        let tokens = 300;
        let mut inp = Inputs::random(&cfg, tokens, &mut rng);
        let nan = bf16::from_f32(f32::NAN);
        for t in 0..4 {
            inp.x[t * h..(t + 1) * h].fill(nan); // all scores NaN
        }
        inp.x[10 * h + 3] = bf16::from_f32(f32::INFINITY);
        inp.x[11 * h + 5] = bf16::from_f32(f32::NEG_INFINITY);
        inp.w[7 * h..8 * h].fill(nan); // expert 7: NaN score for every token
        inp.bias[20] = f32::NAN;
        inp.bias[21] = f32::INFINITY;
        inp.bias[22] = f32::NEG_INFINITY;
        let label = format!("extreme {cfg:?} seed {seed}");
        let got = gpu_forward(s, &router, tokens, &inp);
        let want = reference::forward(&cfg, tokens, &inp.x, &inp.w, &inp.bias);
        for t in 0..tokens {
            let (g, r) = (
                &got.idx[t * k..(t + 1) * k],
                &want.topk_idx[t * k..(t + 1) * k],
            );
            assert!(
                g == r || want.near_tie[t],
                "{label}: token {t}: {g:?} vs {r:?}"
            );
            if g != r {
                continue;
            }
            for j in t * k..(t + 1) * k {
                let (a, b) = (got.weights[j], want.topk_weights[j]);
                if b.is_nan() {
                    assert!(a.is_nan(), "{label}: token {t}: weight {a}, reference NaN");
                } else {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1e-6),
                        "{label}: token {t}: {a} vs {b}"
                    );
                }
            }
        }
        // Expert 7 (NaN for every token) and expert 20 (NaN bias) are never chosen over finite
        // candidates; expert 21 (bias +inf: its group's score is +inf, so kept) always is.
        for t in 4..tokens {
            let row = &got.idx[t * k..(t + 1) * k];
            assert!(
                row.contains(&21) && !row.contains(&7) && !row.contains(&20),
                "{label}: token {t} chose a NaN expert: {row:?}"
            );
        }

        // Backward on finite x with NaN in the incoming gradient of a few tokens.
        let clean = Inputs::random(&cfg, tokens, &mut rng);
        let fwd = gpu_forward(s, &router, tokens, &clean);
        let mut grad_out = random_grad(tokens * k, &mut rng);
        grad_out[5 * k + 2] = f32::NAN;
        grad_out[9 * k] = f32::INFINITY;
        for precision in [Precision::Default, Precision::Precise] {
            let opts = BackwardOptions {
                accumulate_grad_w: false,
                precision,
            };
            let g = gpu_backward(
                s,
                &router,
                tokens,
                &clean,
                &fwd.dev.topk_idx,
                &fwd.dev.topk_scores,
                &grad_out,
                opts,
                None,
            );
            let r = reference::backward(
                &cfg,
                tokens,
                &clean.x,
                &clean.w,
                &fwd.idx[..tokens * k],
                &fwd.scores[..tokens * k],
                &grad_out,
            );
            let nan_rows = |v: &[f64], width: usize| -> Vec<bool> {
                v.chunks(width)
                    .map(|row| row.iter().any(|a| !a.is_finite()))
                    .collect()
            };
            assert_eq!(
                nan_rows(&g.grad_x, h),
                nan_rows(&r.grad_x, h),
                "{label} {precision:?}: grad_x non-finite rows"
            );
            assert_eq!(
                nan_rows(&g.grad_w, h),
                nan_rows(&r.grad_w, h),
                "{label} {precision:?}: grad_w non-finite rows"
            );
        }
    }
}

/// Forward and backward (both precisions) captured into a CUDA graph in global capture mode
/// (what PyTorch's CUDA graphs use) and replayed twice: each replay gives the same bits as the
/// direct calls.
fn graph_capture(_: &Arc<CudaStream>) {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let ctx = CudaContext::new(0).unwrap();
    // SAFETY: every buffer below is allocated and used on the one stream `s`: no cross-stream
    // ordering is needed, and no event may be recorded outside the capture.
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().unwrap();
    let cfg = RouterConfig::glm45(8, 4);
    let (tokens, k) = (3001, cfg.num_experts_per_tok);
    let (th, eh) = (
        tokens * cfg.hidden_size,
        cfg.n_routed_experts * cfg.hidden_size,
    );
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    let router = Router::new(cfg).unwrap();
    let inp = Inputs::random(&cfg, tokens, &mut rng);
    let (x, w, bias) = (
        upload(&s, &inp.x),
        upload(&s, &inp.w),
        upload(&s, &inp.bias),
    );
    let g = upload(&s, &random_grad(tokens * k, &mut rng));
    let mut out = Routing {
        topk_idx: poisoned(&s, tokens * k),
        topk_weights: poisoned(&s, tokens * k),
        topk_scores: poisoned(&s, tokens * k),
    };
    let mut gx: [CudaSlice<bf16>; 2] = [poisoned(&s, th), poisoned(&s, th)];
    let mut gw: [CudaSlice<f32>; 2] = [poisoned(&s, eh), poisoned(&s, eh)];
    let mut ws = router.alloc_workspace(&s, tokens).unwrap();

    let mut step = |out: &mut Routing,
                    gx: &mut [CudaSlice<bf16>; 2],
                    gw: &mut [CudaSlice<f32>; 2]|
     -> Result<(), moe_routing::Error> {
        router.forward(&s, tokens, &x, &w, &bias, out)?;
        for (i, precision) in [Precision::Default, Precision::Precise]
            .into_iter()
            .enumerate()
        {
            let opts = BackwardOptions {
                accumulate_grad_w: false,
                precision,
            };
            router.backward(
                &s,
                tokens,
                &x,
                &w,
                &out.topk_idx,
                &out.topk_scores,
                &g,
                &mut gx[i],
                &mut gw[i],
                opts,
                &mut ws,
            )?;
        }
        Ok(())
    };
    let snapshot = |out: &Routing, gx: &[CudaSlice<bf16>; 2], gw: &[CudaSlice<f32>; 2]| {
        s.synchronize().unwrap();
        [
            bits(&download(&s, &out.topk_idx)),
            bits(&download(&s, &out.topk_weights)),
            bits(&download(&s, &out.topk_scores)),
            bits(&download(&s, &gx[0])),
            bits(&download(&s, &gx[1])),
            bits(&download(&s, &gw[0])),
            bits(&download(&s, &gw[1])),
        ]
    };

    step(&mut out, &mut gx, &mut gw).unwrap();
    let want = snapshot(&out, &gx, &gw);

    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    let captured = step(&mut out, &mut gx, &mut gw);
    let graph = s.end_capture(CUgraphInstantiate_flags(0));
    captured.unwrap_or_else(|e| panic!("call under capture failed: {e}"));
    let graph = graph
        .unwrap_or_else(|e| panic!("capture failed: {e:?}"))
        .expect("empty graph");
    let names = [
        "topk_idx",
        "topk_weights",
        "topk_scores",
        "grad_x",
        "grad_x (precise)",
        "grad_w",
        "grad_w (precise)",
    ];
    for replay in 0..2 {
        poison(&s, &mut out.topk_idx);
        poison(&s, &mut out.topk_weights);
        poison(&s, &mut out.topk_scores);
        gx.iter_mut().for_each(|d| poison(&s, d));
        gw.iter_mut().for_each(|d| poison(&s, d));
        graph.launch().unwrap();
        let got = snapshot(&out, &gx, &gw);
        for (i, name) in names.iter().enumerate() {
            assert!(
                got[i] == want[i],
                "replay {replay}: {name} differs from the direct call (seed {seed})"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// The fused forward (E = 64, 128, 160, 256): token and hidden tails, cluster splits, groups.

fn fused_configs() -> Vec<(RouterConfig, usize)> {
    let glm = RouterConfig::glm45;
    vec![
        (glm(8, 4), 1),
        (glm(1, 1), 7),
        (glm(4, 2), 127),
        (glm(16, 8), 129),
        (glm(8, 4), 3001),
        (glm(1, 1), 5000),
        // Group shapes and top-k the epilogue handles (n_group <= 32, K <= 16), no norm.
        (
            RouterConfig {
                n_group: 32,
                topk_group: 5,
                num_experts_per_tok: 16,
                ..glm(1, 1)
            },
            300,
        ),
        (
            RouterConfig {
                n_group: 5,
                topk_group: 2,
                num_experts_per_tok: 1,
                ..glm(1, 1)
            },
            257,
        ),
        (
            RouterConfig {
                n_group: 20,
                topk_group: 3,
                norm_topk_prob: false,
                ..glm(1, 1)
            },
            200,
        ),
        // 192-token tiles (E = 160, H200 plan): unsplit with K > 8 (192 rows through the 8-lane
        // routing), and in pairs with 20 groups (96 rows per CTA, few lanes per token).
        (
            RouterConfig {
                n_group: 32,
                topk_group: 5,
                num_experts_per_tok: 16,
                ..glm(1, 1)
            },
            20000,
        ),
        (
            RouterConfig {
                n_group: 20,
                topk_group: 3,
                norm_topk_prob: false,
                ..glm(1, 1)
            },
            10007,
        ),
        // Hidden tails: not a multiple of the 64-wide block (TMA zero fill), and tiny (split 1).
        (
            RouterConfig {
                hidden_size: 5000,
                ..glm(8, 4)
            },
            1000,
        ),
        (
            RouterConfig {
                hidden_size: 72,
                ..glm(4, 2)
            },
            130,
        ),
        (
            RouterConfig {
                hidden_size: 7168,
                ..glm(8, 4)
            },
            600,
        ),
        // The other instantiations: E = 256 (DeepSeek-V3: H 7168, 8 groups keep 4), 128, 64.
        (
            RouterConfig {
                n_routed_experts: 256,
                hidden_size: 7168,
                ..glm(8, 4)
            },
            3001,
        ),
        (
            RouterConfig {
                n_routed_experts: 256,
                num_experts_per_tok: 16,
                ..glm(32, 7)
            },
            129,
        ),
        (
            RouterConfig {
                n_routed_experts: 128,
                ..glm(4, 2)
            },
            1000,
        ),
        (
            RouterConfig {
                n_routed_experts: 64,
                hidden_size: 2048,
                ..glm(8, 3)
            },
            513,
        ),
    ]
}

fn forward_fused_shapes(s: &Arc<CudaStream>) {
    for (i, (cfg, tokens)) in fused_configs().into_iter().enumerate() {
        let seed = fresh_seed() ^ (i as u64) << 16;
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
        let fwd = gpu_forward(s, &router, tokens, &inp);
        let (ties, err) = check_forward(
            &cfg,
            tokens,
            &inp,
            &fwd,
            &format!("{cfg:?} T={tokens} seed {seed}"),
        );
        println!(
            "  H={:<5} T={tokens:<5} groups {:>2}/{:<2} K={:<2} near-tie rows differing {ties:>2}, rel err {err:.1e}",
            cfg.hidden_size, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
        );
    }
}

/// The launch plan is per expert count: 192-token tiles exist for E = 160 alone, so a process
/// that routes with E = 160 and then with E = 256 must not plan the second with the first's
/// tiles (at T = 10007 the E = 160 plan takes 192-token tiles).
fn forward_plans_per_expert_count(s: &Arc<CudaStream>) {
    let e160 = RouterConfig::glm45(8, 4);
    let e256 = RouterConfig {
        n_routed_experts: 256,
        ..RouterConfig::glm45(8, 4)
    };
    for (cfg, tokens) in [(e160, 10007), (e256, 10007), (e160, 10007)] {
        let seed = fresh_seed();
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
        let fwd = gpu_forward(s, &router, tokens, &inp);
        let label = format!("E={} T={tokens} seed {seed}", cfg.n_routed_experts);
        let (ties, err) = check_forward(&cfg, tokens, &inp, &fwd, &label);
        println!("  {label}: near-tie rows differing {ties}, rel err {err:.1e}");
    }
}

/// Exact ties and NaN, on the fused path (E = 160, 256) and the simple one (E = 96): every expert
/// has the same weight row, so scores tie exactly unless the bias or a NaN separates them.
///   - ties: equal values rank the lower expert index first (experts and groups);
///   - a token whose scores are all NaN gets the K lowest indices (of the first groups);
///   - a NaN score is never chosen over a finite one.
fn forward_ties_and_nan(s: &Arc<CudaStream>) {
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    // E = 96 has no fused instantiation: the simple path.
    let small = RouterConfig {
        hidden_size: 256,
        n_routed_experts: 96,
        num_experts_per_tok: 8,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
    };
    let configs = [
        RouterConfig::glm45(1, 1),
        RouterConfig::glm45(8, 4),
        RouterConfig::glm45(16, 8),
        RouterConfig {
            n_routed_experts: 256,
            hidden_size: 7168,
            ..RouterConfig::glm45(8, 4)
        },
        small,
        RouterConfig {
            n_group: 8,
            topk_group: 4,
            ..small
        },
    ];
    for cfg in configs {
        let (h, e, k) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
        );
        let label = format!("{cfg:?} seed {seed}");
        let router = Router::new(cfg).unwrap();
        let tokens = 131; // two tiles, the second a tail
        let mut inp = Inputs::random(&cfg, tokens, &mut rng);
        let row: Vec<bf16> = inp.w[..h].to_vec();
        for ex in 0..e {
            inp.w[ex * h..(ex + 1) * h].copy_from_slice(&row);
        }
        // Boosted experts, in distinct groups (8 or 16 groups), in increasing index order.
        let boosted = [e / 8 + 1, 3 * e / 8 + 2, e - 1];
        inp.bias.fill(0.0);
        for &b in &boosted {
            inp.bias[b] = 0.5;
        }
        let nan = bf16::from_f32(f32::NAN);
        inp.x[..h].fill(nan); // token 0: all scores NaN
        let got = gpu_forward(s, &router, tokens, &inp);
        let want = reference::forward(&cfg, tokens, &inp.x, &inp.w, &inp.bias);
        let as_i32 = |v: &[usize]| v.iter().map(|&a| a as i32).collect::<Vec<_>>();
        // Token 0 (all NaN): the first kept groups are 0.. (group scores all NaN, tie), so the
        // K lowest indices.
        let nan_row = as_i32(&(0..k).collect::<Vec<_>>());
        assert_eq!(&got.idx[..k], &nan_row[..], "{label}: all-NaN token");
        assert_eq!(
            &want.topk_idx[..k],
            &nan_row[..],
            "{label}: reference, all-NaN token"
        );
        // Other tokens: the boosted experts (ties among them by index), then the lowest
        // indices of the kept groups; the boosted experts' groups rank first, then the lowest
        // group indices, so with K = 8 the rest come from group 0.
        let mut expect = boosted.to_vec();
        expect.extend(
            (0..e)
                .filter(|x| !boosted.contains(x))
                .take(k - boosted.len()),
        );
        let expect = as_i32(&expect);
        for t in 1..tokens {
            let g = &got.idx[t * k..(t + 1) * k];
            assert_eq!(g, &expect[..], "{label}: token {t}");
            assert_eq!(
                &want.topk_idx[t * k..(t + 1) * k],
                &expect[..],
                "{label}: reference"
            );
            assert!(got.weights[t * k..(t + 1) * k]
                .iter()
                .all(|w| w.is_finite()));
        }

        // NaN never beats a finite score: experts 0..4 get NaN scores (their weight rows).
        let mut inp2 = Inputs::random(&cfg, tokens, &mut rng);
        for ex in 0..e {
            inp2.w[ex * h..(ex + 1) * h].copy_from_slice(&row);
        }
        inp2.bias.fill(0.0);
        inp2.w[..4 * h].fill(nan);
        let got = gpu_forward(s, &router, tokens, &inp2);
        let expect = as_i32(&(4..4 + k).collect::<Vec<_>>());
        for t in 0..tokens {
            assert_eq!(
                &got.idx[t * k..(t + 1) * k],
                &expect[..],
                "{label}: NaN experts, token {t}"
            );
        }
    }
}

/// The selection of one token from its choice values `c` (f32, as the kernels add score and
/// bias), by the kernels' rules: larger first, lower index on ties; groups ranked by the f32
/// sum of their two best members, lower group on ties. Returns the experts in rank order.
fn select_f32(cfg: &RouterConfig, c: &[f32]) -> Vec<i32> {
    let e = c.len();
    let by = |a: &usize, b: &usize| c[*b].total_cmp(&c[*a]).then(a.cmp(b));
    let mut cands: Vec<usize> = if cfg.n_group > 1 {
        let per = e / cfg.n_group;
        let score: Vec<f32> = (0..cfg.n_group)
            .map(|g| {
                let mut m: Vec<usize> = (g * per..(g + 1) * per).collect();
                m.sort_by(by);
                c[m[0]] + c[m[1]]
            })
            .collect();
        let mut groups: Vec<usize> = (0..cfg.n_group).collect();
        groups.sort_by(|a, b| score[*b].total_cmp(&score[*a]).then(a.cmp(b)));
        groups[..cfg.topk_group]
            .iter()
            .flat_map(|&g| g * per..(g + 1) * per)
            .collect()
    } else {
        (0..e).collect()
    };
    cands.sort_by(by);
    cands[..cfg.num_experts_per_tok]
        .iter()
        .map(|&i| i as i32)
        .collect()
}

/// Near ties below the reference's tolerance, decided exactly: choice values that differ only
/// in their last bits, and exact ties. Every expert has the same weight row, so a token's
/// scores are all equal; the bias, m · 2^-24 with m random below a range (256, 4096 or
/// 65536), sets the choice values s + bias. The expected selection is computed from the
/// kernel's own score (read back) in f32, so indices must match exactly (no near-tie
/// exemption), at every lanes-per-token shape of the fused routing (8 to 128 tokens per CTA)
/// and with groups.
fn forward_near_ties_exact(s: &Arc<CudaStream>) {
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    let configs = [
        RouterConfig::glm45(1, 1),
        RouterConfig::glm45(8, 4),
        RouterConfig {
            num_experts_per_tok: 4,
            ..RouterConfig::glm45(1, 1)
        },
        RouterConfig {
            num_experts_per_tok: 6,
            ..RouterConfig::glm45(4, 2)
        },
        RouterConfig {
            n_routed_experts: 256,
            hidden_size: 7168,
            ..RouterConfig::glm45(8, 4)
        },
    ];
    let mut rows = 0usize;
    for (ci, cfg) in configs.iter().enumerate() {
        let (h, e, k) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
        );
        let router = Router::new(*cfg).unwrap();
        let token_counts: &[usize] = if ci < 2 {
            &[131, 2048, 4096, 16384]
        } else {
            &[131, 4096]
        };
        for (ti, &tokens) in token_counts.iter().enumerate() {
            let range = [256u32, 4096, 1 << 16][(ci + ti) % 3];
            let label = format!("{cfg:?} T={tokens} bias range {range} seed {seed}");
            let mut inp = Inputs::random(cfg, tokens, &mut rng);
            let row: Vec<bf16> = inp.w[..h].to_vec();
            for ex in 0..e {
                inp.w[ex * h..(ex + 1) * h].copy_from_slice(&row);
            }
            for b in inp.bias.iter_mut() {
                *b = (rng.next_u64() % u64::from(range)) as f32 * (1.0 / 16_777_216.0);
            }
            let got = gpu_forward(s, &router, tokens, &inp);
            for t in 0..tokens {
                let sc = &got.scores[t * k..(t + 1) * k];
                assert!(
                    sc.iter().all(|v| v.to_bits() == sc[0].to_bits()),
                    "{label}: token {t}: scores {sc:?} differ (equal weight rows)"
                );
                let c: Vec<f32> = inp.bias.iter().map(|&b| sc[0] + b).collect();
                let want = select_f32(cfg, &c);
                assert_eq!(
                    &got.idx[t * k..(t + 1) * k],
                    &want[..],
                    "{label}: token {t}"
                );
            }
            rows += tokens;
        }
    }
    println!("  {rows} rows, indices equal to the f32 selection");
}

/// Full scores and expert counts: off by default, and when on they neither change the
/// top-k outputs (bit for bit) nor disagree with them; scores against f64 logits.
fn forward_optional_outputs(s: &Arc<CudaStream>) {
    let small = RouterConfig {
        hidden_size: 256,
        n_routed_experts: 96, // no fused instantiation: the simple path
        num_experts_per_tok: 6,
        n_group: 8,
        topk_group: 3,
        routed_scaling_factor: 1.5,
        norm_topk_prob: true,
    };
    // The fused forward writes the full scores from its split sum (clusters of 2 to 16, rows
    // per CTA uneven for 3 and 6) and, without a split, from the scores in shared memory; the
    // tokens pick each (H200 plan).
    for (cfg, tokens) in [
        (RouterConfig::glm45(8, 4), 3001),  // clusters of 4
        (RouterConfig::glm45(4, 2), 6000),  // clusters of 2
        (RouterConfig::glm45(1, 1), 4096),  // clusters of 3
        (RouterConfig::glm45(8, 4), 2048),  // clusters of 6
        (RouterConfig::glm45(8, 4), 1000),  // clusters of 8
        (RouterConfig::glm45(1, 1), 5),     // clusters of 16
        (RouterConfig::glm45(1, 1), 16384), // no split
        (RouterConfig::glm45(16, 8), 5000), // 192-token tiles in clusters of 4
        (RouterConfig::glm45(8, 3), 20000), // 192-token tiles, no split
        (small, 129),
    ] {
        let seed = fresh_seed();
        let (h, e, k) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
        );
        let label = format!("{cfg:?} T={tokens} seed {seed}");
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
        let plain = gpu_forward(s, &router, tokens, &inp);
        let (x, w, bias) = (upload(s, &inp.x), upload(s, &inp.w), upload(s, &inp.bias));
        let mut out = Routing {
            topk_idx: poisoned(s, tokens * k),
            topk_weights: poisoned(s, tokens * k),
            topk_scores: poisoned(s, tokens * k),
        };
        let mut scores = poisoned::<f32>(s, tokens * e);
        let mut counts = poisoned::<i32>(s, e);
        let extras = ForwardExtras {
            scores: Some(&mut scores),
            expert_counts: Some(&mut counts),
        };
        router
            .forward_with(s, tokens, &x, &w, &bias, &mut out, extras)
            .unwrap();
        s.synchronize().unwrap();
        let idx = download(s, &out.topk_idx);
        let wts = download(s, &out.topk_weights);
        let sc = download(s, &out.topk_scores);
        assert_eq!(idx, plain.idx, "{label}: topk_idx with extras");
        assert_eq!(
            bits(&wts),
            bits(&plain.weights),
            "{label}: topk_weights with extras"
        );
        assert_eq!(
            bits(&sc),
            bits(&plain.scores),
            "{label}: topk_scores with extras"
        );
        let full = download(s, &scores);
        let cnt = download(s, &counts);
        let mut want_cnt = vec![0i32; e];
        for &i in &idx {
            want_cnt[i as usize] += 1;
        }
        assert_eq!(cnt, want_cnt, "{label}: expert counts");
        let mut worst = 0.0f64;
        for t in 0..tokens {
            for j in 0..k {
                let ex = idx[t * k + j] as usize;
                assert_eq!(
                    full[t * e + ex].to_bits(),
                    sc[t * k + j].to_bits(),
                    "{label}: t {t}"
                );
            }
            if t >= 300 {
                continue; // f64 logits of the first 300 tokens suffice
            }
            for ex in 0..e {
                let logit: f64 = (0..h)
                    .map(|i| inp.x[t * h + i].to_f64() * inp.w[ex * h + i].to_f64())
                    .sum();
                let want = 1.0 / (1.0 + (-logit).exp());
                worst = worst.max((full[t * e + ex] as f64 - want).abs());
            }
        }
        assert!(worst < 1e-4, "{label}: scores abs err {worst:e}");
    }
}

/// Same inputs, same bits: the cluster reduction sums the partial logits in a fixed order.
fn forward_is_deterministic(s: &Arc<CudaStream>) {
    for (cfg, tokens) in [
        (RouterConfig::glm45(8, 4), 512),
        (RouterConfig::glm45(4, 2), 10007),
        (RouterConfig::glm45(1, 1), 20000),
    ] {
        let seed = fresh_seed();
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
        let a = gpu_forward(s, &router, tokens, &inp);
        let b = gpu_forward(s, &router, tokens, &inp);
        assert_eq!(a.idx, b.idx, "T={tokens} seed {seed}");
        assert_eq!(bits(&a.weights), bits(&b.weights), "T={tokens} seed {seed}");
        assert_eq!(bits(&a.scores), bits(&b.scores), "T={tokens} seed {seed}");
    }
}

/// Forward then backward through the public Rust API, each against the f64 reference
/// (reference::forward, reference::backward), on the fused paths of both.
fn round_trip(s: &Arc<CudaStream>) {
    for (cfg, tokens) in [
        (RouterConfig::glm45(8, 4), 3001),
        (RouterConfig::glm45(1, 1), 129),
    ] {
        let seed = fresh_seed();
        let [d, p] = check_case(
            s,
            &cfg,
            tokens,
            seed,
            &format!("round trip {cfg:?} T={tokens}"),
        );
        println!(
            "  T={tokens:<5} groups {}/{}: grad_x {:.1e} grad_w {:.1e} | precise {:.1e} {:.1e}",
            cfg.n_group, cfg.topk_group, d.grad_x, d.grad_w, p.grad_x, p.grad_w
        );
    }
}

/// Forward + backward of two different batches on two streams at once (enqueued interleaved,
/// several times over) give the same bits as each run alone.
fn two_streams(_: &Arc<CudaStream>) {
    let ctx = CudaContext::new(0).unwrap();
    let streams = [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
    let cfg = RouterConfig::glm45(8, 4);
    let router = Router::new(cfg).unwrap();
    let (tokens, k) = (8192 + 77, cfg.num_experts_per_tok);
    let (th, eh) = (
        tokens * cfg.hidden_size,
        cfg.n_routed_experts * cfg.hidden_size,
    );
    let seed = fresh_seed();
    struct Job {
        x: CudaSlice<bf16>,
        w: CudaSlice<bf16>,
        bias: CudaSlice<f32>,
        g: CudaSlice<f32>,
        out: Routing,
        gx: CudaSlice<bf16>,
        gw: CudaSlice<f32>,
        ws: CudaSlice<u8>,
    }
    let mut jobs: Vec<Job> = streams
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut rng = Rng::new(seed + i as u64);
            let inp = Inputs::random(&cfg, tokens, &mut rng);
            Job {
                x: upload(s, &inp.x),
                w: upload(s, &inp.w),
                bias: upload(s, &inp.bias),
                g: upload(s, &random_grad(tokens * k, &mut rng)),
                out: Routing {
                    topk_idx: poisoned(s, tokens * k),
                    topk_weights: poisoned(s, tokens * k),
                    topk_scores: poisoned(s, tokens * k),
                },
                gx: poisoned(s, th),
                gw: poisoned(s, eh),
                ws: router.alloc_workspace(s, tokens).unwrap(),
            }
        })
        .collect();
    let step = |s: &Arc<CudaStream>, j: &mut Job| {
        router
            .forward(s, tokens, &j.x, &j.w, &j.bias, &mut j.out)
            .unwrap();
        router
            .backward(
                s,
                tokens,
                &j.x,
                &j.w,
                &j.out.topk_idx,
                &j.out.topk_scores,
                &j.g,
                &mut j.gx,
                &mut j.gw,
                BackwardOptions::default(),
                &mut j.ws,
            )
            .unwrap();
    };
    let snapshot = |s: &Arc<CudaStream>, j: &Job| -> Vec<Vec<u64>> {
        s.synchronize().unwrap();
        vec![
            bits(&download(s, &j.out.topk_idx)),
            bits(&download(s, &j.out.topk_weights)),
            bits(&download(s, &j.gx)),
            bits(&download(s, &j.gw)),
        ]
    };
    let alone: Vec<_> = streams
        .iter()
        .zip(jobs.iter_mut())
        .map(|(s, j)| {
            step(s, j);
            snapshot(s, j)
        })
        .collect();
    for (s, j) in streams.iter().zip(jobs.iter_mut()) {
        poison(s, &mut j.out.topk_idx);
        poison(s, &mut j.gx);
        poison(s, &mut j.gw);
    }
    for _ in 0..3 {
        for (s, j) in streams.iter().zip(jobs.iter_mut()) {
            step(s, j);
        }
    }
    for (i, (s, j)) in streams.iter().zip(&jobs).enumerate() {
        let got = snapshot(s, j);
        for (name, (a, b)) in ["topk_idx", "topk_weights", "grad_x", "grad_w"]
            .iter()
            .zip(got.iter().zip(&alone[i]))
        {
            assert!(
                a == b,
                "stream {i}: {name} differs from the run alone (seed {seed})"
            );
        }
    }
}

/// T·H above 2³¹ elements (T = 450000, H = 5120): 64-bit indexing in every kernel. The
/// forward is checked on sampled tokens (among them the last ones and those past 2³¹/H); the
/// incoming gradient is nonzero only on those tokens, so that the f64 reference of the sample
/// gives grad_w exactly, every other grad_x row must come out exactly zero, and poisoned
/// outputs show any row left unwritten.
fn huge_batch(s: &Arc<CudaStream>) {
    let cfg = RouterConfig::glm45(8, 4);
    let (h, k) = (cfg.hidden_size, cfg.num_experts_per_tok);
    let tokens = 450_000usize;
    assert!(tokens * h > 1usize << 31);
    let seed = fresh_seed();
    let label = format!("huge batch T={tokens} seed {seed}");
    let mut rng = Rng::new(seed);
    let small = Inputs::random(&cfg, 0, &mut rng);
    // x in parallel, one seeded stream per chunk of rows.
    let mut x = vec![bf16::ZERO; tokens * h];
    let rows_per_chunk = 4096;
    std::thread::scope(|scope| {
        for (c, chunk) in x.chunks_mut(rows_per_chunk * h).enumerate() {
            scope.spawn(move || {
                let mut r = Rng::new(seed ^ (0xA5A5_0000 + c as u64));
                chunk
                    .iter_mut()
                    .for_each(|v| *v = bf16::from_f32(r.uniform()));
            });
        }
    });
    let mut sample: Vec<usize> = (0..32).map(|_| rng.below(tokens)).collect();
    let past = (1usize << 31) / h; // first token whose elements lie past 2³¹
    sample.extend([past - 1, past, past + 1]);
    sample.extend(tokens - 16..tokens);
    sample.sort_unstable();
    sample.dedup();
    let n = sample.len();

    let (xd, wd, bd) = (upload(s, &x), upload(s, &small.w), upload(s, &small.bias));
    let mut out = Routing {
        topk_idx: poisoned(s, tokens * k),
        topk_weights: poisoned(s, tokens * k),
        topk_scores: poisoned(s, tokens * k),
    };
    router_forward(s, &cfg, tokens, &xd, &wd, &bd, &mut out);
    let idx = download(s, &out.topk_idx);
    let weights = download(s, &out.topk_weights);
    let scores = download(s, &out.topk_scores);
    assert!(
        idx.iter()
            .all(|&i| i >= 0 && (i as usize) < cfg.n_routed_experts),
        "{label}: index out of range"
    );
    assert!(
        weights.iter().all(|v| v.is_finite()),
        "{label}: weights not all written"
    );

    let sub_x: Vec<bf16> = sample
        .iter()
        .flat_map(|&t| x[t * h..(t + 1) * h].iter().copied())
        .collect();
    let want = reference::forward(&cfg, n, &sub_x, &small.w, &small.bias);
    let pick = |v: &[i32]| -> Vec<i32> {
        sample
            .iter()
            .flat_map(|&t| v[t * k..(t + 1) * k].to_vec())
            .collect()
    };
    let pickf = |v: &[f32]| -> Vec<f32> {
        sample
            .iter()
            .flat_map(|&t| v[t * k..(t + 1) * k].to_vec())
            .collect()
    };
    let (sub_idx, sub_scores) = (pick(&idx), pickf(&scores));
    for (r, &t) in sample.iter().enumerate() {
        let (g, w) = (
            &sub_idx[r * k..(r + 1) * k],
            &want.topk_idx[r * k..(r + 1) * k],
        );
        assert!(
            g == w || want.near_tie[r],
            "{label}: token {t}: indices {g:?}, reference {w:?}"
        );
    }

    // Backward: gradient only on the sampled tokens.
    let mut grad_out = vec![0.0f32; tokens * k];
    let sub_grad = random_grad(n * k, &mut rng);
    for (r, &t) in sample.iter().enumerate() {
        grad_out[t * k..(t + 1) * k].copy_from_slice(&sub_grad[r * k..(r + 1) * k]);
    }
    let gd = upload(s, &grad_out);
    let want = reference::backward(&cfg, n, &sub_x, &small.w, &sub_idx, &sub_scores, &sub_grad);
    let eh = cfg.n_routed_experts * h;
    let mut ws = Router::new(cfg)
        .unwrap()
        .alloc_workspace(s, tokens)
        .unwrap();
    for precision in [Precision::Default, Precision::Precise] {
        let (tol_x, tol_w) = match precision {
            Precision::Precise => (PRECISE_GRAD_X_TOL, PRECISE_GRAD_W_TOL),
            Precision::Default | Precision::TorchBf16 => (GRAD_X_TOL, GRAD_W_TOL),
        };
        let mut gx: CudaSlice<bf16> = poisoned(s, tokens * h);
        let mut gw: CudaSlice<f32> = poisoned(s, eh);
        let opts = BackwardOptions {
            accumulate_grad_w: false,
            precision,
        };
        Router::new(cfg)
            .unwrap()
            .backward(
                s,
                tokens,
                &xd,
                &wd,
                &out.topk_idx,
                &out.topk_scores,
                &gd,
                &mut gx,
                &mut gw,
                opts,
                &mut ws,
            )
            .unwrap();
        s.synchronize().unwrap();
        let gx = download(s, &gx);
        let mut in_sample = vec![false; tokens];
        sample.iter().for_each(|&t| in_sample[t] = true);
        let stray = (0..tokens).filter(|&t| !in_sample[t]).find(|&t| {
            gx[t * h..(t + 1) * h]
                .iter()
                .any(|v| v.to_bits() & 0x7fff != 0)
        });
        assert!(
            stray.is_none(),
            "{label} {precision:?}: grad_x row {stray:?} should be zero"
        );
        let sub_gx: Vec<f64> = sample
            .iter()
            .flat_map(|&t| bf16_to_f64(&gx[t * h..(t + 1) * h]))
            .collect();
        let ex = reference::rel_err(&sub_gx, &want.grad_x);
        let ew = reference::rel_err(&to_f64(&download(s, &gw)), &want.grad_w);
        println!("  {precision:?}: sampled grad_x rel err {ex:.2e}, grad_w {ew:.2e} ({n} tokens sampled)");
        assert!(
            ex <= tol_x && ew <= tol_w,
            "{label} {precision:?}: grad_x {ex:e}, grad_w {ew:e}"
        );
    }
}

fn router_forward(
    s: &Arc<CudaStream>,
    cfg: &RouterConfig,
    tokens: usize,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    bias: &CudaSlice<f32>,
    out: &mut Routing,
) {
    Router::new(*cfg)
        .unwrap()
        .forward(s, tokens, x, w, bias, out)
        .unwrap();
    s.synchronize().unwrap();
}
