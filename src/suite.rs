//! The benchmark suite (`../shared/bench/suite.json`): a minimal reader of its cases.

use std::path::{Path, PathBuf};

use crate::config::RouterConfig;

/// One case of the suite.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub name: String,
    pub tokens: usize,
    pub config: RouterConfig,
}

/// H200 datasheet rates the suite's speed of light is defined with.
pub const HBM_BYTES_PER_S: f64 = 4.8e12;
pub const BF16_FLOPS_PER_S: f64 = 989e12;

impl Case {
    /// Bytes the backward must move: x, grad_x, w, grad_w (fp32) and the [T, K] inputs.
    pub fn backward_bytes(&self) -> f64 {
        let (t, h, e, k) = self.dims();
        2.0 * t * h + 2.0 * t * h + 2.0 * e * h + 4.0 * e * h + 12.0 * t * k
    }
    /// Speed-of-light time of the backward in seconds.
    pub fn backward_sol_s(&self) -> f64 {
        let (t, h, e, _) = self.dims();
        (self.backward_bytes() / HBM_BYTES_PER_S).max(4.0 * t * e * h / BF16_FLOPS_PER_S)
    }
    /// Bytes the forward must move: x, w and the [T, K] outputs.
    pub fn forward_bytes(&self) -> f64 {
        let (t, h, e, k) = self.dims();
        2.0 * t * h + 2.0 * e * h + 12.0 * t * k
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

/// Where the suite lives: `$MOE_ROUTING_SUITE`, else `../shared/bench/suite.json` from the
/// crate root.
pub fn default_path() -> PathBuf {
    if let Ok(p) = std::env::var("MOE_ROUTING_SUITE") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/bench/suite.json")
}

/// Reads the suite's cases.
pub fn load(path: &Path) -> Result<Vec<Case>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&text)
}

/// Parses the suite's JSON: the objects of its "cases" array, flat string/number/bool fields.
pub fn parse(text: &str) -> Result<Vec<Case>, String> {
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
        cases.push(parse_case(&body[1..end])?);
        body = &body[end + 1..];
    }
    Ok(cases)
}

fn parse_case(obj: &str) -> Result<Case, String> {
    let field = |name: &str| -> Result<&str, String> {
        let key = format!("\"{name}\"");
        let at = obj.find(&key).ok_or(format!("case lacks {name}"))?;
        let after = obj[at + key.len()..]
            .trim_start()
            .strip_prefix(':')
            .ok_or("expected ':'")?;
        let value = after.split([',', '\n']).next().unwrap_or("").trim();
        Ok(value.trim_matches('"'))
    };
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
        assert_eq!(cases[0].tokens, 3001);
        assert_eq!(cases[0].config, RouterConfig::glm45(8, 4));
        assert!(!cases[1].config.norm_topk_prob);
        assert_eq!(cases[1].config.num_experts_per_tok, 2);
    }

    #[test]
    fn sol_matches_the_suite_definition() {
        let case = Case {
            name: "t32768".into(),
            tokens: 32768,
            config: RouterConfig::glm45(8, 4),
        };
        // 4·T·H + 6·E·H + 12·T·K bytes at 4.8 TB/s.
        let bytes = 4.0 * 32768.0 * 5120.0 + 6.0 * 160.0 * 5120.0 + 12.0 * 32768.0 * 8.0;
        assert_eq!(case.backward_bytes(), bytes);
        assert!((case.backward_sol_s() * 1e6 - 141.0).abs() < 1.0);
    }

    #[test]
    fn reads_the_shared_suite_when_present() {
        let path = default_path();
        if !path.exists() {
            eprintln!("suite not found at {}: nothing to read", path.display());
            return;
        }
        let cases = load(&path).unwrap();
        assert_eq!(cases.len(), 16);
        assert!(cases.iter().all(|c| c.config.validate().is_ok()));
    }
}
