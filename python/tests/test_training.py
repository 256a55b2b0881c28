"""Training features: grad_w added into Megatron's ``main_grad``, the optional forward outputs
(all scores, per-expert token counts), the loss-free balancing update of the expert bias, and
routing replay.

CPU tests run everywhere, through the float64 reference and the ops' fake kernels; each is
checked against an independent float64 computation written here. GPU tests (a Hopper GPU and
the library) run the same features through the kernels and are skipped otherwise.
"""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_routing
from moe_routing import GroupedTopKRouter
from moe_routing import reference as R

from test_router import CONFIGS, config, inputs, needs_gpu, op_args



def bwd_rest(c):
    return (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)


def plain_weights(x, w, idx, c):
    """Independent float64 routing weights at given experts: sigmoid of the bf16-rounded
    logits, gathered, normalised, scaled (differentiable in x and w)."""
    xb = x.double() + (x.detach().bfloat16().double() - x.detach().double())
    wb = w.double() + (w.detach().bfloat16().double() - w.detach().double())
    s = torch.sigmoid(xb @ wb.t()).gather(1, idx.long())
    if c.norm_topk_prob:
        s = s / (s.sum(-1, keepdim=True) + 1e-20)
    return s * float(torch.tensor(c.routed_scaling_factor, dtype=torch.float32))


def distinct_indices(tokens, experts, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


# --------------------------------------------------------------------------------------------
# The ops: fake kernels, validation (CPU)


def test_fake_shapes_of_the_new_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = CONFIGS["glm45"]
    E, H = c.n_routed_experts, c.hidden_size
    with FakeTensorMode():
        x = torch.empty(37, H, dtype=torch.bfloat16)
        w = torch.empty(E, H)
        b = torch.empty(E)
        for scores, counts in ((False, False), (True, False), (False, True), (True, True)):
            out = torch.ops.moe_routing.route_with_stats(x, w, b, *op_args(c), False, scores,
                                                         counts)
            assert [tuple(t.shape) for t in out[:3]] == [(37, 8)] * 3
            assert (tuple(out[3].shape), out[3].dtype) == ((37, E) if scores else (0,),
                                                           torch.float32)
            assert (tuple(out[4].shape), out[4].dtype) == ((E,) if counts else (0,),
                                                           torch.int32)
        idx, weights, s, _, _ = torch.ops.moe_routing.route_with_stats(x, w, b, *op_args(c))
        acc = torch.empty(E, H)
        version = acc._version
        gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, weights, *bwd_rest(c),
                                                      grad_w_out=acc)
        assert (tuple(gx.shape), gx.dtype) == ((37, H), torch.bfloat16)
        assert (tuple(gw.shape), gw.dtype) == ((0,), torch.float32)
        assert acc._version > version  # written in place, as its schema says
        # Positional, and left at its default.
        gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, weights, *bwd_rest(c),
                                                      False, False, acc)
        assert tuple(gw.shape) == (0,)
        gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, weights, *bwd_rest(c))
        assert tuple(gw.shape) == (E, H)


