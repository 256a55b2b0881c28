"""The router backward on the public benchmark's workload, timed as that benchmark does.

    python python/benches/public_range.py [--suite FILE] [--repeats N] [--json PATH] [--dry-run]

For each case of ``benches/shapes/public_range.json`` (GLM-4.5's router: H 5120, E 160, K 8,
scale 2.5; 1264 to 7680 tokens), with the inputs as PyTorch holds them (``topk_idx`` int64,
the sigmoid scores of all experts [T, E] bf16, ``grad_topk_weights`` bf16; grad_w bf16), it
times three things, each call on its own:

- ``kernel_us``: ``moe_routing::route_backward`` (the op a training step calls);
- ``eager_us``: eager PyTorch's autograd backward of the same router (bf16 linear, sigmoid,
  gather, normalization, scale);
- ``copy_us``: a device-to-device copy of (read + write) / 2 of the case's bytes, the
  memory-bound floor measured the same way.

Method (the public benchmark's): before each call a 256 MB write evicts the L2, then a short
spin lets the host queue the whole call; the call's duration runs from its first GPU
operation's start to its last one's end, as the profiler (CUPTI) records them on the GPU, so
that no host time and no launch gap before the first kernel is counted. The median over
``--repeats`` calls is the figure; the number of GPU operations per call is reported too.
It prints one row per case and the means, and writes them as JSON.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
torch = None  # imported by main() unless --dry-run


def load_torch():
    global torch
    import torch as t

    sys.path.insert(0, str(ROOT / "python"))
    import moe_routing  # noqa: F401  (registers the ops)

    torch = t

FLUSH_BYTES = 256 << 20
SPIN_CYCLES = 200_000  # ~0.1 ms: longer than a call's host time


def case_bytes(t, h, e, k):
    """(read, write) bytes of the public benchmark's SOL formula."""
    read = 2 * t * k + 8 * t * k + 2 * t * e + 2 * t * h + 2 * e * h
    return read, 2 * t * h + 2 * e * h


class Inputs:
    def __init__(self, c, seed):
        t, h, e, k = c["tokens"], c["hidden_size"], c["n_routed_experts"], c["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        self.w = (torch.randn(e, h, device="cuda", generator=gen) / h ** 0.5).to(torch.bfloat16)
        self.scores = torch.nn.functional.linear(self.x, self.w).sigmoid()  # bf16
        pick = torch.rand(t, e, device="cuda", generator=gen)
        self.idx = pick.topk(k, dim=-1).indices  # int64, K distinct experts a token
        self.grad = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
        self.c = c

    def ours(self):
        c = self.c
        return torch.ops.moe_routing.route_backward(
            self.x, self.w, self.idx, self.scores, self.grad, c["n_group"], c["topk_group"],
            c["routed_scaling_factor"], c["norm_topk_prob"], False, True)

    def eager_graph(self):
        """The eager forward's output, whose backward is timed (built untimed)."""
        c = self.c
        xg, wg = self.x.detach().requires_grad_(), self.w.detach().requires_grad_()
        scores = torch.nn.functional.linear(xg, wg).sigmoid()
        weights = scores.gather(1, self.idx)
        if c["norm_topk_prob"]:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c["routed_scaling_factor"], xg, wg


def gpu_spans(prof):
    """GPU operations (kernels, copies, memsets) as (name, start, end) in µs, by start."""
    ops = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ops, key=lambda o: o[1])


