"""The framework adapters against plain-PyTorch re-implementations, written here, of the
routing of Megatron-LM's ``TopKRouter`` (sigmoid score function, group-limited top-k, expert
bias, ``(probs, routing_map)``) and of torchtitan's ``TokenChoiceTopKRouter`` (sigmoid,
node-limited top-k, ``(top_scores, selected_experts_indices, scores or counts)``), in
float64. Neither framework is needed.

CPU tests use the reference backend; the GPU tests (a Hopper GPU and the library) the
kernels, and are skipped otherwise. Tokens whose selection is within 1e-5 of a tie are left
out of the comparisons of selections.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_routing import reference as R
from moe_routing.adapters import MegatronTopKRouter, TokenChoiceTopKRouter

from test_router import needs_gpu  # (same directory: pytest puts it on sys.path)


def bf16_exact(t):
    return t.to(torch.bfloat16).to(t.dtype)


def group_limited_top_k(choice, top_k, num_groups, group_topk, per_group_best):
    """[T, K] indices of the top_k `choice` values among the experts of each token's
    `group_topk` best groups, a group scored by the sum of its `per_group_best` best."""
    if not num_groups or num_groups == 1:
        return choice.topk(top_k, dim=-1).indices
    t, e = choice.shape
    grouped = choice.view(t, num_groups, e // num_groups)
    group_score = grouped.topk(per_group_best, dim=-1).values.sum(-1)
    kept = group_score.topk(group_topk, dim=-1).indices
    keep = torch.zeros(t, num_groups, dtype=torch.bool).scatter(1, kept, True)
    keep = keep.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    return choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices


def near_tie_tokens(x, w, bias, top_k, n_group, topk_group):
    return R.near_ties(R.choice_values(x, w, bias), top_k, n_group, topk_group)


# --------------------------------------------------------------------------------------------
# Megatron-LM


def megatron_config(**kw):
    base = dict(
        hidden_size=64, num_moe_experts=32, moe_router_topk=4, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_input_jitter_eps=None,
        moe_expert_capacity_factor=None, moe_router_dtype=None, add_bias_linear=False,
        params_dtype=torch.float32, init_method_std=0.02, perform_initialization=True,
        sequence_parallel=False, gradient_accumulation_fusion=False,
        moe_enable_routing_replay=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def megatron_routing(logits, c, expert_bias=None, indices=None):
    """Megatron's sigmoid routing as its code reads (float64): scores = sigmoid(logits); the
    selection on scores + expert_bias, group-limited with groups ranked by the sum of their
    topk // group_topk best; probs = the selected scores, normalised for topk > 1, times the
    scaling factor; dense probs and the boolean routing map [T, E]. Given `indices`, the
    replay of those."""
    scores = torch.sigmoid(logits)
    if indices is None:
        choice = scores if expert_bias is None else scores + expert_bias.double()
        group_topk = c.moe_router_group_topk
        indices = group_limited_top_k(choice.detach(), c.moe_router_topk,
                                      c.moe_router_num_groups if group_topk else None,
                                      group_topk, c.moe_router_topk // (group_topk or 1))
    probs = scores.gather(1, indices)
    if c.moe_router_topk > 1:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    if c.moe_router_topk_scaling_factor:
        probs = probs * c.moe_router_topk_scaling_factor
    dense = torch.zeros_like(scores).scatter(1, indices, probs)
    routing_map = torch.zeros(scores.shape, dtype=torch.bool).scatter(1, indices, True)
    return dense, routing_map


def _megatron_inputs(c, s, b, seed):
    g = torch.Generator().manual_seed(seed)
    x = bf16_exact(torch.randn(s, b, c.hidden_size, generator=g))
    w = bf16_exact(torch.randn(c.num_moe_experts, c.hidden_size, generator=g) * 2
                   / math.sqrt(c.hidden_size))
    bias = torch.randn(c.num_moe_experts, generator=g) * 0.05
    return x, w, bias


def _megatron_router(c, w, bias, **kw):
    router = MegatronTopKRouter(c, backend=kw.pop("backend", "reference"), **kw)
    with torch.no_grad():
        router.weight.copy_(w)
        router.expert_bias.copy_(bias)
    return router


def _groups(c):
    return (c.moe_router_num_groups, c.moe_router_group_topk) if c.moe_router_group_topk \
        else (1, 1)


@pytest.mark.parametrize("kw", [
    {},  # DeepSeek-V3's shape of routing: groups, bias, scale
    dict(moe_router_num_groups=None, moe_router_group_topk=None,
         moe_router_topk_scaling_factor=None),
    dict(moe_router_topk=1, moe_router_num_groups=None, moe_router_group_topk=None),
])
def test_megatron_router_matches_megatron_routing(kw):
    c = megatron_config(**kw)
    x, w, bias = _megatron_inputs(c, 12, 3, seed=1)
    router = _megatron_router(c, w, bias)
    xs = x.clone().requires_grad_(True)
    probs, routing_map = router(xs)
    assert probs.shape == routing_map.shape == (36, 32)
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool
    xd, wd = x.double().reshape(-1, 64).requires_grad_(True), w.double().requires_grad_(True)
    want_probs, want_map = megatron_routing(xd @ wd.t(), c, bias)
    ok = ~near_tie_tokens(x.reshape(-1, 64), w, bias, c.moe_router_topk, *_groups(c))
    assert int(ok.sum()) >= 30
    assert torch.equal(routing_map[ok], want_map[ok])
    torch.testing.assert_close(probs[ok].double(), want_probs[ok], rtol=1e-6, atol=1e-7)
    assert int(routing_map.sum()) == 36 * c.moe_router_topk
    # Gradients (tokens without near ties).
    g = torch.randn(36, 32, dtype=torch.float64) * ok.unsqueeze(-1)
    (probs * g.float()).sum().backward()
    (want_probs * g).sum().backward()
    assert R.rel_err(xs.grad.reshape(-1, 64), xd.grad) < 1e-5
    assert R.rel_err(router.weight.grad, wd.grad) < 1e-5
    assert router.expert_bias.grad is None


def test_megatron_counts_bias_update_and_state():
    c = megatron_config()
    x, w, bias = _megatron_inputs(c, 10, 2, seed=2)
    router = _megatron_router(c, w, bias)
    assert set(router.state_dict()) == {"weight", "expert_bias"}
    assert router.weight.sequence_parallel is False
    _, map1 = router(x)
    _, map2 = router(x[:4])
    want = map1.sum(0) + map2.sum(0)
    assert router.local_tokens_per_expert.dtype == torch.float32
    assert torch.equal(router.local_tokens_per_expert, want.float())
    with torch.no_grad():  # no counting without grad (evaluation, recomputation)
        router(x)
    # Padding tokens (True in padding_mask) are not counted.
    pad = torch.zeros(10, 2, dtype=torch.bool)
    pad[7:] = True
    _, map3 = router(x, padding_mask=pad)
    want = want + map3[~pad.reshape(-1)].sum(0)
    assert torch.equal(router.local_tokens_per_expert, want.float())
    # Megatron's update: bias + rate * sign(mean - counts), over all experts.
    before = router.expert_bias.clone()
    counts = router.local_tokens_per_expert.clone().double()
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias.double(),
                               before.double() + 1e-3 * torch.sign(counts.mean() - counts))
    assert not router.local_tokens_per_expert.any()
    # Without the expert bias: no buffers, and no bias in the selection.
    plain = MegatronTopKRouter(megatron_config(moe_router_enable_expert_bias=False),
                               backend="reference")
    assert plain.expert_bias is None and plain.local_tokens_per_expert is None
    assert set(plain.state_dict()) == {"weight"}
    with torch.no_grad():
        plain.weight.copy_(w)
    probs, _ = plain(x)
    want_probs, _ = megatron_routing(x.double().reshape(-1, 64) @ w.double().t(), c)
    ok = ~near_tie_tokens(x.reshape(-1, 64), w, torch.zeros(32), 4, 4, 2)
    torch.testing.assert_close(probs[ok].double(), want_probs[ok], rtol=1e-6, atol=1e-7)


def test_megatron_probs_dtype_follows_the_router_dtype():
    c = megatron_config()
    x, w, bias = _megatron_inputs(c, 4, 2, seed=3)
    router = _megatron_router(c, w, bias)
    assert router(x.bfloat16())[0].dtype == torch.bfloat16  # the input's dtype
    router.config.moe_router_dtype = "fp32"
    assert router(x.bfloat16())[0].dtype == torch.float32
    router.config.moe_router_dtype = "fp64"
    assert router(x.bfloat16())[0].dtype == torch.float64


def test_megatron_config_checks():
    bad = [
        (dict(moe_router_score_function="softmax"), "moe_router_score_function must be"),
        (dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4),
         "moe_aux_loss_coeff > 0 for 'seq_aux_loss'"),
        (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
              moe_aux_loss_coeff=[0.0, 1e-3]), "moe_aux_loss_coeff > 0 for 'seq_aux_loss'"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "'sinkhorn'"),
        (dict(moe_z_loss_coeff=1e-3), "moe_z_loss_coeff"),
        (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
        (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
        (dict(add_bias_linear=True), "add_bias_linear"),
        (dict(moe_router_topk=8, moe_router_group_topk=2), "must be 2 with groups"),
        (dict(moe_router_num_groups=None), "moe_router_num_groups is not"),
        (dict(moe_router_num_groups=3), "n_group"),
        (dict(num_moe_experts=None), "no `num_moe_experts`"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            MegatronTopKRouter(megatron_config(**kw))
    with pytest.raises(ValueError, match="backend must be one of"):
        MegatronTopKRouter(megatron_config(), backend="triton")
    router = MegatronTopKRouter(megatron_config(), backend="reference")
    with pytest.raises(ValueError, match="hidden_size 64"):
        router(torch.zeros(3, 2, 48))
    with pytest.raises(ValueError, match="padding_mask must be a tensor of 6 elements"):
        router(torch.zeros(3, 2, 64), padding_mask=torch.zeros(3, dtype=torch.bool))


class _Action:  # Megatron's RouterReplayAction members have these values
    def __init__(self, value):
        self.value = value


class _Replay:
    """A stand-in with the interface of Megatron's RouterReplay."""

    def __init__(self):
        self.router_replay_action = None
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.replay_backward_list = []

    def record_indices(self, idx):
        self.recorded_topk_idx = idx


