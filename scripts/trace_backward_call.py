"""One backward call through the C ABI, as a profiler sees it: which GPU operations (kernels,
memsets, copies) it runs, and the host time of the call.

    python3 scripts/trace_backward_call.py [--tokens T ...] [--json PATH]

Per token count: inputs as PyTorch holds them (the public benchmark's interface: int64
topk_idx, bf16 scores of all experts, bf16 grad_topk_weights, bf16 grad_w) and, for the
training suite's interface, int32 indices and f32 [T, K] scores and gradients with f32 grad_w.
The call goes straight to ``moe_routing_backward`` (no Python op around it), after an
unrelated kernel, under ``torch.profiler``; the script prints every GPU operation the call
launched and fails unless there is exactly one (a kernel). Needs a CUDA GPU, PyTorch and the
built library (``$MOE_ROUTING_LIB`` or the build tree; see ``python/moe_routing/_lib.py``).
"""

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from moe_routing import _lib  # noqa: E402

H, E, K = 5120, 160, 8


def config():
    return _lib.MoeRoutingConfig(
        struct_size=ctypes.sizeof(_lib.MoeRoutingConfig),
        norm_topk_prob=1,
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
    )


# The two interfaces' dtypes: (int64 idx, all scores, bf16 scores, bf16 grads, bf16 grad_w).
PYTORCH = (True, True, True, True, True)
TRAINING = (False, False, False, False, False)


def inputs(tokens, dt):
    """Random inputs of one call (never zeros) in dtypes `dt`."""
    idx64, all_scores, scores_bf16, grad_bf16, grad_w_bf16 = dt[:5]
    dev = "cuda"
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02
    idx = torch.rand(tokens, E, device=dev).argsort(dim=1)[:, :K].contiguous()
    scores = torch.rand(tokens, E, device=dev) * 0.98 + 0.01
    grad = torch.randn(tokens, K, device=dev)
    real = lambda bf: torch.bfloat16 if bf else torch.float32
    t = dict(idx=idx.to(torch.int64 if idx64 else torch.int32),
             scores=(scores if all_scores else scores.gather(1, idx).contiguous()).to(
                 real(scores_bf16)),
             grad=grad.to(real(grad_bf16)),
             grad_w=torch.empty(E, H, device=dev, dtype=real(grad_w_bf16)))
    if len(dt) > 5 and dt[5]:  # the [T, K] rows one element off 16-byte alignment
        for key in ("idx", "scores", "grad"):
            flat = t[key].flatten()
            buf = torch.empty(flat.numel() + 1, device=dev, dtype=flat.dtype)
            buf[1:].copy_(flat)
            t[key] = buf[1:]
    t.update(x=x, w=w, grad_x=torch.empty_like(x))
    ws = _lib.load().moe_routing_backward_workspace_bytes(ctypes.byref(config()), tokens)
    t["workspace"] = torch.zeros(ws, device=dev, dtype=torch.uint8)  # once, as the C ABI asks
    return t


def args(tokens, t, dt):
    idx64, all_scores, scores_bf16, grad_bf16, grad_w_bf16 = dt[:5]
    p = lambda v, ty: ctypes.cast(ctypes.c_void_p(v.data_ptr()), ctypes.POINTER(ty))
    a = _lib.MoeRoutingBackwardArgs(
        struct_size=ctypes.sizeof(_lib.MoeRoutingBackwardArgs),
        precision=_lib.PRECISION_DEFAULT,
        tokens=tokens,
        x=p(t["x"], ctypes.c_uint16), x_len=t["x"].numel(),
        w=p(t["w"], ctypes.c_uint16), w_len=t["w"].numel(),
        topk_idx=p(t["idx"], ctypes.c_int32), topk_idx_len=t["idx"].numel(),
        grad_topk_weights=p(t["grad"], ctypes.c_float), grad_topk_weights_len=t["grad"].numel(),
        grad_x=p(t["grad_x"], ctypes.c_uint16), grad_x_len=t["grad_x"].numel(),
        grad_w=p(t["grad_w"], ctypes.c_float), grad_w_len=t["grad_w"].numel(),
        workspace=ctypes.c_void_p(t["workspace"].data_ptr()),
        workspace_bytes=t["workspace"].numel(),
    )
    if all_scores:
        a.scores = ctypes.c_void_p(t["scores"].data_ptr())
        a.scores_len = t["scores"].numel()
    else:
        a.topk_scores = p(t["scores"], ctypes.c_float)
        a.topk_scores_len = t["scores"].numel()
    a.topk_idx_dtype = _lib.DTYPE_I64 if idx64 else _lib.DTYPE_I32
    a.scores_dtype = _lib.DTYPE_BF16 if scores_bf16 else _lib.DTYPE_F32
    a.grad_topk_weights_dtype = _lib.DTYPE_BF16 if grad_bf16 else _lib.DTYPE_F32
    a.grad_w_dtype = _lib.DTYPE_BF16 if grad_w_bf16 else _lib.DTYPE_F32
    return a


def single_call_us(call, n=30):
    """Median device time of `n` calls, each after an L2 flush (CUDA events; the flushes keep
    the GPU busy while the host queues the call, so that its host time is not counted)."""
    flush = torch.empty(2 * 50 * 2**20 // 4, device="cuda", dtype=torch.float32)
    times = []
    for _ in range(n):
        for _ in range(4):  # the GPU busy long enough that the call is queued before it starts
            flush.fill_(1.0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[n // 2]


def trace(tokens, dt):
    lib = _lib.load()
    cfg = config()
    t = inputs(tokens, dt)
    a = args(tokens, t, dt)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    call = lambda: _lib.check_status(
        lib.moe_routing_backward(ctypes.byref(cfg), ctypes.byref(a), stream), "backward")
    call()  # warm-up: module load, attributes
    torch.cuda.synchronize()
    flush = torch.empty(2 * 50 * 2**20 // 4, device="cuda", dtype=torch.float32)
    flush.fill_(1.0)  # an unrelated kernel before the call, as in a training step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # Host cost of the call alone (enqueue), over many calls.
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in ops], host_us, single_call_us(call)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[1264, 7680, 512, 32768])
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true",
                    help="also each dtype of the PyTorch interface alone, beside the training's, and the "
                         "training's with rows off 16-byte alignment (the any-K kernels)")
    ap.add_argument("--only", help="run only the variant of this label (e.g. 'training dtypes')")
    opts = ap.parse_args()
    rows, ok = [], True
    variants = [("pytorch dtypes", PYTORCH), ("training dtypes", TRAINING)]
    if opts.sweep:
        names = ["int64 idx", "all scores", "bf16 scores", "bf16 grads", "bf16 grad_w"]
        for i, n in enumerate(names):
            variants.append((n, tuple(j == i for j in range(5))))
        variants.append(("unaligned rows", TRAINING + (True,)))
    if opts.only:
        variants = [v for v in variants if v[0] == opts.only]
    for tokens in opts.tokens:
        for label, dt in variants:
            ops, host_us, single_us = trace(tokens, dt)
            print(f"T={tokens:>6} {label:<16} {len(ops)} GPU op(s), host {host_us:.1f} us/call, "
                  f"single call {single_us:.1f} us")
            for name, us in ops:
                print(f"    {us:8.1f} us  {name[:110]}")
            ok &= len(ops) == 1
            rows.append(dict(tokens=tokens, interface=label, gpu_ops=[n for n, _ in ops],
                             host_us=round(host_us, 2), single_call_us=round(single_us, 2)))
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("one GPU operation per call:", "yes" if ok else "NO")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
