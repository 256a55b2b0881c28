"""A drop-in for Megatron-LM's ``TopKRouter`` (``megatron/core/transformer/moe/router.py``)
with DeepSeek-V3's sigmoid, group-limited routing on the CUDA kernels. Megatron is not
imported: the config is read by attribute name (a ``TransformerConfig`` or any object)."""

from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops, training
from ..module import _BACKENDS, _log_kernel_paths, _route_tokens, _use_kernel

_AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _required(config, name: str):
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"the config has no `{name}`")
    return value


def _aux_loss_coeff(config, kind: str) -> float:
    """Megatron's coefficient of the auxiliary loss `kind` (0 where it is not configured)."""
    types = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    coeff = getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0
    if isinstance(types, str):
        return float(coeff) if types == kind else 0.0
    if kind in list(types):
        return float(list(coeff)[list(types).index(kind)])
    return 0.0


def routing_config(config) -> dict:
    """The kernels' router config of a Megatron config, ValueError naming the setting where
    Megatron would route otherwise than the kernels do (or add something they do not)."""
    hidden = int(_required(config, "hidden_size"))
    experts = int(_required(config, "num_moe_experts"))
    top_k = int(_required(config, "moe_router_topk"))
    score = getattr(config, "moe_router_score_function", "softmax")
    if score != "sigmoid":
        raise ValueError(f"moe_router_score_function must be 'sigmoid' (the kernels' scores), "
                         f"got {score!r}")
    types = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    for kind in ([types] if isinstance(types, str) else list(types)):
        if kind in ("sinkhorn", "quantile_balancing"):
            raise ValueError(f"moe_router_load_balancing_type {kind!r} routes otherwise; the "
                             f"kernels route by top-k (use 'none', or an auxiliary loss type "
                             f"with moe_aux_loss_coeff 0)")
    for kind in _AUX_LOSS_TYPES:
        if _aux_loss_coeff(config, kind) > 0:
            raise ValueError(
                f"moe_aux_loss_coeff > 0 for {kind!r}: this router computes no auxiliary loss "
                f"(it needs differentiable scores of every expert); set moe_aux_loss_coeff to "
                f"0 and balance with moe_router_enable_expert_bias, or keep Megatron's router")
    unsupported = [
        ("moe_z_loss_coeff", lambda v: bool(v)),
        ("moe_input_jitter_eps", lambda v: v is not None),
        ("moe_expert_capacity_factor", lambda v: v is not None),
        ("moe_router_force_load_balancing", lambda v: bool(v)),
        ("moe_router_force_biased", lambda v: v is not None),
        ("add_bias_linear", lambda v: bool(v)),
    ]
    for name, used in unsupported:
        value = getattr(config, name, None)
        if used(value):
            raise ValueError(f"{name}={value!r} is not supported by this router (the kernels "
                             f"have no such step); leave it unset")
    num_groups = getattr(config, "moe_router_num_groups", None)
    group_topk = getattr(config, "moe_router_group_topk", None)
    if group_topk:
        if not num_groups:
            raise ValueError("moe_router_group_topk is set, but moe_router_num_groups is not")
        n_group, topk_group = int(num_groups), int(group_topk)
        # Megatron ranks groups by the sum of their top (topk / group_topk) scores; the
        # kernels (as DeepSeek-V3) by their top two.
        if n_group > 1 and top_k // topk_group != 2:
            raise ValueError(
                f"moe_router_topk // moe_router_group_topk must be 2 with groups (Megatron "
                f"ranks groups by their best topk // group_topk scores, the kernels by their "
                f"best 2), got {top_k} // {topk_group}")
    else:
        n_group, topk_group = 1, 1
    scale = getattr(config, "moe_router_topk_scaling_factor", None)
    scale = float(scale) if scale else 1.0  # (Megatron scales only by a non-zero factor)
    ops.check_config(hidden, experts, top_k, n_group, topk_group, scale)
    return dict(hidden_size=hidden, n_routed_experts=experts, top_k=top_k, n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=scale,
                norm_topk_prob=top_k > 1)  # (Megatron normalises sigmoid scores for top_k > 1)