def test_megatron_routing_replay():
    c = megatron_config()
    x, w, bias = _megatron_inputs(c, 8, 2, seed=4)
    replay = _Replay()
    router = MegatronTopKRouter(c, backend="reference", router_replay=replay)
    with torch.no_grad():
        router.weight.copy_(w)
        router.expert_bias.copy_(bias)
    replay.router_replay_action = _Action("record")
    probs, routing_map = router(x)
    recorded = replay.recorded_topk_idx
    assert recorded.dtype == torch.int64 and recorded.shape == (16, 4)
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, recorded, True), routing_map)
    # Replay other experts: Megatron's probs at them, differentiable.
    g = torch.Generator().manual_seed(5)
    target = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(16)])
    replay.router_replay_action = _Action("replay_forward")
    replay.target_topk_idx = target
    xs = x.clone().requires_grad_(True)
    probs, routing_map = router(xs)
    xd, wd = x.double().reshape(-1, 64).requires_grad_(True), w.double().requires_grad_(True)
    want_probs, want_map = megatron_routing(xd @ wd.t(), c, indices=target)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-6, atol=1e-7)
    gr = torch.randn(16, 32, dtype=torch.float64)
    (probs * gr.float()).sum().backward()
    (want_probs * gr).sum().backward()
    assert R.rel_err(xs.grad.reshape(-1, 64), xd.grad) < 1e-5
    assert R.rel_err(router.weight.grad, wd.grad) < 1e-5
    # The backward replay (activation recomputation) takes the queued indices in order.
    replay.router_replay_action = _Action("replay_backward")
    replay.replay_backward_list = [target, recorded]
    assert torch.equal(router(x)[1], want_map)
    assert replay.replay_backward_list == [recorded]
    replay.router_replay_action = _Action("bogus")
    with pytest.raises(ValueError, match="unknown router_replay_action"):
        router(x)


