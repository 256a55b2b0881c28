//! The benchmark suites (`benches/shapes/`): a minimal reader of their cases.
//!
//! - `suite.json`, the training suite: the backward's routing inputs as the forward saves them
//!   (int32 `topk_idx`, the chosen scores [T, K] f32, f32 `grad_topk_weights`), grad_w f32.
//! - `public_range.json`: the token counts of the public benchmark of this backward, with its
//!   inputs as PyTorch holds them (int64 `topk_idx`, the scores of all experts [T, E] bf16,
//!   bf16 `grad_topk_weights`), grad_w bf16. Its file says so in an `"interface"` object.
//!
//! Every case carries its suite's [`Interface`], which its speed of light counts.

use std::path::{Path, PathBuf};

use crate::config::RouterConfig;

/// The dtypes and shapes of the backward's routing inputs and grad_w a suite times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Interface {
    /// int32 `topk_idx`, chosen scores [T, K] f32, f32 `grad_topk_weights`; grad_w f32.
    #[default]
    Training,
    /// As PyTorch holds them: int64 `topk_idx`, all scores [T, E] bf16, bf16
    /// `grad_topk_weights`; grad_w bf16.
    PyTorch,
}

/// One case of a suite.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub name: String,
    pub tokens: usize,
    pub config: RouterConfig,
    pub interface: Interface,
}

/// H200 datasheet rates the suites' speed of light is defined with.
pub const HBM_BYTES_PER_S: f64 = 4.8e12;
pub const BF16_FLOPS_PER_S: f64 = 989e12;

impl Case {
    /// Bytes the backward must read: x, w and the routing inputs of the case's interface.
    pub fn backward_read_bytes(&self) -> f64 {
        let (t, h, e, k) = self.dims();
        let routing = match self.interface {
            // int32 indices, f32 chosen scores, f32 grads
            Interface::Training => 12.0 * t * k,
            // bf16 grads, int64 indices, bf16 scores of all experts
            Interface::PyTorch => 2.0 * t * k + 8.0 * t * k + 2.0 * t * e,
        };
        2.0 * t * h + 2.0 * e * h + routing
    }
    /// Bytes the backward must write: grad_x (bf16) and grad_w (f32 or bf16).
    pub fn backward_write_bytes(&self) -> f64 {
        let (t, h, e, _) = self.dims();
        let grad_w = match self.interface {
            Interface::Training => 4.0,
            Interface::PyTorch => 2.0,
        };
        2.0 * t * h + grad_w * e * h
    }
    /// Bytes the backward must move: its reads and writes.
    pub fn backward_bytes(&self) -> f64 {
        self.backward_read_bytes() + self.backward_write_bytes()
    }
    /// Speed-of-light time of the backward in seconds.
    pub fn backward_sol_s(&self) -> f64 {
        let (t, h, e, _) = self.dims();
        (self.backward_bytes() / HBM_BYTES_PER_S).max(4.0 * t * e * h / BF16_FLOPS_PER_S)
    }
    /// Bytes the forward must read: x and w.
    pub fn forward_read_bytes(&self) -> f64 {
        let (t, h, e, _) = self.dims();
        2.0 * t * h + 2.0 * e * h
    }
    /// Bytes the forward must write: the [T, K] outputs (int32 indices, f32 weights and scores).
    pub fn forward_write_bytes(&self) -> f64 {
        let (t, _, _, k) = self.dims();
        12.0 * t * k
    }
    /// Bytes the forward must move: x, w and the [T, K] outputs.
    pub fn forward_bytes(&self) -> f64 {
        self.forward_read_bytes() + self.forward_write_bytes()
    }
    /// Speed-of-light time of the forward in seconds.
    pub fn forward_sol_s(&self) -> f64 {
        let (t, h, e, _) = self.dims();
        (self.forward_bytes() / HBM_BYTES_PER_S).max(2.0 * t * e * h / BF16_FLOPS_PER_S)
    }
    fn dims(&self) -> (f64, f64, f64, f64) {
        let c = &self.config;
        (
            self.tokens as f64,
            c.hidden_size as f64,
            c.n_routed_experts as f64,
            c.num_experts_per_tok as f64,
        )
    }
}

/// `file` in the crate's `benches/shapes/`.
fn shapes_file(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/shapes")
        .join(file)
}

