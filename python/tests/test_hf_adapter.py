"""Tests of replace_hf_routers and GroupedTopKRouter.from_hf on HF transformers' routers.

Stand-ins of the routers, under their real class names, mimic each covered class's structure
as transformers 5.x (hyper-parameters as attributes, ``(router_logits, topk_weights,
topk_indices)``) and 4.x (a ``config`` too, ``(topk_indices, topk_weights)``, dropped groups
filled with 0) build them; their forward is the published routing in fp32. They need no
transformers, nor a GPU: the module routes through the reference backend on the CPU (and
through the kernels in the GPU variants, skipped without a Hopper GPU and the library). A
stand-in of transformers 5.x's output recorder checks that router_logits are still recorded
after replacement. With transformers installed, the same is checked on its own models built
from tiny configs.
"""

import copy
import logging
import math
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_routing import _lib
from moe_routing import reference as R
from moe_routing.module import GroupedTopKRouter, replace_hf_routers

HAS_GPU = (_lib.find_library() is not None and torch.cuda.is_available()
           and torch.cuda.get_device_capability(0) == (9, 0))

BACKENDS = [
    "reference",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not HAS_GPU, reason="needs a Hopper GPU (sm_90) through torch.cuda and libmoe_routing.so")),
]

try:
    import transformers

    HF_VERSION = tuple(int(v) for v in transformers.__version__.split(".")[:2])
except Exception:  # not installed, or broken
    HF_VERSION = None

# Before 5.13 (since 5.0), transformers' routers return the logits only: their MoE blocks route.
needs_hf = pytest.mark.skipif(HF_VERSION is None or HF_VERSION < (5, 13),
                              reason="transformers 5.13 or later not importable")

H = 64


def config(**kw):
    base = dict(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                initializer_range=0.02)
    base.update(kw)
    return SimpleNamespace(**base)


CONFIGS = {
    "grouped": config(),
    "flat": config(n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1,
                   routed_scaling_factor=1.0, norm_topk_prob=False),
}


def hf_routing(hidden_states, weight, bias, top_k, n_group, topk_group, norm_topk_prob,
               routed_scaling_factor, dropped=float("-inf")):
    """The grouped top-k routing of HF's routers, in fp32: sigmoid scores, plus the bias for
    the selection; with groups, the `topk_group` groups with the best sum of their two best
    biased scores stay and the other experts get `dropped`; the `top_k` best, their unbiased
    scores, optionally normalised, times the scaling factor. Returns
    ``(router_logits, topk_weights, topk_indices)``."""
    x = hidden_states.reshape(-1, weight.shape[1]).float()
    logits = x @ weight.float().t()
    scores = logits.sigmoid()
    choice = scores + bias.float()
    if n_group is not None and n_group > 1:
        t, e = choice.shape
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        kept = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), dropped)
    idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return logits, weights * routed_scaling_factor, idx


# --------------------------------------------------------------------------------------------
# Stand-ins of HF's routers


def _v5_init(self, config):
    nn.Module.__init__(self)
    self.top_k = config.num_experts_per_tok
    self.num_experts = config.n_routed_experts
    self.hidden_dim = config.hidden_size
    self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
    self.routed_scaling_factor = config.routed_scaling_factor
    self.num_group = config.n_group
    self.topk_group = config.topk_group
    self.norm_topk_prob = config.norm_topk_prob
    self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))


def _v5_forward(self, hidden_states):
    return hf_routing(hidden_states, self.weight, self.e_score_correction_bias, self.top_k,
                      self.num_group, self.topk_group, self.norm_topk_prob,
                      self.routed_scaling_factor)


def _v4_init(self, config):
    nn.Module.__init__(self)
    self.config = config
    self.top_k = config.num_experts_per_tok
    self.n_routed_experts = config.n_routed_experts
    self.routed_scaling_factor = config.routed_scaling_factor
    self.n_group = config.n_group
    self.topk_group = config.topk_group
    self.norm_topk_prob = config.norm_topk_prob
    self.weight = nn.Parameter(torch.empty(self.n_routed_experts, config.hidden_size))
    self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))