def test_megatron_gradient_accumulation_fusion():
    c = megatron_config(gradient_accumulation_fusion=True)
    x, w, bias = _megatron_inputs(c, 8, 2, seed=6)
    fused = _megatron_router(c, w, bias)
    plain = _megatron_router(c, w, bias, accumulate_grad_into_main_grad=False)
    fused.weight.main_grad = torch.zeros(32, 64)
    fused.weight.grad_added_to_main_grad = False
    g = torch.randn(16, 32)
    (fused(x)[0] * g).sum().backward()
    (plain(x)[0] * g).sum().backward()
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad)
    assert fused.weight.grad_added_to_main_grad is True


def test_megatron_from_router():
    c = megatron_config()
    x, w, bias = _megatron_inputs(c, 6, 2, seed=7)

    class Stand(nn.Module):  # what from_megatron reads of Megatron's TopKRouter
        def __init__(self):
            super().__init__()
            self.config = c
            self.weight = nn.Parameter(w.clone())
            self.register_buffer("expert_bias", bias.clone())
            self.layer_number = 3
            self.router_replay = None

    new = MegatronTopKRouter.from_megatron(Stand().eval(), backend="reference")
    assert new.layer_number == 3 and not new.training
    assert torch.equal(new.weight, w) and torch.equal(new.expert_bias, bias)
    torch.testing.assert_close(new(x)[0], _megatron_router(c, w, bias)(x)[0])