/// The training suite: `$MOE_ROUTING_SUITE`, else `benches/shapes/suite.json` in the crate.
pub fn default_path() -> PathBuf {
    match std::env::var_os("MOE_ROUTING_SUITE") {
        Some(p) => PathBuf::from(p),
        None => shapes_file("suite.json"),
    }
}

/// The public-range suite: `$MOE_ROUTING_PUBLIC_RANGE`, else `benches/shapes/public_range.json`
/// in the crate.
pub fn public_range_path() -> PathBuf {
    match std::env::var_os("MOE_ROUTING_PUBLIC_RANGE") {
        Some(p) => PathBuf::from(p),
        None => shapes_file("public_range.json"),
    }
}

/// Reads a suite's cases.
pub fn load(path: &Path) -> Result<Vec<Case>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses a suite's JSON: its `"interface"` object if any (else [`Interface::Training`]), then
/// the objects of its "cases" array, flat string/number/bool fields.
pub fn parse(text: &str) -> Result<Vec<Case>, String> {
    let interface = parse_interface(text)?;
    let start = text.find("\"cases\"").ok_or("no \"cases\" in suite")?;
    let rest = &text[start..];
    let open = rest.find('[').ok_or("\"cases\" is not an array")?;
    let mut cases = Vec::new();
    let mut body = &rest[open + 1..];
    loop {
        body = body.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
        if body.starts_with(']') {
            break;
        }
        if !body.starts_with('{') {
            return Err("expected an object in \"cases\"".into());
        }
        let end = body.find('}').ok_or("unterminated case object")?;
        cases.push(parse_case(&body[1..end], interface)?);
        body = &body[end + 1..];
    }
    Ok(cases)
}

/// The value of `"name": value` in the text of a flat object: a string's contents (no escapes
/// in these files), else the number or literal as written.
fn field<'a>(obj: &'a str, name: &str, what: &str) -> Result<&'a str, String> {
    let key = format!("\"{name}\"");
    let at = obj.find(&key).ok_or(format!("{what} lacks {name}"))?;
    let value = obj[at + key.len()..]
        .trim_start()
        .strip_prefix(':')
        .ok_or("expected ':'")?
        .trim_start();
    Ok(match value.strip_prefix('"') {
        Some(s) => s.split('"').next().unwrap_or(""),
        None => value.split([',', '\n', '}']).next().unwrap_or("").trim(),
    })
}

/// The suite's interface: PyTorch's where its `"interface"` object names exactly those dtypes,
/// the training one where there is none; any other is an error rather than a wrong SOL.
fn parse_interface(text: &str) -> Result<Interface, String> {
    let Some(at) = text.find("\"interface\"") else {
        return Ok(Interface::Training);
    };
    let rest = text[at + "\"interface\"".len()..]
        .trim_start()
        .strip_prefix(':')
        .map(str::trim_start)
        .and_then(|r| r.strip_prefix('{'))
        .ok_or("\"interface\" is not an object")?;
    let obj = &rest[..rest.find('}').ok_or("unterminated \"interface\"")?];
    let expected = [
        ("topk_idx", "int64 [T,K]"),
        ("scores", "bf16 [T,E]"),
        ("grad_topk_weights", "bf16 [T,K]"),
        ("x", "bf16 [T,H]"),
        ("w", "bf16 [E,H]"),
        ("grad_x", "bf16 [T,H]"),
        ("grad_w", "bf16 [E,H]"),
    ];
    for (name, dtype) in expected {
        let value = field(obj, name, "interface")?;
        if !value.starts_with(dtype) {
            return Err(format!(
                "interface {name} is \"{value}\": only {dtype} is supported"
            ));
        }
    }
    Ok(Interface::PyTorch)
}

fn parse_case(obj: &str, interface: Interface) -> Result<Case, String> {
    let field = |name: &str| field(obj, name, "case");
    let num = |name: &str| -> Result<usize, String> {
        field(name)?.parse().map_err(|e| format!("{name}: {e}"))
    };
    Ok(Case {
        name: field("name")?.to_string(),
        tokens: num("tokens")?,
        config: RouterConfig {
            hidden_size: num("hidden_size")?,
            n_routed_experts: num("n_routed_experts")?,
            num_experts_per_tok: num("top_k")?,
            n_group: num("n_group")?,
            topk_group: num("topk_group")?,
            routed_scaling_factor: field("routed_scaling_factor")?
                .parse()
                .map_err(|e| format!("routed_scaling_factor: {e}"))?,
            norm_topk_prob: field("norm_topk_prob")? == "true",
        },
        interface,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
