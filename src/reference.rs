//! Exact (f64) reference implementation of the grouped top-k MoE router
//! (DeepSeek-V3 / GLM-4.5 "noaux_tc" style), used to validate the fast kernels.
//!
//! Layouts are row-major: `x` is `[T, H]` bf16, `w` is `[E, H]` bf16, `bias` is
//! `[E]` f32 and every per-selection tensor is `[T, K]`.
//!
//! Forward, per token:
//! * `logit[e] = Σ_h x[t,h]·w[e,h]` in f64 (bf16 → f64 is exact),
//! * `s[e] = sigmoid(logit[e])`, `choice[e] = s[e] + bias[e]`,
//! * with `n_group > 1`, only the experts of the `topk_group` best groups
//!   (group score = sum of the two best `choice` values of the group) are
//!   candidates,
//! * the `K` best candidates (by `choice`) are selected in rank order,
//! * scores are the un-biased sigmoids, weights are the (optionally
//!   normalised) scores times `routed_scaling_factor`.
//!
//! Ranking: NaN is worse than every non-NaN value (including -inf), larger is
//! better, ties (and NaN vs NaN) go to the lower index.
//!
//! This is a test reference, not a public API: inconsistent inputs panic.

use std::cmp::Ordering;
use std::thread;

use half::bf16;

use crate::config::RouterConfig;

/// Epsilon added to the sum of the selected scores when normalising.
const NORM_EPS: f64 = 1e-20;
/// Relative distance below which two ranked values count as a near tie.
const TIE_REL: f64 = 1e-5;
/// Number of tokens whose logits are computed together (re-uses each row of
/// `w` while it is hot in cache).
const TOKEN_TILE: usize = 8;

/// Result of [`forward`].
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardOutput {
    /// Selected experts per token, best first, `[T*K]`.
    pub topk_idx: Vec<i32>,
    /// Routing weights (normalised and scaled), `[T*K]`.
    pub topk_weights: Vec<f32>,
    /// Sigmoid scores (without bias) of the selected experts, `[T*K]`.
    pub topk_scores: Vec<f32>,
    /// per token: true where the selection is within 1e-5 relative of a tie
    /// (see [`forward`]).
    pub near_tie: Vec<bool>,
}

impl ForwardOutput {
    fn with_capacity(tokens: usize, k: usize) -> Self {
        ForwardOutput {
            topk_idx: Vec::with_capacity(tokens * k),
            topk_weights: Vec::with_capacity(tokens * k),
            topk_scores: Vec::with_capacity(tokens * k),
            near_tie: Vec::with_capacity(tokens),
        }
    }

    fn append(&mut self, other: ForwardOutput) {
        self.topk_idx.extend(other.topk_idx);
        self.topk_weights.extend(other.topk_weights);
        self.topk_scores.extend(other.topk_scores);
        self.near_tie.extend(other.near_tie);
    }
}

/// Result of [`backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardOutput {
    /// `[T*H]`
    pub grad_x: Vec<f64>,
    /// `[E*H]`
    pub grad_w: Vec<f64>,
}

/// Orders `(value, index)` pairs best-first: non-NaN before NaN, larger values
/// first, ties (including NaN vs NaN and -0.0 vs 0.0) by lower index.
/// This is a total order for distinct indices.
fn rank_cmp(a: f64, ia: usize, b: f64, ib: usize) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (false, true) => Ordering::Less,
        (true, false) => Ordering::Greater,
        (true, true) => ia.cmp(&ib),
        (false, false) => match b.partial_cmp(&a) {
            Some(Ordering::Equal) | None => ia.cmp(&ib),
            Some(ord) => ord,
        },
    }
}

/// True when `a` and `b` (adjacent in a ranking) are within `TIE_REL`
/// relative of each other. Equal infinities count as a tie; NaN never does.
fn is_near(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() < TIE_REL * a.abs().max(b.abs()).max(1e-30)
}

