"""Tests of the native ops (libmoe_routing_torch.so) against the ctypes ops.

Without the native op library (or with MOE_ROUTING_TORCH_OP=0) every test is skipped. The
schema and input-validation tests need no GPU (CPU tensors fail their checks before any device
work); the others need a Hopper GPU, and compare the native ops bit for bit with the ctypes
implementation (ops._route_ctypes / ops._route_backward_ctypes: the same library through its
C ABI), and cover autograd, torch.compile and CUDA graph capture.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_routing
from moe_routing import _lib, ops

NATIVE = ops.BACKEND == "native"
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)

needs_native = pytest.mark.skipif(
    not NATIVE,
    reason="native ops not in use (no libmoe_routing_torch.so, or MOE_ROUTING_TORCH_OP=0)",
)
needs_gpu = pytest.mark.skipif(
    not (NATIVE and HAS_HOPPER and _lib.find_library() is not None),
    reason="needs the native ops, a Hopper GPU (sm_90) and libmoe_routing.so",
)

# GLM-4.5's router (E 160, K 8, 8 groups of which 4) at a smaller H.
H, E, K, GROUPS, TOPK_GROUP, SCALE = 512, 160, 8, 8, 4, 2.5
CFG = (GROUPS, TOPK_GROUP, SCALE, True)  # route_backward's n_group .. norm_topk_prob
# The package beside the tests (a checkout), else none: the installed one.
PYTHON_DIR = Path(__file__).resolve().parents[1]
PYTHON_DIR = PYTHON_DIR if (PYTHON_DIR / "moe_routing").is_dir() else None
OPS = ("route", "route_with_stats", "route_backward")


def _ctypes_env():
    env = dict(os.environ, MOE_ROUTING_TORCH_OP="0")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (PYTHON_DIR and str(PYTHON_DIR), env.get("PYTHONPATH")) if p)
    return env


def _in_ctypes_process(what):
    """Runs this file's `what` in a process with the ctypes ops; its JSON result."""
    out = subprocess.run(
        [sys.executable, __file__, what], env=_ctypes_env(), check=True, capture_output=True,
        text=True, timeout=300,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Schemas and validation (no GPU)


def _schemas():
    import moe_routing.ops as o

    return {"backend": o.BACKEND,
            **{n: str(getattr(torch.ops.moe_routing, n).default._schema) for n in OPS},
            **{n + "_tags": sorted(str(t) for t in getattr(torch.ops.moe_routing, n).default.tags)
               for n in OPS}}


def _bad_calls():
    """Calls with one bad argument each (CPU tensors: all fail before any device work)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g)
    b = torch.randn(32, generator=g)
    cfg = dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True)
    idx = torch.zeros(8, 4, dtype=torch.int64)
    s = torch.full((8, 4), 0.5)
    gr = torch.ones(8, 4)
    rest = (4, 2, 1.5, True)
    fwd = torch.ops.moe_routing.route
    stats = torch.ops.moe_routing.route_with_stats
    bwd = torch.ops.moe_routing.route_backward
    acc = torch.zeros(32, 64)
    calls = {
        "x dtype": lambda: fwd(x.float(), w, b, **cfg),
        "x dims": lambda: fwd(x[0], w, b, **cfg),
        "x 3d": lambda: fwd(x[None], w, b, **cfg),
        "weight dims": lambda: fwd(x, w[0], b, **cfg),
        "weight shape": lambda: fwd(x, w[:, :32], b, **cfg),
        "weight dtype": lambda: fwd(x, w.half(), b, **cfg),
        "bias shape": lambda: fwd(x, w, b[:31], **cfg),
        "bias dims": lambda: fwd(x, w, b[None], **cfg),
        "bias dtype": lambda: fwd(x, w, b.double(), **cfg),
        "x contiguous": lambda: fwd(x.t().contiguous().t()[:, :64], w, b, **cfg),
        "weight contiguous": lambda: fwd(x, w.t().contiguous().t(), b, **cfg),
        "hidden": lambda: fwd(x[:, :60].contiguous(), w[:, :60].contiguous(), b, **cfg),
        "experts": lambda: fwd(x, torch.zeros(0, 64), torch.zeros(0), **cfg),
        "top_k": lambda: fwd(x, w, b, **dict(cfg, top_k=17)),
        "top_k 0": lambda: fwd(x, w, b, **dict(cfg, top_k=0)),
        "n_group": lambda: fwd(x, w, b, **dict(cfg, n_group=3)),
        "n_group 0": lambda: fwd(x, w, b, **dict(cfg, n_group=0)),
        "topk_group": lambda: fwd(x, w, b, **dict(cfg, topk_group=5)),
        "groups of 1": lambda: fwd(x, w, b, **dict(cfg, n_group=32, topk_group=4)),
        "candidates": lambda: fwd(x, w, b, **dict(cfg, top_k=9, topk_group=1)),
        "scale nan": lambda: fwd(x, w, b, **dict(cfg, routed_scaling_factor=float("nan"))),
        "scale inf": lambda: fwd(x, w, b, **dict(cfg, routed_scaling_factor=-float("inf"))),
        "route device": lambda: fwd(x, w, b, **cfg),
        "idx dtype": lambda: bwd(x, w, idx.short(), s, gr, *rest),
        "idx dims": lambda: bwd(x, w, idx[0], s, gr, *rest),
        "idx shape": lambda: bwd(x, w, idx[:7], s, gr, *rest),
        "scores dims": lambda: bwd(x, w, idx, s[0], gr, *rest),
        "scores dtype": lambda: bwd(x, w, idx, s.double(), gr, *rest),
        "scores width": lambda: bwd(x, w, idx, s[:, :3].contiguous(), gr, *rest),
        "scores contiguous": lambda: bwd(x, w, idx, torch.rand(32, 8).t(), gr, *rest),
        "grad dtype": lambda: bwd(x, w, idx, s, gr.half(), *rest),
        "grad shape": lambda: bwd(x, w, idx, s, gr[:, :3], *rest),
        "grad contiguous": lambda: bwd(x, w, idx, s, gr.t().contiguous().t(), *rest),
        "backward x dtype": lambda: bwd(x.float(), w, idx, s, gr, *rest),
        "backward config": lambda: bwd(x, w, idx, s, gr, 3, 2, 1.5, True),
        "precise bf16": lambda: bwd(x, w, idx, s, gr, *rest, True, True),
        "backward device": lambda: bwd(x, w, idx, s, gr, *rest),
        "stats x dtype": lambda: stats(x.float(), w, b, **cfg, return_counts=True),
        "stats bias shape": lambda: stats(x, w, b[:31], **cfg, return_scores=True),
        "stats top_k": lambda: stats(x, w, b, **dict(cfg, top_k=17), return_scores=True),
        "stats device": lambda: stats(x, w, b, **cfg, return_scores=True, return_counts=True),
        "grad_w_out dtype": lambda: bwd(x, w, idx, s, gr, *rest, grad_w_out=acc.double()),
        "grad_w_out shape": lambda: bwd(x, w, idx, s, gr, *rest, grad_w_out=acc[:31]),
        "grad_w_out dims": lambda: bwd(x, w, idx, s, gr, *rest, grad_w_out=acc[None]),
        "grad_w_out contiguous": lambda: bwd(x, w, idx, s, gr, *rest,
                                             grad_w_out=torch.zeros(64, 32).t()),
        "grad_w_out bf16": lambda: bwd(x, w, idx, s, gr, *rest, False, True, acc),
        "grad_w_out device": lambda: bwd(x, w, idx, s, gr, *rest, grad_w_out=acc),
    }
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        calls["weight on cpu"] = lambda: fwd(xc, w, b.cuda(), **cfg)
        calls["bias on cpu"] = lambda: fwd(xc, wc, b, **cfg)
        calls["idx on cpu"] = lambda: bwd(xc, wc, idx, s.cuda(), gr.cuda(), *rest)
        calls["grad on cpu"] = lambda: bwd(xc, wc, idx.cuda(), s.cuda(), gr, *rest)
        calls["grad_w_out on cpu"] = lambda: bwd(xc, wc, idx.cuda(), s.cuda(), gr.cuda(), *rest,
                                                 grad_w_out=acc)
        calls["stats bias on cpu"] = lambda: stats(xc, wc, b, **cfg, return_counts=True)
    return calls


def _errors():
    """What each bad call raises: [type name, message]."""
    out = {}
    for name, call in _bad_calls().items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the type is what is compared)
            out[name] = [type(e).__name__, str(e).splitlines()[0]]
    return out


@needs_native
def test_native_ops_are_registered_from_cpp():
    assert ops.native_library_path() is not None and ops.native_library_path().is_file()
    assert torch._library.custom_ops._maybe_get_opdef("moe_routing::route") is None
    assert moe_routing.route is torch.ops.moe_routing.route
    for name in OPS:
        qual = f"moe_routing::{name}"
        for key in ("CUDA", "CPU", "Autograd", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, key), (name, key)
        assert "torch_ops.cpp" in torch._C._dispatch_dump(qual)


@needs_native
def test_schemas_match_the_ctypes_ops():
    ours = _schemas()
    theirs = _in_ctypes_process("schemas")
    assert ours.pop("backend") == "native" and theirs.pop("backend") == "ctypes"
    assert ours == theirs


@needs_native
def test_invalid_arguments_raise_as_the_ctypes_ops_do():
    ours = _errors()
    theirs = _in_ctypes_process("errors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name] is not None, name
        assert ours[name] == theirs[name], name
    # Each message names the bad argument.
    assert ours["bias dtype"] == ["ValueError", "bias must be torch.float32, got torch.float64"]
    assert ours["grad shape"][1].startswith("grad_topk_weights must have shape [8, 4]")
    assert ours["route device"][1] == "x must be a CUDA tensor, got device cpu"
    assert ours["grad_w_out dtype"] == ["ValueError",
                                        "grad_w_out must be torch.float32, got torch.float64"]
    assert ours["grad_w_out shape"][1].startswith("grad_w_out must have shape [32, 64]")
    assert ours["grad_w_out bf16"][1].startswith("grad_w_out: grad_w is added into it")


# --------------------------------------------------------------------------------------------
# GPU: the same results as the ctypes ops


def _inputs(T, seed, wdtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, H, device="cuda", generator=gen) * (2.0 / math.sqrt(H)))
    w = w.to(torch.bfloat16).to(wdtype)
    b = torch.randn(E, device="cuda", generator=gen) * 0.05
    return x, w, b


def _backward_inputs(T, seed, idx_dtype, scores, real, wdtype=torch.bfloat16):
    """x, w, topk_idx, scores ([T, K] or all experts' [T, E]) and grad_topk_weights, in the
    given dtypes."""
    x, w, b = _inputs(T, seed, wdtype)
    idx, _, chosen = torch.ops.moe_routing.route(x, w, b, K, *CFG)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000)
    if scores == "all":
        s = torch.rand(T, E, device="cuda", generator=gen)
        s.scatter_(1, idx.long(), chosen)
    else:
        s = chosen
    g = torch.randn(T, K, device="cuda", generator=gen)
    return x, w, idx.to(idx_dtype), s.to(real), g.to(real)


def _fresh_stream():
    """A stream of the current device with no cached workspace (streams come from a pool of
    32 per priority, which earlier tests may have used)."""
    dev = torch.cuda.current_device()
    for priority in (0, -1):
        for _ in range(40):
            stream = torch.cuda.Stream(priority=priority)
            if (dev, stream.cuda_stream) not in ops._workspaces:
                return stream
    pytest.skip("every pooled stream has a cached workspace already")


def _equal(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert p.dtype == q.dtype and p.shape == q.shape and p.device == q.device
        assert torch.equal(p, q)


@needs_gpu
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [0, 1, 300, 2048])
def test_route_equals_the_ctypes_op(T, wdtype):
    x, w, b = _inputs(T, 1 + T, wdtype)
    for norm, scale in ((True, SCALE), (False, 1.0)):
        args = (x, w, b, K, GROUPS, TOPK_GROUP, scale, norm)
        _equal(torch.ops.moe_routing.route(*args), ops._route_ctypes(*args))


@needs_gpu
def test_route_copies_misaligned_views():
    x, w, b = _inputs(65, 3)
    base = torch.empty(x.numel() + 4, dtype=torch.bfloat16, device="cuda")
    view = base[4:].view(x.shape)
    view.copy_(x)
    assert view.data_ptr() % 16 != 0
    _equal(torch.ops.moe_routing.route(view, w, b, K, *CFG),
           torch.ops.moe_routing.route(x, w, b, K, *CFG))


@needs_gpu
@pytest.mark.parametrize(
    "idx_dtype,scores,real,grad_w_bf16,precise",
    [
        (torch.int64, "all", torch.bfloat16, True, False),   # PyTorch's dtypes, bf16 grad_w
        (torch.int64, "all", torch.bfloat16, False, False),
        (torch.int32, "topk", torch.float32, False, False),  # route's own outputs
        (torch.int32, "topk", torch.float32, False, True),   # precise
        (torch.int64, "topk", torch.bfloat16, True, False),
        (torch.int32, "all", torch.float32, False, False),
    ],
)
@pytest.mark.parametrize("T", [1, 300, 2048])
def test_route_backward_equals_the_ctypes_op(T, idx_dtype, scores, real, grad_w_bf16, precise):
    x, w, idx, s, g = _backward_inputs(T, 7 + T, idx_dtype, scores, real)
    args = (x, w, idx, s, g, *CFG, precise, grad_w_bf16)
    ours = torch.ops.moe_routing.route_backward(*args)
    assert ours[1].dtype == (torch.bfloat16 if grad_w_bf16 else torch.float32)
    _equal(ours, ops._route_backward_ctypes(*args))
    # Defaults, and an f32 weight (rounded to bf16 as in the forward).
    _equal(torch.ops.moe_routing.route_backward(x, w, idx, s, g, *CFG),
           ops._route_backward_ctypes(x, w, idx, s, g, *CFG))
    args = (x, w.float(), idx, s, g, *CFG, precise, grad_w_bf16)
    _equal(torch.ops.moe_routing.route_backward(*args), ops._route_backward_ctypes(*args))


@needs_gpu
def test_route_backward_with_zero_tokens():
    x, w, b = _inputs(0, 5)
    idx, weights, scores = torch.ops.moe_routing.route(x, w, b, K, *CFG)
    for bf16 in (False, True):
        args = (x, w, idx, scores, weights, *CFG, False, bf16)
        ours = torch.ops.moe_routing.route_backward(*args)
        _equal(ours, ops._route_backward_ctypes(*args))
        assert ours[0].shape == (0, H) and bool((ours[1] == 0).all())


@needs_gpu
def test_invalid_cuda_arguments_raise_and_touch_nothing():
    x, w, idx, s, g = _backward_inputs(64, 9, torch.int64, "all", torch.bfloat16)
    stream = _fresh_stream()
    key = (x.device.index, stream.cuda_stream)
    bad = [
        ((x, w, idx[:, :4].contiguous(), s, g), r"grad_topk_weights must have shape \[64, 4\]"),
        ((x, w, idx.short(), s, g), "topk_idx must be torch.int32 or torch.int64"),
        ((x, w, idx, s[:, :100], g), "topk_scores must"),
        ((x, w, idx, s, g.half()), "grad_topk_weights must be torch.float32 or torch.bfloat16"),
        ((x, w, idx, s, g.cpu()), "grad_topk_weights is on cpu, but x is on cuda"),
        ((x, w.t(), idx, s, g), "weight must"),
    ]
    with torch.cuda.stream(stream):
        for args, msg in bad:
            with pytest.raises(ValueError, match=msg):
                torch.ops.moe_routing.route_backward(*args, *CFG)
        with pytest.raises(ValueError, match="grad_w_bf16: precise mode"):
            torch.ops.moe_routing.route_backward(x, w, idx, s, g, *CFG, True, True)
        with pytest.raises(ValueError, match="n_group"):
            torch.ops.moe_routing.route_backward(x, w, idx, s, g, 7, 2, SCALE, True)
    stream.synchronize()
    assert key not in ops._workspaces  # no call got as far as its workspace


@needs_gpu
def test_workspace_is_cached_per_stream_and_grown():
    stream = torch.cuda.Stream()
    cfg = _lib.make_config(H, E, K, GROUPS, TOPK_GROUP, SCALE, True)
    results = []
    with torch.cuda.stream(stream):
        key = (torch.cuda.current_device(), stream.cuda_stream)
        for T, seed in ((300, 11), (2048, 12), (300, 11)):
            args = _backward_inputs(T, seed, torch.int64, "all", torch.bfloat16)
            results.append(torch.ops.moe_routing.route_backward(*args, *CFG, False, True))
            ws = ops._workspaces[key]
            assert ws.dtype == torch.uint8 and ws.device.index == key[0]
            assert ws.numel() >= _lib.backward_workspace_bytes(cfg, T)
    stream.synchronize()
    _equal(results[0], results[2])


# --------------------------------------------------------------------------------------------
# GPU: autograd, torch.compile, CUDA graphs


def _loss(x, w, b, g):
    _, weights, _ = torch.ops.moe_routing.route(x, w, b, K, *CFG)
    return (weights * g).sum()


@needs_gpu
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_autograd_through_route(wdtype):
    x, w, b = _inputs(300, 13, wdtype)
    g = torch.randn(300, K, device="cuda")
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    idx, weights, scores = torch.ops.moe_routing.route(xr, wr, b, K, *CFG)
    assert weights.requires_grad and not idx.requires_grad and not scores.requires_grad
    gx, gw = torch.autograd.grad((weights * g).sum(), (xr, wr))
    # The backward is route_backward on route's outputs (bf16 grad_w for a bf16 weight).
    want_x, want_w = ops._route_backward_ctypes(x, w, idx, scores, g, *CFG, False,
                                                wdtype == torch.bfloat16)
    assert gx.dtype == torch.bfloat16 and gw.dtype == wdtype
    assert torch.equal(gx, want_x) and torch.equal(gw, want_w.to(wdtype))
    # Only x: grad_w is not returned.
    (gx_only,) = torch.autograd.grad(_loss(xr, w, b, g), (xr,))
    assert torch.equal(gx_only, want_x)


@needs_gpu
def test_route_backward_is_not_differentiable():
    x, w, idx, s, g = _backward_inputs(64, 14, torch.int32, "topk", torch.float32)
    gr = g.clone().requires_grad_(True)
    gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, gr, *CFG)
    assert gx.requires_grad and gw.requires_grad
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.autograd.grad(gx.float().sum(), (gr,))
    # Neither output is tracked where no gradient is needed: grad mode off, or no input asking.
    with torch.no_grad():
        gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, gr, *CFG)
    assert not gx.requires_grad and not gw.requires_grad
    gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, g, *CFG)
    assert not gx.requires_grad and not gw.requires_grad


def _step(x, w, b, g):
    idx, weights, _ = torch.ops.moe_routing.route(x, w, b, K, *CFG)
    return idx, weights, (weights * g).sum()


@needs_gpu
def test_torch_compile_fullgraph():
    # Forward and backward (AOTAutograd) of a compiled function calling route, against eager.
    torch._dynamo.reset()
    x, w, b = _inputs(300, 15)
    g = torch.randn(300, K, device="cuda")
    compiled = torch.compile(_step, fullgraph=True)
    for T in (300, 129):  # and another token count
        runs = []
        for fn in (compiled, _step):
            xs, ws = x[:T].clone().requires_grad_(True), w.clone().requires_grad_(True)
            idx, weights, loss = fn(xs, ws, b, g[:T])
            loss.backward()
            runs.append((idx, weights, xs.grad, ws.grad))
        (ci, cw, cgx, cgw), (ei, ew, egx, egw) = runs
        _equal((ci, cw), (ei, ew))
        torch.testing.assert_close(cgx, egx)
        torch.testing.assert_close(cgw, egw)
    torch._dynamo.reset()


@needs_gpu
@pytest.mark.parametrize("warm", [False, True])
def test_cuda_graph_of_route_backward_equals_eager(warm):
    # warm: the capture stream has a cached workspace (reused in the graph); else the graph
    # gets its own, and nothing is cached for that stream.
    T = 1024
    x, w, idx, s, g = _backward_inputs(T, 16, torch.int64, "all", torch.bfloat16)
    static = [t.clone() for t in (x, w, idx, s, g)]
    capture = _fresh_stream()
    key = (x.device.index, capture.cuda_stream)
    capture.wait_stream(torch.cuda.current_stream())
    if warm:
        with torch.cuda.stream(capture):
            torch.ops.moe_routing.route_backward(*static, *CFG, False, True)
        assert key in ops._workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        out_x, out_w = torch.ops.moe_routing.route_backward(*static, *CFG, False, True)
    assert (key in ops._workspaces) == warm
    for seed in (17, 18, 17):
        new = _backward_inputs(T, seed, torch.int64, "all", torch.bfloat16)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        want = torch.ops.moe_routing.route_backward(*new, *CFG, False, True)
        torch.cuda.synchronize()
        _equal((out_x, out_w), want)
        _equal(want, ops._route_backward_ctypes(*new, *CFG, False, True))


if __name__ == "__main__":
    # The ctypes side of the comparisons, run in a process with MOE_ROUTING_TORCH_OP=0.
    what = sys.argv[1]
    print(json.dumps(_schemas() if what == "schemas" else _errors()))
