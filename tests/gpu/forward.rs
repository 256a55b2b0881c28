//! The forward against the f64 reference: small, fused and suite shapes, ties and NaN,
//! near ties decided to the last bit, the optional outputs, determinism.

use super::*;

pub(super) fn forward_small_shapes(s: &Arc<CudaStream>) {
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

pub(super) fn forward_fused_shapes(s: &Arc<CudaStream>) {
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

/// The forward's kernels above 256 experts alone (`wide_configs`, also among the fused shapes),
/// so that compute-sanitizer can take them by name.
pub(super) fn forward_wide_experts(s: &Arc<CudaStream>) {
    for (i, (cfg, tokens)) in wide_configs().into_iter().enumerate() {
        let seed = fresh_seed() ^ (i as u64) << 20;
        assert!(
            cfg.kernel_paths().unwrap().forward_fused,
            "{cfg:?}: the fused forward"
        );
        let router = Router::new(cfg).unwrap();
        let inp = Inputs::random(&cfg, tokens, &mut Rng::new(seed));
        let fwd = gpu_forward(s, &router, tokens, &inp);
        let label = format!("{cfg:?} T={tokens} seed {seed}");
        let (ties, err) = check_forward(&cfg, tokens, &inp, &fwd, &label);
        println!(
            "  E={} K={:<2} T={tokens:<5} near-tie rows differing {ties:>2}, rel err {err:.1e}",
            cfg.n_routed_experts, cfg.num_experts_per_tok
        );
    }
}

/// The launch plan is per expert count: 192-token tiles exist for E = 160 alone, so a process
/// that routes with E = 160 and then with E = 256 must not plan the second with the first's
/// tiles (at T = 10007 the E = 160 plan takes 192-token tiles).
pub(super) fn forward_plans_per_expert_count(s: &Arc<CudaStream>) {
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

/// Exact ties and NaN, on the fused path (E = 160, 256; 96 on the 128-expert kernel, masked)
/// and the simple one (E = 72): every expert
/// has the same weight row, so scores tie exactly unless the bias or a NaN separates them.
///   - ties: equal values rank the lower expert index first (experts and groups);
///   - a token whose scores are all NaN gets the K lowest indices (of the first groups);
///   - a NaN score is never chosen over a finite one.
pub(super) fn forward_ties_and_nan(s: &Arc<CudaStream>) {
    let seed = fresh_seed();
    let mut rng = Rng::new(seed);
    // E = 96: the 128-expert kernel, its last 32 experts masked (never chosen, even over NaN).
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
        // E = 72 (not a multiple of 16): the simple path.
        RouterConfig {
            n_routed_experts: 72,
            ..small
        },
        RouterConfig {
            n_routed_experts: 72,
            n_group: 8,
            topk_group: 4,
            ..small
        },
        // E = 320 on the 384-expert kernel (masked), top-12.
        RouterConfig {
            n_routed_experts: 320,
            num_experts_per_tok: 12,
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
pub(super) fn select_f32(cfg: &RouterConfig, c: &[f32]) -> Vec<i32> {
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
pub(super) fn forward_near_ties_exact(s: &Arc<CudaStream>) {
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
pub(super) fn forward_optional_outputs(s: &Arc<CudaStream>) {
    let small = RouterConfig {
        hidden_size: 256,
        n_routed_experts: 72, // not a multiple of 16: the simple path
        num_experts_per_tok: 6,
        n_group: 8,
        topk_group: 3,
        routed_scaling_factor: 1.5,
        norm_topk_prob: true,
    };
    let kimi_k2 = RouterConfig {
        hidden_size: 7168,
        n_routed_experts: 384,
        ..RouterConfig::glm45(1, 1)
    };
    let e96 = RouterConfig {
        hidden_size: 1024,
        n_routed_experts: 96,
        num_experts_per_tok: 6,
        ..RouterConfig::glm45(8, 3)
    };
    let e320 = RouterConfig {
        hidden_size: 2048,
        n_routed_experts: 320,
        ..RouterConfig::glm45(1, 1)
    };
    let e512_k16 = RouterConfig {
        hidden_size: 2048,
        n_routed_experts: 512,
        num_experts_per_tok: 16,
        ..RouterConfig::glm45(8, 4)
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
        (kimi_k2, 3001),                    // 384 experts: 64-token tiles, split
        (kimi_k2, 1),                       // ... the largest split
        (e512_k16, 700),                    // 512 experts, lists of 16
        (e96, 1000),                        // 96 experts on the 128-expert kernel, masked
        (e320, 300),                        // 320 on the 384-expert kernel
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
            ..Default::default()
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
        // The indices as int64 (PyTorch's dtype) instead: the same values and outputs, the
        // int32 buffer untouched.
        let mut out64 = Routing {
            topk_idx: poisoned(s, tokens * k),
            topk_weights: poisoned(s, tokens * k),
            topk_scores: poisoned(s, tokens * k),
        };
        let mut idx64 = poisoned::<i64>(s, tokens * k);
        let extras = ForwardExtras {
            topk_idx_i64: Some(&mut idx64),
            ..Default::default()
        };
        router
            .forward_with(s, tokens, &x, &w, &bias, &mut out64, extras)
            .unwrap();
        s.synchronize().unwrap();
        let want64: Vec<i64> = plain.idx.iter().map(|&i| i64::from(i)).collect();
        assert_eq!(download(s, &idx64), want64, "{label}: topk_idx as int64");
        assert!(
            download(s, &out64.topk_idx).iter().all(|&v| v == -1),
            "{label}: the int32 indices written beside the int64 ones"
        );
        assert_eq!(
            bits(&download(s, &out64.topk_weights)),
            bits(&plain.weights),
            "{label}: topk_weights with int64 indices"
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
pub(super) fn forward_is_deterministic(s: &Arc<CudaStream>) {
    for (cfg, tokens) in [
        (RouterConfig::glm45(8, 4), 512),
        (RouterConfig::glm45(4, 2), 10007),
        (RouterConfig::glm45(1, 1), 20000),
        (
            RouterConfig {
                hidden_size: 7168,
                n_routed_experts: 384,
                ..RouterConfig::glm45(1, 1)
            },
            4096,
        ),
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

pub(super) fn suite_forward(s: &Arc<CudaStream>) {
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