def test_route_with_stats_autograd_on_meta():
    c = CONFIGS["small"]
    x = torch.empty(9, c.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(c.n_routed_experts, c.hidden_size, device="meta", requires_grad=True)
    b = torch.empty(c.n_routed_experts, device="meta")
    idx, weights, s, scores, counts = torch.ops.moe_routing.route_with_stats(
        x, w, b, *op_args(c), False, True, True)
    assert weights.requires_grad
    assert not any(t.requires_grad for t in (idx, s, scores, counts))
    weights.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_route_backward_into_grad_w_out_traces_and_compiles():
    # The mutation of grad_w_out is in the op's schema: make_fx records the op, and
    # torch.compile (fullgraph) functionalises it.
    from torch.fx.experimental.proxy_tensor import make_fx

    c = CONFIGS["small"]
    E, H = c.n_routed_experts, c.hidden_size

    def step(x, w, idx, s, g, acc):
        gx, _ = torch.ops.moe_routing.route_backward(x, w, idx, s, g, *bwd_rest(c), False,
                                                     False, acc)
        return gx

    args = (torch.empty(16, H, dtype=torch.bfloat16), torch.empty(E, H),
            torch.zeros(16, 4, dtype=torch.int64), torch.empty(16, 4), torch.empty(16, 4),
            torch.empty(E, H))
    gm = make_fx(step, tracing_mode="fake")(*args)
    assert "moe_routing.route_backward.default" in {
        str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    meta = [t.to("meta") for t in args]
    assert compiled(*meta).shape == (16, H)
    torch._dynamo.reset()


def test_new_op_arguments_are_validated():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 8, "cpu")
    idx = torch.zeros(8, 4, dtype=torch.int64)
    s = torch.full((8, 4), 0.5)
    g = torch.ones(8, 4)
    acc = torch.zeros(32, 64)
    bwd = torch.ops.moe_routing.route_backward
    bad = [
        (dict(grad_w_out=acc.double()), "grad_w_out must be torch.float32"),
        (dict(grad_w_out=acc[:31]), r"grad_w_out must have shape \[32, 64\]"),
        (dict(grad_w_out=acc.t().contiguous().t()[:, :64]), "grad_w_out must"),
        (dict(grad_w_out=acc, grad_w_bf16=True), "grad_w_out: grad_w is added into it"),
        (dict(grad_w_out=acc), "x must be a CUDA tensor"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            bwd(x, w, idx, s, g, *bwd_rest(c), **kw)
    assert torch.equal(acc, torch.zeros(32, 64))
    with pytest.raises(ValueError, match="bias must be torch.float32"):
        torch.ops.moe_routing.route_with_stats(x, w, b.double(), *op_args(c), False, True, True)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        torch.ops.moe_routing.route_with_stats(x, w, b, *op_args(c), False, True, True)


# --------------------------------------------------------------------------------------------
# The reference (CPU)


def test_reference_backward_adds_into_grad_w_out():
    c = CONFIGS["glm45"]
    x, w, b = inputs(c, 50, "cpu", seed=2)
    idx, _, s = R.route(x, w, b, *op_args(c))
    g = torch.randn(idx.shape, dtype=torch.float64)
    gx, gw = R.route_backward(x, w, idx, s, g, c.routed_scaling_factor, c.norm_topk_prob)
    start = torch.randn(w.shape)
    acc = start.clone()
    gx2, none = R.route_backward(x, w, idx, s, g, c.routed_scaling_factor, c.norm_topk_prob,
                                 grad_w_out=acc)
    assert none.shape == (0,) and torch.equal(gx2, gx)
    assert R.rel_err(acc.double() - start.double(), gw) < 1e-6
    with pytest.raises(ValueError, match="grad_w_out must be torch.float32"):
        R.route_backward(x, w, idx, s, g, c.routed_scaling_factor, c.norm_topk_prob,
                         grad_w_out=acc.double())


def test_reference_stats():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 40, "cpu", seed=3)
    idx, weights, s, scores, counts = R.route_with_stats(x, w, b, *op_args(c),
                                                         return_scores=True, return_counts=True)
    want_scores = torch.sigmoid(x.double() @ w.bfloat16().double().t())
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, want_scores.gather(1, idx), rtol=0, atol=1e-12)
    assert counts.dtype == torch.int64 and int(counts.sum()) == 40 * c.num_experts_per_tok
    assert counts.tolist() == [int((idx == e).sum()) for e in range(c.n_routed_experts)]
    idx0, w0, s0 = R.route(x, w, b, *op_args(c))
    assert torch.equal(idx, idx0) and torch.equal(weights, w0)


# --------------------------------------------------------------------------------------------
# main_grad (CPU, reference backend)


def _routers(c, seed=0, **kw):
    torch.manual_seed(seed)
    fused = GroupedTopKRouter(c, backend="reference", accumulate_grad_into_main_grad=True, **kw)
    plain = GroupedTopKRouter(c, backend="reference")
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _step(module, x, g, **kw):
    xs = x.clone().requires_grad_(True)
    _, weights, idx = module(xs, **kw)
    (weights * g).sum().backward()
    return xs.grad, idx


@pytest.mark.parametrize("megatron_flag", [True, False])
def test_main_grad_accumulation(megatron_flag):
    c = CONFIGS["glm45"]
    fused, plain = _routers(c)
    start = torch.randn(fused.weight.shape)
    fused.weight.main_grad = start.clone()
    if megatron_flag:
        fused.weight.grad_added_to_main_grad = False
    gen = torch.Generator().manual_seed(4)
    total = torch.zeros(fused.weight.shape, dtype=torch.float64)
    for micro in range(2):  # two micro-batches accumulate
        x = torch.randn(64, c.hidden_size, generator=gen)
        g = torch.randn(64, c.num_experts_per_tok, generator=gen)
        gx, idx = _step(fused, x, g)
        plain.zero_grad(set_to_none=True)
        gx_plain, idx_plain = _step(plain, x, g)
        assert torch.equal(idx, idx_plain)
        torch.testing.assert_close(gx, gx_plain)
        total += plain.weight.grad.double()
        assert R.rel_err(fused.weight.main_grad.double() - start.double(), total) < 1e-6
    if megatron_flag:
        # Megatron's convention: flagged, and a placeholder gradient its hook skips.
        assert fused.weight.grad_added_to_main_grad is True
        assert fused.weight.grad.shape == fused.weight.shape
    else:
        assert fused.weight.grad is None


def test_main_grad_zero_out_wgrad_and_without_main_grad():
    c = CONFIGS["small"]
    fused, plain = _routers(c, seed=1)
    x = torch.randn(16, c.hidden_size)
    g = torch.randn(16, c.num_experts_per_tok)
    # No main_grad: the gradient goes to weight.grad as usual.
    _step(fused, x, g)
    _step(plain, x, g)
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad)
    fused.weight.grad = None
    fused.weight.main_grad = torch.zeros(fused.weight.shape)
    fused.weight.grad_added_to_main_grad = False
    fused.weight.zero_out_wgrad = True
    _step(fused, x, g)
    assert torch.equal(fused.weight.grad, torch.zeros_like(fused.weight))
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad)
    # The option off: main_grad is left alone.
    off = GroupedTopKRouter(c, backend="reference")
    off.weight.main_grad = torch.zeros(off.weight.shape)
    _step(off, x, g)
    assert not off.weight.main_grad.any() and off.weight.grad is not None


