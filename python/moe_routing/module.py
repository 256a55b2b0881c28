"""``GroupedTopKRouter``: a drop-in for HF transformers' ``DeepseekV3TopkRouter`` and
``Glm4MoeTopkRouter`` that routes with the CUDA kernels."""

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor, nn

from . import ops, reference

_BACKENDS = ("auto", "cuda", "reference")
_HF_ROUTER_CLASSES = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")


def _cfg(config, name: str, default=None):
    v = getattr(config, name, None)
    if v is None:
        if default is None:
            raise ValueError(f"the config has no `{name}`")
        return default
    return v


class GroupedTopKRouter(nn.Module):
    """Grouped top-k ("noaux_tc") MoE router with the interface of transformers 5.x's
    ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` (checked against transformers 5.24).

    Args:
        config: an HF config (``DeepseekV3Config``, ``Glm4MoeConfig``, or any object) with
            ``hidden_size``, ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``,
            ``topk_group``, ``routed_scaling_factor`` and ``norm_topk_prob`` (``n_group`` and
            ``topk_group`` of None mean 1; ``initializer_range`` is used by
            :meth:`reset_parameters` if present).
        backend: ``"auto"`` (the CUDA kernels for CUDA inputs, :mod:`moe_routing.reference`
            otherwise), ``"cuda"`` (the kernels; other devices raise ValueError) or
            ``"reference"`` (always the pure-PyTorch float64 reference).
        compute_router_logits: HF's router also returns the fp32 ``router_logits`` [T, E]
            (``x @ weight.T`` in fp32), which its MoE blocks discard. The kernels do not
            materialize them; with False (default) the first output is None, with True they
            are computed as HF does (an extra fp32 matrix product, differentiable).
        precise_backward: fp32-accurate ``grad_w`` (a second pass over x).

    Parameters and buffers are those of HF: ``weight`` [E, H] (Parameter, fp32) and
    ``e_score_correction_bias`` [E] (buffer, fp32), so HF state dicts load as they are.

    ``forward(hidden_states)`` takes ``[..., H]`` (e.g. [B, S, H]) and returns, like HF 5.x,
    ``(router_logits, topk_weights, topk_indices)``: ``router_logits`` [T, E] fp32 or None
    (see above), ``topk_weights`` [T, K] fp32 and ``topk_indices`` [T, K] int64, with
    T = B·S. Differences from HF: experts come best first (HF's order is unspecified); NaN
    scores rank lowest and ties go to the lower index (HF's ``torch.topk`` prefers NaN and
    breaks ties arbitrarily); logits come from bf16-rounded ``hidden_states`` and ``weight``
    with fp32 accumulation (HF: fp32 inputs). The kernels consume bf16: ``hidden_states``
    is cast to bf16 (its gradient comes back in its own dtype) and ``weight`` is rounded to
    bf16 inside the op, its gradient staying fp32.
    """

    def __init__(
        self,
        config,
        *,
        backend: str = "auto",
        compute_router_logits: bool = False,
        precise_backward: bool = False,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.config = config
        self.top_k = int(_cfg(config, "num_experts_per_tok"))
        self.num_experts = int(_cfg(config, "n_routed_experts"))
        self.n_routed_experts = self.num_experts  # transformers 4.x name
        self.hidden_dim = int(_cfg(config, "hidden_size"))
        self.routed_scaling_factor = float(_cfg(config, "routed_scaling_factor", 1.0))
        self.num_group = int(_cfg(config, "n_group", 1))
        self.n_group = self.num_group  # transformers 4.x name
        self.topk_group = int(_cfg(config, "topk_group", 1))
        self.norm_topk_prob = bool(_cfg(config, "norm_topk_prob", False))
        ops.check_config(self.hidden_dim, self.num_experts, self.top_k, self.num_group,
                         self.topk_group, self.routed_scaling_factor)
        self.backend = backend
        self.compute_router_logits = compute_router_logits
        self.precise_backward = precise_backward
        dtype = dtype or torch.float32
        self.weight = nn.Parameter(
            torch.empty((self.num_experts, self.hidden_dim), device=device, dtype=dtype)
        )
        self.register_buffer(
            "e_score_correction_bias",
            torch.zeros(self.num_experts, device=device, dtype=torch.float32),
        )
        self.reset_parameters()

    def reset_parameters(self, std: Optional[float] = None) -> None:
        """HF's initialization: ``weight ~ N(0, initializer_range)``, bias zero."""
        if std is None:
            std = float(getattr(self.config, "initializer_range", None) or 0.02)
        with torch.no_grad():
            self.weight.normal_(0.0, std)
            self.e_score_correction_bias.zero_()

    @classmethod
    def from_hf(cls, router: nn.Module, **kwargs) -> "GroupedTopKRouter":
        """A router with the config, parameters, device and dtypes of an HF router
        (transformers 5.x keeps the hyper-parameters as attributes, 4.x a ``config``)."""
        config = getattr(router, "config", None)
        if config is None:

            def attr(*names):
                for n in names:
                    if getattr(router, n, None) is not None:
                        return getattr(router, n)
                raise ValueError(f"{type(router).__name__} has none of {names}")

            config = SimpleNamespace(
                hidden_size=router.weight.shape[1],
                n_routed_experts=router.weight.shape[0],
                num_experts_per_tok=attr("top_k"),
                n_group=attr("num_group", "n_group"),
                topk_group=attr("topk_group"),
                routed_scaling_factor=attr("routed_scaling_factor"),
                norm_topk_prob=attr("norm_topk_prob"),
            )
        new = cls(config, device=router.weight.device, dtype=router.weight.dtype, **kwargs)
        new.load_state_dict(router.state_dict())
        return new

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_dim}, experts={self.num_experts}, top_k={self.top_k}, "
            f"n_group={self.num_group}, topk_group={self.topk_group}, "
            f"scale={self.routed_scaling_factor}, norm={self.norm_topk_prob}, "
            f"backend={self.backend!r}"
        )

    def _use_kernel(self, hidden_states: Tensor) -> bool:
        if self.backend == "reference":
            return False
        if self.backend == "cuda":
            return True  # the op raises ValueError for other devices
        return hidden_states.is_cuda

    def forward(self, hidden_states: Tensor):
        if hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(
                f"hidden_states must end in hidden_size {self.hidden_dim}, "
                f"got shape {tuple(hidden_states.shape)}"
            )
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        bias = self.e_score_correction_bias.to(torch.float32)
        if self._use_kernel(hidden_states):
            x = hidden_states.to(torch.bfloat16).contiguous()
            w = self.weight
            if w.dtype not in (torch.bfloat16, torch.float32):
                w = w.to(torch.float32)
            topk_idx, topk_weights, _ = torch.ops.moe_routing.route(
                x,
                w.contiguous(),
                bias.contiguous(),
                self.top_k,
                self.num_group,
                self.topk_group,
                self.routed_scaling_factor,
                self.norm_topk_prob,
                self.precise_backward,
            )
            topk_indices = topk_idx.to(torch.int64)
        else:
            topk_indices, topk_weights, _ = reference.route(
                hidden_states,
                self.weight,
                bias,
                self.top_k,
                self.num_group,
                self.topk_group,
                self.routed_scaling_factor,
                self.norm_topk_prob,
            )
            topk_weights = topk_weights.to(torch.float32)
        router_logits = None
        if self.compute_router_logits:
            router_logits = nn.functional.linear(
                hidden_states.to(torch.float32), self.weight.to(torch.float32)
            )
        return router_logits, topk_weights, topk_indices


def replace_hf_routers(model: nn.Module, **kwargs) -> int:
    """Replaces every ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` in `model` by a
    :class:`GroupedTopKRouter` with the same config, parameters, device and dtypes.
    Returns the number replaced. (HF's ``output_router_logits`` recording looks for its own
    router classes, so it records nothing from replaced routers.)"""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in _HF_ROUTER_CLASSES
    ]
    for parent, name, child in targets:
        setattr(parent, name, GroupedTopKRouter.from_hf(child, **kwargs))
    return len(targets)