# --------------------------------------------------------------------------------------------
# torchtitan


def titan_routing(x, gate_w, expert_bias, num_expert_groups, num_limited_groups, top_k,
                  route_norm, route_scale):
    """torchtitan's sigmoid token-choice routing as its code reads (float64): the selection
    on sigmoid scores + bias, node-limited with groups ranked by their two best; top scores
    gathered from the unbiased scores, normalised with route_norm, times route_scale; the
    token count of each expert."""
    scores = torch.sigmoid(x @ gate_w.t())
    choice = scores if expert_bias is None else scores + expert_bias.double()
    idx = group_limited_top_k(choice.detach(), top_k, num_expert_groups, num_limited_groups, 2)
    top = scores.gather(1, idx)
    if route_norm:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * route_scale
    counts = torch.bincount(idx.flatten(), minlength=gate_w.shape[0])
    return top, idx, scores, counts


TITAN = dict(dim=64, num_experts=32, num_expert_groups=4, num_limited_groups=2, top_k=4,
             route_norm=True, route_scale=2.5)


def _titan_inputs(seed, tokens=40):
    g = torch.Generator().manual_seed(seed)
    x = bf16_exact(torch.randn(tokens, 64, generator=g))
    w = bf16_exact(torch.randn(32, 64, generator=g) * 2 / math.sqrt(64))
    bias = torch.randn(32, generator=g) * 0.05
    return x, w, bias


def _titan_router(w, **kw):
    kw.setdefault("backend", "reference")
    router = TokenChoiceTopKRouter(**{**TITAN, **kw})
    with torch.no_grad():
        router.gate.weight.copy_(w)
    return router


def _by_expert(values, idx):
    """Rows reordered by expert index (torchtitan's order is unspecified)."""
    order = idx.argsort(-1)
    return values.gather(-1, order), idx.gather(-1, order)