def test_main_grad_is_validated():
    c = CONFIGS["small"]
    fused, _ = _routers(c)
    x = torch.randn(4, c.hidden_size)
    for bad, msg in [
        (torch.zeros(fused.weight.shape, dtype=torch.bfloat16), "must be torch.float32"),
        (torch.zeros(31, 64), "has shape"),
        (torch.zeros(64, 32).t(), "must be contiguous"),
        ("main", "must be a torch.Tensor"),
    ]:
        fused.weight.main_grad = bad
        with pytest.raises(ValueError, match="weight.main_grad " + msg):
            fused(x)
    # Under no_grad (inference) main_grad is not touched, so not checked.
    with torch.no_grad():
        fused(x)
    with pytest.raises(TypeError, match="accumulate_grad_into_main_grad must be a bool"):
        GroupedTopKRouter(c, accumulate_grad_into_main_grad=1)


# --------------------------------------------------------------------------------------------
# Optional outputs in the module (CPU, reference backend)


def test_module_counts_and_scores():
    c = CONFIGS["glm45"]
    torch.manual_seed(5)
    m = GroupedTopKRouter(c, backend="reference", track_expert_counts=True, keep_scores=True)
    plain = GroupedTopKRouter(c, backend="reference")
    plain.load_state_dict(m.state_dict())
    assert set(m.state_dict()) == set(plain.state_dict())  # tokens_per_expert: not persistent
    gen = torch.Generator().manual_seed(6)
    seen = torch.zeros(c.n_routed_experts, dtype=torch.int64)
    for T in (30, 50):
        x = torch.randn(T, c.hidden_size, generator=gen)
        _, weights, idx = m(x)
        _, w_plain, i_plain = plain(x)
        assert torch.equal(idx, i_plain) and torch.equal(weights, w_plain)
        want = torch.tensor([int((idx == e).sum()) for e in range(c.n_routed_experts)])
        assert m.last_expert_counts.dtype == torch.int32
        assert m.last_expert_counts.tolist() == want.tolist()
        seen += want
        assert m.tokens_per_expert.tolist() == seen.tolist()
        logits = x.bfloat16().double() @ m.weight.detach().bfloat16().double().t()
        assert m.last_scores.dtype == torch.float32 and m.last_scores.shape == (T, 160)
        torch.testing.assert_close(m.last_scores.double(), torch.sigmoid(logits), rtol=0,
                                   atol=1e-7)
    # Not summed in eval mode, nor under no_grad.
    m.eval()
    m(torch.randn(10, c.hidden_size))
    m.train()
    with torch.no_grad():
        m(torch.randn(10, c.hidden_size))
    assert m.tokens_per_expert.tolist() == seen.tolist()
    # The bias update from the sum, which is then reset.
    before = m.e_score_correction_bias.clone()
    m.update_expert_bias(0.01)
    mean = sum(seen.tolist()) / len(seen)
    step = [0.01 * ((mean > n) - (mean < n)) for n in seen.tolist()]
    torch.testing.assert_close(m.e_score_correction_bias - before,
                               torch.tensor(step, dtype=torch.float32))
    assert not m.tokens_per_expert.any()
    with pytest.raises(ValueError, match="track_expert_counts=True"):
        plain.update_expert_bias(0.01)
    assert not hasattr(plain, "tokens_per_expert") and plain.last_expert_counts is None


