//! The suites' reader (moe_routing_dev::suite): parsing, the speed of light each case counts,
//! and the repository's two suites.

use moe_routing::RouterConfig;
use moe_routing_dev::suite::{
    default_path, load, parse, public_range_path, shapes_file, Case, Interface,
};

#[test]
fn parses_cases() {
    let text = r#"{"about": "x", "cases": [
      {"name": "a", "tokens": 3001, "hidden_size": 5120, "n_routed_experts": 160,
       "top_k": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
       "norm_topk_prob": true},
      {"name": "b", "tokens": 7, "hidden_size": 64, "n_routed_experts": 16, "top_k": 2,
       "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": false}
    ]}"#;
    let cases = parse(text).unwrap();
    assert_eq!(cases.len(), 2);
    assert_eq!(cases[0].name, "a");
    assert_eq!(cases[0].tokens, 3001);
    assert_eq!(cases[0].config, RouterConfig::glm45(8, 4));
    assert_eq!(cases[0].interface, Interface::Training);
    assert!(!cases[1].config.norm_topk_prob);
    assert_eq!(cases[1].config.num_experts_per_tok, 2);
}

const PYTORCH_INTERFACE: &str = r#""interface": {
  "topk_idx": "int64 [T,K]", "scores": "bf16 [T,E] (all experts)",
  "grad_topk_weights": "bf16 [T,K]", "x": "bf16 [T,H]", "w": "bf16 [E,H]",
  "grad_x": "bf16 [T,H]", "grad_w": "bf16 [E,H] (written)"}"#;

#[test]
fn parses_the_interface() {
    let case = r#"{"name": "s1", "tokens": 1264, "hidden_size": 5120,
      "n_routed_experts": 160, "top_k": 8, "n_group": 1, "topk_group": 1,
      "routed_scaling_factor": 2.5, "norm_topk_prob": true}"#;
    let text = format!("{{{PYTORCH_INTERFACE}, \"cases\": [{case}]}}");
    let cases = parse(&text).unwrap();
    assert_eq!(cases[0].interface, Interface::PyTorch);
    assert_eq!(cases[0].config, RouterConfig::glm45(1, 1));
    // A dtype this reader has no SOL for is an error, not the training interface.
    let fp32_grad_w = text.replace("bf16 [E,H] (written)", "fp32 [E,H]");
    assert!(parse(&fp32_grad_w).unwrap_err().contains("grad_w"));
}

#[test]
fn sol_matches_the_suite_definition() {
    let case = Case {
        name: "t32768".into(),
        tokens: 32768,
        config: RouterConfig::glm45(8, 4),
        interface: Interface::Training,
    };
    let (t, h, e, k) = (32768.0, 5120.0, 160.0, 8.0);
    // Reads x, w and the [T, K] inputs; writes grad_x and grad_w (fp32).
    assert_eq!(
        case.backward_read_bytes(),
        2.0 * t * h + 2.0 * e * h + 12.0 * t * k
    );
    assert_eq!(case.backward_write_bytes(), 2.0 * t * h + 4.0 * e * h);
    // 4·T·H + 6·E·H + 12·T·K bytes at 4.8 TB/s.
    let bytes = 4.0 * t * h + 6.0 * e * h + 12.0 * t * k;
    assert_eq!(case.backward_bytes(), bytes);
    assert!((case.backward_sol_s() * 1e6 - 141.0).abs() < 1.0);
}

#[test]
fn public_range_sol_matches_its_file() {
    let case = Case {
        name: "s1264".into(),
        tokens: 1264,
        config: RouterConfig::glm45(1, 1),
        interface: Interface::PyTorch,
    };
    let (t, h, e, k) = (1264.0, 5120.0, 160.0, 8.0);
    // The file's formula: 2TK + 8TK + 2TE + 2TH + 2EH + 2TH + 2EH, flops 4TEH.
    let read = 2.0 * t * k + 8.0 * t * k + 2.0 * t * e + 2.0 * t * h + 2.0 * e * h;
    let write = 2.0 * t * h + 2.0 * e * h;
    assert_eq!(case.backward_read_bytes(), read);
    assert_eq!(case.backward_write_bytes(), write);
    let sol = ((read + write) / 4.8e12).max(4.0 * t * e * h / 989e12);
    assert_eq!(case.backward_sol_s(), sol);
    assert!((sol * 1e6 - 6.18).abs() < 0.01, "{}", sol * 1e6);
}

#[test]
fn reads_the_repository_suites() {
    if std::env::var_os("MOE_ROUTING_SUITE").is_none() {
        assert_eq!(default_path(), shapes_file("suite.json"));
    }
    if std::env::var_os("MOE_ROUTING_PUBLIC_RANGE").is_none() {
        assert_eq!(public_range_path(), shapes_file("public_range.json"));
    }
    let training = load(&shapes_file("suite.json")).unwrap();
    assert_eq!(training.len(), 16);
    assert!(training.iter().all(|c| c.interface == Interface::Training));
    assert!(training.iter().all(|c| c.config.validate().is_ok()));

    let public = load(&shapes_file("public_range.json")).unwrap();
    assert_eq!(public.len(), 16);
    assert!(public.iter().all(|c| c.interface == Interface::PyTorch));
    assert!(public.iter().all(|c| c.config == RouterConfig::glm45(1, 1)));
    let tokens: Vec<usize> = public.iter().map(|c| c.tokens).collect();
    assert_eq!((tokens[0], tokens[15]), (1264, 7680));
    assert_eq!(tokens.iter().sum::<usize>(), 41538); // mean 2596.1
}
