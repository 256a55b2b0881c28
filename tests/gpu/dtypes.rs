//! The backward on the inputs as PyTorch holds them (int64 indices, the scores of all experts,
//! bf16 scores and gradients, bf16 grad_w), read in place, and `Precision::TorchBf16` against
//! the eager bf16 composition it follows.

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use moe_routing::reference::{self, BackwardOutput};
use moe_routing::{BackwardOptions, FloatElem, IndexElem, Precision, Router, RouterConfig, Scores};
use moe_routing_dev::suite::{self, Case};
use moe_routing_dev::testing::{bf16_to_f64, fresh_seed, random_grad, Inputs, Rng};

use super::{
    download, gpu_forward, poisoned, upload, Grads, GRAD_W_TOL, GRAD_X_TOL, PRECISE_GRAD_W_TOL,
    PRECISE_GRAD_X_TOL,
};

/// One combination of the backward's input and output dtypes.
#[derive(Clone, Copy, Debug)]
pub struct Dtypes {
    pub idx_i64: bool,
    /// The scores of all experts [T, E] rather than the chosen ones [T, K].
    pub all_scores: bool,
    pub scores_bf16: bool,
    pub grad_bf16: bool,
    pub grad_w_bf16: bool,
}

impl Dtypes {
    /// The public benchmark's: int64 indices, all scores bf16, bf16 gradients and grad_w.
    pub const PYTORCH: Dtypes = Dtypes {
        idx_i64: true,
        all_scores: true,
        scores_bf16: true,
        grad_bf16: true,
        grad_w_bf16: true,
    };
    /// The n-th of all 32 combinations.
    pub fn nth(n: usize) -> Self {
        Dtypes {
            idx_i64: n & 1 != 0,
            all_scores: n & 2 != 0,
            scores_bf16: n & 4 != 0,
            grad_bf16: n & 8 != 0,
            grad_w_bf16: n & 16 != 0,
        }
    }
}

/// Element types the test converts to and from on the host.
trait Real: DeviceRepr + ValidAsZeroBits + Default + Clone + Copy + FloatElem {
    fn of(v: f32) -> Self;
    fn f64(self) -> f64;
}
impl Real for f32 {
    fn of(v: f32) -> Self {
        v
    }
    fn f64(self) -> f64 {
        f64::from(self)
    }
}
impl Real for bf16 {
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn f64(self) -> f64 {
        self.to_f64()
    }
}

/// A token's routing inputs on the host, before conversion: `scores` is [T, K] or [T, E].
struct Host<'a> {
    s: &'a Arc<CudaStream>,
    router: &'a Router,
    tokens: usize,
    inp: &'a Inputs,
    idx: &'a [i32],
    scores: &'a [f32],
    grads: &'a [f32],
    d: Dtypes,
    precision: Precision,
}

// One level per dtype, so that each combination calls `backward_as` with its own types.
fn with_idx(h: &Host) -> Grads {
    if h.d.idx_i64 {
        with_scores(h, h.idx.iter().map(|&v| i64::from(v)).collect::<Vec<_>>())
    } else {
        with_scores(h, h.idx.to_vec())
    }
}
fn with_scores<I: IndexElem + DeviceRepr>(h: &Host, idx: Vec<I>) -> Grads {
    if h.d.scores_bf16 {
        with_grads(
            h,
            idx,
            h.scores.iter().map(|&v| bf16::of(v)).collect::<Vec<_>>(),
        )
    } else {
        with_grads(h, idx, h.scores.to_vec())
    }
}
fn with_grads<I: IndexElem + DeviceRepr, S: Real>(h: &Host, idx: Vec<I>, sc: Vec<S>) -> Grads {
    if h.d.grad_bf16 {
        with_grad_w(
            h,
            idx,
            sc,
            h.grads.iter().map(|&v| bf16::of(v)).collect::<Vec<_>>(),
        )
    } else {
        with_grad_w(h, idx, sc, h.grads.to_vec())
    }
}
fn with_grad_w<I: IndexElem + DeviceRepr, S: Real, G: Real>(
    h: &Host,
    idx: Vec<I>,
    sc: Vec<S>,
    g: Vec<G>,
) -> Grads {
    if h.d.grad_w_bf16 {
        run::<I, S, G, bf16>(h, idx, sc, g)
    } else {
        run::<I, S, G, f32>(h, idx, sc, g)
    }
}
fn run<I: IndexElem + DeviceRepr, S: Real, G: Real, W: Real>(
    h: &Host,
    idx: Vec<I>,
    sc: Vec<S>,
    g: Vec<G>,
) -> Grads {
    let (s, cfg, tokens) = (h.s, h.router.config(), h.tokens);
    let (x, w) = (upload(s, &h.inp.x), upload(s, &h.inp.w));
    let (idx, sc, g) = (upload(s, &idx), upload(s, &sc), upload(s, &g));
    let mut grad_x: CudaSlice<bf16> = poisoned(s, (tokens * cfg.hidden_size).max(1));
    let mut grad_w: CudaSlice<W> = poisoned(s, cfg.n_routed_experts * cfg.hidden_size);
    let mut ws = h.router.alloc_workspace(s, tokens).unwrap();
    let scores = if h.d.all_scores {
        Scores::All(&sc)
    } else {
        Scores::Chosen(&sc)
    };
    let options = BackwardOptions {
        accumulate_grad_w: false,
        precision: h.precision,
    };
    h.router
        .backward_as(
            s,
            tokens,
            &x,
            &w,
            &idx,
            scores,
            &g,
            &mut grad_x,
            &mut grad_w,
            options,
            &mut ws,
        )
        .unwrap_or_else(|e| panic!("{:?} {:?}: {e}", h.d, h.precision));
    s.synchronize().unwrap();
    Grads {
        grad_x: bf16_to_f64(&download(s, &grad_x)[..tokens * cfg.hidden_size]),
        grad_w: download(s, &grad_w).into_iter().map(W::f64).collect(),
    }
}