# --------------------------------------------------------------------------------------------
# update_expert_bias (CPU)


def _expected_bias(counts, bias, rate):
    """Per expert, in Python floats: lower the bias of experts above the mean load, raise it
    below, leave it at the mean."""
    rows = counts.double().reshape(-1, counts.shape[-1]).tolist()
    out = []
    for row, b in zip(rows, bias.double().reshape(-1, counts.shape[-1]).tolist()):
        mean = sum(row) / len(row)
        out.append([bi + rate * ((n < mean) - (n > mean)) for n, bi in zip(row, b)])
    return torch.tensor(out, dtype=torch.float64).reshape(bias.shape)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_update_expert_bias(dtype):
    gen = torch.Generator().manual_seed(7)
    counts = torch.randint(0, 100, (3, 16), generator=gen).to(dtype)
    counts[0] = 10  # all at the mean: no change
    counts[1, :8] = 4
    counts[1, 8:] = 6  # mean 5
    bias = torch.randn(3, 16, generator=gen)
    want = _expected_bias(counts, bias, 1e-3)
    kept = counts.clone()
    out = moe_routing.update_expert_bias(counts, bias, 1e-3)
    assert out is bias and torch.equal(counts, kept)
    torch.testing.assert_close(bias.double(), want, rtol=0, atol=1e-7)
    assert torch.equal(bias[0], (want[0]).float())
    # One router: [E].
    b1 = torch.zeros(16)
    moe_routing.update_expert_bias(counts[2], b1, 0.5)
    torch.testing.assert_close(b1.double(), _expected_bias(counts[2], torch.zeros(16), 0.5))