_PROBS_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class MegatronTopKRouter(nn.Module):
    """Megatron-LM's ``TopKRouter`` for sigmoid group-limited routing (DeepSeek-V3), on the
    kernels: the same constructor, parameters, buffers and forward.

    ``forward(input, padding_mask=None)`` takes the hidden states ``[S, B, H]`` (or any
    ``[..., H]``) and returns Megatron's ``(probs, routing_map)``: ``probs`` [T, E], the
    routing weights at each token's chosen experts and 0 elsewhere (differentiable, in
    Megatron's logits dtype: the input's, or fp32 / fp64 with ``moe_router_dtype``), and
    ``routing_map`` [T, E] bool. With ``moe_router_enable_expert_bias`` it has Megatron's
    buffers ``expert_bias`` [E] fp32 (added to the scores for the selection only) and
    ``local_tokens_per_expert`` [E] fp32, to which every forward with grad enabled adds its
    per-expert token counts (from the same kernel call; padding tokens, where
    ``padding_mask`` is True, are left out, as in Megatron's code), so that Megatron's
    ``finalize_model_grads`` updates the bias as it does for its own router
    (:meth:`update_expert_bias` does the same by hand).

    Config (read by name): ``hidden_size``, ``num_moe_experts``, ``moe_router_topk``,
    ``moe_router_score_function == "sigmoid"``, ``moe_router_num_groups`` /
    ``moe_router_group_topk`` (with groups, ``topk // group_topk`` must be 2: the kernels
    rank groups by their two best scores), ``moe_router_topk_scaling_factor``,
    ``moe_router_enable_expert_bias``, ``moe_router_bias_update_rate``, ``moe_router_dtype``,
    ``params_dtype``, ``init_method`` / ``perform_initialization``, ``sequence_parallel``,
    ``gradient_accumulation_fusion`` (grad_w added into ``weight.main_grad`` by the kernel,
    see :class:`moe_routing.GroupedTopKRouter`), ``moe_enable_routing_replay``. Settings for
    steps the kernels do not have (auxiliary or z losses, input jitter, token dropping,
    sinkhorn, a logit bias) raise ValueError naming them. Differences from Megatron: logits
    come from bf16-rounded input and weight with fp32 accumulation; experts of dropped groups
    are never chosen; ties go to the lower index.

    Routing replay: ``router_replay`` (Megatron's ``RouterReplay``, created when
    ``moe_enable_routing_replay`` is set, or the object given as `router_replay`: anything
    with its ``router_replay_action``, ``target_topk_idx``, ``replay_backward_list`` and
    ``record_indices``) records the chosen experts or replays given ones (the weights
    recomputed at them, differentiable; see :func:`moe_routing.route_with_indices`).
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, *,
                 backend: str = "auto", precise_backward: bool = False,
                 accumulate_grad_into_main_grad: Optional[bool] = None, device=None,
                 router_replay=None):
        super().__init__()
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        cfg = routing_config(config)
        self.config = config
        self.backend = backend
        self.precise_backward = bool(precise_backward)
        if accumulate_grad_into_main_grad is None:
            accumulate_grad_into_main_grad = bool(
                getattr(config, "gradient_accumulation_fusion", False))
        self.accumulate_grad_into_main_grad = bool(accumulate_grad_into_main_grad)
        self._cfg = cfg
        self.num_experts = cfg["n_routed_experts"]
        self.topk = cfg["top_k"]
        self.routing_type = getattr(config, "moe_router_load_balancing_type", "aux_loss")
        self.score_function = "sigmoid"
        self.input_jitter = None
        self.layer_number = None
        self.is_mtp_layer = is_mtp_layer
        self.moe_aux_loss_func = None
        self.calculate_per_token_loss = getattr(config, "calculate_per_token_loss", False)
        for name in ("tp", "cp", "tp_cp", "tp_dp_cp"):
            setattr(self, f"{name}_group", getattr(pg_collection, name, None))
        self.frozen_expert_bias = False
        self.global_tokens_per_expert = None
        self.ga_steps = None
        self.qb_beta = self.qb_beta_accum = self.qb_beta_count = None
        self.bias = None  # (Megatron's logit bias, add_bias_linear: not supported)
        self.weight = nn.Parameter(torch.empty((self.num_experts, cfg["hidden_size"]),
                                               dtype=torch.float32, device=device))
        self.enable_expert_bias = bool(getattr(config, "moe_router_enable_expert_bias", False))
        if self.enable_expert_bias:
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(self.num_experts, dtype=torch.float32,
                                             device=device), persistent=False)
            self.register_buffer("expert_bias", torch.zeros(self.num_experts,
                                                            dtype=torch.float32,
                                                            device=device))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None
        self.router_replay = router_replay
        if router_replay is None and getattr(config, "moe_enable_routing_replay", False):
            try:
                from megatron.core.transformer.moe.router_replay import RouterReplay
            except ImportError as err:
                raise ImportError(
                    "moe_enable_routing_replay needs Megatron-LM's RouterReplay; without "
                    "Megatron, leave it off and set `router_replay` to an object with its "
                    "interface") from err
            self.router_replay = RouterReplay()
        self._zero_bias: Optional[Tensor] = None
        self.reset_parameters()
        if backend != "reference":
            _log_kernel_paths(cfg["hidden_size"], self.num_experts, self.topk, cfg["n_group"],
                              cfg["topk_group"], cfg["routed_scaling_factor"],
                              cfg["norm_topk_prob"])

    @classmethod
    def from_megatron(cls, router: nn.Module, **kwargs) -> "MegatronTopKRouter":
        """A router with the config, weight, expert bias, layer number, replay object and
        training mode of a Megatron ``TopKRouter``."""
        weight = router.weight
        kwargs.setdefault("router_replay", getattr(router, "router_replay", None))
        new = cls(router.config, device=weight.device, **kwargs)
        with torch.no_grad():
            new.weight.data = weight.detach().clone()
            if new.enable_expert_bias:
                new.expert_bias.copy_(router.expert_bias)
        new.weight.requires_grad_(weight.requires_grad)
        new.set_layer_number(getattr(router, "layer_number", None))
        return new.train(router.training)

    def reset_parameters(self) -> None:
        """Megatron's initialisation: ``config.init_method`` (normal with
        ``init_method_std``, 0.02 by default, where the config has none) unless
        ``perform_initialization`` is False, then the weight in ``params_dtype``, tagged with
        ``sequence_parallel``."""
        config = self.config
        if getattr(config, "perform_initialization", True):
            init = getattr(config, "init_method", None)
            if callable(init):
                init(self.weight)
            else:
                std = getattr(config, "init_method_std", None) or 0.02
                with torch.no_grad():
                    self.weight.normal_(0.0, std)
        dtype = getattr(config, "params_dtype", None) or torch.float32
        self.weight.data = self.weight.data.to(dtype=dtype)
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel",
                                                               False)))

    def set_layer_number(self, layer_number) -> None:
        self.layer_number = layer_number
        if self.router_replay is not None and hasattr(self.router_replay, "layer_number"):
            self.router_replay.layer_number = layer_number

    def is_aux_loss_enabled(self) -> bool:
        return False

    def reset_global_aux_loss_tracker(self) -> None:
        pass

    def _maintain_float32_expert_bias(self) -> None:
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)

    def _load_from_state_dict(self, *args, **kwargs):
        self._maintain_float32_expert_bias()
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args, **kwargs):
        self._maintain_float32_expert_bias()
        return super()._save_to_state_dict(*args, **kwargs)

    def update_expert_bias(self, rate: Optional[float] = None, group=None) -> Tensor:
        """Megatron's end-of-step bias update by hand: :func:`moe_routing.update_expert_bias`
        from ``local_tokens_per_expert`` (summed over `group` if given) with `rate` (default
        ``moe_router_bias_update_rate``), then the counts reset. Returns ``expert_bias``."""
        if not self.enable_expert_bias:
            raise ValueError("update_expert_bias needs moe_router_enable_expert_bias")
        if rate is None:
            rate = float(getattr(self.config, "moe_router_bias_update_rate", 1e-3))
        training.update_expert_bias(self.local_tokens_per_expert, self.expert_bias, rate,
                                    group)
        self.local_tokens_per_expert.zero_()
        return self.expert_bias

    def _bias(self, like: Tensor) -> Tensor:
        if self.expert_bias is not None:
            return self.expert_bias
        if self._zero_bias is None or self._zero_bias.device != like.device:
            self._zero_bias = torch.zeros(self.num_experts, dtype=torch.float32,
                                          device=like.device)
        return self._zero_bias

    def _replay_action(self):
        """``(indices to replay or None, whether to record the selection)``."""
        replay = self.router_replay
        if replay is None:
            return None, False
        action = getattr(replay, "router_replay_action", None)
        action = getattr(action, "value", action)
        if action is None:
            return None, False
        if action == "record":
            return None, True
        if action == "replay_forward":
            return replay.target_topk_idx, False
        if action == "replay_backward":
            return replay.replay_backward_list.pop(0), False
        raise ValueError(f"router_replay has an unknown router_replay_action {action!r}")

    def forward(self, input: Tensor, padding_mask: Optional[Tensor] = None):
        self._maintain_float32_expert_bias()
        cfg = self._cfg
        H, E = cfg["hidden_size"], self.num_experts
        if input.shape[-1] != H:
            raise ValueError(f"input must end in hidden_size {H}, got shape "
                             f"{tuple(input.shape)}")
        x = input.reshape(-1, H)
        T = x.shape[0]
        if padding_mask is not None:
            if not isinstance(padding_mask, Tensor) or padding_mask.numel() != T:
                raise ValueError(f"padding_mask must be a tensor of {T} elements (one per "
                                 f"token), got {getattr(padding_mask, 'shape', padding_mask)}")
            padding_mask = padding_mask.reshape(-1).to(torch.bool)
        replay_idx, record = self._replay_action()
        if replay_idx is not None:
            replay_idx = replay_idx.to(x.device)
        count = self.enable_expert_bias and torch.is_grad_enabled()
        weights, idx, _, counts = _route_tokens(
            x, self.weight, self._bias(x), self.topk, cfg["n_group"], cfg["topk_group"],
            cfg["routed_scaling_factor"], cfg["norm_topk_prob"],
            use_kernel=_use_kernel(self.backend, x), precise=self.precise_backward,
            topk_indices=replay_idx, main_grad=self.accumulate_grad_into_main_grad,
            return_counts=count and padding_mask is None)
        if record:
            self.router_replay.record_indices(idx)
        probs_dtype = _PROBS_DTYPES.get(getattr(self.config, "moe_router_dtype", None),
                                        input.dtype)
        probs = torch.zeros((T, E), dtype=probs_dtype, device=x.device).scatter(
            1, idx, weights.to(probs_dtype))
        routing_map = torch.zeros((T, E), dtype=torch.bool, device=x.device).scatter(
            1, idx, True)
        if count:
            with torch.no_grad():
                if padding_mask is not None:
                    counts = (routing_map & ~padding_mask.unsqueeze(-1)).sum(dim=0)
                self.local_tokens_per_expert += counts
        return probs, routing_map

    def extra_repr(self) -> str:
        cfg = self._cfg
        return (f"hidden={cfg['hidden_size']}, experts={self.num_experts}, topk={self.topk}, "
                f"groups={cfg['topk_group']} of {cfg['n_group']}, "
                f"scale={cfg['routed_scaling_factor']}, expert_bias={self.enable_expert_bias}, "
                f"backend={self.backend!r}")
