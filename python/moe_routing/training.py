"""Training features around the router: routing replay (:func:`route_with_indices`), the
loss-free balancing update of the expert bias (:func:`update_expert_bias`), and the autograd
path that adds ``grad_w`` into Megatron's ``main_grad`` (used by
:class:`moe_routing.GroupedTopKRouter` and the framework adapters)."""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops, reference

_BACKENDS = ("auto", "cuda", "reference")


# --------------------------------------------------------------------------------------------
# Loss-free balancing


def update_expert_bias(counts: Tensor, bias: Tensor, rate: float, group=None) -> Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step, in place and without autograd:
    ``bias += rate * sign(mean(counts) - counts)``, the mean over the experts (last
    dimension). An expert that took more tokens than the mean gets its bias lowered by
    `rate`, one that took fewer gets it raised, one exactly at the mean keeps it.

    Args:
        counts: tokens routed to each expert, [E] (or [L, E] for L routers at once), any
            integer or floating dtype: e.g. ``GroupedTopKRouter.tokens_per_expert`` or the
            ``expert_counts`` of ``route_with_stats``. Not modified.
        bias: the expert score correction bias, a floating tensor of the same shape and
            device (``e_score_correction_bias``), updated in place.
        rate: the update speed (DeepSeek-V3's gamma), a finite number > 0.
        group: a ``torch.distributed`` process group: the counts are first summed over it
            (all-reduce of a copy), so that every rank applies the same update. None: the
            local counts.

    Returns `bias`.
    """
    if not isinstance(counts, Tensor):
        raise TypeError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if counts.dim() == 0:
        raise ValueError("counts must have the experts as its last dimension, got a scalar")
    if counts.dtype == torch.bool or counts.is_complex():
        raise ValueError(f"counts must be an integer or floating tensor, got {counts.dtype}")
    if not bias.is_floating_point():
        raise ValueError(f"bias must be a floating tensor, got {bias.dtype}")
    if bias.shape != counts.shape:
        raise ValueError(f"bias has shape {tuple(bias.shape)}, counts {tuple(counts.shape)}: "
                         f"they must be equal")
    if bias.device != counts.device:
        raise ValueError(f"bias is on {bias.device}, but counts is on {counts.device}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"rate must be a number, got {type(rate).__name__}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be finite and > 0, got {rate}")
    if group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group is given, but torch.distributed is not initialized")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got "
                            f"{type(group).__name__}")
    with torch.no_grad():
        c = counts.detach()
        if group is not None:
            c = c.clone()
            dist.all_reduce(c, op=dist.ReduceOp.SUM, group=group)
        c = c.to(torch.float64)
        step = torch.sign(c.mean(dim=-1, keepdim=True) - c)
        bias.add_(step.to(bias.dtype), alpha=rate)
    return bias


# --------------------------------------------------------------------------------------------
# The autograd path of replay and main_grad accumulation


@dataclass(frozen=True)
class _Spec:
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    precise: bool
    use_kernel: bool  # the ops (x bf16 on a GPU), else the float64 reference
    return_scores: bool = False
    return_counts: bool = False
    # With main_grad: the Parameter whose gradient goes into it, and that tensor.
    param: Optional[Tensor] = None
    main_grad: Optional[Tensor] = None


def _counts_of(topk_idx: Tensor, n_experts: int) -> Tensor:
    """[E] int32 token counts of the given selection (no host synchronisation)."""
    idx = topk_idx.reshape(-1).to(torch.int64)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=topk_idx.device)
    return counts.scatter_add_(0, idx, torch.ones(idx.shape, dtype=torch.int32,
                                                  device=idx.device))


def _weights_at(x: Tensor, weight: Tensor, topk_idx: Tensor, spec: _Spec, dtype: torch.dtype):
    """The forward at given experts, in plain PyTorch: logits of bf16-rounded x and weight in
    `dtype` (float32: the kernels' arithmetic; float64: the reference's), sigmoid, gathered at
    `topk_idx`, normalised, scaled. Returns ``(topk_weights, topk_scores, scores or None)``,
    all in `dtype`. The bias takes no part: it only selects."""
    xb = x.detach().to(torch.bfloat16).to(dtype)
    wb = weight.detach().to(torch.bfloat16).to(dtype)
    logits = xb @ wb.t()
    idx = topk_idx.to(torch.int64)
    topk_scores = torch.sigmoid(logits.gather(1, idx))
    weights = topk_scores
    if spec.norm_topk_prob:
        weights = topk_scores / (topk_scores.sum(-1, keepdim=True) + reference.NORM_EPS)
    weights = weights * reference._f32(spec.routed_scaling_factor)
    scores = torch.sigmoid(logits) if spec.return_scores else None
    return weights, topk_scores, scores


class _Route(torch.autograd.Function):
    """Routing (or the replay of given experts) whose backward is ``route_backward`` (the
    kernel, or the reference's formula), optionally adding ``grad_w`` into ``main_grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, topk_idx, spec: _Spec):
        E = weight.shape[0]
        scores = counts = None
        if topk_idx is None and spec.use_kernel:
            idx, weights, topk_scores, scores, counts = torch.ops.moe_routing.route_with_stats(
                x, weight, bias, spec.top_k, spec.n_group, spec.topk_group,
                spec.routed_scaling_factor, spec.norm_topk_prob, spec.precise,
                spec.return_scores, spec.return_counts)
            scores = scores if spec.return_scores else None
            counts = counts if spec.return_counts else None
        elif topk_idx is None:
            idx, weights, topk_scores, scores, counts = reference.route_with_stats(
                x, weight, bias, spec.top_k, spec.n_group, spec.topk_group,
                spec.routed_scaling_factor, spec.norm_topk_prob,
                return_scores=spec.return_scores, return_counts=spec.return_counts)
        else:
            idx = topk_idx
            dtype = torch.float32 if spec.use_kernel else torch.float64
            weights, topk_scores, scores = _weights_at(x, weight, idx, spec, dtype)
            counts = _counts_of(idx, E) if spec.return_counts else None
        if counts is not None:
            counts = counts.to(torch.int32)
        if scores is not None:
            scores = scores.to(torch.float32)
        ctx.save_for_backward(x, weight, idx, topk_scores)
        ctx.spec = spec
        weights = weights.to(torch.float32)
        topk_scores = topk_scores.to(torch.float32)
        ctx.mark_non_differentiable(
            *(t for t in (idx, topk_scores, scores, counts) if t is not None))
        return weights, idx, topk_scores, scores, counts

    @staticmethod
    def backward(ctx, grad_weights, _grad_idx, _grad_topk_scores, _grad_scores, _grad_counts):
        x, weight, idx, topk_scores = ctx.saved_tensors
        spec: _Spec = ctx.spec
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_weights is None or not (need_x or need_w):
            return None, None, None, None, None
        main_grad = spec.main_grad if need_w else None
        if spec.use_kernel:
            g = grad_weights
            if g.dtype not in (torch.float32, torch.bfloat16):
                g = g.to(torch.float32)
            grad_w_bf16 = weight.dtype == torch.bfloat16 and not spec.precise and main_grad is None
            grad_x, grad_w = torch.ops.moe_routing.route_backward(
                x, weight, idx, topk_scores, g.contiguous(), spec.n_group, spec.topk_group,
                spec.routed_scaling_factor, spec.norm_topk_prob, spec.precise, grad_w_bf16,
                main_grad)
        else:
            grad_x, grad_w = reference.route_backward(
                x, weight, idx, topk_scores, grad_weights, spec.routed_scaling_factor,
                spec.norm_topk_prob, grad_w_out=main_grad)
        grad_x = grad_x.to(x.dtype) if need_x else None
        if main_grad is not None:
            grad_w = _main_grad_done(spec.param, main_grad)
        elif need_w:
            grad_w = grad_w.to(weight.dtype)
        else:
            grad_w = None
        return grad_x, grad_w, None, None, None


def _main_grad_done(param: Tensor, main_grad: Tensor) -> Optional[Tensor]:
    """After grad_w went into ``main_grad``: Megatron's convention for the gradient returned
    for the parameter. Where the parameter has ``grad_added_to_main_grad`` (Megatron's
    distributed optimizer sets it), it becomes True and the gradient is a placeholder of the
    parameter's shape and dtype, left uninitialised (zeros with ``zero_out_wgrad``), which
    Megatron's gradient hook skips but which keeps the hooks on the main backward thread;
    without it, None."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
    return make(param.shape, dtype=param.dtype, device=param.device)


def main_grad_of(param: Tensor) -> Optional[Tensor]:
    """``param.main_grad`` where the gradient is to go there (the parameter has one and needs
    a gradient with grad mode on), checked: an fp32 tensor of the parameter's shape, dense, on
    its device (ValueError otherwise); else None."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None or not (torch.is_grad_enabled() and param.requires_grad):
        return None
    if not isinstance(main_grad, Tensor):
        raise ValueError(f"weight.main_grad must be a torch.Tensor, got "
                         f"{type(main_grad).__name__}")
    if main_grad.dtype != torch.float32:
        raise ValueError(f"weight.main_grad must be torch.float32 (the kernel adds grad_w in "
                         f"fp32), got {main_grad.dtype}")
    if main_grad.shape != param.shape:
        raise ValueError(f"weight.main_grad has shape {tuple(main_grad.shape)}, the weight "
                         f"{tuple(param.shape)}")
    if not main_grad.is_contiguous():
        raise ValueError("weight.main_grad must be contiguous")
    if main_grad.device != param.device:
        raise ValueError(f"weight.main_grad is on {main_grad.device}, the weight on "
                         f"{param.device}")
    return main_grad


def _route(x, weight, bias, topk_idx, spec: _Spec):
    """``(topk_weights f32, topk_idx, topk_scores f32, scores f32 or None, counts int32 or
    None)`` through :class:`_Route`."""
    return _Route.apply(x, weight, bias, topk_idx, spec)


# --------------------------------------------------------------------------------------------
# Routing replay


def check_topk_indices(topk_idx, tokens: int, top_k: int, n_experts: int, device: torch.device,
                  values: bool = True) -> None:
    """Checks replayed expert indices: a [tokens, top_k] int32 or int64 tensor on `device`
    and, with `values`, distinct indices in ``[0, n_experts)`` in each row (one host
    synchronisation). TypeError or ValueError naming ``topk_idx``."""
    if not isinstance(topk_idx, Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be torch.int32 or torch.int64, got {topk_idx.dtype}")
    if tuple(topk_idx.shape) != (tokens, top_k):
        raise ValueError(f"topk_idx must have shape [T, top_k] = [{tokens}, {top_k}], got "
                         f"{tuple(topk_idx.shape)}")
    if topk_idx.device != device:
        raise ValueError(f"topk_idx is on {topk_idx.device}, but x is on {device}")
    if not values or topk_idx.numel() == 0:
        return
    with torch.no_grad():
        out_of_range = (topk_idx < 0) | (topk_idx >= n_experts)
        ranked = topk_idx.sort(dim=1).values
        repeated = torch.zeros_like(out_of_range)
        repeated[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
        bad = (out_of_range | repeated).any(dim=1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"topk_idx must hold distinct expert indices in [0, {n_experts}) in each row; "
                f"row {row} holds {topk_idx[row].tolist()}")


def route_with_indices(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    topk_idx: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    precise_backward: bool = False,
    *,
    backend: str = "auto",
    check_indices: bool = True,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Routing replay: the routing weights of the experts in `topk_idx` (e.g. recorded at
    rollout) instead of selecting them, differentiable in `x` and `weight`, with the
    arguments and outputs of ``route``.

    The weights are those the forward gives at those experts: the sigmoid scores of the
    logits of bf16-rounded `x` and `weight` (fp32 arithmetic with the kernels, float64 with
    the reference), normalised over each row with `norm_topk_prob`, times
    `routed_scaling_factor`. `bias` only selects experts, so it does not enter them here; it
    is checked as ``route`` checks it. The forward is plain PyTorch (one [T, E] matrix
    product); the backward is ``route_backward``, as for ``route``.

    Args:
        topk_idx: [T, top_k] int32 or int64, on x's device: each row distinct experts in
            ``[0, E)``. With `check_indices` (default) their values are checked too, which
            synchronises with the GPU once: pass False inside CUDA graph capture.
        backend: ``"auto"`` (the kernels' backward for x on a Hopper GPU, the reference
            elsewhere), ``"cuda"`` (the kernels: x bf16 on a Hopper GPU, as ``route``
            requires) or ``"reference"``.

    Returns ``(topk_idx, topk_weights [T, K] f32, topk_scores [T, K] f32)``, `topk_idx` as
    given.
    """
    from .module import kernels_run_on  # (module imports this file)

    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    use_kernel = backend == "cuda" or (backend == "auto" and x.is_cuda and (
        torch.compiler.is_compiling() or kernels_run_on(x.device)))
    if use_kernel:
        # The checks (and messages) of route, whose backward this takes.
        ops._check_route(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor)
        ops._check_devices(x.device, weight=weight, bias=bias)
    else:
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"x must be [T, H] and weight [E, H], got shapes "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got "
                             f"{tuple(bias.shape)}")
        for name, t in (("weight", weight), ("bias", bias)):
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, but x is on {x.device}")
        ops.check_config(int(x.shape[1]), int(weight.shape[0]), top_k, n_group, topk_group,
                         routed_scaling_factor)
    check_topk_indices(topk_idx, int(x.shape[0]), top_k, int(weight.shape[0]), x.device,
                       values=check_indices)
    spec = _Spec(top_k, n_group, topk_group, float(routed_scaling_factor),
                 bool(norm_topk_prob), bool(precise_backward), use_kernel)
    weights, _, topk_scores, _, _ = _route(x, weight, bias, topk_idx.contiguous(), spec)
    return topk_idx, weights, topk_scores


__all__ = ["route_with_indices", "update_expert_bias", "check_topk_indices", "main_grad_of"]
