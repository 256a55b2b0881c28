//! Random inputs and small helpers shared by the tests, benches and examples.

use half::bf16;

use moe_routing::RouterConfig;

/// splitmix64: small, fast, reproducible from a printed seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A seed from the clock, so that every run checks fresh inputs; print it on failure.
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5EED)
}

/// Router inputs whose logits have unit scale: x uniform in [-1, 1), w uniform scaled by
/// 3/sqrt(H), bias uniform in [-0.1, 0.1).
pub struct Inputs {
    pub x: Vec<bf16>,
    pub w: Vec<bf16>,
    pub bias: Vec<f32>,
}

impl Inputs {
    pub fn random(cfg: &RouterConfig, tokens: usize, rng: &mut Rng) -> Self {
        let (h, e) = (cfg.hidden_size, cfg.n_routed_experts);
        let ws = 3.0 / (h as f32).sqrt();
        Self {
            x: (0..tokens * h)
                .map(|_| bf16::from_f32(rng.uniform()))
                .collect(),
            w: (0..e * h)
                .map(|_| bf16::from_f32(rng.uniform() * ws))
                .collect(),
            bias: (0..e).map(|_| rng.uniform() * 0.1).collect(),
        }
    }
}

/// Gradient of the routing weights: uniform in [-1, 1).
pub fn random_grad(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.uniform()).collect()
}

pub fn to_f64<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&a| a.into()).collect()
}

pub fn bf16_to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|a| a.to_f64()).collect()
}