/// True when any adjacent pair of the (already ranked) values is a near tie.
fn has_near_tie(values: impl Iterator<Item = f64>) -> bool {
    let mut prev: Option<f64> = None;
    for v in values {
        if let Some(p) = prev {
            if is_near(p, v) {
                return true;
            }
        }
        prev = Some(v);
    }
    false
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn num_threads() -> usize {
    thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Number of candidate experts per token for this configuration.
fn num_candidates(cfg: &RouterConfig) -> usize {
    if cfg.n_group > 1 {
        cfg.topk_group * (cfg.n_routed_experts / cfg.n_group)
    } else {
        cfg.n_routed_experts
    }
}

fn validate_config(cfg: &RouterConfig) {
    assert!(cfg.hidden_size >= 1, "hidden_size must be >= 1");
    assert!(cfg.n_routed_experts >= 1, "n_routed_experts must be >= 1");
    assert!(
        cfg.num_experts_per_tok >= 1,
        "num_experts_per_tok must be >= 1"
    );
    assert!(
        cfg.n_routed_experts <= i32::MAX as usize,
        "n_routed_experts does not fit in i32"
    );
    if cfg.n_group > 1 {
        assert_eq!(
            cfg.n_routed_experts % cfg.n_group,
            0,
            "n_routed_experts must be divisible by n_group"
        );
        assert!(
            cfg.topk_group >= 1 && cfg.topk_group <= cfg.n_group,
            "topk_group must be in 1..=n_group"
        );
    }
    assert!(
        cfg.num_experts_per_tok <= num_candidates(cfg),
        "num_experts_per_tok ({}) exceeds the number of candidate experts ({})",
        cfg.num_experts_per_tok,
        num_candidates(cfg)
    );
}

/// Selects the top-K experts of one token from its `choice` values
/// (sigmoid + bias). Returns the indices in rank order and the near-tie flag.
fn select(cfg: &RouterConfig, choice: &[f64]) -> (Vec<usize>, bool) {
    let e = choice.len();
    let k = cfg.num_experts_per_tok;
    let by_choice = |a: &usize, b: &usize| rank_cmp(choice[*a], *a, choice[*b], *b);
    let mut near_tie = false;

    let mut cands: Vec<usize> = if cfg.n_group > 1 {
        let n_group = cfg.n_group;
        let gsize = e / n_group;
        let group_score: Vec<f64> = (0..n_group)
            .map(|g| {
                let mut members: Vec<usize> = (g * gsize..(g + 1) * gsize).collect();
                members.sort_by(by_choice);
                // Sum of the two best members (or the only one for groups of 1).
                members
                    .iter()
                    .take(2)
                    .map(|&i| choice[i])
                    .fold(None, |acc: Option<f64>, v| Some(acc.map_or(v, |a| a + v)))
                    .unwrap_or(f64::NAN)
            })
            .collect();
        let mut groups: Vec<usize> = (0..n_group).collect();
        groups.sort_by(|a, b| rank_cmp(group_score[*a], *a, group_score[*b], *b));
        if cfg.topk_group < n_group {
            near_tie |= has_near_tie(groups[..=cfg.topk_group].iter().map(|&g| group_score[g]));
        }
        groups[..cfg.topk_group]
            .iter()
            .flat_map(|&g| g * gsize..(g + 1) * gsize)
            .collect()
    } else {
        (0..e).collect()
    };

    cands.sort_by(by_choice);
    let m = (k + 1).min(cands.len());
    near_tie |= has_near_tie(cands[..m].iter().map(|&i| choice[i]));
    cands.truncate(k);
    (cands, near_tie)
}

/// Routing weights from the selected sigmoid scores (f64).
fn weights_from_scores(cfg: &RouterConfig, s: &[f64]) -> Vec<f64> {
    let c = f64::from(cfg.routed_scaling_factor);
    if cfg.norm_topk_prob {
        let denom = s.iter().sum::<f64>() + NORM_EPS;
        s.iter().map(|&v| v / denom * c).collect()
    } else {
        s.iter().map(|&v| v * c).collect()
    }
}

/// Routes one token given its logits; appends the results to `out`.
fn route_token(cfg: &RouterConfig, logits: &[f64], bias: &[f64], out: &mut ForwardOutput) {
    let s: Vec<f64> = logits.iter().map(|&l| sigmoid(l)).collect();
    let choice: Vec<f64> = s.iter().zip(bias).map(|(&a, &b)| a + b).collect();
    let (idx, near_tie) = select(cfg, &choice);
    let sel: Vec<f64> = idx.iter().map(|&i| s[i]).collect();
    let weights = weights_from_scores(cfg, &sel);
    out.topk_idx.extend(idx.iter().map(|&i| i as i32));
    out.topk_scores.extend(sel.iter().map(|&v| v as f32));
    out.topk_weights.extend(weights.iter().map(|&v| v as f32));
    out.near_tie.push(near_tie);
}

/// f64 dot product with eight independent accumulators (vectorisable,
/// deterministic).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for ((s, &p), &q) in acc.iter_mut().zip(xa).zip(xb) {
            *s += p * q;
        }
    }
    let mut tail = 0.0f64;
    for (&p, &q) in ra.iter().zip(rb) {
        tail += p * q;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Forward over a contiguous block of tokens (`x` holds whole rows).
fn forward_chunk(cfg: &RouterConfig, x: &[bf16], w64: &[f64], bias64: &[f64]) -> ForwardOutput {
    let h = cfg.hidden_size;
    let e = cfg.n_routed_experts;
    let rows = x.len() / h;
    let mut out = ForwardOutput::with_capacity(rows, cfg.num_experts_per_tok);
    let mut xbuf = vec![0.0f64; TOKEN_TILE * h];
    let mut logits = vec![0.0f64; TOKEN_TILE * e];
    for tile in x.chunks(TOKEN_TILE * h) {
        let nr = tile.len() / h;
        for (d, s) in xbuf.iter_mut().zip(tile) {
            *d = s.to_f64();
        }
        for (ei, wrow) in w64.chunks_exact(h).enumerate() {
            for (r, xrow) in xbuf[..nr * h].chunks_exact(h).enumerate() {
                logits[r * e + ei] = dot(xrow, wrow);
            }
        }
        for lrow in logits[..nr * e].chunks_exact(e) {
            route_token(cfg, lrow, bias64, &mut out);
        }
    }
    out
}

/// Reference forward: see the module documentation for the exact semantics.
///
/// `near_tie[t]` is true if either
/// (a) `n_group > 1`, `topk_group < n_group` and, among the group scores
///     sorted best-first, an adjacent pair among the first `topk_group + 1`
///     differs by less than `1e-5·max(|a|,|b|,1e-30)`, or
/// (b) among the kept candidates' `choice` values sorted best-first, an
///     adjacent pair among the first `K + 1` (fewer if fewer candidates)
///     differs by less than that.
///
/// Equal infinities count as ties; NaN values never do.
pub fn forward(
    cfg: &RouterConfig,
    tokens: usize,
    x: &[bf16],
    w: &[bf16],
    bias: &[f32],
) -> ForwardOutput {
    validate_config(cfg);
    let h = cfg.hidden_size;
    let e = cfg.n_routed_experts;
    let k = cfg.num_experts_per_tok;
    assert_eq!(x.len(), tokens * h, "x must be [T, H]");
    assert_eq!(w.len(), e * h, "w must be [E, H]");
    assert_eq!(bias.len(), e, "bias must be [E]");

    let w64: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
    let bias64: Vec<f64> = bias.iter().map(|&v| f64::from(v)).collect();

    let mut out = ForwardOutput::with_capacity(tokens, k);
    if tokens == 0 {
        return out;
    }
    let nthreads = num_threads().min(tokens);
    let chunk = tokens.div_ceil(nthreads);
    let parts: Vec<ForwardOutput> = thread::scope(|scope| {
        let handles: Vec<_> = x
            .chunks(chunk * h)
            .map(|xc| {
                let (w64, bias64) = (&w64, &bias64);
                scope.spawn(move || forward_chunk(cfg, xc, w64, bias64))
            })
            .collect();
        handles
            .into_iter()
            .map(|hdl| hdl.join().expect("forward worker panicked"))
            .collect()
    });
    for part in parts {
        out.append(part);
    }
    out
}

/// The routing gradient of one token: grad_logit_k for k in 0..K (f64).
///
/// With `c = routed_scaling_factor`: if `norm_topk_prob`,
/// `S = Σ s + 1e-20`, `dot = Σ g·s`, `grad_s_k = c·(g_k/S − dot/S²)`,
/// otherwise `grad_s_k = c·g_k`; then `grad_logit_k = grad_s_k·s_k·(1 − s_k)`.
pub fn routing_grad(cfg: &RouterConfig, scores: &[f32], grad_w: &[f32]) -> Vec<f64> {
    assert_eq!(
        scores.len(),
        grad_w.len(),
        "scores and grads differ in length"
    );
    assert_eq!(
        scores.len(),
        cfg.num_experts_per_tok,
        "routing_grad expects K values"
    );
    let c = f64::from(cfg.routed_scaling_factor);
    let s: Vec<f64> = scores.iter().map(|&v| f64::from(v)).collect();
    let g: Vec<f64> = grad_w.iter().map(|&v| f64::from(v)).collect();
    let grad_s: Vec<f64> = if cfg.norm_topk_prob {
        let sum = s.iter().sum::<f64>() + NORM_EPS;
        let dot = g.iter().zip(&s).map(|(&a, &b)| a * b).sum::<f64>();
        g.iter()
            .map(|&gk| c * (gk / sum - dot / (sum * sum)))
            .collect()
    } else {
        g.iter().map(|&gk| c * gk).collect()
    };
    grad_s
        .iter()
        .zip(&s)
        .map(|(&gs, &sk)| gs * sk * (1.0 - sk))
        .collect()
}

/// `Precision::TorchBf16`'s routing gradient of one token: the eager bf16 PyTorch composition,
/// each elementwise step computed in f32 and rounded to bf16, in its order:
///
/// ```text
/// S    = bf16(bf16(Σ s) + 1e-20)                 the forward's normalizer
/// g'   = bf16(g · scale)                         scaling
/// dot  = bf16(Σ_k bf16(g'_k · bf16(s_k / S)))    the normalization's products and their sum
/// q    = bf16(bf16(g' − dot) / S)                the difference and the quotient (g' unnormalized)
/// G    = bf16(bf16(q · s) · bf16(1 − s))         the sigmoid's gradient
/// ```
///
/// `scores` are rounded to bf16 first (PyTorch holds them so).
pub fn routing_grad_torch_bf16(cfg: &RouterConfig, scores: &[f32], grad_w: &[f32]) -> Vec<f64> {
    let r = |v: f32| bf16::from_f32(v).to_f32();
    let c = cfg.routed_scaling_factor;
    let s: Vec<f32> = scores.iter().map(|&v| r(v)).collect();
    let g: Vec<f32> = grad_w.iter().map(|&v| r(v * c)).collect();
    let q: Vec<f32> = if cfg.norm_topk_prob {
        let sum = r(r(s.iter().sum::<f32>()) + 1e-20);
        let dot = r(g
            .iter()
            .zip(&s)
            .map(|(&gk, &sk)| r(gk * r(sk / sum)))
            .sum::<f32>());
        g.iter().map(|&gk| r(r(gk - dot) / sum)).collect()
    } else {
        g
    };
    q.iter()
        .zip(&s)
        .map(|(&qk, &sk)| f64::from(r(r(qk * sk) * r(1.0 - sk))))
        .collect()
}

/// Reference backward: gradients of `x` and `w` given the gradient of the
/// routing weights (the bias gets no gradient).
///
/// `G[t, topk_idx[t,k]] += routing_grad(...)[k]`, `grad_x = G·w`,
/// `grad_w = Gᵀ·x`, all in f64, exploiting the K-sparsity of `G`.
pub fn backward(
    cfg: &RouterConfig,
    tokens: usize,
    x: &[bf16],
    w: &[bf16],
    topk_idx: &[i32],
    topk_scores: &[f32],
    grad_topk_weights: &[f32],
) -> BackwardOutput {
    backward_with(
        cfg,
        tokens,
        x,
        w,
        topk_idx,
        topk_scores,
        grad_topk_weights,
        routing_grad,
    )
}

/// [`backward`] with `Precision::TorchBf16`'s routing gradient
/// ([`routing_grad_torch_bf16`]); the GEMMs exact, as there.
pub fn backward_torch_bf16(
    cfg: &RouterConfig,
    tokens: usize,
    x: &[bf16],
    w: &[bf16],
    topk_idx: &[i32],
    topk_scores: &[f32],
    grad_topk_weights: &[f32],
) -> BackwardOutput {
    backward_with(
        cfg,
        tokens,
        x,
        w,
        topk_idx,
        topk_scores,
        grad_topk_weights,
        routing_grad_torch_bf16,
    )
}

#[allow(clippy::too_many_arguments)]
fn backward_with(
    cfg: &RouterConfig,
    tokens: usize,
    x: &[bf16],
    w: &[bf16],
    topk_idx: &[i32],
    topk_scores: &[f32],
    grad_topk_weights: &[f32],
    routing_grad: fn(&RouterConfig, &[f32], &[f32]) -> Vec<f64>,
) -> BackwardOutput {
    validate_config(cfg);
    let h = cfg.hidden_size;
    let e = cfg.n_routed_experts;
    let k = cfg.num_experts_per_tok;
    assert_eq!(x.len(), tokens * h, "x must be [T, H]");
    assert_eq!(w.len(), e * h, "w must be [E, H]");
    assert_eq!(topk_idx.len(), tokens * k, "topk_idx must be [T, K]");
    assert_eq!(topk_scores.len(), tokens * k, "topk_scores must be [T, K]");
    assert_eq!(
        grad_topk_weights.len(),
        tokens * k,
        "grad_topk_weights must be [T, K]"
    );

    let idx: Vec<usize> = topk_idx
        .iter()
        .map(|&i| {
            assert!(i >= 0 && (i as usize) < e, "expert index {i} out of range");
            i as usize
        })
        .collect();
    let gl: Vec<f64> = topk_scores
        .chunks_exact(k)
        .zip(grad_topk_weights.chunks_exact(k))
        .flat_map(|(s, g)| routing_grad(cfg, s, g))
        .collect();

    let mut grad_x = vec![0.0f64; tokens * h];
    let mut grad_w = vec![0.0f64; e * h];
    let nthreads = num_threads();

    // grad_x = G·w: each token touches K rows of w; parallel over tokens.
    if tokens > 0 {
        let w64: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
        let chunk = tokens.div_ceil(nthreads.min(tokens));
        thread::scope(|scope| {
            for (ci, gx) in grad_x.chunks_mut(chunk * h).enumerate() {
                let (w64, idx, gl) = (&w64, &idx, &gl);
                scope.spawn(move || {
                    for (r, row) in gx.chunks_exact_mut(h).enumerate() {
                        let t = ci * chunk + r;
                        for kk in 0..k {
                            let g = gl[t * k + kk];
                            let ei = idx[t * k + kk];
                            let wrow = &w64[ei * h..(ei + 1) * h];
                            for (d, &wv) in row.iter_mut().zip(wrow) {
                                *d += g * wv;
                            }
                        }
                    }
                });
            }
        });
    }

    // grad_w = Gᵀ·x: parallel over disjoint expert ranges, each accumulating
    // tokens in order (deterministic, independent of the thread count).
    if tokens > 0 {
        let chunk = e.div_ceil(nthreads.min(e));
        thread::scope(|scope| {
            for (ci, gw) in grad_w.chunks_mut(chunk * h).enumerate() {
                let (idx, gl) = (&idx, &gl);
                scope.spawn(move || {
                    let e0 = ci * chunk;
                    let e1 = e0 + gw.len() / h;
                    for t in 0..tokens {
                        let xrow = &x[t * h..(t + 1) * h];
                        for kk in 0..k {
                            let ei = idx[t * k + kk];
                            if ei < e0 || ei >= e1 {
                                continue;
                            }
                            let g = gl[t * k + kk];
                            let dst = &mut gw[(ei - e0) * h..(ei - e0 + 1) * h];
                            for (d, xv) in dst.iter_mut().zip(xrow) {
                                *d += g * xv.to_f64();
                            }
                        }
                    }
                });
            }
        });
    }

    BackwardOutput { grad_x, grad_w }
}

/// ‖a − b‖₂ / ‖b‖₂.
///
/// Returns 0 if both are zero (or identical), +inf if `b` is zero but `a` is
/// not, and +inf if `a` contains a NaN or the result would otherwise be NaN.
/// The norms are computed with scaling, so tiny or huge values do not
/// underflow/overflow.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err: length mismatch");
    if a.iter().any(|v| v.is_nan()) {
        return f64::INFINITY;
    }
    if a.iter().chain(b).any(|v| !v.is_finite()) {
        // Non-finite values: only an exact match counts as no error.
        return if a.iter().zip(b).all(|(p, q)| p == q) {
            0.0
        } else {
            f64::INFINITY
        };
    }
    let d_max = a
        .iter()
        .zip(b)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f64, f64::max);
    if d_max == 0.0 {
        return 0.0;
    }
    let b_max = b.iter().map(|v| v.abs()).fold(0.0f64, f64::max);
    if b_max == 0.0 {
        return f64::INFINITY;
    }
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(p, q)| {
            let d = (p - q) / d_max;
            d * d
        })
        .sum();
    let den: f64 = b
        .iter()
        .map(|q| {
            let v = q / b_max;
            v * v
        })
        .sum();
    let r = (d_max / b_max) * (num / den).sqrt();
    if r.is_nan() {
        f64::INFINITY
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: tiny deterministic PRNG.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Self {
            Rng(seed)
        }

        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in [0, 1).
        fn uniform(&mut self) -> f64 {
            (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
        }

        /// Uniform in [-scale, scale).
        fn sym(&mut self, scale: f64) -> f64 {
            (2.0 * self.uniform() - 1.0) * scale
        }

        fn bf16_vec(&mut self, n: usize, scale: f64) -> Vec<bf16> {
            (0..n).map(|_| bf16::from_f64(self.sym(scale))).collect()
        }

        fn f32_vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
            (0..n).map(|_| self.sym(scale) as f32).collect()
        }
    }

    fn cfg(
        h: usize,
        e: usize,
        k: usize,
        n_group: usize,
        topk_group: usize,
        scale: f32,
        norm: bool,
    ) -> RouterConfig {
        RouterConfig {
            hidden_size: h,
            n_routed_experts: e,
            num_experts_per_tok: k,
            n_group,
            topk_group,
            routed_scaling_factor: scale,
            norm_topk_prob: norm,
        }
    }

    fn to_f64(v: &[bf16]) -> Vec<f64> {
        v.iter().map(|x| x.to_f64()).collect()
    }

    /// Routing weights in f64 for fixed expert indices, from f64 x and w.
    fn weights_fixed(
        cfg: &RouterConfig,
        tokens: usize,
        x: &[f64],
        w: &[f64],
        idx: &[i32],
    ) -> Vec<f64> {
        let h = cfg.hidden_size;
        let k = cfg.num_experts_per_tok;
        let mut out = Vec::with_capacity(tokens * k);
        for t in 0..tokens {
            let xrow = &x[t * h..(t + 1) * h];
            let s: Vec<f64> = idx[t * k..(t + 1) * k]
                .iter()
                .map(|&e| {
                    let e = e as usize;
                    let wrow = &w[e * h..(e + 1) * h];
                    let logit: f64 = xrow.iter().zip(wrow).map(|(a, b)| a * b).sum();
                    sigmoid(logit)
                })
                .collect();
            out.extend(weights_from_scores(cfg, &s));
        }
        out
    }

    fn loss(
        cfg: &RouterConfig,
        tokens: usize,
        x: &[f64],
        w: &[f64],
        idx: &[i32],
        g: &[f32],
    ) -> f64 {
        weights_fixed(cfg, tokens, x, w, idx)
            .iter()
            .zip(g)
            .map(|(a, &b)| a * f64::from(b))
            .sum()
    }

    fn fd_check(norm: bool, seed: u64) {
        let (t, h, e, k) = (3, 16, 16, 4);
        let c = cfg(h, e, k, 4, 2, 2.5, norm);
        let mut rng = Rng::new(seed);
        let x = rng.bf16_vec(t * h, 1.0);
        let w = rng.bf16_vec(e * h, 0.5);
        let bias = rng.f32_vec(e, 0.1);
        let g = rng.f32_vec(t * k, 1.0);

        let fwd = forward(&c, t, &x, &w, &bias);
        let bwd = backward(&c, t, &x, &w, &fwd.topk_idx, &fwd.topk_scores, &g);
        assert_eq!(bwd.grad_x.len(), t * h);
        assert_eq!(bwd.grad_w.len(), e * h);

        let x64 = to_f64(&x);
        let w64 = to_f64(&w);
        let idx = &fwd.topk_idx;

        // The f64 helper agrees with the forward's weights at the base point.
        let base = weights_fixed(&c, t, &x64, &w64, idx);
        for (a, &b) in base.iter().zip(&fwd.topk_weights) {
            assert!((a - f64::from(b)).abs() <= 1e-6 * a.abs().max(1.0));
        }

        let eps = 1e-6;
        let fd = |xv: &[f64], wv: &[f64], which_x: bool, i: usize| -> f64 {
            let (mut xp, mut wp) = (xv.to_vec(), wv.to_vec());
            let (mut xm, mut wm) = (xv.to_vec(), wv.to_vec());
            if which_x {
                xp[i] += eps;
                xm[i] -= eps;
            } else {
                wp[i] += eps;
                wm[i] -= eps;
            }
            (loss(&c, t, &xp, &wp, idx, &g) - loss(&c, t, &xm, &wm, idx, &g)) / (2.0 * eps)
        };
        let fd_x: Vec<f64> = (0..t * h).map(|i| fd(&x64, &w64, true, i)).collect();
        let fd_w: Vec<f64> = (0..e * h).map(|i| fd(&x64, &w64, false, i)).collect();

        let ex = rel_err(&bwd.grad_x, &fd_x);
        let ew = rel_err(&bwd.grad_w, &fd_w);
        assert!(
            fd_x.iter().any(|v| *v != 0.0) && fd_w.iter().any(|v| *v != 0.0),
            "degenerate finite-difference gradients"
        );
        assert!(ex < 1e-6, "grad_x rel err {ex:e} (norm={norm})");
        assert!(ew < 1e-6, "grad_w rel err {ew:e} (norm={norm})");
    }

    #[test]
    fn backward_matches_finite_differences_norm() {
        fd_check(true, 1);
        fd_check(true, 2);
    }

    #[test]
    fn backward_matches_finite_differences_no_norm() {
        fd_check(false, 3);
        fd_check(false, 4);
    }

    #[test]
    fn backward_matches_dense_products() {
        let (t, h, e, k) = (37, 24, 32, 6);
        let c = cfg(h, e, k, 8, 3, 1.7, true);
        let mut rng = Rng::new(11);
        let x = rng.bf16_vec(t * h, 1.0);
        let w = rng.bf16_vec(e * h, 0.3);
        let bias = rng.f32_vec(e, 0.05);
        let g = rng.f32_vec(t * k, 1.0);
        let fwd = forward(&c, t, &x, &w, &bias);
        let bwd = backward(&c, t, &x, &w, &fwd.topk_idx, &fwd.topk_scores, &g);

        let mut dense = vec![0.0f64; t * e];
        for tt in 0..t {
            let gl = routing_grad(
                &c,
                &fwd.topk_scores[tt * k..(tt + 1) * k],
                &g[tt * k..(tt + 1) * k],
            );
            for kk in 0..k {
                dense[tt * e + fwd.topk_idx[tt * k + kk] as usize] += gl[kk];
            }
        }
        let (x64, w64) = (to_f64(&x), to_f64(&w));
        let mut gx = vec![0.0f64; t * h];
        let mut gw = vec![0.0f64; e * h];
        for tt in 0..t {
            for ee in 0..e {
                for hh in 0..h {
                    gx[tt * h + hh] += dense[tt * e + ee] * w64[ee * h + hh];
                    gw[ee * h + hh] += dense[tt * e + ee] * x64[tt * h + hh];
                }
            }
        }
        assert!(rel_err(&bwd.grad_x, &gx) < 1e-12);
        assert!(rel_err(&bwd.grad_w, &gw) < 1e-12);
    }

    #[test]
    fn routing_grad_formulas() {
        let c = cfg(4, 8, 2, 1, 1, 2.0, false);
        let gl = routing_grad(&c, &[0.5, 0.25], &[1.0, -2.0]);
        assert_eq!(gl, vec![2.0 * 0.25, 2.0 * -2.0 * 0.1875]);
        let c = cfg(4, 8, 2, 1, 1, 2.0, true);
        let gl = routing_grad(&c, &[0.5, 0.25], &[1.0, -2.0]);
        let (s, dot) = (0.75 + 1e-20, 0.5 - 0.5);
        let want = [
            2.0 * (1.0 / s - dot / (s * s)) * 0.25,
            2.0 * (-2.0 / s - dot / (s * s)) * 0.1875,
        ];
        for (a, b) in gl.iter().zip(&want) {
            assert!((a - b).abs() < 1e-15);
        }
    }

    #[test]
    fn torch_bf16_routing_grad_rounds_each_step() {
        let mut rng = Rng::new(17);
        for norm in [true, false] {
            let c = cfg(4, 160, 8, 1, 1, 2.5, norm);
            for _ in 0..200 {
                let s: Vec<f32> = (0..8)
                    .map(|_| (0.01 + 0.98 * rng.uniform()) as f32)
                    .collect();
                let g: Vec<f32> = (0..8).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect();
                let exact = routing_grad(&c, &s, &g);
                let torch = routing_grad_torch_bf16(&c, &s, &g);
                // Every value a bf16, and within a few bf16 roundings of the exact gradient
                // (the normalization's difference cancels: measured against its terms' scale).
                let scale = exact.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                for (t, e) in torch.iter().zip(&exact) {
                    assert_eq!(f64::from(bf16::from_f64(*t).to_f32()), *t);
                    assert!((t - e).abs() <= 0.05 * scale, "{t} vs {e} (scale {scale})");
                }
            }
        }
        // One token by hand, K = 2, scale 1: S = 0.75, w = (2/3 → 0.66796875, 1/3 → 0.333984375),
        // dot = bf16(1·0.66796875 + bf16(-2·0.333984375)) = 0.66796875 - 0.66796875 = 0.
        let c = cfg(4, 8, 2, 1, 1, 1.0, true);
        let got = routing_grad_torch_bf16(&c, &[0.5, 0.25], &[1.0, -2.0]);
        let r = |v: f32| f64::from(bf16::from_f32(v).to_f32());
        let q = [r(1.0 / 0.75), r(-2.0 / 0.75)];
        assert_eq!(
            got,
            vec![
                r(r(q[0] as f32 * 0.5) as f32 * 0.5),
                r(r(q[1] as f32 * 0.25) as f32 * 0.75)
            ]
        );
    }

    /// w all zero → every sigmoid is exactly 0.5 and `bias` alone decides.
    fn bias_only(c: &RouterConfig, bias: &[f32]) -> ForwardOutput {
        let t = 2;
        let mut rng = Rng::new(5);
        let x = rng.bf16_vec(t * c.hidden_size, 1.0);
        let w = vec![bf16::ZERO; c.n_routed_experts * c.hidden_size];
        let out = forward(c, t, &x, &w, bias);
        assert!(out.topk_scores.iter().all(|&s| s == 0.5));
        out
    }

    #[test]
    fn group_selection_and_tie_breaking() {
        // Groups of two: scores g0 = 1.5 + (-0.5) = 1.0, g1 = 1.6, g2 = 1.4,
        // g3 = 1.0. Expert 0 is the global best but group 0 is not kept.
        let bias = [1.0f32, -1.0, 0.3, 0.3, 0.2, 0.2, 0.0, 0.0];
        let c = cfg(4, 8, 3, 4, 2, 1.0, false);
        let out = bias_only(&c, &bias);
        for tok in 0..2 {
            let idx = &out.topk_idx[tok * 3..(tok + 1) * 3];
            assert!(!idx.contains(&0) && !idx.contains(&1));
            // 2 and 3 tie (lower index first), 4 beats its twin 5.
            assert_eq!(idx, &[2, 3, 4]);
            assert!(out.near_tie[tok]);
        }
        assert_eq!(out.topk_weights, vec![0.5f32; 6]);

        // Keep three groups: g0 and g3 tie at 1.0, the lower index (g0) wins.
        let c = cfg(4, 8, 3, 4, 3, 1.0, false);
        let out = bias_only(&c, &bias);
        assert_eq!(&out.topk_idx[..3], &[0, 2, 3]);
        assert!(out.near_tie[0]);

        // K = 1 with a clear winner: the g0/g3 tie lies beyond the first
        // topk_group + 1 groups, so it is not flagged.
        let c = cfg(4, 8, 1, 4, 2, 1.0, false);
        let bias2 = [1.0f32, -1.0, 0.3, 0.2, 0.25, 0.2, 0.0, 0.0];
        let out = bias_only(&c, &bias2);
        // g0 = 1.0, g1 = 1.5, g2 = 1.45, g3 = 1.0 → keep g1, g2 → best is 2.
        assert_eq!(&out.topk_idx[..1], &[2]);
        assert!(!out.near_tie[0]);

        // Well separated values: no near tie, selection from the best groups.
        let bias3: Vec<f32> = (0..8).map(|e| e as f32 * 0.01).collect();
        let c = cfg(4, 8, 3, 4, 2, 1.0, false);
        let out = bias_only(&c, &bias3);
        assert_eq!(&out.topk_idx[..3], &[7, 6, 5]);
        assert_eq!(out.near_tie, vec![false, false]);

        // Exact ties everywhere: lowest indices win.
        let c = cfg(4, 8, 3, 1, 1, 1.0, true);
        let out = bias_only(&c, &[0.0; 8]);
        assert_eq!(&out.topk_idx[..3], &[0, 1, 2]);
        assert!(out.near_tie[0]);
    }

    #[test]
    fn nan_handling() {
        let (t, h, e) = (5, 8, 16);
        let mut rng = Rng::new(7);
        let x = rng.bf16_vec(t * h, 1.0);
        let w = rng.bf16_vec(e * h, 0.5);
        let nan_bias = vec![f32::NAN; e];

        // All NaN choices: lowest indices of the kept candidates (groups 0, 1).
        for (k, n_group, topk_group) in [(4, 4, 2), (6, 4, 2), (5, 1, 1), (8, 2, 1)] {
            let c = cfg(h, e, k, n_group, topk_group, 2.5, true);
            let out = forward(&c, t, &x, &w, &nan_bias);
            let want: Vec<i32> = (0..k as i32).collect();
            for tok in 0..t {
                assert_eq!(&out.topk_idx[tok * k..(tok + 1) * k], want.as_slice());
            }
            assert!(out.topk_scores.iter().all(|s| s.is_finite()));
            assert!(out.topk_weights.iter().all(|s| s.is_finite()));
        }

        // A single NaN bias on the otherwise best expert is never picked.
        let mut bias: Vec<f32> = (0..e).map(|i| i as f32 * 0.01).collect();
        bias[e - 1] = f32::NAN;
        let c = cfg(h, e, 4, 1, 1, 1.0, false);
        let out = bias_only(&c, &bias);
        assert_eq!(&out.topk_idx[..4], &[14, 13, 12, 11]);

        // A NaN row of w makes expert 3's logit (and score) NaN: it is never
        // selected, even when all other experts are selected.
        let mut w_nan = w.clone();
        w_nan[3 * h] = bf16::NAN;
        let bias = rng.f32_vec(e, 0.1);
        for (n_group, topk_group) in [(1, 1), (4, 4)] {
            let c = cfg(h, e, e - 1, n_group, topk_group, 1.0, true);
            let out = forward(&c, t, &x, &w_nan, &bias);
            for tok in 0..t {
                let mut idx = out.topk_idx[tok * (e - 1)..(tok + 1) * (e - 1)].to_vec();
                assert!(!idx.contains(&3));
                idx.sort_unstable();
                idx.dedup();
                assert_eq!(idx.len(), e - 1);
            }
            assert!(out.topk_weights.iter().all(|v| v.is_finite()));
        }

        // -inf beats NaN.
        let mut bias = vec![f32::NAN; e];
        bias[9] = f32::NEG_INFINITY;
        let c = cfg(h, e, 2, 1, 1, 1.0, false);
        let out = bias_only(&c, &bias);
        assert_eq!(&out.topk_idx[..2], &[9, 0]);
    }

    #[test]
    fn normalized_weights_sum_to_scale() {
        let (t, h, e, k) = (20, 32, 64, 8);
        let mut rng = Rng::new(9);
        let x = rng.bf16_vec(t * h, 1.0);
        let w = rng.bf16_vec(e * h, 0.5);
        let bias = rng.f32_vec(e, 0.1);
        let c = cfg(h, e, k, 8, 4, 2.5, true);
        let out = forward(&c, t, &x, &w, &bias);
        for tok in 0..t {
            let sum: f64 = out.topk_weights[tok * k..(tok + 1) * k]
                .iter()
                .map(|&v| f64::from(v))
                .sum();
            assert!((sum - 2.5).abs() < 1e-6, "token {tok}: sum {sum}");
        }
        // Without normalisation the weights are the scaled scores.
        let c = cfg(h, e, k, 8, 4, 2.5, false);
        let out2 = forward(&c, t, &x, &w, &bias);
        assert_eq!(out.topk_idx, out2.topk_idx);
        for (wt, s) in out2.topk_weights.iter().zip(&out2.topk_scores) {
            assert!((f64::from(*wt) - 2.5 * f64::from(*s)).abs() < 1e-6);
        }
    }

    /// Independent, straightforward implementation (finite data only):
    /// masked -inf groups and a stable descending sort.
    fn naive_topk(c: &RouterConfig, x: &[f64], w: &[f64], bias: &[f32]) -> Vec<i32> {
        let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        let mut choice: Vec<f64> = (0..e)
            .map(|ee| {
                let l: f64 = (0..h).map(|hh| x[hh] * w[ee * h + hh]).sum();
                1.0 / (1.0 + (-l).exp()) + f64::from(bias[ee])
            })
            .collect();
        if c.n_group > 1 {
            let gs = e / c.n_group;
            let mut scores: Vec<(usize, f64)> = (0..c.n_group)
                .map(|g| {
                    let mut v = choice[g * gs..(g + 1) * gs].to_vec();
                    v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                    (g, v[0] + v[1])
                })
                .collect();
            scores.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
            let kept: Vec<usize> = scores[..c.topk_group].iter().map(|p| p.0).collect();
            for (ee, v) in choice.iter_mut().enumerate() {
                if !kept.contains(&(ee / gs)) {
                    *v = f64::NEG_INFINITY;
                }
            }
        }
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| choice[b].partial_cmp(&choice[a]).unwrap());
        order[..k].iter().map(|&i| i as i32).collect()
    }

    #[test]
    fn forward_matches_naive_and_is_thread_independent() {
        let (t, h, e) = (53, 40, 32);
        let mut rng = Rng::new(13);
        let x = rng.bf16_vec(t * h, 1.0);
        let w = rng.bf16_vec(e * h, 0.4);
        let bias = rng.f32_vec(e, 0.2);
        let (x64, w64) = (to_f64(&x), to_f64(&w));
        for (k, n_group, topk_group) in [(8, 8, 4), (4, 4, 2), (6, 1, 1), (2, 16, 1), (3, 16, 5)] {
            let c = cfg(h, e, k, n_group, topk_group, 2.5, true);
            let out = forward(&c, t, &x, &w, &bias);
            assert_eq!(out.topk_idx.len(), t * k);
            assert_eq!(out.near_tie.len(), t);
            for tok in 0..t {
                let naive = naive_topk(&c, &x64[tok * h..(tok + 1) * h], &w64, &bias);
                assert_eq!(&out.topk_idx[tok * k..(tok + 1) * k], naive.as_slice());
                let single = forward(&c, 1, &x[tok * h..(tok + 1) * h], &w, &bias);
                assert_eq!(single.topk_idx, out.topk_idx[tok * k..(tok + 1) * k]);
                assert_eq!(
                    single.topk_weights,
                    out.topk_weights[tok * k..(tok + 1) * k]
                );
                assert_eq!(single.topk_scores, out.topk_scores[tok * k..(tok + 1) * k]);
                assert_eq!(single.near_tie[0], out.near_tie[tok]);
            }
        }
        // Zero tokens.
        let c = cfg(h, e, 4, 4, 2, 1.0, true);
        let out = forward(&c, 0, &[], &w, &bias);
        assert!(out.topk_idx.is_empty() && out.near_tie.is_empty());
        let b = backward(&c, 0, &[], &w, &[], &[], &[]);
        assert!(b.grad_x.is_empty());
        assert!(b.grad_w.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn rel_err_edge_cases() {
        assert_eq!(rel_err(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
        assert_eq!(rel_err(&[1.0, 0.0], &[0.0, 0.0]), f64::INFINITY);
        assert_eq!(rel_err(&[f64::NAN, 0.0], &[1.0, 0.0]), f64::INFINITY);
        assert_eq!(rel_err(&[1.0, 2.0], &[f64::NAN, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[3.0, 4.0], &[3.0, 4.0]), 0.0);
        let r = rel_err(&[3.0, 4.0 + 5e-3], &[3.0, 4.0]);
        assert!((r - 1e-3).abs() < 1e-12);
        let r = rel_err(&[3e-200, 4e-200 + 5e-203], &[3e-200, 4e-200]);
        assert!((r - 1e-3).abs() < 1e-9);
        let r = rel_err(&[3e200, 4e200 + 5e197], &[3e200, 4e200]);
        assert!((r - 1e-3).abs() < 1e-9);
    }

    #[test]
    #[should_panic]
    fn inconsistent_lengths_panic() {
        let c = cfg(4, 8, 2, 1, 1, 1.0, true);
        let _ = forward(&c, 2, &[bf16::ZERO; 7], &[bf16::ZERO; 32], &[0.0; 8]);
    }

    /// Timing at production size; run with
    /// `cargo test --release --lib reference -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn large_shape_timing() {
        let (t, h, e, k) = (2048, 5120, 160, 8);
        let c = cfg(h, e, k, 8, 4, 2.5, true);
        let mut rng = Rng::new(17);
        let x = rng.bf16_vec(t * h, 1.0);
        let w = rng.bf16_vec(e * h, 0.02);
        let bias = rng.f32_vec(e, 0.01);
        let g = rng.f32_vec(t * k, 1.0);
        let start = std::time::Instant::now();
        let fwd = forward(&c, t, &x, &w, &bias);
        let tf = start.elapsed();
        let start = std::time::Instant::now();
        let bwd = backward(&c, t, &x, &w, &fwd.topk_idx, &fwd.topk_scores, &g);
        let tb = start.elapsed();
        let ties = fwd.near_tie.iter().filter(|&&v| v).count();
        println!("forward {tf:?}, backward {tb:?}, near ties {ties}/{t}");
        assert!(bwd.grad_x.iter().all(|v| v.is_finite()));
    }
}