def test_update_expert_bias_validation():
    c, b = torch.ones(8, dtype=torch.int64), torch.zeros(8)
    upd = moe_routing.update_expert_bias
    for args, err, msg in [
        ((c.tolist(), b, 0.1), TypeError, "counts must be a torch.Tensor"),
        ((c, b.tolist(), 0.1), TypeError, "bias must be a torch.Tensor"),
        ((c, b, "0.1"), TypeError, "rate must be a number"),
        ((c, b, True), TypeError, "rate must be a number"),
        ((c, b, 0.0), ValueError, "rate must be finite and > 0"),
        ((c, b, float("nan")), ValueError, "rate must be finite and > 0"),
        ((c, b[:7], 0.1), ValueError, "bias has shape"),
        ((c.bool(), b, 0.1), ValueError, "counts must be an integer or floating"),
        ((c, c.clone(), 0.1), ValueError, "bias must be a floating tensor"),
        ((c[0], b[0], 0.1), ValueError, "last dimension"),
    ]:
        with pytest.raises(err, match=msg):
            upd(*args)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        upd(c, b, 0.1, group=object())
    assert not b.any()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bias_worker(rank, world, port, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(100 + rank)  # different counts on each rank
        counts = torch.randint(0, 50, (24,), generator=gen)
        bias = torch.linspace(-0.1, 0.1, 24)
        moe_routing.update_expert_bias(counts, bias, 0.01, group=dist.group.WORLD)
        # A router's own counts, through its method.
        m = GroupedTopKRouter(config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=4,
                                     n_group=4, topk_group=2), backend="reference",
                              track_expert_counts=True)
        torch.manual_seed(3)
        m.reset_parameters()
        m(torch.randn(20 + 10 * rank, 64, generator=gen))
        local = m.tokens_per_expert.clone()
        m.update_expert_bias(0.01, group=dist.group.WORLD)
        torch.save({"counts": counts, "bias": bias, "router_counts": local,
                    "router_bias": m.e_score_correction_bias.clone()},
                   os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_update_expert_bias_all_reduces_over_a_group(world):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_bias_worker, args=(world, _free_port(), d), nprocs=world, join=True)
        res = [torch.load(os.path.join(d, f"rank{i}.pt")) for i in range(world)]
    total = sum(r["counts"] for r in res)
    want = _expected_bias(total, torch.linspace(-0.1, 0.1, 24), 0.01)
    router_total = sum(r["router_counts"] for r in res)
    router_want = _expected_bias(router_total, torch.zeros(32), 0.01)
    for r in res:  # every rank applies the update of the summed counts
        torch.testing.assert_close(r["bias"].double(), want, rtol=0, atol=1e-7)
        torch.testing.assert_close(r["router_bias"].double(), router_want, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Routing replay (CPU, reference backend)


@pytest.mark.parametrize("name", ["small", "glm45", "flat_unnormed"])
def test_route_with_indices_matches_independent_formula(name):
    c = CONFIGS[name]
    x, w, b = inputs(c, 33, "cpu", seed=8)
    x = x.float()
    idx = distinct_indices(33, c.n_routed_experts, c.num_experts_per_tok, seed=9)
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out_idx, weights, scores = moe_routing.route_with_indices(xs, ws, b, idx, *op_args(c))
    assert out_idx is idx and weights.dtype == scores.dtype == torch.float32
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want = plain_weights(xr, wr, idx, c)
    torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=1e-7)
    g = torch.randn(weights.shape, dtype=torch.float64)
    (weights * g.float()).sum().backward()
    (want * g).sum().backward()
    assert R.rel_err(xs.grad, xr.grad) < 1e-6 and R.rel_err(ws.grad, wr.grad) < 1e-6
    # The bias selects, so it does not change replayed weights.
    _, again, _ = moe_routing.route_with_indices(x, w, b + 5.0, idx.int(), *op_args(c))
    assert torch.equal(again, weights.detach())


def test_replay_of_the_own_selection_is_the_forward():
    c = CONFIGS["glm45"]
    torch.manual_seed(10)
    m = GroupedTopKRouter(c, backend="reference")
    with torch.no_grad():
        m.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(2, 20, c.hidden_size)
    g = torch.randn(40, c.num_experts_per_tok)
    gx, idx = _step(m, x, g)
    gw = m.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    # As an argument, with int32 indices...
    gx_r, idx_r = _step(m, x, g, topk_indices=idx.int())
    assert torch.equal(idx_r, idx)
    torch.testing.assert_close(gx_r, gx)
    torch.testing.assert_close(m.weight.grad, gw)
    # ... and as the attribute, which every forward uses until cleared.
    m.replay_indices = idx.flip(-1)
    _, weights_attr, idx_attr = m(x)
    _, weights_own, _ = m(x, topk_indices=idx)
    assert torch.equal(idx_attr, idx.flip(-1))
    torch.testing.assert_close(weights_attr, weights_own.flip(-1))
    m.replay_indices = None
    assert torch.equal(m(x)[2], idx)


def test_replay_with_main_grad_and_counts():
    c = CONFIGS["small"]
    fused, plain = _routers(c, seed=11, track_expert_counts=True)
    fused.weight.main_grad = torch.zeros(fused.weight.shape)
    idx = distinct_indices(24, c.n_routed_experts, c.num_experts_per_tok, seed=12)
    x = torch.randn(24, c.hidden_size)
    g = torch.randn(24, c.num_experts_per_tok)
    _step(fused, x, g, topk_indices=idx)
    _step(plain, x, g, topk_indices=idx)
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad)
    assert fused.weight.grad is None
    assert fused.last_expert_counts.tolist() == [int((idx == e).sum()) for e in range(32)]


