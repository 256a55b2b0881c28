//! The API around the kernels: zero tokens, invalid arguments, random shapes, extreme inputs,
//! CUDA graphs, a forward + backward round trip, two streams, a huge batch.

use super::*;

pub(super) fn zero_tokens(s: &Arc<CudaStream>) {
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

pub(super) fn invalid_arguments_touch_nothing(s: &Arc<CudaStream>) {
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

/// Random shapes within the supported bounds, GPU against the CPU reference: forward indices,
/// both precisions, accumulate on and off. Every other case draws E (a multiple of 16 up to
/// 512) and H (a multiple of 64 up to 1024) at random, the rest take one of the listed shapes;
/// K up to 16 either way. The seed of a failing case is in its message.
pub(super) fn randomized_equivalence(s: &Arc<CudaStream>) {
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
        let (hidden_size, n_routed_experts) = if case % 2 == 1 {
            (64 * (1 + rng.below(16)), 16 * (1 + rng.below(32)))
        } else {
            shapes[rng.below(shapes.len())]
        };
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
pub(super) fn extreme_inputs(s: &Arc<CudaStream>) {
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
pub(super) fn graph_capture(_: &Arc<CudaStream>) {
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

/// Forward then backward through the public Rust API, each against the f64 reference
/// (reference::forward, reference::backward), on the fused paths of both.
pub(super) fn round_trip(s: &Arc<CudaStream>) {
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
pub(super) fn two_streams(_: &Arc<CudaStream>) {
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
pub(super) fn huge_batch(s: &Arc<CudaStream>) {
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

pub(super) fn router_forward(
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