/// The share of elements of `got` within 1e-2 of `want`, absolute or relative.
fn agreeing(got: &[f64], want: &[f64]) -> f64 {
    let close = got
        .iter()
        .zip(want)
        .filter(|(&a, &b)| (a - b).abs() <= 1e-2 * b.abs().max(1.0))
        .count();
    close as f64 / want.len().max(1) as f64
}

/// The backward of one case in dtypes `d` and each precision they allow, against the
/// reference on the values the kernel sees (bf16 inputs rounded). Returns the torch_bf16 run's
/// share of agreeing elements (grad_x, grad_w).
pub fn check_dtypes(
    s: &Arc<CudaStream>,
    cfg: &RouterConfig,
    tokens: usize,
    d: Dtypes,
    seed: u64,
    label: &str,
) -> (f64, f64) {
    let mut rng = Rng::new(seed);
    let router = Router::new(*cfg).unwrap();
    let inp = Inputs::random(cfg, tokens, &mut rng);
    let fwd = gpu_forward(s, &router, tokens, &inp);
    let (k, e) = (cfg.num_experts_per_tok, cfg.n_routed_experts);
    let idx = &fwd.idx[..tokens * k];
    let chosen = &fwd.scores[..tokens * k];
    // All experts' scores: random in (0, 1), the forward's at the chosen ones, so that a read
    // of any other expert's shows.
    let all: Vec<f32> = if d.all_scores {
        let mut all: Vec<f32> = (0..tokens * e)
            .map(|_| 0.01 + 0.98 * rng.uniform())
            .collect();
        for t in 0..tokens {
            for j in 0..k {
                all[t * e + idx[t * k + j] as usize] = chosen[t * k + j];
            }
        }
        all
    } else {
        Vec::new()
    };
    let grads = random_grad(tokens * k, &mut rng);
    // What the kernel reads, in f32: bf16 inputs rounded.
    let round = |v: f32, bf: bool| if bf { bf16::from_f32(v).to_f32() } else { v };
    let seen_scores: Vec<f32> = chosen.iter().map(|&v| round(v, d.scores_bf16)).collect();
    let seen_grads: Vec<f32> = grads.iter().map(|&v| round(v, d.grad_bf16)).collect();
    let host = |precision| Host {
        s,
        router: &router,
        tokens,
        inp: &inp,
        idx,
        scores: if d.all_scores { &all } else { chosen },
        grads: &grads,
        d,
        precision,
    };
    let args = (
        cfg,
        tokens,
        &inp.x[..],
        &inp.w[..],
        idx,
        &seen_scores[..],
        &seen_grads[..],
    );
    let exact = reference::backward(args.0, args.1, args.2, args.3, args.4, args.5, args.6);
    let torch =
        reference::backward_torch_bf16(args.0, args.1, args.2, args.3, args.4, args.5, args.6);
    let check = |got: &Grads, want: &BackwardOutput, (tol_x, tol_w): (f64, f64), what: &str| {
        let ex = reference::rel_err(&got.grad_x, &want.grad_x);
        let ew = reference::rel_err(&got.grad_w, &want.grad_w);
        assert!(
            ex <= tol_x && ew <= tol_w,
            "{label} {d:?} {what}: grad_x err {ex:e}, grad_w err {ew:e} (seed {seed})"
        );
    };
    check(
        &with_idx(&host(Precision::Default)),
        &exact,
        (GRAD_X_TOL, GRAD_W_TOL),
        "default",
    );
    if !d.grad_w_bf16 {
        let tol = (PRECISE_GRAD_X_TOL, PRECISE_GRAD_W_TOL);
        check(&with_idx(&host(Precision::Precise)), &exact, tol, "precise");
    }
    // torch_bf16: the same G as the composition, so only the GEMMs' order and the outputs'
    // rounding differ.
    let got = with_idx(&host(Precision::TorchBf16));
    check(&got, &torch, (GRAD_X_TOL, GRAD_W_TOL), "torch_bf16");
    let agree = (
        agreeing(&got.grad_x, &torch.grad_x),
        agreeing(&got.grad_w, &torch.grad_w),
    );
    assert!(
        agree.0 >= 0.999 && agree.1 >= 0.999,
        "{label} {d:?} torch_bf16: {:.4}% of grad_x, {:.4}% of grad_w within 1e-2 (seed {seed})",
        100.0 * agree.0,
        100.0 * agree.1
    );
    agree
}

