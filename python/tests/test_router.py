"""Tests of the moe_routing PyTorch package.

CPU tests (any machine): the ctypes layout, library loading and ABI version, status strings,
config validation against the library, fake/meta shapes and autograd wiring, input
validation, the reference's ranking semantics and backward, and the module against HF
transformers (if installed). GPU tests (a Hopper GPU, sm_90, and the library): the ops against
the reference, gradients, opcheck, torch.compile(fullgraph=True), CUDA graph capture and a
short training loop. Each test that cannot run here is skipped with the reason.
"""

import ctypes
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

import moe_routing
from moe_routing import _lib, ops
from moe_routing import reference as R
from moe_routing.module import GroupedTopKRouter, replace_hf_routers

HAS_LIB = _lib.find_library() is not None
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)

needs_lib = pytest.mark.skipif(
    not HAS_LIB,
    reason="libmoe_routing.so not found (cargo xtask package, or set MOE_ROUTING_LIB)",
)
needs_gpu = pytest.mark.skipif(
    not (HAS_LIB and HAS_HOPPER),
    reason="needs a Hopper GPU (sm_90) through torch.cuda and libmoe_routing.so",
)

try:
    import transformers  # noqa: F401
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    HAS_HF = True
except Exception:  # not installed, or without these models
    HAS_HF = False

needs_hf = pytest.mark.skipif(
    not HAS_HF, reason="transformers 5.x with DeepseekV3/Glm4Moe not importable"
)


def config(**kw):
    base = dict(
        hidden_size=512,
        n_routed_experts=160,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    base.update(kw)
    return SimpleNamespace(**base)


# Shapes covering both backward paths: GLM-4.5's E=160/K=8 (H % 128 == 0) and DeepSeek-V3's
# E=256/K=8 (H % 64 == 0) take the fused kernel; the others (H = 136, E = 32: no fused kernel)
# the simple one.
CONFIGS = {
    "glm45": config(),
    "deepseek_v3": config(hidden_size=256, n_routed_experts=256, n_group=8, topk_group=4),
    "flat_unnormed": config(hidden_size=136, n_routed_experts=64, num_experts_per_tok=6,
                            n_group=1, topk_group=1, routed_scaling_factor=1.0,
                            norm_topk_prob=False),
    "small": config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                    topk_group=2, routed_scaling_factor=1.5),
}


def op_args(c):
    return (c.num_experts_per_tok, c.n_group, c.topk_group, c.routed_scaling_factor,
            c.norm_topk_prob)


