"""Every model router shape against eager PyTorch and its ceiling, one call at a time.

    python python/benches/models.py [--json PATH] [--models FILE] [--repeats N] [--dry-run]
                                    [--only NAME,...] [--tokens T,...]

For each model of ``benches/shapes/models.json`` at each of its token counts, on one GPU:

- ``fwd_us``, ``bwd_us``: the library's forward (``moe_routing::route``) and backward
  (``moe_routing::route_backward``, the training dtypes the forward returns: int32 indices,
  f32 [T, K] scores and gradients, f32 grad_w);
- ``torch_fwd_us``, ``torch_bwd_us``: the eager bf16 PyTorch composition (one GEMM, then
  sigmoid, bias, group mask, top-k, gather, normalization and scale; its autograd backward:
  the elementwise steps, then the two GEMMs);
- ``fwd_ceiling_us``, ``bwd_ceiling_us``: the larger of the pass's bytes moved by a copy (a
  device-to-device copy of (read + write) / 2 bytes, timed as the calls are) and its FLOPs at
  the tensor peak (989 TFLOP/s, dense bf16);
- ``path``: ``fused`` where both passes take the fused kernels, else ``simple``
  (``fwd_path`` and ``bwd_path`` per pass, from the library's ``moe_routing_kernel_paths``).

Method (the public benchmark's): each call alone, after a write of 256 MB that evicts the L2
and a spin kernel that lets the host queue the whole call, timed by CUDA events around it
(from its first kernel's start to its last kernel's end, plus the events themselves); the
median of ``--repeats`` calls. Bytes per pass: forward reads x, w and the bias and writes the
[T, K] indices, weights and scores; backward reads x, w and the three [T, K] arrays and writes
grad_x (bf16) and grad_w (f32). FLOPs: 2·T·E·H forward, 4·T·E·H backward.

It prints a table with each pass's ratio to its ceiling and marks where a shape misses the
speed floor (more than 1.3× GLM-4.5's ratio at the same T, or slower than PyTorch), and writes
``{"device", "method", "models": [{"name", "hidden_size", "n_routed_experts", "top_k",
"n_group", "topk_group", "cases": [...]}]}``. ``--dry-run`` needs neither a GPU nor torch: it
checks the models file and prints each shape's kernel paths, bytes and FLOPs. ``--only`` and
``--tokens`` narrow a run to some models and other token counts (sweeps of a plan's
diagnostics, such as ``MOE_ROUTING_BACKWARD_SPLIT``, over a few shapes).
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TENSOR_PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM
FLOOR_VS_GLM = 1.3


def load_lib():
    """The package's ctypes binding alone (no torch): for the kernel paths."""
    spec = importlib.util.spec_from_file_location(
        "moe_routing_lib", ROOT / "python/moe_routing/_lib.py")
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    return lib


def config_args(m):
    return (m["hidden_size"], m["n_routed_experts"], m["top_k"], m["n_group"], m["topk_group"],
            m["routed_scaling_factor"], m["norm_topk_prob"])


def paths(lib, m):
    names = lib.kernel_path_names(lib.make_config(*config_args(m)))
    return (names["forward"], names["backward"]) if names else ("unknown", "unknown")


def pass_bytes(m, t):
    """(read, write) bytes of the forward and of the backward."""
    h, e, k = m["hidden_size"], m["n_routed_experts"], m["top_k"]
    fwd = (2 * t * h + 2 * e * h + 4 * e, 12 * t * k)
    bwd = (2 * t * h + 2 * e * h + 12 * t * k, 2 * t * h + 4 * e * h)
    return fwd, bwd


def pass_flops(m, t):
    h, e = m["hidden_size"], m["n_routed_experts"]
    return 2 * t * e * h, 4 * t * e * h


def check_models(spec):
    for m in spec["models"]:
        for key in ("name", "hidden_size", "n_routed_experts", "top_k", "n_group", "topk_group",
                    "routed_scaling_factor", "norm_topk_prob"):
            if key not in m:
                raise SystemExit(f"models file: {m.get('name', m)} has no {key}")
    if not spec.get("tokens"):
        raise SystemExit("models file: no tokens")