/// A suite's cases; `MOE_ROUTING_SUITE_CASES=name,name,...` keeps only those.
fn load_cases(file: &str) -> Vec<Case> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/shapes")
        .join(file);
    let cases = suite::load(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    match std::env::var("MOE_ROUTING_SUITE_CASES") {
        Ok(names) => {
            let keep: Vec<&str> = names.split(',').map(str::trim).collect();
            cases
                .into_iter()
                .filter(|c| keep.contains(&c.name.as_str()))
                .collect()
        }
        Err(_) => cases,
    }
}

/// Every case of both suites (`MOE_ROUTING_SUITE_CASES` picks from either): the public range
/// in the benchmark's dtypes, the training suite in a spread of the combinations; every
/// precision they allow.
pub fn suites_in_pytorch_dtypes(s: &Arc<CudaStream>) {
    let training = load_cases("suite.json");
    let cases: Vec<(Case, Dtypes)> = load_cases("public_range.json")
        .into_iter()
        .map(|c| (c, Dtypes::PYTORCH))
        .chain(
            training
                .into_iter()
                .enumerate()
                .map(|(i, c)| (c, Dtypes::nth(i * 7 % 32))),
        )
        .collect();
    assert!(
        !cases.is_empty(),
        "MOE_ROUTING_SUITE_CASES names no case of either suite"
    );
    for (case, d) in cases {
        let seed = fresh_seed();
        let (ax, aw) = check_dtypes(s, &case.config, case.tokens, d, seed, &case.name);
        println!(
            "  dtypes {:<14} {d:?}: torch_bf16 agrees on {:.3}% of grad_x, {:.3}% of grad_w",
            case.name,
            100.0 * ax,
            100.0 * aw
        );
    }
}

/// Small shapes on every path (fused K = 8, fused any K, simple), each combination of dtypes.
pub fn backward_dtypes_small(s: &Arc<CudaStream>) {
    let cfg = |h, e, k, g, tg| RouterConfig {
        hidden_size: h,
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_group: g,
        topk_group: tg,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
    };
    let shapes = [
        (cfg(512, 160, 8, 1, 1), 300),  // fused, K = 8
        (cfg(256, 64, 6, 1, 1), 200),   // fused, any K
        (cfg(1024, 256, 8, 8, 4), 333), // fused, 256 experts
        (cfg(512, 384, 8, 1, 1), 150),  // fused wide, 384 experts
        (cfg(256, 320, 12, 4, 2), 90),  // fused wide, 320 experts on the 384 kernel, top-12
        (cfg(136, 96, 5, 4, 2), 77),    // simple
    ];
    for (i, (c, tokens)) in shapes.into_iter().enumerate() {
        for n in 0..32 {
            let seed = fresh_seed();
            check_dtypes(
                s,
                &c,
                tokens,
                Dtypes::nth((n + i) % 32),
                seed,
                &format!("{c:?} T={tokens}"),
            );
        }
    }
}