def test_replay_indices_are_validated():
    c = CONFIGS["small"]
    x, w, b = inputs(c, 6, "cpu")
    good = distinct_indices(6, 32, 4, seed=13)
    replay = moe_routing.route_with_indices
    bad = [
        (good.short(), ValueError, "topk_idx must be torch.int32 or torch.int64"),
        (good.float(), ValueError, "topk_idx must be torch.int32 or torch.int64"),
        (good[:5], ValueError, r"topk_idx must have shape \[T, top_k\] = \[6, 4\]"),
        (good[:, :3], ValueError, r"topk_idx must have shape"),
        (good.tolist(), TypeError, "topk_idx must be a torch.Tensor"),
    ]
    out_of_range = good.clone()
    out_of_range[4, 1] = 32
    negative = good.clone()
    negative[2, 0] = -1
    repeated = good.clone()
    repeated[3, 2] = repeated[3, 0]
    bad += [
        (out_of_range, ValueError, r"distinct expert indices in \[0, 32\) .* row 4 holds"),
        (negative, ValueError, "row 2 holds"),
        (repeated, ValueError, "row 3 holds"),
    ]
    for idx, err, msg in bad:
        with pytest.raises(err, match=msg):
            replay(x, w, b, idx, *op_args(c))
    with pytest.raises(ValueError, match="backend must be one of"):
        replay(x, w, b, good, *op_args(c), backend="triton")
    with pytest.raises(ValueError, match="n_group"):
        replay(x, w, b, good, 4, 3, 2, 1.5, True)
    with pytest.raises(ValueError, match="bias must have shape"):
        replay(x, w, b[:31], good, *op_args(c))
    # The checks of route when the kernels are asked for.
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        replay(x, w, b, good, *op_args(c), backend="cuda")
    # Values are not looked at without check_indices (no synchronisation).
    replay(x, w, b, good, *op_args(c), check_indices=False)
    m = GroupedTopKRouter(c, backend="reference")
    with pytest.raises(ValueError, match="row 4 holds"):
        m(x, topk_indices=out_of_range)


def test_module_compiles_fullgraph_with_counts_on_meta():
    # Dynamo + AOTAutograd over the module with its optional outputs (route_with_stats and
    # the buffer update) on meta tensors.
    c = CONFIGS["glm45"]
    m = GroupedTopKRouter(c, backend="cuda", device="meta", track_expert_counts=True)

    def step(module, hs):
        _, weights, idx = module(hs)
        return weights.sum(), idx

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    hs = torch.empty(256, c.hidden_size, device="meta", dtype=torch.bfloat16,
                     requires_grad=True)
    loss, idx = compiled(m, hs)
    loss.backward()
    assert idx.shape == (256, 8) and m.weight.grad.shape == m.weight.shape
    assert m.tokens_per_expert.device.type == "meta"
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# GPU: the same features through the kernels


def _gpu_inputs(c, T, seed):
    x, w, b = inputs(c, T, "cuda", seed=seed)
    return x, w, b


@needs_gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_with_stats_on_gpu(name):
    c = CONFIGS[name]
    x, w, b = _gpu_inputs(c, 3001, 20)
    idx, weights, s = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    for scores_on, counts_on in ((True, True), (True, False), (False, True), (False, False)):
        out = torch.ops.moe_routing.route_with_stats(x, w, b, *op_args(c), False, scores_on,
                                                     counts_on)
        for got, want in zip(out[:3], (idx, weights, s)):
            assert torch.equal(got, want)
        if scores_on:
            want_scores = R.choice_values(x, w, torch.zeros_like(b))
            assert out[3].shape == (3001, c.n_routed_experts)
            torch.testing.assert_close(out[3].double(), want_scores, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out[3].gather(1, idx.long()), s, rtol=1e-6, atol=1e-7)
        else:
            assert out[3].shape == (0,)
        if counts_on:
            want_counts = torch.bincount(idx.long().flatten(), minlength=c.n_routed_experts)
            assert out[4].dtype == torch.int32 and torch.equal(out[4].long(), want_counts)
        else:
            assert out[4].shape == (0,)
    # Zero tokens: zero counts.
    out = torch.ops.moe_routing.route_with_stats(x[:0], w, b, *op_args(c), False, True, True)
    assert out[3].shape == (0, c.n_routed_experts) and not out[4].any()