def dry_run(spec):
    lib = None
    try:
        lib = load_lib()
        lib.load()
    except Exception as e:  # (no library built: paths unknown)
        print(f"library not loaded ({e}); kernel paths unknown")
        lib = None
    for m in spec["models"]:
        fwd, bwd = paths(lib, m) if lib else ("unknown", "unknown")
        print(f"{m['name']}: H {m['hidden_size']}, E {m['n_routed_experts']}, "
              f"top-{m['top_k']}, groups {m['topk_group']} of {m['n_group']}: "
              f"forward {fwd}, backward {bwd}")
        for t in spec["tokens"]:
            (fr, fw), (br, bw) = pass_bytes(m, t)
            ff, bf = pass_flops(m, t)
            print(f"  T {t:6d}: forward {(fr + fw) / 1e6:8.1f} MB {ff / 1e9:8.1f} GFLOP, "
                  f"backward {(br + bw) / 1e6:8.1f} MB {bf / 1e9:8.1f} GFLOP")


class Timer:
    """One call alone: L2 evicted, the call queued behind a spin, CUDA events around it."""

    def __init__(self, torch, repeats):
        self.torch = torch
        self.repeats = repeats
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        # A spin of about 1 ms at the H200's clock: longer than any call's host time.
        self.spin_cycles = 2_000_000

    def __call__(self, call, prepare=None):
        torch = self.torch
        call(*(prepare() if prepare else ()))  # (warm-up: handles, loading, workspaces)
        times = []
        for _ in range(self.repeats):
            args = prepare() if prepare else ()
            self.flush.fill_(1)
            torch.cuda._sleep(self.spin_cycles)
            self.start.record()
            call(*args)
            self.end.record()
            self.end.synchronize()
            times.append(self.start.elapsed_time(self.end) * 1e3)
        return sorted(times)[len(times) // 2]


def torch_route(torch, x, w, bias, m):
    """The eager bf16 composition of the forward: returns (topk_idx, topk_weights)."""
    t = x.shape[0]
    e, k, g, tg = m["n_routed_experts"], m["top_k"], m["n_group"], m["topk_group"]
    logits = torch.nn.functional.linear(x, w)
    scores = logits.float().sigmoid()
    choice = scores.detach() + bias
    if g > 1:
        group_scores = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(-1)
        group_idx = group_scores.topk(tg, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        mask = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    topk_idx = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if m["norm_topk_prob"]:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_idx, weights * m["routed_scaling_factor"]


def time_model(torch, timer, copy_us, m, t):
    h, e, k = m["hidden_size"], m["n_routed_experts"], m["top_k"]
    g, tg, scale, norm = m["n_group"], m["topk_group"], m["routed_scaling_factor"], \
        m["norm_topk_prob"]
    gen = torch.Generator(device="cuda").manual_seed(t * 7919 + e)
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(e, h, device="cuda", generator=gen) / h ** 0.5).to(torch.bfloat16)
    bias = torch.randn(e, device="cuda", generator=gen) * 0.05
    ops = torch.ops.moe_routing
    idx, weights, topk_scores = ops.route(x, w, bias, k, g, tg, scale, norm)
    grad = torch.randn(t, k, device="cuda", generator=gen)
    case = {"tokens": t}
    case["fwd_us"] = timer(lambda: ops.route(x, w, bias, k, g, tg, scale, norm))
    case["bwd_us"] = timer(lambda: ops.route_backward(x, w, idx, topk_scores, grad, g, tg, scale,
                                                      norm))

    case["torch_fwd_us"] = timer(lambda: torch_route(torch, x, w, bias, m))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def forward_graph():  # (untimed: the backward alone is)
        _, out = torch_route(torch, xg, wg, bias, m)
        return (out,)

    case["torch_bwd_us"] = timer(lambda out: torch.autograd.grad(out, (xg, wg), grad),
                                 prepare=forward_graph)

    (fr, fw), (br, bw) = pass_bytes(m, t)
    ff, bf = pass_flops(m, t)
    case["fwd_ceiling_us"] = max(copy_us((fr + fw) // 2), ff / TENSOR_PEAK * 1e6)
    case["bwd_ceiling_us"] = max(copy_us((br + bw) // 2), bf / TENSOR_PEAK * 1e6)
    del x, w, xg, wg
    return case


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(ROOT / "benches/shapes/models.json"))
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", default=None,
                    help="comma-separated model names: those alone (for sweeps of a few shapes)")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated token counts in place of the models file's")
    args = ap.parse_args()
    spec = json.loads(Path(args.models).read_text())
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {m.get("name") for m in spec.get("models", [])})
        if unknown:
            raise SystemExit(f"--only: no model named {', '.join(unknown)} in {args.models}")
        spec["models"] = [m for m in spec["models"] if m.get("name") in names]
    if args.tokens:
        try:
            spec["tokens"] = [int(t) for t in args.tokens.split(",")]
        except ValueError:
            raise SystemExit(f"--tokens: not a list of integers: {args.tokens}")
        if min(spec["tokens"]) < 1:
            raise SystemExit("--tokens: every count must be at least 1")
    check_models(spec)
    if args.dry_run:
        dry_run(spec)
        return

    import torch

    sys.path.insert(0, str(ROOT / "python"))
    import moe_routing  # noqa: F401  (registers the ops)
    from moe_routing import _lib, ops as moe_ops

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    timer = Timer(torch, args.repeats)
    copies = {}

    def copy_us(nbytes):
        n = (int(nbytes) + 15) // 16 * 16
        if n not in copies:
            src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copies[n] = timer(lambda: dst.copy_(src))
            del src, dst
        return copies[n]

    results = []
    for m in spec["models"]:
        fwd_path, bwd_path = paths(_lib, m)
        cases = []
        for t in spec["tokens"]:
            case = time_model(torch, timer, copy_us, m, t)
            case["fwd_path"], case["bwd_path"] = fwd_path, bwd_path
            case["path"] = "fused" if fwd_path == bwd_path == "fused" else "simple"
            for p in ("fwd", "bwd"):
                case[f"{p}_over_ceiling"] = case[f"{p}_us"] / case[f"{p}_ceiling_us"]
            cases.append({key: round(v, 4) if isinstance(v, float) else v
                          for key, v in case.items()})
            torch.cuda.empty_cache()
        results.append({key: m[key] for key in ("name", "hidden_size", "n_routed_experts",
                                                 "top_k", "n_group", "topk_group")}
                       | {"cases": cases})

    # The speed floor: each pass within 1.3x of GLM-4.5's ratio at the same T, and not slower
    # than the eager composition.
    glm = next((r for r in results if r["name"] == "GLM-4.5"), None)
    print(f"ops: {moe_ops.BACKEND}; device: {torch.cuda.get_device_name()}")
    print(f"{'model':22s} {'T':>6s} {'path':>6s} {'fwd us':>9s} {'x ceil':>7s} {'torch':>9s} "
          f"{'bwd us':>9s} {'x ceil':>7s} {'torch':>9s}  floor")
    for r in results:
        for c in r["cases"]:
            misses = []
            for p in ("fwd", "bwd"):
                if c[f"{p}_us"] > c[f"torch_{p}_us"]:
                    misses.append(f"{p} slower than torch")
                ref = next((g for g in glm["cases"] if g["tokens"] == c["tokens"]), None) \
                    if glm else None
                if ref and c[f"{p}_over_ceiling"] > FLOOR_VS_GLM * ref[f"{p}_over_ceiling"]:
                    misses.append(f"{p} > {FLOOR_VS_GLM}x GLM-4.5's ratio")
            print(f"{r['name']:22s} {c['tokens']:6d} {c['path']:>6s} {c['fwd_us']:9.1f} "
                  f"{c['fwd_over_ceiling']:7.2f} {c['torch_fwd_us']:9.1f} {c['bwd_us']:9.1f} "
                  f"{c['bwd_over_ceiling']:7.2f} {c['torch_bwd_us']:9.1f}  "
                  f"{'; '.join(misses) or 'ok'}")
    if args.json:
        out = {
            "device": torch.cuda.get_device_name(),
            "method": ("one call at a time: a 256 MB write (L2 evicted) and a ~1 ms spin "
                       "before it, CUDA events around it; median of "
                       f"{args.repeats}. Ceiling: the larger of (read + write) / 2 bytes by "
                       "a device-to-device copy, timed the same way, and the FLOPs at "
                       "989 TFLOP/s. Backward in the training dtypes (int32 indices, f32 "
                       "[T, K] scores and gradients, f32 grad_w); PyTorch: eager bf16 "
                       "composition, its backward by autograd"),
            "ops": moe_ops.BACKEND,
            "models": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