def _v4_forward(self, hidden_states):
    _, weights, idx = hf_routing(hidden_states, self.weight, self.e_score_correction_bias,
                                 self.top_k, self.n_group, self.topk_group,
                                 self.norm_topk_prob, self.routed_scaling_factor, dropped=0.0)
    return idx, weights


def _config_only_init(self, config):
    nn.Module.__init__(self)
    self.config = config
    self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
    self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))


def _config_only_forward(self, hidden_states):
    c = self.config
    return hf_routing(hidden_states, self.weight, self.e_score_correction_bias,
                      c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
                      c.routed_scaling_factor)


class V5:
    """transformers 5.x's routers with this structure (5.25)."""


class V4:
    """transformers 4.x's (4.57)."""


class Other:
    """Routers of neither, and look-alikes."""


def stand_in(holder, name, init, forward, **attrs):
    """A router class named `name` (picklable as ``holder.<name>``)."""
    cls = type(name, (nn.Module,), {"__init__": init, "forward": forward, "__module__": __name__,
                                    "__qualname__": f"{holder.__name__}.{name}", **attrs})
    setattr(holder, name, cls)
    return cls


V5_NAMES = (
    "DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter", "Dots1TopkRouter",
    "AXK1TopkRouter", "AXK2TopkRouter", "BailingHybridTopkRouter", "DeepseekV32TopkRouter",
    "Dots3NoteTextTopkRouter", "ExaoneMoeTopkRouter", "Glm4vMoeTextTopkRouter",
    "Glm5NextTextTopkRouter", "GlmMoeDsaTopkRouter", "HYV4TopkRouter", "HYV4VLTopkRouter",
    "KimiLinearTopkRouter", "MiMoV2FlashTopkRouter", "MiniCPM5MoeTopkRouter",
    "NemotronHTopkRouter", "SolarOpenTopkRouter",
)
V4_NAMES = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4vMoeTextTopkRouter",
            "Dots1TopkRouter")
for _name in V5_NAMES:
    stand_in(V5, _name, _v5_init, _v5_forward)
for _name in V4_NAMES:
    stand_in(V4, _name, _v4_init, _v4_forward)
stand_in(Other, "ConfigOnlyTopkRouter", _config_only_init, _config_only_forward)

# (holder, class name, config): every class on both configs, and AXK2's light checkpoints
# (n_group None: no groups).
CASES = [(V5, n, c) for n in V5_NAMES for c in CONFIGS] + [
    (V4, n, c) for n in V4_NAMES for c in CONFIGS] + [
    (Other, "ConfigOnlyTopkRouter", c) for c in CONFIGS] + [
    (V5, "AXK2TopkRouter", "no_groups")]
CASE_IDS = [f"{h.__name__}-{n}-{c}" for h, n, c in CASES]


def case_config(name):
    if name == "no_groups":
        return config(n_group=None, topk_group=None)
    return CONFIGS[name]


def randomize(router, seed):
    """bf16-exact weight (so that HF's fp32 logits are the reference's) and a small bias
    (positive for 4.x's routers: they fill dropped groups with 0, not -inf)."""
    g = torch.Generator().manual_seed(seed)
    e, h = router.weight.shape
    low = 0.0 if type(router).__qualname__.startswith("V4.") else -0.05
    with torch.no_grad():
        router.weight.copy_((torch.randn(e, h, generator=g) * (2 / math.sqrt(h))).bfloat16())
        router.e_score_correction_bias.copy_(torch.rand(e, generator=g) * 0.1 + low)
    return router


class Layer(nn.Module):
    def __init__(self, router):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.gate = router
        self.mlp.shared = nn.Linear(H, H)


