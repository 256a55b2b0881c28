//! GPU tests: the CUDA kernels against the f64 CPU reference, on every suite case and on
//! small shapes, plus validation, determinism and the zero-token case. The tests live in
//! `gpu/` by subject (forward, backward, dtypes, api); this file holds the harness and the
//! helpers they share.
//!
//! Own harness: with no CUDA device every test reports "skipped" (never "passed").
//! `gpu [FILTER]` runs the tests whose name contains FILTER.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moe_routing::reference;
use moe_routing::{
    cuda_device_count, BackwardOptions, ForwardExtras, Precision, Router, RouterConfig, Routing,
    Status,
};
use moe_routing_dev::suite::{self, Case};
use moe_routing_dev::testing::{bf16_to_f64, fresh_seed, random_grad, to_f64, Inputs, Rng};

const GRAD_X_TOL: f64 = 1e-2;
const GRAD_W_TOL: f64 = 5e-3;
const PRECISE_GRAD_X_TOL: f64 = 4e-3;
const PRECISE_GRAD_W_TOL: f64 = 1e-5;

#[path = "gpu/api.rs"]
mod api;
#[path = "gpu/backward.rs"]
mod backward;
#[path = "gpu/dtypes.rs"]
mod dtypes;
#[path = "gpu/forward.rs"]
mod forward;

type Test = (&'static str, fn(&Arc<CudaStream>));

fn main() {
    // The wide fused backward takes more than 256 experts by default, and more than 8 a token
    // at up to 256 experts only with MOE_ROUTING_WIDE_BACKWARD=1: these tests turn it on for
    // every wide shape, unless the environment says otherwise (=0 tests them all on the simple
    // path).
    if std::env::var_os("MOE_ROUTING_WIDE_BACKWARD").is_none() {
        std::env::set_var("MOE_ROUTING_WIDE_BACKWARD", "1");
    }
    let tests: &[Test] = &[
        ("forward_small_shapes", forward::forward_small_shapes),
        ("forward_fused_shapes", forward::forward_fused_shapes),
        ("forward_wide_experts", forward::forward_wide_experts),
        (
            "forward_plans_per_expert_count",
            forward::forward_plans_per_expert_count,
        ),
        ("forward_ties_and_nan", forward::forward_ties_and_nan),
        ("forward_near_ties_exact", forward::forward_near_ties_exact),
        (
            "forward_optional_outputs",
            forward::forward_optional_outputs,
        ),
        (
            "forward_is_deterministic",
            forward::forward_is_deterministic,
        ),
        ("round_trip", api::round_trip),
        ("backward_small_shapes", backward::backward_small_shapes),
        (
            "backward_is_deterministic",
            backward::backward_is_deterministic,
        ),
        ("backward_grad_w_sums", backward::backward_grad_w_sums),
        (
            "backward_fused_expert_counts",
            backward::backward_fused_expert_counts,
        ),
        (
            "backward_fused_any_top_k",
            backward::backward_fused_any_top_k,
        ),
        ("backward_wide_experts", backward::backward_wide_experts),
        ("backward_wide_small", backward::backward_wide_small),
        (
            "backward_unaligned_routing_rows",
            backward::backward_unaligned_routing_rows,
        ),
        (
            "fused_kernels_of_every_expert_count",
            backward::fused_kernels_of_every_expert_count,
        ),
        ("backward_dtypes_small", dtypes::backward_dtypes_small),
        ("zero_tokens", api::zero_tokens),
        (
            "invalid_arguments_touch_nothing",
            api::invalid_arguments_touch_nothing,
        ),
        ("randomized_equivalence", api::randomized_equivalence),
        ("extreme_inputs", api::extreme_inputs),
        ("graph_capture", api::graph_capture),
        ("two_streams", api::two_streams),
        ("huge_batch", api::huge_batch),
        ("suite_forward", forward::suite_forward),
        ("suite_backward", backward::suite_backward),
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

/// Two backward results with the same bits in grad_x and in grad_w.
fn assert_same_grads(a: &Grads, b: &Grads, label: &str) {
    assert!(
        bits(&a.grad_x) == bits(&b.grad_x),
        "{label}: grad_x differs"
    );
    assert!(
        bits(&a.grad_w) == bits(&b.grad_w),
        "{label}: grad_w differs"
    );
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
        // E = 20 (not a multiple of 8): the CUDA-core backward (no tensor-core GEMM); E = 40:
        // the simple forward, the tensor-core GEMMs backward.
        (
            RouterConfig {
                hidden_size: 136,
                n_routed_experts: 20,
                num_experts_per_tok: 4,
                n_group: 4,
                topk_group: 2,
                ..base
            },
            77,
        ),
        (
            RouterConfig {
                hidden_size: 136,
                n_routed_experts: 40,
                num_experts_per_tok: 5,
                n_group: 4,
                topk_group: 2,
                ..base
            },
            300,
        ),
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
        // E = 144 on the 160-expert kernel (192-token tiles), its last 16 experts masked.
        (
            RouterConfig {
                n_routed_experts: 144,
                ..glm(8, 4)
            },
            20000,
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
    .into_iter()
    .chain(wide_configs())
    .collect()
}

/// Above 256 experts (the forward's 64-token tiles, the few-lanes routing with lists of 8 or
/// 16): Kimi-K2 (H 7168, E 384, K 8, no groups) from one token (the largest split) up, top-12
/// with groups, and 512 experts at top-16 with a hidden tail.
fn wide_configs() -> Vec<(RouterConfig, usize)> {
    let glm = RouterConfig::glm45;
    vec![
        (
            RouterConfig {
                n_routed_experts: 384,
                hidden_size: 7168,
                ..glm(1, 1)
            },
            1,
        ),
        (
            RouterConfig {
                n_routed_experts: 384,
                hidden_size: 7168,
                ..glm(1, 1)
            },
            3001,
        ),
        (
            RouterConfig {
                n_routed_experts: 384,
                num_experts_per_tok: 12,
                hidden_size: 2048,
                ..glm(8, 4)
            },
            700,
        ),
        (
            RouterConfig {
                n_routed_experts: 512,
                num_experts_per_tok: 16,
                hidden_size: 4000,
                ..glm(8, 4)
            },
            2000,
        ),
    ]
}
