//! Validation that needs no GPU: configs are checked before anything launches.

use moe_routing::{Router, RouterConfig, Status};

fn glm() -> RouterConfig {
    RouterConfig::glm45(8, 4)
}

#[test]
fn suite_configs_are_valid() {
    for (g, tg) in [(1, 1), (4, 2), (8, 4), (8, 3), (16, 8)] {
        Router::new(RouterConfig::glm45(g, tg)).expect("valid config rejected");
    }
}

#[test]
fn bad_configs_are_rejected_with_a_typed_error() {
    let cfg = glm();
    let cases = [
        (
            "n_group does not divide E",
            RouterConfig { n_group: 7, ..cfg },
        ),
        (
            "topk_group > n_group",
            RouterConfig {
                topk_group: 9,
                ..cfg
            },
        ),
        (
            "topk_group = 0",
            RouterConfig {
                topk_group: 0,
                ..cfg
            },
        ),
        (
            "K > candidates after groups",
            RouterConfig {
                num_experts_per_tok: 41,
                topk_group: 2,
                ..cfg
            },
        ),
        (
            "H not a multiple of 8",
            RouterConfig {
                hidden_size: 5124,
                ..cfg
            },
        ),
        (
            "H = 0",
            RouterConfig {
                hidden_size: 0,
                ..cfg
            },
        ),
        (
            "E above the limit",
            RouterConfig {
                n_routed_experts: 1024,
                n_group: 1,
                topk_group: 1,
                ..cfg
            },
        ),
        (
            "K above the limit",
            RouterConfig {
                num_experts_per_tok: 17,
                ..cfg
            },
        ),
        (
            "K = 0",
            RouterConfig {
                num_experts_per_tok: 0,
                ..cfg
            },
        ),
        (
            "groups of one expert",
            RouterConfig {
                n_routed_experts: 8,
                n_group: 8,
                topk_group: 8,
                ..cfg
            },
        ),
        (
            "scale not finite",
            RouterConfig {
                routed_scaling_factor: f32::INFINITY,
                ..cfg
            },
        ),
        ("n_group = 0", RouterConfig { n_group: 0, ..cfg }),
    ];
    for (what, bad) in cases {
        let err = Router::new(bad).expect_err(what);
        assert_eq!(err.kind, Status::InvalidConfig, "{what}: {err}");
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn kernel_paths_say_which_kernels_a_config_takes() {
    let paths = |cfg: RouterConfig| {
        let p = cfg.kernel_paths().unwrap();
        (p.forward_fused, p.backward_fused)
    };
    assert_eq!(paths(glm()), (true, true));
    // Top-12: the fused forward, the simple backward (K <= 8).
    let top12 = RouterConfig {
        num_experts_per_tok: 12,
        ..glm()
    };
    assert_eq!(paths(top12), (true, false));
    // Kimi-K2's 384 experts: both fused (the backward on the wide kernel).
    let kimi_k2 = RouterConfig {
        hidden_size: 7168,
        n_routed_experts: 384,
        n_group: 1,
        topk_group: 1,
        ..glm()
    };
    assert_eq!(paths(kimi_k2), (true, true));
    // 96 experts: the 128-expert forward, its last 32 experts masked; the simple backward.
    let e96 = RouterConfig {
        n_routed_experts: 96,
        num_experts_per_tok: 6,
        n_group: 1,
        topk_group: 1,
        ..glm()
    };
    assert_eq!(paths(e96), (true, false));
    // 72 experts (not a multiple of 16): both simple.
    assert_eq!(
        paths(RouterConfig {
            n_routed_experts: 72,
            ..e96
        }),
        (false, false)
    );
    let bad = RouterConfig {
        n_group: 7,
        ..glm()
    };
    assert_eq!(bad.kernel_paths().unwrap_err().kind, Status::InvalidConfig);
}

#[test]
fn huge_fields_do_not_overflow() {
    let bad = RouterConfig {
        hidden_size: usize::MAX,
        ..glm()
    };
    assert_eq!(Router::new(bad).unwrap_err().kind, Status::InvalidConfig);
}

#[test]
fn workspace_size_grows_with_tokens_and_is_zero_for_none() {
    let r = Router::new(glm()).unwrap();
    assert_eq!(r.backward_workspace_bytes(0), 0);
    assert!(r.backward_workspace_bytes(4096) >= r.backward_workspace_bytes(128));
    assert_eq!(r.backward_workspace_bytes(4096) % 256, 0);
}

/// Property test over the validation layer: random (often invalid) configs never panic, and a
/// config is accepted exactly when it satisfies the documented rules.
#[test]
fn random_configs_are_accepted_exactly_when_valid() {
    let mut rng = moe_routing_dev::testing::Rng::new(0x5EED_CAFE);
    let pick = |rng: &mut moe_routing_dev::testing::Rng, choices: &[usize]| -> usize {
        choices[rng.below(choices.len())]
    };
    let mut accepted = 0;
    for _ in 0..20_000 {
        let cfg = RouterConfig {
            hidden_size: pick(
                &mut rng,
                &[0, 1, 7, 8, 64, 5120, 5124, 7168, 65536, 65544, usize::MAX],
            ),
            n_routed_experts: pick(&mut rng, &[0, 1, 2, 8, 64, 160, 256, 512, 513, 1024]),
            num_experts_per_tok: pick(&mut rng, &[0, 1, 2, 6, 8, 16, 17, 64]),
            n_group: pick(&mut rng, &[0, 1, 2, 3, 4, 8, 16, 32, 160, 512]),
            topk_group: pick(&mut rng, &[0, 1, 2, 3, 4, 8, 16, 17]),
            routed_scaling_factor: [1.0, 2.5, -1.0, 0.0, f32::NAN, f32::INFINITY][rng.below(6)],
            norm_topk_prob: rng.below(2) == 1,
        };
        let (h, e, k, g, tg) = (
            cfg.hidden_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
        );
        let valid = h > 0
            && h % 8 == 0
            && h <= 65536
            && (1..=512).contains(&e)
            && (1..=16).contains(&k)
            && g >= 1
            && e % g == 0
            && (1..=g).contains(&tg)
            && (g == 1 || e / g >= 2)
            && k <= tg * (e / g)
            && cfg.routed_scaling_factor.is_finite();
        match Router::new(cfg) {
            Ok(_) => {
                assert!(valid, "accepted an invalid config: {cfg:?}");
                accepted += 1;
            }
            Err(err) => {
                assert!(!valid, "rejected a valid config: {cfg:?}: {err}");
                assert_eq!(err.kind, Status::InvalidConfig);
            }
        }
    }
    assert!(
        accepted > 100,
        "the generator should produce valid configs too ({accepted})"
    );
}

/// `Router` is plain configuration (the C++ side keeps only atomics per device), so one router
/// may be shared by threads driving different streams.
#[test]
fn router_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Router>();
    assert_send_sync::<RouterConfig>();
    assert_send_sync::<moe_routing::Error>();
}

/// Error messages carry the C++ layer's description of the status and the call's context.
#[test]
fn errors_describe_their_status() {
    let err = Router::new(RouterConfig {
        n_group: 7,
        ..glm()
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("invalid router config: "), "{text}");
    assert!(text.contains("n_group: 7"), "{text}");
}
