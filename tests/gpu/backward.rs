//! The backward against the f64 reference: small, fused and suite shapes, every grad_w sum,
//! other expert counts and top-k, unaligned routing rows, determinism.

use super::*;

pub(super) fn backward_small_shapes(s: &Arc<CudaStream>) {
    for (i, (cfg, tokens)) in small_configs().into_iter().enumerate() {
        let seed = fresh_seed() ^ (i as u64) << 8;
        check_case(s, &cfg, tokens, seed, &format!("{cfg:?} T={tokens}"));
    }
}

// The fused backward sums grad_w over the CTAs of a hidden slice in one of three ways, picked
// by shape and device (fused_backward.cu). On an H200: H = 1024, T = 1024 sums in clusters of
// 8, and H = 7168, T = 4096 in clusters of 2; H = 1024, T = 2048 spreads the sum over 16 CTAs
// through global memory, and H = 5120, T = 2048 over 3 (T = 1536, below, takes 64-column slices
// since v23); H = 20480 (more slices than SMs) has
// the last CTA of a slice sum it; H = 10240, T = 256 (one CTA per 128-column slice) needs no
// sum, and H = 5120, T = 512 takes 64-column slices, one CTA each, whose wgrad warpgroup
// writes grad_w. Each is checked against the reference and for bitwise-equal repeats,
// in both precisions (precise mode: two sweeps in one launch, or at H = 20480, where a CTA's
// units span slices, two launches, the second accumulating).
pub(super) fn backward_grad_w_sums(s: &Arc<CudaStream>) {
    for (i, (hidden_size, tokens)) in [
        (1024, 1024),
        (1024, 2048),
        (7168, 4096),
        (20480, 256),
        (10240, 256),
        (5120, 512),
        (5120, 1536),
        (5120, 2048),
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
/// warpgroup taking dgrad and the other wgrad; k CTAs per slice where the slices are few) and 128 (GLM-4.5-Air: the same kernels as 160,
/// 64-column slices at small T, 128-column ones with grad_w summed over a slice's CTAs above),
/// against the reference in both precisions, accumulating or not, and bitwise repeatable.
pub(super) fn backward_fused_expert_counts(s: &Arc<CudaStream>) {
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
    // 256 experts with few slices (16 of 64 columns), one group: 8 CTAs per slice at T = 3001
    // on an H200, their partials summed spread.
    let narrow = RouterConfig {
        hidden_size: 1024,
        n_group: 1,
        topk_group: 1,
        ..v3
    };
    // Kimi-Linear's shape (36 slices): 3 CTAs per slice at T = 4096, each summing a third; at
    // T = 600 and 1024 too (5 and 8 tiles: CTAs of 1 to 3 tiles).
    let kimi_linear = RouterConfig {
        hidden_size: 2304,
        routed_scaling_factor: 2.446,
        ..narrow
    };
    for (i, (cfg, tokens)) in [
        (v3, 1),
        (v3, 300),
        (v3, 2000),
        (narrow, 3001),
        (kimi_linear, 600),
        (kimi_linear, 1024),
        (kimi_linear, 4096),
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

/// The wide fused backward (more than 256 experts, any K up to 16; 64-token units of 64-column
/// slices): Kimi-K2's shape (H 7168, E 384, K 8: one CTA per slice) from one token up; 16 slices
/// at top-16, where k CTAs share a slice and sum its grad_w spread; E = 320 and 272 on the
/// 384-expert kernel (its experts beyond E masked), with groups and a token tail; 512 experts at
/// top-16 (one CTA per slice at T = 1000, two summed spread at 5000 on an H200) and 448 on that
/// kernel; top-10 to top-16 at 64 to 256 experts, on the 384-expert kernel. Precise mode takes
/// the simple path for these shapes (check_fused_case checks it too).
pub(super) fn backward_wide_experts(s: &Arc<CudaStream>) {
    let kimi_k2 = RouterConfig {
        hidden_size: 7168,
        n_routed_experts: 384,
        num_experts_per_tok: 8,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.827,
        norm_topk_prob: true,
    };
    let top16 = RouterConfig {
        hidden_size: 1024,
        num_experts_per_tok: 16,
        n_group: 8,
        topk_group: 4,
        ..kimi_k2
    };
    let masked = RouterConfig {
        hidden_size: 2048,
        n_routed_experts: 320,
        num_experts_per_tok: 10,
        n_group: 4,
        topk_group: 2,
        ..kimi_k2
    };
    let narrowest = RouterConfig {
        hidden_size: 512,
        n_routed_experts: 272,
        num_experts_per_tok: 3,
        ..kimi_k2
    };
    // 512 experts: the dgrad warpgroup also takes wgrad of the first 128.
    let e512 = RouterConfig {
        hidden_size: 4096,
        n_routed_experts: 512,
        num_experts_per_tok: 16,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 1.0,
        ..kimi_k2
    };
    let e448 = RouterConfig {
        hidden_size: 1024,
        n_routed_experts: 448,
        ..kimi_k2
    };
    // More than 8 experts a token at up to 256 experts: the 384-expert kernel, masked.
    let top12_e160 = RouterConfig {
        hidden_size: 1024,
        n_routed_experts: 160,
        num_experts_per_tok: 12,
        ..kimi_k2
    };
    let top16_e64 = RouterConfig {
        hidden_size: 512,
        n_routed_experts: 64,
        num_experts_per_tok: 16,
        ..kimi_k2
    };
    let top10_e256 = RouterConfig {
        hidden_size: 2048,
        n_routed_experts: 256,
        num_experts_per_tok: 10,
        n_group: 8,
        topk_group: 4,
        ..kimi_k2
    };
    for (i, (cfg, tokens)) in [
        (kimi_k2, 1),
        (kimi_k2, 1000),
        (kimi_k2, 4096),
        (top16, 3001),
        (masked, 777),
        (narrowest, 2049),
        (e512, 1000),
        (e512, 5000),
        (e448, 333),
        (top12_e160, 500),
        (top16_e64, 300),
        (top10_e256, 1000),
    ]
    .into_iter()
    .enumerate()
    {
        check_fused_case(s, &cfg, tokens, fresh_seed() ^ (i as u64) << 20);
    }
}

/// The wide backward on small shapes, for the sanitizers: E = 384 at K = 8 (one CTA per slice)
/// and E = 512 at K = 12 (16 slices, 8 CTAs each on an H200, summed spread).
pub(super) fn backward_wide_small(s: &Arc<CudaStream>) {
    let cfg = |e, k, h| RouterConfig {
        hidden_size: h,
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
    };
    for (i, (c, tokens)) in [(cfg(384, 8, 1024), 200), (cfg(512, 12, 1024), 1333)]
        .into_iter()
        .enumerate()
    {
        check_fused_case(s, &c, tokens, fresh_seed() ^ (i as u64) << 24);
    }
}

/// One shape on the fused kernels: against the reference in both precisions, accumulating or
/// not, and bitwise repeatable. The library must say the shape is fused, and the fused kernels
/// take G as bf16 in the default mode (grad_w ~1e-3 off; so does the simple path's tensor-core
/// GEMM, while its CUDA-core one, fp32 throughout, would leave ~1e-6).
pub(super) fn check_fused_case(s: &Arc<CudaStream>, cfg: &RouterConfig, tokens: usize, seed: u64) {
    let label = format!("{cfg:?} T={tokens}");
    assert!(
        cfg.kernel_paths().unwrap().backward_fused,
        "{label}: not a fused backward shape"
    );
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
pub(super) fn backward_fused_any_top_k(s: &Arc<CudaStream>) {
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
pub(super) fn backward_unaligned_routing_rows(s: &Arc<CudaStream>) {
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
            assert_same_grads(&got, &aligned, &format!("{cfg:?} T={tokens} {precision:?}"));
        }
    }
}

pub(super) fn backward_is_deterministic(s: &Arc<CudaStream>) {
    let cfg = RouterConfig::glm45(8, 4);
    assert_deterministic(s, &cfg, 3001, &[Precision::Default, Precision::Precise]);
}

// Two backward calls on the same inputs give the same bits.
pub(super) fn assert_deterministic(
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
        let run = || {
            gpu_backward(
                s,
                &router,
                tokens,
                &inp,
                &fwd.dev.topk_idx,
                &fwd.dev.topk_scores,
                &grad_out,
                opts,
                None,
            )
        };
        let (a, b) = (run(), run());
        let label = format!("between runs ({cfg:?} T={tokens} {precision:?})");
        assert_same_grads(&a, &b, &label);
    }
}

pub(super) fn suite_backward(s: &Arc<CudaStream>) {
    for case in suite_cases() {
        let seed = fresh_seed();
        let [d, p] = check_case(s, &case.config, case.tokens, seed, &case.name);
        println!(
            "  backward {:<14} rel err default: grad_x {:.2e} grad_w {:.2e} | precise: grad_x {:.2e} grad_w {:.2e}",
            case.name, d.grad_x, d.grad_w, p.grad_x, p.grad_w
        );
    }
}

/// Every expert count that has fused kernels (`RouterConfig::kernel_paths`, which reads the
/// library's table of kernels, cpp/src/fused_kernels.def), at K = 8 and K = 6: the forward and
/// the backward against the reference, so that a row added to the table is tested with no test
/// of its own.
pub(super) fn fused_kernels_of_every_expert_count(s: &Arc<CudaStream>) {
    let tokens = 300;
    let (mut forward, mut backward) = (0, 0);
    for experts in (16..=512).step_by(16) {
        for top_k in [8, 6] {
            let cfg = RouterConfig {
                hidden_size: 1024,
                n_routed_experts: experts,
                num_experts_per_tok: top_k,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 2.5,
                norm_topk_prob: true,
            };
            let paths = cfg.kernel_paths().unwrap();
            let seed = fresh_seed() ^ ((experts * 16 + top_k) as u64) << 16;
            if paths.forward_fused {
                let router = Router::new(cfg).unwrap();
                let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
                let fwd = gpu_forward(s, &router, tokens, &inp);
                let label = format!("{cfg:?} T={tokens} seed {seed}");
                check_forward(&cfg, tokens, &inp, &fwd, &label);
                forward += 1;
            }
            if paths.backward_fused {
                check_fused_case(s, &cfg, tokens, seed);
                backward += 1;
            }
        }
    }
    println!("  fused shapes checked: forward {forward}, backward {backward}");
    let glm45 = RouterConfig::glm45(1, 1).kernel_paths().unwrap();
    assert!(glm45.forward_fused && glm45.backward_fused, "{glm45:?}");
    assert!(forward > 0 && backward > 0);
}