class TinyModel(nn.Module):
    """Decoder layers whose MoE block holds its router as ``mlp.gate``; forward calls each."""

    def __init__(self, routers):
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.layers = nn.ModuleList(Layer(r) for r in routers)

    def forward(self, x):
        return [layer.mlp.gate(x) for layer in self.layers]


def tiny_model(cls, cfg, n=3, seed=0):
    return TinyModel([randomize(cls(cfg), seed + i) for i in range(n)])


def tokens(seed, n=200, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n // 2, H, generator=g).bfloat16().float().to(device)


def split(out):
    """``(topk_weights, topk_indices)`` of either interface."""
    return (out[1], out[2]) if len(out) == 3 else (out[1], out[0])


def assert_same_routing(hidden, router, got, want, top_k, n_group, topk_group):
    """Same experts and weights (HF's order is unspecified) on the tokens without near ties."""
    (w, i), (w_hf, i_hf) = got, want
    x = hidden.reshape(-1, H).cpu()
    choice = R.choice_values(x, router.weight.cpu(), router.e_score_correction_bias.cpu())
    ok = ~R.near_ties(choice, top_k, n_group or 1, topk_group or 1)
    assert ok.float().mean() > 0.9
    assert i.dtype == torch.int64 and w.dtype == torch.float32
    s, p = i.cpu().sort(-1)
    s_hf, p_hf = i_hf.cpu().sort(-1)
    assert torch.equal(s[ok], s_hf[ok])
    torch.testing.assert_close(w.cpu().gather(1, p)[ok], w_hf.cpu().gather(1, p_hf)[ok],
                               rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Replacement of the covered classes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("holder,name,cfg_name", CASES, ids=CASE_IDS)
def test_replaces_the_router_and_routes_as_it(holder, name, cfg_name, backend):
    cls, cfg = getattr(holder, name), case_config(cfg_name)
    device = "cuda" if backend == "cuda" else "cpu"
    model = tiny_model(cls, cfg).to(device)
    original = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert replace_hf_routers(model, backend=backend) == 3
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    hs = tokens(1, device=device)
    for layer, hf_layer in zip(model.layers, original.layers):
        gate, hf_gate = layer.mlp.gate, hf_layer.mlp.gate
        assert isinstance(gate, GroupedTopKRouter) and isinstance(gate, cls)
        assert type(gate).__name__ == f"GroupedTopKRouter_{name}"
        assert gate.backend == backend and gate.compute_router_logits is None
        out, want = gate(hs), hf_gate(hs)
        assert len(out) == len(want)
        if len(out) == 3:
            assert out[0] is None  # nothing records them
        assert_same_routing(hs, hf_gate, split(out), split(want), cfg.num_experts_per_tok,
                            cfg.n_group, cfg.topk_group)
    assert isinstance(model.layers[0].mlp.shared, nn.Linear)


@pytest.mark.parametrize("holder,name,cfg_name", CASES, ids=CASE_IDS)
def test_from_hf_reads_the_hyper_parameters(holder, name, cfg_name):
    cfg = case_config(cfg_name)
    hf = randomize(getattr(holder, name)(cfg), 5)
    ours = GroupedTopKRouter.from_hf(hf, compute_router_logits=True)
    assert type(ours) is GroupedTopKRouter
    assert (ours.hidden_dim, ours.num_experts, ours.top_k) == (
        H, cfg.n_routed_experts, cfg.num_experts_per_tok)
    assert (ours.num_group, ours.topk_group) == (cfg.n_group or 1, cfg.topk_group or 1)
    assert ours.norm_topk_prob == cfg.norm_topk_prob
    assert ours.routed_scaling_factor == cfg.routed_scaling_factor
    assert torch.equal(ours.weight, hf.weight)
    assert torch.equal(ours.e_score_correction_bias, hf.e_score_correction_bias)
    hs = tokens(6)
    logits, w, i = ours(hs)
    torch.testing.assert_close(logits, hs.reshape(-1, H) @ hf.weight.t())
    assert_same_routing(hs, hf, (w, i), split(hf(hs)), cfg.num_experts_per_tok, cfg.n_group,
                        cfg.topk_group)


def test_from_hf_keeps_dtype_requires_grad_mode_and_device():
    hf = V5.Glm4MoeTopkRouter(CONFIGS["grouped"]).to(torch.bfloat16).eval()
    hf.weight.requires_grad_(False)
    ours = GroupedTopKRouter.from_hf(hf)
    assert ours.weight.dtype == torch.bfloat16 and not ours.weight.requires_grad
    assert not ours.training
    # 4.x's config gives the initialization's scale.
    hf = V4.Glm4MoeTopkRouter(config(initializer_range=0.5))
    assert GroupedTopKRouter.from_hf(hf).config.initializer_range == 0.5
    with torch.device("meta"):
        meta = V5.Glm4MoeTopkRouter(CONFIGS["grouped"])
    model = TinyModel([meta])
    assert replace_hf_routers(model) == 1
    assert model.layers[0].mlp.gate.weight.device.type == "meta"


def test_shared_routers_stay_shared_and_a_second_call_replaces_nothing():
    router = randomize(V5.DeepseekV3TopkRouter(CONFIGS["grouped"]), 0)
    model = TinyModel([router, router, randomize(V5.DeepseekV3TopkRouter(CONFIGS["grouped"]), 1)])
    assert replace_hf_routers(model) == 2
    gates = [layer.mlp.gate for layer in model.layers]
    assert gates[0] is gates[1] and gates[0] is not gates[2]
    assert replace_hf_routers(model) == 0
    assert [layer.mlp.gate for layer in model.layers] == gates


def test_replaced_models_copy_and_pickle():
    for cls in (V5.Glm4MoeTopkRouter, V4.Glm4MoeTopkRouter):
        model = tiny_model(cls, CONFIGS["grouped"], n=2)
        replace_hf_routers(model)
        hs = tokens(2)
        want = model(hs)
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            gate = clone.layers[0].mlp.gate
            assert type(gate) is type(model.layers[0].mlp.gate)
            assert gate.weight is not model.layers[0].mlp.gate.weight
            for got, exp in zip(clone(hs), want):
                assert all((a is None and b is None) or torch.equal(a, b)
                           for a, b in zip(got, exp))


# --------------------------------------------------------------------------------------------
# Look-alikes: not replaced, and logged


def _softmax_forward(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim).float()
    logits = x @ self.weight.float().t()
    scores = logits.softmax(-1)
    idx = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
    return logits, scores.gather(1, idx) * self.routed_scaling_factor, idx


def _logit_choice_forward(self, hidden_states):
    # Selection on logits + bias rather than sigmoid scores + bias.
    x = hidden_states.reshape(-1, self.hidden_dim).float()
    logits = x @ self.weight.float().t()
    idx = (logits + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
    weights = logits.gather(1, idx).sigmoid()
    return logits, weights / weights.sum(-1, keepdim=True), idx


def _no_bias_init(self, config):
    _v5_init(self, config)
    del self.e_score_correction_bias


def _no_bias_forward(self, hidden_states):
    return hf_routing(hidden_states, self.weight, torch.zeros(self.num_experts), self.top_k,
                      self.num_group, self.topk_group, self.norm_topk_prob,
                      self.routed_scaling_factor)


def _bias_parameter_init(self, config):
    _v5_init(self, config)
    del self.e_score_correction_bias
    self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts),
                                                requires_grad=False)


def _no_scale_init(self, config):
    # The MoE block scales after combining the experts.
    _v5_init(self, config)
    del self.routed_scaling_factor


def _no_scale_forward(self, hidden_states):
    return hf_routing(hidden_states, self.weight, self.e_score_correction_bias, self.top_k,
                      self.num_group, self.topk_group, self.norm_topk_prob, 1.0)


def _extra_parameter_init(self, config):
    _v5_init(self, config)
    self.global_scale = nn.Parameter(torch.ones(1))


def _gate_init(self, config):
    # transformers 5.0 to 5.12: the gate computes the logits, its MoE block routes.
    _config_only_init(self, config)


def _gate_forward(self, hidden_states):
    return hidden_states.reshape(-1, self.config.hidden_size).float() @ self.weight.float().t()


LOOK_ALIKES = {
    "SoftmaxTopkRouter": (_v5_init, _softmax_forward, "routes differently"),
    "LogitChoiceTopKRouter": (_v5_init, _logit_choice_forward, "routes differently"),
    "Qwen3MoeTopKRouter": (_no_bias_init, _no_bias_forward, "`e_score_correction_bias` is missing"),
    "LagunaTopKRouter": (_bias_parameter_init, _v5_forward, "is a Parameter"),
    "BeamTopKRouter": (_no_scale_init, _no_scale_forward, "no routed_scaling_factor"),
    "InklingTopkRouter": (_extra_parameter_init, _v5_forward, "also holds global_scale"),
    "GateOnlyTopkRouter": (_gate_init, _gate_forward, "returns one tensor"),
}
for _name, (_init, _forward, _) in LOOK_ALIKES.items():
    stand_in(Other, _name, _init, _forward)


@pytest.mark.parametrize("name", list(LOOK_ALIKES))
def test_look_alikes_are_skipped_and_logged(name, caplog):
    caplog.set_level(logging.DEBUG, logger="moe_routing")
    model = TinyModel([getattr(Other, name)(CONFIGS["grouped"]) for _ in range(2)])
    gates = [layer.mlp.gate for layer in model.layers]
    assert replace_hf_routers(model) == 0
    assert [layer.mlp.gate for layer in model.layers] == gates
    [record] = [r for r in caplog.records if r.name == "moe_routing"]
    has_weight_and_bias = name != "Qwen3MoeTopKRouter"
    assert record.levelno == (logging.WARNING if has_weight_and_bias else logging.DEBUG)
    message = record.getMessage()
    assert f"2 {name} not replaced" in message and LOOK_ALIKES[name][2] in message


def test_from_hf_says_what_is_missing():
    with pytest.raises(ValueError, match="no routed_scaling_factor"):
        GroupedTopKRouter.from_hf(Other.BeamTopKRouter(CONFIGS["grouped"]))
    with pytest.raises(ValueError, match="is a Parameter"):
        GroupedTopKRouter.from_hf(Other.LagunaTopKRouter(CONFIGS["grouped"]))


def test_other_modules_are_left_alone(caplog):
    caplog.set_level(logging.DEBUG, logger="moe_routing")
    model = tiny_model(V5.DeepseekV3TopkRouter, CONFIGS["grouped"], n=1)
    model.layers.append(nn.TransformerEncoderLayer(H, 2, 32))
    assert replace_hf_routers(model) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------------------------
# Recording of router_logits


class Recorder:
    """The mechanism of transformers 5.x's output recorder (``_can_record_outputs`` holding
    ``"router_logits": OutputRecorder(<router class>, index=0)``): forward hooks on the
    modules that are instances of the router class, installed once, that keep output[0],
    unless None, while a recording call runs."""

    def __init__(self, model, target_class):
        self.collected = None
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, target_class)]

    def _hook(self, module, args, output):
        if self.collected is not None and output[0] is not None:
            self.collected.append(output[0])

    def __call__(self, model, *args):
        self.collected = []
        try:
            model(*args)
        finally:
            collected, self.collected = self.collected, None
        return collected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hooked_first", [False, True], ids=["replace-then-hook",
                                                             "hook-then-replace"])