@pytest.mark.parametrize("kw", [
    {},
    dict(num_expert_groups=None, num_limited_groups=None, route_norm=False, route_scale=1.0),
])
def test_torchtitan_router_matches_torchtitan_routing(kw):
    x, w, bias = _titan_inputs(seed=8)
    router = _titan_router(w, **kw)
    assert set(router.state_dict()) == {"gate.weight"}
    args = {**TITAN, **kw}
    xs = x.clone().requires_grad_(True)
    top, idx, scores = router(xs, bias)
    assert top.dtype == torch.float32 and idx.dtype == torch.int64 and top.shape == (40, 4)
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want_top, want_idx, want_scores, _ = titan_routing(
        xd, wd, bias, args["num_expert_groups"], args["num_limited_groups"], 4,
        args["route_norm"], args["route_scale"])
    n_group = args["num_expert_groups"] or 1
    ok = ~near_tie_tokens(x, w, bias, 4, n_group, args["num_limited_groups"] or 1)
    assert int(ok.sum()) >= 35
    top_s, idx_s = _by_expert(top, idx)
    want_top_s, want_idx_s = _by_expert(want_top, want_idx)
    assert torch.equal(idx_s[ok], want_idx_s[ok])
    torch.testing.assert_close(top_s[ok].double(), want_top_s[ok], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(scores.double(), want_scores.detach(), rtol=1e-6, atol=1e-7)
    assert not scores.requires_grad
    g = torch.randn(40, 4, dtype=torch.float64) * ok.unsqueeze(-1)
    (top_s * g.float()).sum().backward()
    (want_top_s * g).sum().backward()
    assert R.rel_err(xs.grad, xd.grad) < 1e-5
    assert R.rel_err(router.gate.weight.grad, wd.grad) < 1e-5


def test_torchtitan_counts_shapes_and_bias():
    x, w, bias = _titan_inputs(seed=9, tokens=48)
    router = _titan_router(w, returns="counts")
    top, idx, counts = router(x.view(2, 24, 64), bias)  # leading dimensions are kept
    assert top.shape == idx.shape == (2, 24, 4)
    _, want_idx, _, want_counts = titan_routing(x.double(), w.double(), bias, 4, 2, 4, True,
                                                2.5)
    ok = ~near_tie_tokens(x, w, bias, 4, 4, 2)
    assert ok.all(), "pick a seed without near ties"
    assert counts.dtype == torch.int64 and torch.equal(counts, want_counts)
    # The bias selects but does not weigh: a large bias on expert 5 makes every token choose
    # it, with the same unbiased score as weight.
    big = torch.zeros(32)
    big[5] = 10.0
    top_b, idx_b, scores = _titan_router(w)(x, big)
    assert bool((idx_b == 5).any(-1).all())
    col = (idx_b == 5).float().argmax(-1, keepdim=True)
    s5 = torch.sigmoid(x.double() @ w.double().t())[:, 5]
    torch.testing.assert_close(scores[:, 5].double(), s5, rtol=1e-6, atol=1e-7)
    want = s5 / torch.sigmoid(x.double() @ w.double().t()).gather(1, idx_b).sum(-1) * 2.5
    torch.testing.assert_close(top_b.gather(1, col).squeeze(1).double(), want, rtol=1e-6,
                               atol=1e-7)
    # Replay of given experts.
    top_r, idx_r, _ = router(x, bias, topk_indices=idx.reshape(48, 4).flip(-1))
    torch.testing.assert_close(top_r, top.reshape(48, 4).flip(-1))


def test_torchtitan_constructors_and_checks():
    x, w, bias = _titan_inputs(seed=10)
    gate = SimpleNamespace(in_features=64, out_features=32, bias=False)
    config = SimpleNamespace(num_experts=32, gate=gate, num_expert_groups=4,
                             num_limited_groups=2, top_k=4, score_func="sigmoid",
                             route_norm=True, route_scale=2.5, _debug_force_load_balance=False)
    from_config = TokenChoiceTopKRouter.from_config(config, backend="reference")
    assert (from_config.dim, from_config.top_k, from_config.route_scale) == (64, 4, 2.5)

    class Stand(nn.Module):  # what from_torchtitan reads of torchtitan's router
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(64, 32, bias=False)
            for k, v in TITAN.items():
                if k != "dim":
                    setattr(self, k, v)
            self.score_func = "sigmoid"
            self._debug_force_load_balance = False

    stand = Stand()
    new = TokenChoiceTopKRouter.from_torchtitan(stand, backend="reference")
    assert torch.equal(new.gate.weight, stand.gate.weight)
    _titan_router(stand.gate.weight.detach())(x)
    bad = [
        (dict(score_func="softmax"), "score_func must be 'sigmoid'"),
        (dict(gate_bias=True), "gate_bias"),
        (dict(_debug_force_load_balance=True), "_debug_force_load_balance"),
        (dict(num_limited_groups=None), "num_limited_groups must be set"),
        (dict(num_expert_groups=3), "n_group"),
        (dict(returns="histc"), "returns must be one of"),
        (dict(top_k=17), "top_k"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            TokenChoiceTopKRouter(**{**TITAN, **kw})
    router = _titan_router(w)
    with pytest.raises(ValueError, match=r"expert_bias must be a floating tensor of shape \[32\]"):
        router(x, bias[:31])
    with pytest.raises(ValueError, match="x must end in dim 64"):
        router(x[:, :32])


# --------------------------------------------------------------------------------------------
# GPU: the adapters on the kernels


@needs_gpu
def test_megatron_router_on_gpu():
    c = megatron_config(hidden_size=512, num_moe_experts=256, moe_router_topk=8,
                        moe_router_num_groups=8, moe_router_group_topk=4)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 4, 512, generator=g).bfloat16()
    w = bf16_exact(torch.randn(256, 512, generator=g) * 2 / math.sqrt(512))
    bias = torch.randn(256, generator=g) * 0.05
    router = _megatron_router(c, w, bias, backend="cuda").cuda()
    xs = x.cuda().requires_grad_(True)
    probs, routing_map = router(xs)
    assert probs.dtype == torch.bfloat16
    xd = x.double().reshape(-1, 512).requires_grad_(True)
    wd = w.double().requires_grad_(True)
    want_probs, want_map = megatron_routing(xd @ wd.t(), c, bias)
    ok = ~near_tie_tokens(x.reshape(-1, 512), w, bias, 8, 8, 4)
    assert torch.equal(routing_map.cpu()[ok], want_map[ok])
    torch.testing.assert_close(probs.cpu()[ok].double(), want_probs[ok], rtol=1e-2, atol=1e-3)
    assert torch.equal(router.local_tokens_per_expert.cpu(), routing_map.sum(0).float().cpu())
    gr = torch.randn(1024, 256, dtype=torch.float64) * ok.unsqueeze(-1)
    (probs.float() * gr.float().cuda()).sum().backward()
    (want_probs * gr).sum().backward()
    assert R.rel_err(xs.grad.reshape(-1, 512).cpu(), xd.grad) < 2e-2
    assert R.rel_err(router.weight.grad.cpu(), wd.grad) < 1e-2


@needs_gpu
def test_torchtitan_router_on_gpu():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2048, 512, generator=g).bfloat16()
    w = bf16_exact(torch.randn(160, 512, generator=g) * 2 / math.sqrt(512))
    bias = torch.randn(160, generator=g) * 0.05
    args = dict(dim=512, num_experts=160, num_expert_groups=8, num_limited_groups=4, top_k=8,
                route_norm=True, route_scale=2.5)
    for returns in ("scores", "counts"):
        router = TokenChoiceTopKRouter(**args, returns=returns, backend="cuda").cuda()
        with torch.no_grad():
            router.gate.weight.copy_(w)
        xs = x.cuda().requires_grad_(True)
        top, idx, third = router(xs, bias.cuda())
        xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
        want_top, want_idx, want_scores, want_counts = titan_routing(xd, wd, bias, 8, 4, 8,
                                                                     True, 2.5)
        ok = ~near_tie_tokens(x, w, bias, 8, 8, 4)
        top_s, idx_s = _by_expert(top.cpu(), idx.cpu())
        want_top_s, want_idx_s = _by_expert(want_top, want_idx)
        assert torch.equal(idx_s[ok], want_idx_s[ok])
        torch.testing.assert_close(top_s[ok].double(), want_top_s[ok], rtol=1e-5, atol=1e-6)
        if returns == "scores":
            torch.testing.assert_close(third.cpu().double(), want_scores.detach(), rtol=1e-5,
                                       atol=1e-6)
        else:
            assert torch.equal(third.cpu(), torch.bincount(idx.cpu().flatten(), minlength=160))
        gr = torch.randn(2048, 8, dtype=torch.float64) * ok.unsqueeze(-1)
        (top_s.cuda() * gr.float().cuda()).sum().backward()
        (want_top_s * gr).sum().backward()
        assert R.rel_err(xs.grad.cpu(), xd.grad) < 2e-2
        assert R.rel_err(router.gate.weight.grad.cpu(), wd.grad) < 1e-2