@needs_gpu
@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_backward_into_grad_w_out_on_gpu(name, precise):
    c = CONFIGS[name]
    x, w, b = _gpu_inputs(c, 2000, 21)
    idx, weights, s = torch.ops.moe_routing.route(x, w, b, *op_args(c))
    g = torch.randn(weights.shape, device="cuda")
    gx, gw = torch.ops.moe_routing.route_backward(x, w, idx, s, g, *bwd_rest(c), precise)
    start = torch.randn(w.shape, device="cuda")
    acc = start.clone()
    version = acc._version
    gx2, placeholder = torch.ops.moe_routing.route_backward(x, w, idx, s, g, *bwd_rest(c),
                                                            precise, False, acc)
    assert placeholder.shape == (0,) and acc._version > version
    torch.testing.assert_close(gx2, gx)
    assert R.rel_err(acc, start + gw) <= 1e-6
    # Against the float64 reference.
    _, rw = R.route_backward(x, w, idx, s, g, c.routed_scaling_factor, c.norm_topk_prob)
    assert R.rel_err(acc.double() - start.double(), rw) <= (1e-4 if precise else 5e-3)


@needs_gpu
def test_module_main_grad_on_gpu():
    c = CONFIGS["glm45"]
    torch.manual_seed(22)
    fused = GroupedTopKRouter(c, accumulate_grad_into_main_grad=True).cuda()
    plain = GroupedTopKRouter(c).cuda()
    plain.load_state_dict(fused.state_dict())
    start = torch.randn(fused.weight.shape, device="cuda")
    fused.weight.main_grad = start.clone()
    fused.weight.grad_added_to_main_grad = False
    gen = torch.Generator(device="cuda").manual_seed(23)
    x = torch.randn(1024, c.hidden_size, device="cuda", generator=gen).bfloat16()
    g = torch.randn(1024, 8, device="cuda", generator=gen)
    gx, idx = _step(fused, x, g)
    gx_plain, idx_plain = _step(plain, x, g)
    assert torch.equal(idx, idx_plain)
    torch.testing.assert_close(gx, gx_plain)
    assert R.rel_err(fused.weight.main_grad, start + plain.weight.grad) <= 1e-6
    assert fused.weight.grad_added_to_main_grad is True


@needs_gpu
def test_route_with_indices_on_gpu():
    c = CONFIGS["glm45"]
    x, w, b = _gpu_inputs(c, 1500, 24)
    xk, wk = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    idx, weights, _ = torch.ops.moe_routing.route(xk, wk, b, *op_args(c))
    g = torch.randn(weights.shape, device="cuda")
    gx, gw = torch.autograd.grad((weights * g).sum(), (xk, wk))
    # Replaying the kernel's own selection gives its weights and gradients (fp32 rounding).
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    _, replayed, _ = moe_routing.route_with_indices(xr, wr, b, idx, *op_args(c))
    torch.testing.assert_close(replayed, weights.detach(), rtol=1e-5, atol=1e-6)
    rx, rw = torch.autograd.grad((replayed * g).sum(), (xr, wr))
    assert R.rel_err(rx, gx) <= 1e-2 and R.rel_err(rw, gw) <= 2e-3
    # Other experts: against the independent float64 formula.
    other = distinct_indices(1500, c.n_routed_experts, 8, seed=25).cuda()
    xr.grad = wr.grad = None
    _, replayed, _ = moe_routing.route_with_indices(xr, wr, b, other, *op_args(c))
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want = plain_weights(xd, wd, other, c)
    torch.testing.assert_close(replayed.double(), want, rtol=1e-5, atol=1e-6)
    (replayed * g).sum().backward()
    (want * g.double()).sum().backward()
    assert R.rel_err(xr.grad, xd.grad) <= 1e-2 and R.rel_err(wr.grad, wd.grad) <= 5e-3


@needs_gpu
def test_module_counts_and_replay_on_gpu():
    c = CONFIGS["glm45"]
    torch.manual_seed(26)
    m = GroupedTopKRouter(c, track_expert_counts=True, keep_scores=True).cuda()
    x = torch.randn(3, 300, c.hidden_size, device="cuda").bfloat16()
    _, weights, idx = m(x)
    want = torch.bincount(idx.flatten(), minlength=c.n_routed_experts)
    assert torch.equal(m.last_expert_counts.long(), want)
    assert torch.equal(m.tokens_per_expert, want)
    want_scores = R.choice_values(x.reshape(-1, c.hidden_size), m.weight,
                                  torch.zeros_like(m.e_score_correction_bias))
    torch.testing.assert_close(m.last_scores.double(), want_scores, rtol=1e-5, atol=1e-6)
    _, replayed, idx_r = m(x, topk_indices=idx)
    assert torch.equal(idx_r, idx)
    torch.testing.assert_close(replayed, weights, rtol=1e-5, atol=1e-6)
