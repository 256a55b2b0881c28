//! Routes one suite case end to end and prints a summary.
//!
//!     cargo run --release --example route -- [CASE_NAME] [--tokens N]
//!
//! With a CUDA device: GPU forward and backward, checked against the f64 CPU reference.
//! Without one: the CPU reference alone (forward, backward and a routing summary).

use std::time::Instant;

use half::bf16;
use moe_routing::{cuda_device_count, reference, BackwardOptions, Router, Routing};
use moe_routing_dev::suite;
use moe_routing_dev::testing::{bf16_to_f64, fresh_seed, random_grad, to_f64, Inputs, Rng};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or("t3001_g8x4".into());
    let cases = suite::load(&suite::default_path())?;
    let mut case = cases
        .into_iter()
        .find(|c| c.name == name)
        .ok_or_else(|| format!("no suite case named {name}"))?;
    if let Some(i) = args.iter().position(|a| a == "--tokens") {
        case.tokens = args.get(i + 1).ok_or("--tokens needs a value")?.parse()?;
    }
    let (cfg, tokens) = (case.config, case.tokens);
    let k = cfg.num_experts_per_tok;
    let seed = fresh_seed();
    println!(
        "case {} : T={tokens} H={} E={} K={k} groups {}x{} (seed {seed})",
        case.name, cfg.hidden_size, cfg.n_routed_experts, cfg.n_group, cfg.topk_group
    );
    let mut rng = Rng::new(seed);
    let inp = Inputs::random(&cfg, tokens, &mut rng);
    let grad_out = random_grad(tokens * k, &mut rng);

    let t0 = Instant::now();
    let fwd = reference::forward(&cfg, tokens, &inp.x, &inp.w, &inp.bias);
    let bwd = reference::backward(
        &cfg,
        tokens,
        &inp.x,
        &inp.w,
        &fwd.topk_idx,
        &fwd.topk_scores,
        &grad_out,
    );
    println!(
        "CPU reference (f64): forward + backward in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    let mut load = vec![0usize; cfg.n_routed_experts];
    fwd.topk_idx.iter().for_each(|&e| load[e as usize] += 1);
    let (min, max) = (load.iter().min().unwrap(), load.iter().max().unwrap());
    let near = fwd.near_tie.iter().filter(|&&b| b).count();
    println!(
        "  tokens per expert: min {min}, max {max}, mean {:.1}; near-tie rows {near}",
        (tokens * k) as f64 / cfg.n_routed_experts as f64
    );
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    println!(
        "  |grad_x| = {:.4e}, |grad_w| = {:.4e}",
        norm(&bwd.grad_x),
        norm(&bwd.grad_w)
    );

    if cuda_device_count() == 0 {
        println!("no CUDA device: GPU kernels not run");
        return Ok(());
    }
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let s = ctx.default_stream();
    let router = Router::new(cfg)?;
    let (x, w, bias) = (
        s.clone_htod(&inp.x)?,
        s.clone_htod(&inp.w)?,
        s.clone_htod(&inp.bias)?,
    );
    let mut routing = Routing::alloc(&s, &cfg, tokens)?;
    router.forward(&s, tokens, &x, &w, &bias, &mut routing)?;
    let g = s.clone_htod(&grad_out)?;
    let mut grad_x = s.alloc_zeros::<bf16>(tokens * cfg.hidden_size)?;
    let mut grad_w = s.alloc_zeros::<f32>(cfg.n_routed_experts * cfg.hidden_size)?;
    let mut ws = router.alloc_workspace(&s, tokens)?;
    let opts = BackwardOptions::default();
    router.backward(
        &s,
        tokens,
        &x,
        &w,
        &routing.topk_idx,
        &routing.topk_scores,
        &g,
        &mut grad_x,
        &mut grad_w,
        opts,
        &mut ws,
    )?;
    s.synchronize()?;
    let idx = s.clone_dtoh(&routing.topk_idx)?;
    let differing = (0..tokens)
        .filter(|&t| idx[t * k..(t + 1) * k] != fwd.topk_idx[t * k..(t + 1) * k])
        .count();
    println!("GPU: rows whose indices differ from the reference: {differing} (near ties: {near})");
    // The backward is checked on the reference's indices where they agree; use the GPU's saved
    // scores so that both sides differentiate the same routing.
    let scores = s.clone_dtoh(&routing.topk_scores)?;
    let want = reference::backward(&cfg, tokens, &inp.x, &inp.w, &idx, &scores, &grad_out);
    let gx = bf16_to_f64(&s.clone_dtoh(&grad_x)?);
    let gw = to_f64(&s.clone_dtoh(&grad_w)?);
    println!(
        "GPU backward: rel err grad_x {:.2e}, grad_w {:.2e}",
        reference::rel_err(&gx, &want.grad_x),
        reference::rel_err(&gw, &want.grad_w)
    );
    Ok(())
}
