"""A drop-in for torchtitan's ``TokenChoiceTopKRouter`` (``torchtitan/models/common/moe.py``;
``torchtitan/models/moe/moe.py`` in earlier releases) with sigmoid, node-limited routing on the
CUDA kernels. torchtitan is not imported."""

from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..module import _BACKENDS, _log_kernel_paths, _route_tokens, _use_kernel

_RETURNS = ("scores", "counts")


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan's ``TokenChoiceTopKRouter`` for ``score_func="sigmoid"``, on the kernels:
    the same arguments, the gate as ``gate`` (an ``nn.Linear`` without bias, so state dicts
    and the ``moe.router.gate`` module names carry over) and the same forward.

    ``forward(x, expert_bias=None)`` takes ``x`` [T, D] (or [..., D]) and the optional
    load-balancing bias [E] (added to the scores for the selection only) and returns, as
    torchtitan's router does, ``(top_scores [T, K] fp32, selected_experts_indices [T, K]
    int64, third)``, where `third` is, with ``returns="scores"`` (torchtitan's current
    router), all sigmoid scores [T, E] fp32, and with ``returns="counts"`` (its releases up
    to mid-2026), the token count of each expert [E] int64: both from the same kernel call,
    neither differentiable. Inputs of more dimensions keep their leading ones in the outputs.

    Arguments as torchtitan's: `num_expert_groups` / `num_limited_groups` (node-limited
    routing: groups ranked by the sum of their two best biased scores), `top_k`,
    `route_norm` (normalise the selected scores), `route_scale`. ``score_func="softmax"``, a
    gate bias and ``_debug_force_load_balance`` are not supported (ValueError). Differences
    from torchtitan: the gate runs on bf16-rounded x and weight with fp32 accumulation
    (torchtitan: fp32 autocast); experts come best first; ties go to the lower index.

    `backend`, `precise_backward` and `accumulate_grad_into_main_grad` are those of
    :class:`moe_routing.GroupedTopKRouter`; ``topk_indices`` (forward argument) or the
    ``replay_indices`` attribute replay given experts.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        num_expert_groups: Optional[int] = None,
        num_limited_groups: Optional[int] = None,
        top_k: int = 1,
        score_func: str = "sigmoid",
        route_norm: bool = False,
        route_scale: float = 1.0,
        gate_bias: bool = False,
        _debug_force_load_balance: bool = False,
        *,
        returns: str = "scores",
        backend: str = "auto",
        precise_backward: bool = False,
        accumulate_grad_into_main_grad: bool = False,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if score_func != "sigmoid":
            raise ValueError(f"score_func must be 'sigmoid' (the kernels' scores), got "
                             f"{score_func!r}")
        if gate_bias:
            raise ValueError("gate_bias=True is not supported (the kernels' gate has no bias)")
        if _debug_force_load_balance:
            raise ValueError("_debug_force_load_balance is not supported; use torchtitan's "
                             "router for that debug mode")
        if returns not in _RETURNS:
            raise ValueError(f"returns must be one of {_RETURNS}, got {returns!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if num_expert_groups is not None and num_limited_groups is None:
            raise ValueError("num_limited_groups must be set when num_expert_groups is set")
        n_group = 1 if num_expert_groups is None else int(num_expert_groups)
        topk_group = 1 if num_expert_groups is None else int(num_limited_groups)
        ops.check_config(int(dim), int(num_experts), int(top_k), n_group, topk_group,
                         float(route_scale))
        self.gate = nn.Linear(dim, num_experts, bias=False, device=device, dtype=dtype)
        self.dim = int(dim)
        self.num_experts = int(num_experts)
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = int(top_k)
        self.score_func = score_func
        self.route_norm = bool(route_norm)
        self.route_scale = float(route_scale)
        self._debug_force_load_balance = False
        self.returns = returns
        self.backend = backend
        self.precise_backward = bool(precise_backward)
        self.accumulate_grad_into_main_grad = bool(accumulate_grad_into_main_grad)
        self.replay_indices: Optional[Tensor] = None
        self._groups = (n_group, topk_group)
        self._zero_bias: Optional[Tensor] = None
        if backend != "reference":
            _log_kernel_paths(self.dim, self.num_experts, self.top_k, n_group, topk_group,
                              self.route_scale, self.route_norm)

    @classmethod
    def from_config(cls, config, dim: Optional[int] = None, **kwargs):
        """From torchtitan's ``TokenChoiceTopKRouter.Config`` (or any object with its fields);
        `dim` defaults to ``config.gate.in_features``."""
        gate = getattr(config, "gate", None)
        if dim is None:
            dim = getattr(gate, "in_features", None)
            if dim is None:
                raise ValueError("dim is not given and the config has no gate.in_features")
        return cls(
            dim, config.num_experts,
            num_expert_groups=getattr(config, "num_expert_groups", None),
            num_limited_groups=getattr(config, "num_limited_groups", None),
            top_k=getattr(config, "top_k", 1),
            score_func=getattr(config, "score_func", "sigmoid"),
            route_norm=getattr(config, "route_norm", False),
            route_scale=getattr(config, "route_scale", 1.0),
            gate_bias=bool(getattr(gate, "bias", False)),
            _debug_force_load_balance=getattr(config, "_debug_force_load_balance", False),
            **kwargs)

    @classmethod
    def from_torchtitan(cls, router: nn.Module, **kwargs) -> "TokenChoiceTopKRouter":
        """A router with the settings, gate weight (device, dtype, ``requires_grad``) and
        training mode of a torchtitan ``TokenChoiceTopKRouter``."""
        weight = router.gate.weight
        new = cls(
            weight.shape[1], router.num_experts,
            num_expert_groups=router.num_expert_groups,
            num_limited_groups=router.num_limited_groups,
            top_k=router.top_k, score_func=router.score_func, route_norm=router.route_norm,
            route_scale=router.route_scale,
            gate_bias=getattr(router.gate, "bias", None) is not None,
            _debug_force_load_balance=getattr(router, "_debug_force_load_balance", False),
            device=weight.device, dtype=weight.dtype, **kwargs)
        with torch.no_grad():
            new.gate.weight.copy_(weight)
        new.gate.weight.requires_grad_(weight.requires_grad)
        return new.train(router.training)

    def init_weights(self, init_std: float) -> None:
        """torchtitan's initialisation of the gate: a truncated normal of std `init_std`."""
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)

    def _bias(self, expert_bias: Optional[Tensor], x: Tensor) -> Tensor:
        if expert_bias is None:
            if self._zero_bias is None or self._zero_bias.device != x.device:
                self._zero_bias = torch.zeros(self.num_experts, dtype=torch.float32,
                                              device=x.device)
            return self._zero_bias
        if not isinstance(expert_bias, Tensor):
            raise TypeError(f"expert_bias must be a torch.Tensor, got "
                            f"{type(expert_bias).__name__}")
        if tuple(expert_bias.shape) != (self.num_experts,) or not expert_bias.is_floating_point():
            raise ValueError(f"expert_bias must be a floating tensor of shape "
                             f"[{self.num_experts}], got {expert_bias.dtype} of shape "
                             f"{tuple(expert_bias.shape)}")
        if expert_bias.device != x.device:
            raise ValueError(f"expert_bias is on {expert_bias.device}, but x is on {x.device}")
        return expert_bias

    def forward(self, x: Tensor, expert_bias: Optional[Tensor] = None,
                topk_indices: Optional[Tensor] = None):
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must end in dim {self.dim}, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, self.dim)
        if topk_indices is None:
            topk_indices = self.replay_indices
        if (isinstance(topk_indices, Tensor) and topk_indices.dim() == len(lead) + 1
                and topk_indices.shape[:-1] == lead):
            topk_indices = topk_indices.reshape(-1, topk_indices.shape[-1])
        scores_wanted = self.returns == "scores"
        n_group, topk_group = self._groups
        weights, idx, scores, counts = _route_tokens(
            tokens, self.gate.weight, self._bias(expert_bias, tokens), self.top_k, n_group,
            topk_group, self.route_scale, self.route_norm,
            use_kernel=_use_kernel(self.backend, tokens), precise=self.precise_backward,
            topk_indices=topk_indices, main_grad=self.accumulate_grad_into_main_grad,
            return_scores=scores_wanted, return_counts=not scores_wanted)
        third = (scores.reshape(*lead, self.num_experts) if scores_wanted
                 else counts.to(torch.int64))
        return (weights.reshape(*lead, self.top_k), idx.reshape(*lead, self.top_k), third)

    def extra_repr(self) -> str:
        n_group, topk_group = self._groups
        return (f"dim={self.dim}, experts={self.num_experts}, top_k={self.top_k}, "
                f"groups={topk_group} of {n_group}, route_norm={self.route_norm}, "
                f"route_scale={self.route_scale}, returns={self.returns!r}, "
                f"backend={self.backend!r}")