def test_router_logits_are_recorded_after_replacement(hooked_first, backend):
    cls = V5.Glm4MoeLiteTopkRouter
    device = "cuda" if backend == "cuda" else "cpu"
    model = tiny_model(cls, CONFIGS["grouped"]).to(device)
    hs = tokens(3, device=device)
    want = [hf_routing(hs, layer.mlp.gate.weight, layer.mlp.gate.e_score_correction_bias,
                       4, 4, 2, True, 2.5)[0] for layer in model.layers]
    if hooked_first:
        recorder = Recorder(model, cls)
        assert len(recorder(model, hs)) == 3
    assert replace_hf_routers(model, backend=backend) == 3
    if not hooked_first:
        assert all(out[0] is None for out in model(hs))  # no hook: no logits
        recorder = Recorder(model, cls)
    got = recorder(model, hs)
    assert len(got) == 3
    for logits, exp in zip(got, want):
        assert logits.dtype == torch.float32 and logits.shape == (200, 16)
        torch.testing.assert_close(logits, exp)
    assert all(out[0] is not None for out in model(hs))  # hooked: computed, though unrecorded
    for handle in recorder.handles:
        handle.remove()
    assert all(out[0] is None for out in model(hs))


def test_compute_router_logits_can_be_set():
    for value, computed in ((True, True), (False, False)):
        model = tiny_model(V5.Dots1TopkRouter, CONFIGS["grouped"], n=1)
        replace_hf_routers(model, compute_router_logits=value)
        recorder = Recorder(model, V5.Dots1TopkRouter)
        assert len(recorder(model, tokens(4))) == int(computed)
        assert (model(tokens(4))[0][0] is not None) == computed