def time_calls(call, repeats, prepare=None):
    """Median µs from a call's first GPU operation's start to its last one's end, and the
    operations per call. Each call: L2 flush, spin, the call, a second spin; in the trace the
    spins' kernels bracket the call's operations."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    call(*(prepare() if prepare else ()))  # warm-up: loading, workspaces, autograd
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            args = prepare() if prepare else ()
            flush.fill_(1)
            torch.cuda._sleep(SPIN_CYCLES)
            call(*args)
            torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    groups, ops = [], None
    for name, start, end in gpu_spans(prof):
        if "spin" in name:
            if ops is not None:
                groups.append(ops)
            ops = []
        elif ops is not None:
            ops.append((name, start, end))
    calls = groups[0::2]  # (the odd groups: the next call's preparation and flush)
    if len(calls) != repeats or not all(calls):
        raise RuntimeError(f"found {len(calls)} calls in the trace, expected {repeats}")
    durations = [max(o[2] for o in ops) - ops[0][1] for ops in calls]
    counts = [len(ops) for ops in calls]
    return statistics.median(durations), statistics.median(counts), [o[0] for o in calls[0]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=str(ROOT / "benches/shapes/public_range.json"))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--no-eager", action="store_true", help="skip eager PyTorch's backward")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the cases, their bytes and SOL (no GPU, no torch)")
    args = ap.parse_args()
    suite = json.loads(Path(args.suite).read_text())
    if args.dry_run:
        for c in suite["cases"]:
            t, h, e, k = c["tokens"], c["hidden_size"], c["n_routed_experts"], c["top_k"]
            read, write = case_bytes(t, h, e, k)
            sol = max((read + write) / suite["sol"]["bandwidth_Bps"],
                      4 * t * e * h / suite["sol"]["tensor_flops"]) * 1e6
            print(f"{c['name']:<8} T {t:5d}: {(read + write) / 1e6:6.1f} MB, SOL {sol:5.2f} us")
        return
    load_torch()
    rows = []
    print(f"{'case':<8} {'T':>5} {'ours us':>8} {'ops':>4} {'copy us':>8} {'ours/copy':>9} "
          f"{'eager us':>9} {'eager ops':>9}")
    for n, c in enumerate(suite["cases"]):
        inp = Inputs(c, seed=1000 + n)
        t, h, e, k = c["tokens"], c["hidden_size"], c["n_routed_experts"], c["top_k"]
        row = {"name": c["name"], "tokens": t}
        row["kernel_us"], row["ops_per_call"], names = time_calls(inp.ours, args.repeats)
        read, write = case_bytes(t, h, e, k)
        src = torch.empty((read + write) // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        row["copy_us"], _, _ = time_calls(lambda: dst.copy_(src), args.repeats)
        del src, dst
        row["kernel_over_copy"] = row["kernel_us"] / row["copy_us"]
        row["sol_us"] = max((read + write) / suite["sol"]["bandwidth_Bps"],
                            4 * t * e * h / suite["sol"]["tensor_flops"]) * 1e6
        if not args.no_eager:
            grad = inp.grad

            def prepare():
                out, xg, wg = inp.eager_graph()
                return out, xg, wg

            row["eager_us"], row["eager_ops_per_call"], _ = time_calls(
                lambda out, xg, wg: torch.autograd.grad(out, (xg, wg), grad), args.repeats,
                prepare)
        row["op_names"] = [o[:100] for o in names]
        rows.append(row)
        print(f"{c['name']:<8} {t:5d} {row['kernel_us']:8.2f} {row['ops_per_call']:4g} "
              f"{row['copy_us']:8.2f} {row['kernel_over_copy']:9.2f} "
              f"{row.get('eager_us', float('nan')):9.2f} {row.get('eager_ops_per_call', 0):9g}")
        del inp
    mean = lambda key: statistics.fmean(r[key] for r in rows)
    out = {
        "device": torch.cuda.get_device_name(),
        "method": ("each call alone: a 256 MB write (L2 evicted), a ~0.1 ms spin, the call; "
                   "first GPU operation's start to last one's end (CUPTI, torch.profiler); "
                   f"median of {args.repeats}"),
        "call": ("torch.ops.moe_routing.route_backward: int64 topk_idx, bf16 scores [T, E], "
                 "bf16 grad_topk_weights, bf16 grad_w"),
        "mean_kernel_us": mean("kernel_us"),
        "mean_copy_us": mean("copy_us"),
        "mean_kernel_over_copy": mean("kernel_over_copy"),
        "max_kernel_over_copy": max(r["kernel_over_copy"] for r in rows),
        "mean_sol_us": mean("sol_us"),
        "cases": rows,
    }
    if not args.no_eager:
        out["mean_eager_us"] = mean("eager_us")
    print(f"mean: ours {out['mean_kernel_us']:.2f} us, copy {out['mean_copy_us']:.2f} us, "
          f"ours/copy {out['mean_kernel_over_copy']:.2f} (max {out['max_kernel_over_copy']:.2f})"
          + (f", eager {out['mean_eager_us']:.2f} us" if not args.no_eager else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
