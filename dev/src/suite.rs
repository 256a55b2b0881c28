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

use moe_routing::RouterConfig;

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
/// A file of the repository's `benches/shapes/`.
pub fn shapes_file(file: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    root.join("benches/shapes").join(file)
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