# --------------------------------------------------------------------------------------------
# transformers' own models


HF_COMMON = dict(vocab_size=64, hidden_size=H, intermediate_size=64, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                 n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                 n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
MLA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16)
HF_MODELS = {
    "DeepseekV3": dict(first_k_dense_replace=1, **MLA),
    "Glm4Moe": dict(first_k_dense_replace=1, head_dim=16),
    "Glm4MoeLite": dict(**MLA),  # the first layer dense
    "Dots1": dict(first_k_dense_replace=1, head_dim=16),
}


def hf_model(name):
    cfg = getattr(transformers, f"{name}Config")(**HF_COMMON, **HF_MODELS[name])
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    gates = [m for m in model.modules() if type(m).__name__ == f"{name}TopkRouter"]
    assert len(gates) == 2
    for i, gate in enumerate(gates):
        randomize(gate, 10 + i)
    return model, type(gates[0])


@needs_hf
@pytest.mark.parametrize("recorded_first", [False, True])
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_models(name, recorded_first):
    model, cls = hf_model(name)
    # Recent releases record router_logits from the router.
    records = "router_logits" in (type(model.model)._can_record_outputs or {})
    if recorded_first and not records:
        pytest.skip(f"transformers {transformers.__version__} records no router_logits here")
    original = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if recorded_first:
            model(ids, output_router_logits=True)
        assert replace_hf_routers(model) == 2
        gates = [(m, o) for m, o in zip(model.modules(), original.modules()) if isinstance(o, cls)]
        assert all(isinstance(m, GroupedTopKRouter) and isinstance(m, cls) for m, _ in gates)
        hs = tokens(7)
        for gate, hf_gate in gates:
            assert_same_routing(hs, hf_gate, split(gate(hs)), split(hf_gate(hs)), 4, 4, 2)
        model(ids)
        if not records:
            return
        want = original(ids, output_router_logits=True).router_logits
        got = model(ids, output_router_logits=True).router_logits
        assert len(got) == len(want) == 2
        # The first MoE layer sees the same hidden states; later ones differ by the rounding
        # of the routing weights.
        torch.testing.assert_close(got[0], want[0])
        assert all(t.shape == (14, 16) and t.dtype == torch.float32 for t in got)
        assert model(ids).router_logits is None
