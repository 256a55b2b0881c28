"""Host cost and GPU operations of one call of the PyTorch ops, as a training step makes it.

    python python/benches/host_cost.py [--tokens T] [--json PATH] [--engine]

On the public benchmark's shape (GLM-4.5: H 5120, E 160, K 8, 8 groups of which 4) and its
interface for the backward (int64 indices, bf16 scores of all experts, bf16 gradients, bf16
grad_w), it measures per op:
- host µs per call: a tight loop of calls, CPU time per call (queued behind a GPU spin so
  that the loop never waits on the GPU; median of 5 loops);
- GPU operations per call: every kernel, memset and copy of one call under torch.profiler,
  after an unrelated kernel (a call's first kernel is its own).
Prints which implementation of the ops is registered (``native``: the C++ ops of
libmoe_routing_torch.so, or ``ctypes``: the Python ones; ``MOE_ROUTING_TORCH_OP=0`` forces the
latter, for an A/B comparison), then both figures, and writes them as JSON (``ops``,
``host_us_forward``, ``host_us_backward``, ``gpu_ops_forward``, ``gpu_ops_backward``, the
kernels among them, ``kernels_per_forward`` and ``kernels_per_backward``, and the operations'
names). Needs a CUDA GPU and the library (see the package README).
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_routing  # noqa: E402,F401  (registers the ops)
from moe_routing import ops as moe_ops  # noqa: E402

H, E, K, GROUPS, TOPK_GROUP, SCALE = 5120, 160, 8, 8, 4, 2.5


def make_inputs(tokens):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    b = torch.randn(E, device="cuda", generator=gen) * 0.05
    idx, weights, _ = torch.ops.moe_routing.route(x, w, b, K, GROUPS, TOPK_GROUP, SCALE, True)
    scores = torch.rand(tokens, E, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
    return x, w, b, idx.long(), scores, grad


def host_us(call, n=400, rounds=5):
    """Host µs per call in each of `rounds` loops of `n` calls, sorted (the median is the
    figure); each loop is queued behind a GPU spin long enough that it never waits on the GPU.
    (With the GPU free, a loop whose calls take longer on the GPU than on the host fills the
    launch queue and then measures the GPU: 2000 calls behind 6 ms of work read 38 µs a native
    backward call on an H200, 21 µs so.)"""
    cycles = int(2e9 * n * 200e-6)  # 200 µs a call at 2 GHz (longer at lower clocks)
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(times)


def gpu_ops(call):
    flush = torch.empty(2**24, device="cuda")
    flush.fill_(1.0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def is_memory_op(name):
    """A memset or copy in the profiler's GPU records (``Memset (Device)``, ``Memcpy DtoD
    (Device -> Device)``), not a kernel."""
    return name.startswith(("Memset", "Memcpy"))


def host_breakdown(call, n=50):
    """Where a call's host time goes: the profiler's CPU-side events of `n` calls (the op, its
    PyTorch calls and the CUDA runtime calls beneath), µs per call. The profiler adds its own
    cost to every event: read these as shares, not as the calls' times."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / n, e.cpu_time_total / n) for e in prof.key_averages()
            if e.cpu_time_total > 0 and e.key != "cudaDeviceSynchronize"]
    return sorted(rows, key=lambda r: -r[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print the profiler's CPU-side events per call (host_breakdown)")
    ap.add_argument("--engine", action="store_true",
                    help="also time the backward as a training step runs it: autograd's engine "
                         "applying route's node (torch.autograd.grad of topk_weights), beside the "
                         "same for torch.mul, whose difference is route's node")
    ap.add_argument("--inference-mode", action="store_true",
                    help="every call under torch.inference_mode() (a diagnostic: what autograd's "
                         "dispatch and bookkeeping add to a call)")
    opts = ap.parse_args()
    if opts.engine and opts.inference_mode:
        ap.error("--engine times autograd's engine, which --inference-mode turns off")
    with torch.inference_mode() if opts.inference_mode else contextlib.nullcontext():
        run(opts)


def run(opts):
    native = moe_ops.native_library_path()
    print(f"ops: {moe_ops.BACKEND}" + (f" ({native})" if native else ""))
    x, w, b, idx, scores, grad = make_inputs(opts.tokens)
    forward = lambda: torch.ops.moe_routing.route(x, w, b, K, GROUPS, TOPK_GROUP, SCALE, True)
    backward = lambda: torch.ops.moe_routing.route_backward(
        x, w, idx, scores, grad, GROUPS, TOPK_GROUP, SCALE, True, False, True)
    calls = (("forward", forward), ("backward", backward))
    for _, call in calls:  # warm-up: library load, workspace, module load
        call()
    torch.cuda.synchronize()
    out = dict(device=torch.cuda.get_device_name(), tokens=opts.tokens, ops=moe_ops.BACKEND,
               inference_mode=opts.inference_mode,
               interface="int64 topk_idx, bf16 scores [T, E], bf16 grad_topk_weights, bf16 grad_w")
    # For scale, in the same run: one ordinary PyTorch op (an elementwise product of two small
    # bf16 tensors: one allocation, one kernel), whose host time varies with the machine as ours.
    reference = lambda: torch.mul(grad, grad)
    reference()
    times = host_us(reference)
    out["host_us_reference_op"] = round(times[len(times) // 2], 2)
    print(f"{'torch.mul':<8} host {out['host_us_reference_op']:7.1f} us per call (for scale)")
    # Host times first: once torch.profiler has run in a process, every later CUDA call pays
    # for its callbacks (the profiler's figures below come after).
    host = {name: host_us(call) for name, call in calls}
    for name, call in calls:
        ops = gpu_ops(call)
        times = host[name]
        out[f"host_us_{name}"] = round(times[len(times) // 2], 2)
        out[f"host_us_{name}_min"] = round(times[0], 2)
        out[f"gpu_ops_{name}"] = len(ops)
        out[f"kernels_per_{name}"] = sum(not is_memory_op(o) for o in ops)
        out[f"gpu_op_names_{name}"] = [o[:120] for o in ops]
        print(f"{name:<8} host {out[f'host_us_{name}']:7.1f} us per call (fastest loop "
              f"{times[0]:.1f}), {len(ops)} GPU op(s)")
        for o in ops:
            print(f"    {o[:110]}")
        if opts.breakdown:
            for key, count, us in host_breakdown(call)[:12]:
                print(f"      {us:7.2f} us  x{count:g}  {key[:90]}")
    if opts.engine:
        engine_cost(out, x, w, b, grad)
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=1) + "\n")


def engine_cost(out, x, w, b, grad):
    """Host µs of one backward through autograd's engine: torch.autograd.grad of route's
    topk_weights with respect to x and w, the graph kept (the engine hands the graph to its
    device thread and waits for it, in every call), beside the same call on torch.mul's graph;
    the difference is what route's node costs a training step beyond an elementwise op's."""
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    _, weights, _ = torch.ops.moe_routing.route(xg, wg, b, K, GROUPS, TOPK_GROUP, SCALE, True)
    g = grad.to(weights.dtype)
    route_grad = lambda: torch.autograd.grad(weights, (xg, wg), g, retain_graph=True)
    a, gm = grad.float().requires_grad_(), grad.float()
    y = torch.mul(a, a)
    mul_grad = lambda: torch.autograd.grad(y, (a,), gm, retain_graph=True)
    for name, call in (("reference_engine", mul_grad), ("backward_engine", route_grad)):
        call()
        torch.cuda.synchronize()
        times = host_us(call)
        out[f"host_us_{name}"] = round(times[len(times) // 2], 2)
    out["host_us_backward_node"] = round(
        out["host_us_backward_engine"] - out["host_us_reference_engine"], 2)
    print(f"{'engine':<8} host {out['host_us_backward_engine']:7.1f} us per autograd.grad of "
          f"route (torch.mul's {out['host_us_reference_engine']:.1f}; route's node "
          f"{out['host_us_backward_node']:+.1f})")


if __name__ == "__main__":
    main()