def inputs(c, tokens, device, seed=0):
    """Random x [T, H] bf16, weight [E, H] f32 (bf16-exact) and bias [E] f32 whose sigmoid
    scores spread over (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    h, e = c.hidden_size, c.n_routed_experts
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
    w = (torch.randn(e, h, generator=g) * (2.0 / math.sqrt(h))).to(torch.bfloat16).float()
    b = torch.randn(e, generator=g) * 0.05
    return x.to(device), w.to(device), b.to(device)


# --------------------------------------------------------------------------------------------
# ctypes layout, library, statuses (CPU)


def test_struct_layout_matches_the_header():
    assert ctypes.sizeof(_lib.MoeRoutingConfig) == 56
    assert _lib.MoeRoutingConfig.hidden_size.offset == 8
    assert _lib.MoeRoutingConfig.routed_scaling_factor.offset == 48
    assert _lib.MoeRoutingConfig.reserved.offset == 52
    assert ctypes.sizeof(_lib.MoeRoutingForwardArgs) == 160
    assert _lib.MoeRoutingForwardArgs.topk_idx_dtype.offset == 152  # ..._FORWARD_ARGS_SIZE_V3
    assert _lib.MoeRoutingForwardArgs.tokens.offset == 8
    assert _lib.MoeRoutingForwardArgs.topk_scores_len.offset == 104
    assert _lib.MoeRoutingForwardArgs.scores.offset == 112  # MOE_ROUTING_FORWARD_ARGS_SIZE_V1
    assert _lib.MoeRoutingForwardArgs.expert_counts.offset == 128
    assert _lib.MoeRoutingForwardArgs.flags.offset == 144  # MOE_ROUTING_FORWARD_ARGS_SIZE_V2
    assert _lib.MoeRoutingForwardArgs.device.offset == 148
    assert ctypes.sizeof(_lib.MoeRoutingBackwardArgs) == 192
    assert _lib.MoeRoutingBackwardArgs.scores.offset == 152
    assert _lib.MoeRoutingBackwardArgs.flags.offset == 184  # MOE_ROUTING_BACKWARD_ARGS_SIZE_V2
    assert _lib.MoeRoutingBackwardArgs.tokens.offset == 8
    assert _lib.MoeRoutingBackwardArgs.workspace_bytes.offset == 136
    assert _lib.MoeRoutingBackwardArgs.accumulate_grad_w.offset == 144
    assert _lib.MoeRoutingBackwardArgs.reserved.offset == 148


def test_lookup_order(monkeypatch, tmp_path):
    monkeypatch.delenv(_lib.ENV_VAR, raising=False)
    monkeypatch.delenv("CARGO_TARGET_DIR", raising=False)
    paths = _lib.candidate_paths()
    pkg = _lib._package_dir()
    assert paths[0] == pkg / "lib" / "libmoe_routing.so"
    assert paths[-1] == pkg.parent.parent / "target/release/moe_routing/lib/libmoe_routing.so"
    # $MOE_ROUTING_LIB is the only candidate when set, even if it does not exist.
    missing = tmp_path / "nowhere" / "libmoe_routing.so"
    monkeypatch.setenv(_lib.ENV_VAR, str(missing))
    assert _lib.candidate_paths() == [missing]
    assert _lib.find_library() is None
    monkeypatch.setattr(_lib, "_lib", None)
    with pytest.raises(_lib.LibraryError, match="MOE_ROUTING_LIB"):
        _lib.load()


def test_open_library_rejects_other_files(tmp_path):
    junk = tmp_path / "libmoe_routing.so"
    junk.write_bytes(b"not a shared library")
    with pytest.raises(_lib.LibraryError, match="cannot load"):
        _lib.open_library(junk)


@needs_lib
def test_library_loads_with_abi_version_1():
    assert moe_routing.abi_version() == 1 == _lib.ABI_VERSION
    assert moe_routing.version() == "0.1.0" == moe_routing.__version__
    assert moe_routing.library_path().is_file()
    assert _lib.device_count() >= 0


@needs_lib
def test_abi_version_mismatch_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_lib, "ABI_VERSION", 2)
    with pytest.raises(_lib.LibraryError, match="C ABI version 1.*needs version 2"):
        _lib.open_library(_lib.find_library())


@needs_lib
def test_status_strings_and_errors():
    want = [
        "success",
        "invalid router config",
        "invalid shape",
        "null pointer",
        "misaligned pointer",
        "buffer too small",
        "pointer is not device memory of the stream's device",
        "CUDA error",
        "unsupported",
    ]
    for code, text in enumerate(want):
        assert moe_routing.status_string(code) == text
    for code in (-1, 9, 2**31 - 1):
        assert moe_routing.status_string(code) == "unknown status"
    _lib.check_status(_lib.SUCCESS, "call")
    with pytest.raises(moe_routing.MoeRoutingError, match="call failed: buffer too small") as e:
        _lib.check_status(_lib.BUFFER_TOO_SMALL, "call")
    assert e.value.status == _lib.BUFFER_TOO_SMALL
    assert isinstance(e.value, RuntimeError)


@needs_lib
def test_config_checks_agree_with_the_library():
    cases = [
        dict(),
        dict(n_group=7),
        dict(topk_group=9),
        dict(topk_group=0),
        dict(hidden_size=5124),
        dict(hidden_size=65536 + 8),
        dict(num_experts_per_tok=0),
        dict(num_experts_per_tok=17),
        dict(n_routed_experts=520, n_group=8),
        dict(n_group=1, topk_group=1),
        dict(n_group=80, topk_group=4),  # groups of 2
        dict(n_group=160, topk_group=8),  # groups of 1
        dict(n_group=8, topk_group=1, num_experts_per_tok=16),  # 16 <= 20 candidates
        dict(n_group=16, topk_group=1, num_experts_per_tok=16),  # 10 candidates < 16
        dict(routed_scaling_factor=float("nan")),
        dict(routed_scaling_factor=float("inf")),
    ]
    for kw in cases:
        c = config(**kw)
        cfg = _lib.make_config(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok,
                               c.n_group, c.topk_group, c.routed_scaling_factor,
                               c.norm_topk_prob)
        lib_ok = _lib.validate_config(cfg) == _lib.SUCCESS
        try:
            ops.check_config(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok,
                             c.n_group, c.topk_group, c.routed_scaling_factor)
            py_ok = True
        except ValueError:
            py_ok = False
        assert py_ok == lib_ok, kw


@needs_lib
def test_workspace_bytes():
    c = CONFIGS["glm45"]
    cfg = _lib.make_config(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.n_group,
                           c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
    n = _lib.backward_workspace_bytes(cfg, 256)
    assert n > 2048 and n % 256 == 0
    assert _lib.backward_workspace_bytes(cfg, 4096) > n
    assert _lib.backward_workspace_bytes(cfg, 0) == 0
    cfg.struct_size = 48
    assert _lib.backward_workspace_bytes(cfg, 256) == 0


# --------------------------------------------------------------------------------------------
# Fake tensors, meta autograd, tracing (CPU)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_fake_shapes(wdtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = CONFIGS["glm45"]
    with FakeTensorMode():
        x = torch.empty(37, c.hidden_size, dtype=torch.bfloat16)
        w = torch.empty(c.n_routed_experts, c.hidden_size, dtype=wdtype)
        b = torch.empty(c.n_routed_experts)
        idx, weights, scores = torch.ops.moe_routing.route(x, w, b, *op_args(c))
        assert (idx.shape, idx.dtype) == ((37, 8), torch.int32)
        assert (weights.shape, weights.dtype) == ((37, 8), torch.float32)
        assert (scores.shape, scores.dtype) == ((37, 8), torch.float32)
        gx, gw = torch.ops.moe_routing.route_backward(
            x, w, idx, scores, weights, c.n_group, c.topk_group, c.routed_scaling_factor,
            c.norm_topk_prob)
        assert (gx.shape, gx.dtype) == ((37, c.hidden_size), torch.bfloat16)
        assert (gw.shape, gw.dtype) == ((c.n_routed_experts, c.hidden_size), torch.float32)
        # PyTorch's dtypes: int64 indices, bf16 scores of all experts and gradients, bf16 grad_w.
        all_scores = torch.empty(37, c.n_routed_experts, dtype=torch.bfloat16)
        gx, gw = torch.ops.moe_routing.route_backward(
            x, w, idx.long(), all_scores, weights.bfloat16(), c.n_group, c.topk_group,
            c.routed_scaling_factor, c.norm_topk_prob, False, True)
        assert (gx.shape, gx.dtype) == ((37, c.hidden_size), torch.bfloat16)
        assert (gw.shape, gw.dtype) == ((c.n_routed_experts, c.hidden_size), torch.bfloat16)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_meta_autograd(wdtype):
    c = CONFIGS["small"]
    x = torch.empty(9, c.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(c.n_routed_experts, c.hidden_size, dtype=wdtype, device="meta",
                    requires_grad=True)
    b = torch.empty(c.n_routed_experts, device="meta")
    idx, weights, scores = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    assert weights.requires_grad
    assert not idx.requires_grad and not scores.requires_grad
    weights.sum().backward()
    assert (x.grad.shape, x.grad.dtype) == (x.shape, torch.bfloat16)
    assert (w.grad.shape, w.grad.dtype) == (w.shape, wdtype)


def test_meta_autograd_tracks_only_what_needs_a_gradient():
    c = CONFIGS["small"]
    x = torch.empty(9, c.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(c.n_routed_experts, c.hidden_size, dtype=torch.bfloat16, device="meta",
                    requires_grad=True)
    b = torch.empty(c.n_routed_experts, device="meta")
    # x alone asked for.
    (gx,) = torch.autograd.grad(torch.ops.moe_routing.route(x, w, b, *op_args(c))[1].sum(), (x,))
    assert gx.shape == x.shape
    # Nothing tracked with grad mode off, or where neither x nor w requires grad.
    with torch.no_grad():
        assert not torch.ops.moe_routing.route(x, w, b, *op_args(c))[1].requires_grad
    idx, weights, scores = torch.ops.moe_routing.route(x.detach(), w.detach(), b, *op_args(c))
    assert not weights.requires_grad
    # route_backward is not differentiable: its outputs raise when backpropagated through.
    g = weights.clone().requires_grad_(True)
    gx, gw = torch.ops.moe_routing.route_backward(
        x.detach(), w.detach(), idx, scores, g, c.n_group, c.topk_group,
        c.routed_scaling_factor, c.norm_topk_prob)
    assert gx.requires_grad and gw.requires_grad
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.autograd.grad(gx.float().sum(), (g,))


def test_int64_indices_on_meta():
    # int64_indices: the kernel writes the indices as int64; the rest is as with int32 (the
    # backward takes either).
    c = CONFIGS["small"]
    x = torch.empty(9, c.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(c.n_routed_experts, c.hidden_size, device="meta", requires_grad=True)
    b = torch.empty(c.n_routed_experts, device="meta")
    idx, weights, _ = torch.ops.moe_routing.route(x, w, b, *op_args(c), False, True)
    assert (idx.shape, idx.dtype) == ((9, c.num_experts_per_tok), torch.int64)
    weights.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    out = torch.ops.moe_routing.route_with_stats(x, w, b, *op_args(c), False, True, True, True)
    assert out[0].dtype == torch.int64 and out[4].dtype == torch.int32


def test_fake_tracing_of_forward_and_backward():
    from torch.fx.experimental.proxy_tensor import make_fx

    c = CONFIGS["small"]

    def step(x, w, b):
        _, weights, _ = torch.ops.moe_routing.route(x, w, b, *op_args(c))
        return torch.autograd.grad(weights.square().sum(), (x, w))

    x, w, b = inputs(c, 16, "cpu")
    x.requires_grad_(True)
    w.requires_grad_(True)
    gm = make_fx(step, tracing_mode="fake")(x, w, b)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "moe_routing.route.default" in targets
    assert "moe_routing.route_backward.default" in targets


def _loss_of_module(module, hs, g):
    _, weights, idx = module(hs)
    return (weights * g).sum(), weights, idx


def test_module_compiles_fullgraph_on_meta():
    # Dynamo + AOTAutograd over the module and both ops, with meta tensors (no GPU needed).
    c = CONFIGS["glm45"]
    m = GroupedTopKRouter(c, backend="cuda", device="meta")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for be in ("aot_eager", backend):
        torch._dynamo.reset()
        step = torch.compile(_loss_of_module, fullgraph=True, backend=be)
        hs = torch.empty(4, 64, c.hidden_size, device="meta", dtype=torch.bfloat16,
                         requires_grad=True)
        loss, weights, idx = step(m, hs, torch.empty(256, 8, device="meta"))
        loss.backward()
        assert weights.shape == idx.shape == (256, 8) and idx.dtype == torch.int64
        assert (hs.grad.shape, hs.grad.dtype) == (hs.shape, torch.bfloat16)
        assert (m.weight.grad.shape, m.weight.grad.dtype) == (m.weight.shape, torch.float32)
        m.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.moe_routing.route in targets or torch.ops.moe_routing.route.default in targets


# --------------------------------------------------------------------------------------------
# Input validation (CPU: every check comes before the library is called)


def _route(x, w, b, c=CONFIGS["small"], **kw):
    args = dict(zip(["top_k", "n_group", "topk_group", "routed_scaling_factor",
                     "norm_topk_prob"], op_args(c)))
    args.update(kw)
    return torch.ops.moe_routing.route(x, w, b, **args)


def test_route_input_validation():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 8, "cpu")
    bad = [
        ((x.float(), w, b), {}, "x must be torch.bfloat16"),
        ((x[0], w, b), {}, r"x must be \[T, H\]"),
        ((x, w[:, :32], b), {}, r"weight must have shape \[32, 64\]"),
        ((x, w.half(), b), {}, "weight must be torch.bfloat16 or torch.float32"),
        ((x, w, b[:31]), {}, r"bias must have shape \[32\]"),
        ((x, w, b.double()), {}, "bias must be torch.float32"),
        ((x.t().contiguous().t()[:, :64], w, b), {}, "x must be contiguous"),
        ((x, w.t().contiguous().t(), b), {}, "weight must be contiguous"),
        ((x, w, b), dict(n_group=3), "n_group"),
        ((x, w, b), dict(topk_group=5), "topk_group"),
        ((x, w, b), dict(top_k=17), "num_experts_per_tok"),
        ((x, w, b), dict(top_k=9, topk_group=1), "candidate experts"),
        ((x, w, b), dict(routed_scaling_factor=float("nan")), "finite"),
        ((x[:, :60].contiguous(), w[:, :60].contiguous(), b), {}, "multiple of 8"),
        ((x, w, b), {}, "x must be a CUDA tensor"),
    ]
    for args, kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _route(*args, **kw)


def test_route_backward_input_validation():
    c = CONFIGS["small"]
    x, w, _ = inputs(c, 8, "cpu")
    idx = torch.zeros(8, 4, dtype=torch.int32)
    s = torch.full((8, 4), 0.5)
    g = torch.ones(8, 4)
    rest = (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
    bad = [
        ((x, w, idx.short(), s, g), "topk_idx must be torch.int32 or torch.int64"),
        ((x, w, idx[:7], s, g), r"topk_idx must have shape \[8, 4\]"),
        ((x, w, idx, s.double(), g), "topk_scores must be torch.float32 or torch.bfloat16"),
        ((x, w, idx, s[:, :3].contiguous(), g), r"topk_scores must have shape \[8, 32\]"),
        ((x, w, idx, s, g.half()), "grad_topk_weights must be torch.float32 or torch.bfloat16"),
        ((x, w, idx, s, g[:, :3]), r"grad_topk_weights must have shape \[8, 4\]"),
        ((x, w, idx, s, g.t().contiguous().t()), "grad_topk_weights must be contiguous"),
        ((x, w, idx, s, g), "x must be a CUDA tensor"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            torch.ops.moe_routing.route_backward(*args, *rest)
    with pytest.raises(ValueError, match="grad_w_bf16: precise mode"):
        torch.ops.moe_routing.route_backward(x, w, idx, s, g, *rest, True, True)


def test_module_validation():
    with pytest.raises(ValueError, match="n_group"):
        GroupedTopKRouter(config(n_group=7))
    with pytest.raises(ValueError, match="backend"):
        GroupedTopKRouter(CONFIGS["small"], backend="triton")
    m = GroupedTopKRouter(CONFIGS["small"])
    with pytest.raises(ValueError, match="hidden_size 64"):
        m(torch.zeros(2, 3, 48))
    cuda_only = GroupedTopKRouter(CONFIGS["small"], backend="cuda")
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_only(torch.zeros(2, 3, 64))


# --------------------------------------------------------------------------------------------
# Reference semantics (CPU)


def test_reference_ranking_nan_ties_and_groups():
    nan, inf = float("nan"), float("inf")
    # No groups: NaN below -inf, ties to the lower index.
    choice = torch.tensor([[0.5, nan, 0.7, 0.5, -inf, 0.7]], dtype=torch.float64)
    assert R.select_experts(choice, 6, 1, 1).tolist() == [[2, 5, 0, 3, 4, 1]]
    # All NaN: K distinct indices, the lowest.
    assert R.select_experts(torch.full((1, 8), nan), 3, 1, 1).tolist() == [[0, 1, 2]]
    # Groups of 4, keep 2: group scores are top-2 sums: g0 = 1.0+0.9, g1 = 0.95+0.1,
    # g2 = 0.99+0.98, g3 = 0.6+0.6 -> keep g2, g0; expert 4 (0.95) is masked out.
    choice = torch.tensor([[1.0, 0.9, 0.0, 0.0,
                            0.95, 0.1, 0.0, 0.0,
                            0.99, 0.98, 0.0, 0.0,
                            0.6, 0.6, 0.6, 0.6]], dtype=torch.float64)
    assert R.select_experts(choice, 4, 4, 2).tolist() == [[0, 8, 9, 1]]
    # A NaN member of a group: the group score is the sum of its best two non-NaN values.
    choice[0, 0] = nan
    assert R.group_scores(choice, 4).tolist()[0][0] == pytest.approx(0.9)
    # Candidates of the kept groups that are NaN still rank above every masked expert.
    allnan = torch.full((1, 16), nan, dtype=torch.float64)
    allnan[0, 12:] = -inf
    idx = R.select_experts(allnan, 4, 4, 2)[0].tolist()
    groups = {i // 4 for i in idx}
    assert len(set(idx)) == 4 and len(groups) <= 2


def test_reference_near_ties():
    choice = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.9, 0.8, 0.8 + 1e-9, 0.1]],
                          dtype=torch.float64)
    assert R.near_ties(choice, 2, 1, 1).tolist() == [False, True]
    # Only the first K+1 ranked values matter.
    choice = torch.tensor([[0.9, 0.8, 0.7, 0.1, 0.1]], dtype=torch.float64)
    assert R.near_ties(choice, 2, 1, 1).tolist() == [False]


@pytest.mark.parametrize("name", ["small", "flat_unnormed", "glm45"])
def test_reference_backward_formula_matches_autograd(name):
    c = CONFIGS[name]
    x, w, b = inputs(c, 33, "cpu", seed=1)
    xd = x.double().requires_grad_(True)
    wd = w.double().requires_grad_(True)
    idx, weights, scores = R.route(xd, wd, b, *op_args(c))
    g = torch.randn(weights.shape, dtype=torch.float64)
    gx, gw = torch.autograd.grad((weights * g).sum(), (xd, wd))
    fx, fw = R.route_backward(x, w, idx, scores.detach(), g, c.routed_scaling_factor,
                              c.norm_topk_prob)
    assert R.rel_err(fx, gx) < 1e-12
    assert R.rel_err(fw, gw) < 1e-12


# --------------------------------------------------------------------------------------------
# The module against HF transformers (CPU)


def _hf_configs():
    kw = dict(hidden_size=64, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
              topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    return [
        (DeepseekV3TopkRouter, DeepseekV3Config(**kw)),
        (Glm4MoeTopkRouter, Glm4MoeConfig(**kw)),
        (Glm4MoeTopkRouter, Glm4MoeConfig(**{**kw, "n_group": 1, "topk_group": 1,
                                            "norm_topk_prob": False})),
    ]


def _hf_pair(cls, cfg, seed=0, **kw):
    hf = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    e, h = hf.weight.shape
    with torch.no_grad():
        hf.weight.copy_((torch.randn(e, h, generator=g) * (2 / math.sqrt(h))).bfloat16().float())
        hf.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
    return hf, GroupedTopKRouter.from_hf(hf, **kw)


@needs_hf
def test_module_parameters_match_hf():
    for cls, cfg in _hf_configs():
        hf = cls(cfg)
        ours = GroupedTopKRouter(cfg)
        want = {k: (tuple(v.shape), v.dtype) for k, v in hf.state_dict().items()}
        got = {k: (tuple(v.shape), v.dtype) for k, v in ours.state_dict().items()}
        assert got == want
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
        assert [n for n, _ in ours.named_buffers()] == [n for n, _ in hf.named_buffers()]
        ours.load_state_dict(hf.state_dict(), strict=True)
        # The hyper-parameter attributes HF's routers expose.
        for attr in ("top_k", "num_experts", "hidden_dim", "routed_scaling_factor",
                     "topk_group", "norm_topk_prob"):
            if hasattr(hf, attr):
                assert getattr(ours, attr) == getattr(hf, attr), attr


@needs_hf
def test_module_matches_hf_forward_and_gradients():
    for cls, cfg in _hf_configs():
        hf, ours = _hf_pair(cls, cfg, compute_router_logits=True)
        g = torch.Generator().manual_seed(3)
        hs = torch.randn(3, 40, cfg.hidden_size, generator=g).bfloat16().float()
        hs_hf = hs.clone().requires_grad_(True)
        hs_ours = hs.clone().requires_grad_(True)
        logits_hf, w_hf, i_hf = hf(hs_hf)
        logits, w, i = ours(hs_ours)
        assert i.dtype == i_hf.dtype == torch.int64
        assert w.dtype == w_hf.dtype == torch.float32
        assert i.shape == i_hf.shape == (120, cfg.num_experts_per_tok)
        assert logits.shape == logits_hf.shape
        torch.testing.assert_close(logits, logits_hf, rtol=1e-5, atol=1e-5)
        # Same expert sets (HF's order is unspecified), except near ties.
        choice = R.choice_values(hs.reshape(-1, cfg.hidden_size), hf.weight,
                                 hf.e_score_correction_bias)
        near = R.near_ties(choice, cfg.num_experts_per_tok, ours.num_group, ours.topk_group)
        assert near.float().mean() < 0.05
        s_hf, p_hf = i_hf.sort(-1)
        s, p = i.sort(-1)
        ok = ~near
        assert torch.equal(s[ok], s_hf[ok])
        torch.testing.assert_close(w.gather(1, p)[ok], w_hf.gather(1, p_hf)[ok],
                                   rtol=1e-5, atol=1e-6)
        # Best first.
        ranked = choice.gather(1, i)
        assert bool((ranked[:, :-1] >= ranked[:, 1:]).all())
        # Gradients through the routing weights (on tokens without near ties).
        gw = torch.randn(w.shape, generator=g)
        mask = ok.unsqueeze(-1).float()
        (w_hf.gather(1, p_hf) * gw * mask).sum().backward()
        (w.gather(1, p) * gw * mask).sum().backward()
        torch.testing.assert_close(hs_ours.grad, hs_hf.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ours.weight.grad, hf.weight.grad, rtol=1e-4, atol=1e-6)
        assert ours.e_score_correction_bias.grad is None


@needs_hf
def test_replace_hf_routers():
    cls, cfg = _hf_configs()[0]
    model = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"gate": cls(cfg)}),
                                 "other": torch.nn.Linear(4, 4)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert replace_hf_routers(model) == 1
    assert isinstance(model["mlp"]["gate"], GroupedTopKRouter)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


# --------------------------------------------------------------------------------------------
# GPU: the kernels through the ops and the module


@needs_gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_reference(name):
    c = CONFIGS[name]
    x, w, b = inputs(c, 3001, "cuda", seed=11)
    idx, weights, scores = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    assert idx.dtype == torch.int32 and weights.dtype == scores.dtype == torch.float32
    choice = R.choice_values(x, w, b)
    near = R.near_ties(choice, c.num_experts_per_tok, c.n_group, c.topk_group)
    assert near.float().mean() < 0.05
    ref_idx, _, _ = R.route(x, w, b, *op_args(c))
    ok = ~near
    assert torch.equal(idx.long()[ok], ref_idx[ok])
    # Rows hold distinct experts, even on near ties.
    assert bool((idx.sort(-1).values.diff(dim=-1) > 0).all())
    # Weights and scores on the kernel's own selection.
    _, ref_w, ref_s = R.route(x, w, b, *op_args(c), topk_idx=idx)
    torch.testing.assert_close(scores.double(), ref_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.double(), ref_w, rtol=1e-5, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_reference(name, precise):
    c = CONFIGS[name]
    x, w, b = inputs(c, 3001, "cuda", seed=12)
    xk = x.clone().requires_grad_(True)
    wk = w.clone().requires_grad_(True)
    idx, weights, _ = torch.ops.moe_routing.route(xk, wk, b, *op_args(c), precise)
    g = torch.randn(weights.shape, device="cuda")
    (weights * g).sum().backward()
    assert xk.grad.dtype == torch.bfloat16 and wk.grad.dtype == torch.float32
    xr = x.double().requires_grad_(True)
    wr = w.double().requires_grad_(True)
    _, ref_w, _ = R.route(xr, wr, b, *op_args(c), topk_idx=idx)
    (ref_w * g.double()).sum().backward()
    assert R.rel_err(xk.grad, xr.grad) <= 1e-2
    assert R.rel_err(wk.grad, wr.grad) <= (1e-4 if precise else 5e-3)


@needs_gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_int64_indices_equal_int32_ones(name):
    c = CONFIGS[name]
    x, w, b = inputs(c, 300, "cuda", seed=3)
    args = (x, w, b, *op_args(c), False)
    idx32, weights32, scores32 = torch.ops.moe_routing.route(*args)
    idx64, weights64, scores64 = torch.ops.moe_routing.route(*args, True)
    assert idx64.dtype == torch.int64 and torch.equal(idx64, idx32.long())
    assert torch.equal(weights64, weights32) and torch.equal(scores64, scores32)
    out = torch.ops.moe_routing.route_with_stats(*args, True, True, True)
    assert out[0].dtype == torch.int64 and torch.equal(out[0], idx32.long())


@needs_gpu
def test_route_backward_op_matches_reference():
    c = CONFIGS["glm45"]
    x, w, b = inputs(c, 1000, "cuda", seed=13)
    wb = w.to(torch.bfloat16)
    idx, _, scores = torch.ops.moe_routing.route(x, wb, b, *op_args(c))
    g = torch.randn(idx.shape, device="cuda")
    rest = (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
    gx, gw = torch.ops.moe_routing.route_backward(x, wb, idx, scores, g, *rest)
    rx, rw = R.route_backward(x, wb, idx, scores, g, c.routed_scaling_factor, c.norm_topk_prob)
    assert R.rel_err(gx, rx) <= 1e-2
    assert R.rel_err(gw, rw) <= 5e-3
    # f32 weight gives the same results (rounded to bf16 inside).
    gx2, gw2 = torch.ops.moe_routing.route_backward(x, w, idx, scores, g, *rest)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2)


@needs_gpu
def test_route_backward_reads_pytorch_dtypes():
    # The public benchmark's interface: int64 indices, bf16 scores of all experts, bf16
    # gradients, bf16 grad_w; and each of those alone. All against the float64 reference.
    c = CONFIGS["glm45"]
    x, w, b = inputs(c, 1300, "cuda", seed=21)
    wb = w.to(torch.bfloat16)
    idx, _, scores = torch.ops.moe_routing.route(x, wb, b, *op_args(c))
    gen = torch.Generator(device="cuda").manual_seed(22)
    all_scores = torch.rand(idx.shape[0], c.n_routed_experts, device="cuda", generator=gen)
    all_scores.scatter_(1, idx.long(), scores)  # the chosen experts' scores as route gave them
    g = torch.randn(idx.shape, device="cuda", generator=gen)
    rest = (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
    for idx_dt, scores_form, real_dt, w_bf16 in [
        (torch.int64, "all", torch.bfloat16, True),
        (torch.int64, "chosen", torch.float32, False),
        (torch.int32, "all", torch.float32, False),
        (torch.int32, "chosen", torch.bfloat16, True),
    ]:
        s = (all_scores if scores_form == "all" else scores).to(real_dt)
        gr = g.to(real_dt)
        gx, gw = torch.ops.moe_routing.route_backward(
            x, wb, idx.to(idx_dt), s, gr, *rest, False, w_bf16)
        assert gw.dtype == (torch.bfloat16 if w_bf16 else torch.float32)
        chosen = s.float().gather(1, idx.long()) if scores_form == "all" else s.float()
        rx, rw = R.route_backward(x, wb, idx, chosen, gr.float(), c.routed_scaling_factor,
                                  c.norm_topk_prob)
        assert R.rel_err(gx, rx) <= 1e-2, (idx_dt, scores_form, real_dt)
        assert R.rel_err(gw.float(), rw) <= 6e-3, (idx_dt, scores_form, real_dt)


@needs_gpu
def test_route_backward_workspace_is_cached_per_stream():
    # One zeroed workspace per (device, stream), grown when a larger call needs more; the
    # results stay those of a fresh workspace (the library leaves it zeroed).
    c = CONFIGS["glm45"]
    rest = (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)
    stream = torch.cuda.Stream()
    results = []
    with torch.cuda.stream(stream):
        for T, seed in ((300, 23), (2000, 24), (300, 23)):
            x, w, b = inputs(c, T, "cuda", seed=seed)
            wb = w.to(torch.bfloat16)
            idx, weights, scores = torch.ops.moe_routing.route(x, wb, b, *op_args(c))
            results.append(torch.ops.moe_routing.route_backward(
                x, wb, idx, scores, weights, *rest))
            key = (x.device.index, stream.cuda_stream)
            assert key in ops._workspaces
            cfg = _lib.make_config(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok,
                                   c.n_group, c.topk_group, c.routed_scaling_factor,
                                   c.norm_topk_prob)
            assert ops._workspaces[key].numel() >= _lib.backward_workspace_bytes(cfg, T)
    stream.synchronize()
    for a, b_ in zip(results[0], results[2]):
        assert torch.equal(a, b_)


@needs_gpu
def test_zero_tokens():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 0, "cuda")
    idx, weights, scores = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    assert idx.shape == weights.shape == scores.shape == (0, c.num_experts_per_tok)
    gx, gw = torch.ops.moe_routing.route_backward(
        x, w, idx, scores, weights, c.n_group, c.topk_group, c.routed_scaling_factor,
        c.norm_topk_prob)
    assert gx.shape == (0, c.hidden_size)
    assert bool((gw == 0).all())


@needs_gpu
def test_misaligned_views_are_copied():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 65, "cuda", seed=14)
    base = torch.empty(x.numel() + 4, dtype=torch.bfloat16, device="cuda")
    view = base[4:].view(x.shape)  # 8-byte offset: not 16-byte aligned
    view.copy_(x)
    assert view.data_ptr() % 16 != 0
    a = torch.ops.moe_routing.route(view, w, b, *op_args(c))
    e = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    for p, q in zip(a, e):
        assert torch.equal(p, q)


@needs_gpu
def test_opcheck():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 64, "cuda", seed=15)
    # opcheck's AOT test adds the outputs up into the first one's dtype, which fails for the
    # int32 indices; torch.compile of the op and its backward is covered below.
    torch.library.opcheck(
        torch.ops.moe_routing.route.default,
        (x.clone().requires_grad_(True), w.clone().requires_grad_(True), b, *op_args(c)),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    idx, _, scores = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    g = torch.randn(idx.shape, device="cuda")
    torch.library.opcheck(
        torch.ops.moe_routing.route_backward.default,
        (x, w, idx, scores, g, c.n_group, c.topk_group, c.routed_scaling_factor,
         c.norm_topk_prob),
    )


def _module_step(module, hs, g, forward=_loss_of_module):
    loss, weights, idx = forward(module, hs, g)
    loss.backward()
    return weights, idx


@needs_gpu
def test_module_compiles_fullgraph():
    c = CONFIGS["glm45"]
    torch._dynamo.reset()
    m = GroupedTopKRouter(c).cuda()
    m_eager = GroupedTopKRouter(c).cuda()
    m_eager.load_state_dict(m.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(16)
    hs = torch.randn(4, 256, c.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    g = torch.randn(4 * 256, c.num_experts_per_tok, device="cuda", generator=gen)
    compiled = torch.compile(_loss_of_module, fullgraph=True)
    hs_c = hs.clone().requires_grad_(True)
    hs_e = hs.clone().requires_grad_(True)
    w_c, i_c = _module_step(m, hs_c, g, compiled)
    w_e, i_e = _module_step(m_eager, hs_e, g)
    assert torch.equal(i_c, i_e) and i_c.dtype == torch.int64
    torch.testing.assert_close(w_c, w_e)
    torch.testing.assert_close(hs_c.grad, hs_e.grad)
    torch.testing.assert_close(m.weight.grad, m_eager.weight.grad)
    # Another token count.
    m.zero_grad(set_to_none=True)
    _module_step(m, hs[:3].clone().requires_grad_(True), g[: 3 * 256], compiled)
    assert m.weight.grad is not None and bool(torch.isfinite(m.weight.grad).all())
    torch._dynamo.reset()


@needs_gpu
def test_cuda_graph_capture_of_forward_and_backward():
    c = CONFIGS["glm45"]
    m = GroupedTopKRouter(c).cuda()
    gen = torch.Generator(device="cuda").manual_seed(17)
    T = 512
    static_x = torch.randn(T, c.hidden_size, device="cuda", generator=gen).requires_grad_(True)
    static_g = torch.randn(T, c.num_experts_per_tok, device="cuda", generator=gen)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            static_x.grad = None
            _module_step(m, static_x, static_g)
    torch.cuda.current_stream().wait_stream(side)

    m.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_w, static_idx = _module_step(m, static_x, static_g)

    for seed in (18, 19):
        gen.manual_seed(seed)
        new_x = torch.randn(T, c.hidden_size, device="cuda", generator=gen)
        new_g = torch.randn(T, c.num_experts_per_tok, device="cuda", generator=gen)
        with torch.no_grad():
            static_x.copy_(new_x)
            static_g.copy_(new_g)
        graph.replay()
        torch.cuda.synchronize()
        # Eager on a copy of the module.
        ref = GroupedTopKRouter(c).cuda()
        ref.load_state_dict(m.state_dict())
        xe = new_x.clone().requires_grad_(True)
        w_e, i_e = _module_step(ref, xe, new_g)
        assert torch.equal(static_idx, i_e)
        torch.testing.assert_close(static_w, w_e)
        torch.testing.assert_close(static_x.grad, xe.grad)
        torch.testing.assert_close(m.weight.grad, ref.weight.grad)


@needs_gpu
def test_training_loop_matches_reference_module():
    # 20 SGD steps on a toy regression over the routing weights, with the kernels and with
    # the float64 reference from the same start. Routes that flip near ties at slightly
    # different steps make the curves drift apart a little; the bounds leave room for that.
    c = config(hidden_size=256)
    torch.manual_seed(20)
    kern = GroupedTopKRouter(c, backend="cuda").cuda()
    ref = GroupedTopKRouter(c, backend="reference").cuda()
    ref.load_state_dict(kern.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(21)
    T = 1024
    x = torch.randn(T, c.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    expert_value = torch.randn(c.n_routed_experts, device="cuda", generator=gen)
    target = torch.randn(T, device="cuda", generator=gen)

    def loss_of(module):
        _, weights, idx = module(x)
        pred = (weights.float() * expert_value[idx]).sum(-1)
        return (pred - target).square().mean()

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (kern, ref)]
    curves = ([], [])
    for _ in range(20):
        for m, opt, curve in zip((kern, ref), opts, curves):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(m)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    k, r = curves
    rel = [abs(a - b) / abs(b) for a, b in zip(k, r)]
    assert all(math.isfinite(v) for v in k)
    assert k[-1] < 0.7 * k[0], k  # it learns
    assert rel[0] < 1e-4, (k, r)
    assert max(rel) < 5e-2, (k, r)
    assert sum(rel) / len(rel) < 1.5e-2, (k, r)
    assert R.rel_err(kern.weight.detach(), ref.weight.detach()) < 2e-2


@needs_gpu
@needs_hf
def test_module_matches_hf_on_gpu():
    kw = dict(hidden_size=512, n_routed_experts=160, num_experts_per_tok=8, n_group=8,
              topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    hf, ours = _hf_pair(Glm4MoeTopkRouter, Glm4MoeConfig(**kw), seed=22)
    hf, ours = hf.cuda(), ours.cuda()
    gen = torch.Generator(device="cuda").manual_seed(23)
    hs = torch.randn(2, 1000, 512, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        _, w_hf, i_hf = hf(hs)
        _, w, i = ours(hs)
    choice = R.choice_values(hs.reshape(-1, 512), hf.weight, hf.e_score_correction_bias)
    ok = ~R.near_ties(choice, 8, 8, 4)
    s_hf, p_hf = i_hf.sort(-1)
    s, p = i.sort(-1)
    assert torch.equal(s[ok], s_hf[ok])
    torch.testing.assert_close(w.gather(1, p)[ok], w_hf.gather(1, p_hf)[ok],
                               rtol=1e-4, atol=1e-5)


def test_kernels_run_on_hopper_only(monkeypatch):
    # The GPU check behind backend="auto" and "cuda", with the device queries stood in for:
    # a Hopper GPU runs the kernels; another one does not, and warns once.
    from moe_routing import module

    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d: caps[d if isinstance(d, int) else d.index])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Some GPU")
    module._kernels_run_on_index.cache_clear()
    try:
        assert module.kernels_run_on(torch.device("cuda", 0))
        with pytest.warns(RuntimeWarning, match="compute capability 8.0"):
            assert not module.kernels_run_on(torch.device("cuda", 1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not module.kernels_run_on(torch.device("cuda", 1))  # asked once
    finally:
        module._kernels_run_on_index.cache_clear()


def test_kernel_paths_are_logged(caplog):
    # Constructing a router says once per config which kernels it takes: INFO for the fused
    # ones, WARNING for the simple ones (here 72 experts, both passes).
    import logging

    from moe_routing import module

    try:
        known = _lib.kernel_paths(_lib.make_config(5120, 160, 8, 8, 4, 2.5, True))
    except _lib.LibraryError:
        pytest.skip("no moe_routing library")
    if known is None:
        pytest.skip("the library predates moe_routing_kernel_paths")
    assert known == _lib.PATH_FORWARD_FUSED | _lib.PATH_BACKWARD_FUSED

    def config(e, k, n_group, topk_group):
        return SimpleNamespace(hidden_size=1024, n_routed_experts=e, num_experts_per_tok=k,
                               n_group=n_group, topk_group=topk_group,
                               routed_scaling_factor=2.5, norm_topk_prob=True)

    module._log_kernel_paths.cache_clear()
    with caplog.at_level(logging.INFO, logger="moe_routing"):
        GroupedTopKRouter(config(72, 6, 1, 1), device="meta")
        GroupedTopKRouter(config(72, 6, 1, 1), device="meta")  # said once
        GroupedTopKRouter(config(160, 8, 8, 4), device="meta")
        GroupedTopKRouter(config(72, 6, 1, 1), backend="reference", device="meta")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "moe_routing"]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], said
    assert "E=72, top-6, groups 1 of 1: forward simple, backward simple" in said[0][1]
    assert "far slower" in said[0][1]
    assert "E=160, top-8, groups 4 of 8: forward fused, backward fused" in said[1][1]
    module._log_kernel_paths.cache_clear()


@needs_lib
def test_kernel_paths_say_which_kernels_a_config_takes():
    if _lib.kernel_paths(_lib.make_config(5120, 160, 8, 8, 4, 2.5, True)) is None:
        pytest.skip("the library predates moe_routing_kernel_paths")
    fused = {"forward": "fused", "backward": "fused"}
    assert moe_routing.kernel_paths(5120, 160, 8, 8, 4) == fused
    assert moe_routing.kernel_paths(7168, 256, 8, 8, 4) == fused  # DeepSeek-V3
    fwd_only = {"forward": "fused", "backward": "simple"}
    # The wide fused backward: by default Kimi-K2's 384 experts and 512 at top-16, not more than
    # 8 a token at up to 256 experts (top-12 at 160: the simple backward);
    # MOE_ROUTING_WIDE_BACKWARD=1 takes every wide shape, =0 none.
    wide = os.environ.get("MOE_ROUTING_WIDE_BACKWARD")
    above_256 = fwd_only if wide == "0" else fused
    assert moe_routing.kernel_paths(7168, 384, 8) == above_256
    assert moe_routing.kernel_paths(4096, 512, 16, 8, 4) == above_256
    assert moe_routing.kernel_paths(5120, 160, 12) == (fused if wide == "1" else fwd_only)
    # 96 experts: the 128-expert forward, masked; 72 experts (not a multiple of 16): both simple.
    assert moe_routing.kernel_paths(5120, 96, 6) == fwd_only
    assert moe_routing.kernel_paths(5120, 72, 6) == {"forward": "simple", "backward": "simple"}
    with pytest.raises(ValueError, match="n_group"):
        moe_routing.kernel_paths(5120, 160, 8, 7, 4)
