"""Pure-PyTorch reference of the router (any device, float64 by default), for tests and as
the module's fallback where there is no CUDA tensor.

Semantics (those of the kernels and of ``src/reference.rs``), per token:

* ``x`` and ``weight`` are rounded to bf16 (the kernels' inputs; gradients pass unrounded),
  then ``logits = x @ weight.T`` in ``dtype``, ``s = sigmoid(logits)``, ``choice = s + bias``;
* with ``n_group > 1`` the group score is the sum of the group's two best ``choice`` values;
  the ``topk_group`` best groups stay, experts of the other groups are no candidates;
* ``topk_idx`` are the ``top_k`` best candidates, best first; ``topk_scores = s[topk_idx]``;
  ``topk_weights = topk_scores / (sum(topk_scores) + 1e-20)`` if ``norm_topk_prob``, then
  ``* routed_scaling_factor``;
* ranking: larger is better, NaN ranks below every number (including -inf), ties (and NaN
  against NaN) go to the lower index, for groups and experts alike.

Gradients flow (through autograd) from ``topk_weights`` into ``x`` and ``weight`` only, never
through the selection; the bias gets none. ``route_with_stats`` also gives every expert's score
``s`` and the number of tokens routed to each expert; ``route_backward`` can add ``grad_w`` into
a given tensor, as the ops do.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

#: Added to the sum of the selected scores before normalising.
NORM_EPS = 1e-20
#: Relative distance under which two adjacent ranked values count as a near tie.
TIE_REL = 1e-5


def rank_order(values: Tensor, candidate: Optional[Tensor] = None) -> Tensor:
    """Permutation (int64) sorting the last dimension best-first.

    Order: candidates before non-candidates (if `candidate` is given), then non-NaN before
    NaN, then larger values first, then lower index first.
    """
    nan = torch.isnan(values)
    v = values.masked_fill(nan, float("-inf"))
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices
    keys = [nan.to(torch.uint8)]
    if candidate is not None:
        keys.append((~candidate).to(torch.uint8))
    for key in keys:  # stable passes: the last key is the most significant
        k = key.gather(-1, order)
        order = order.gather(-1, torch.sort(k, dim=-1, stable=True).indices)
    return order


def group_scores(choice: Tensor, n_group: int) -> Tensor:
    """[T, n_group]: the sum of the two best ``choice`` values of each group."""
    t, e = choice.shape
    g = choice.reshape(t, n_group, e // n_group)
    best2 = g.gather(-1, rank_order(g)[..., :2])
    return best2.sum(-1)


def candidates(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """[T, E] bool: the experts of the kept groups (all experts when ``n_group == 1``)."""
    t, e = choice.shape
    if n_group <= 1:
        return torch.ones_like(choice, dtype=torch.bool)
    kept = rank_order(group_scores(choice, n_group))[:, :topk_group]
    mask = torch.zeros((t, n_group), dtype=torch.bool, device=choice.device)
    mask.scatter_(1, kept, True)
    return mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)


def select_experts(choice: Tensor, top_k: int, n_group: int, topk_group: int) -> Tensor:
    """[T, K] int64: the chosen experts, best first."""
    cand = candidates(choice, n_group, topk_group)
    return rank_order(choice, cand)[:, :top_k]


def _is_near(a: Tensor, b: Tensor, rel: float) -> Tensor:
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), torch.full_like(a, 1e-30))
    return (a == b) | ((a - b).abs() < rel * scale)


def _adjacent_near(sorted_vals: Tensor, rel: float) -> Tensor:
    if sorted_vals.shape[-1] < 2:
        return torch.zeros(sorted_vals.shape[:-1], dtype=torch.bool, device=sorted_vals.device)
    return _is_near(sorted_vals[..., :-1], sorted_vals[..., 1:], rel).any(-1)


def near_ties(choice: Tensor, top_k: int, n_group: int, topk_group: int,
              rel: float = TIE_REL) -> Tensor:
    """[T] bool: tokens whose selection is within `rel` of a tie (as ``src/reference.rs``).

    True if, among the group scores sorted best-first, two adjacent of the first
    ``topk_group + 1`` are near (when groups are dropped), or if, among the candidates'
    ``choice`` sorted best-first, two adjacent of the first ``top_k + 1`` are near.
    """
    t, e = choice.shape
    near = torch.zeros(t, dtype=torch.bool, device=choice.device)
    if n_group > 1 and topk_group < n_group:
        gs = group_scores(choice, n_group)
        sorted_g = gs.gather(1, rank_order(gs))[:, : topk_group + 1]
        near |= _adjacent_near(sorted_g, rel)
    cand = candidates(choice, n_group, topk_group)
    n_cand = (e // n_group) * topk_group if n_group > 1 else e
    m = min(top_k + 1, n_cand)
    sorted_c = choice.gather(1, rank_order(choice, cand)[:, :m])
    near |= _adjacent_near(sorted_c, rel)
    return near


def route(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    *,
    dtype: torch.dtype = torch.float64,
    topk_idx: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference forward, differentiable in ``x`` and ``weight``.

    Returns ``(topk_idx int64 [T, K], topk_weights [T, K], topk_scores [T, K])`` in `dtype`.
    Given `topk_idx`, that selection is used instead of the computed one (to compare
    gradients on exactly the kernel's selection).
    """
    xb = _bf16_rounded(x, dtype)
    wb = _bf16_rounded(weight, dtype)
    logits = xb @ wb.t()
    s = torch.sigmoid(logits)
    if topk_idx is None:
        with torch.no_grad():
            choice = s.detach() + bias.to(torch.float32).to(dtype)
            topk_idx = select_experts(choice, top_k, n_group, topk_group)
    else:
        topk_idx = topk_idx.to(device=s.device, dtype=torch.int64)
    scores = s.gather(1, topk_idx)
    weights = scores
    if norm_topk_prob:
        weights = scores / (scores.sum(-1, keepdim=True) + NORM_EPS)
    weights = weights * _f32(routed_scaling_factor)
    return topk_idx, weights, scores


def expert_counts(topk_idx: Tensor, n_experts: int) -> Tensor:
    """[E] int64: how many tokens chose each expert (each row's indices are distinct)."""
    idx = topk_idx.reshape(-1).to(torch.int64)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=topk_idx.device)
    return counts.scatter_add_(0, idx, torch.ones_like(idx))


def route_with_stats(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    *,
    return_scores: bool = False,
    return_counts: bool = False,
    dtype: torch.dtype = torch.float64,
    topk_idx: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """:func:`route`, plus ``scores`` [T, E] (every expert's sigmoid score, no bias, in
    `dtype`, not differentiable) with `return_scores` and ``expert_counts`` [E] int64 with
    `return_counts` (None where not asked for), as ``moe_routing.route_with_stats``."""
    topk_idx, weights, topk_scores = route(x, weight, bias, top_k, n_group, topk_group,
                                           routed_scaling_factor, norm_topk_prob, dtype=dtype,
                                           topk_idx=topk_idx)
    scores = counts = None
    if return_scores:
        with torch.no_grad():
            scores = torch.sigmoid(_bf16_rounded(x, dtype) @ _bf16_rounded(weight, dtype).t())
    if return_counts:
        counts = expert_counts(topk_idx, weight.shape[0])
    return topk_idx, weights, topk_scores, scores, counts


def _bf16_rounded(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` rounded to bf16, in `dtype`; the gradient passes unrounded (straight through)."""
    td = t.to(dtype)
    return td + (t.detach().to(torch.bfloat16).to(dtype) - td.detach())


def choice_values(x: Tensor, weight: Tensor, bias: Tensor,
                  dtype: torch.dtype = torch.float64) -> Tensor:
    """[T, E]: ``sigmoid(x @ weight.T) + bias`` on bf16-rounded inputs, in `dtype`."""
    with torch.no_grad():
        xb = x.to(torch.bfloat16).to(dtype)
        wb = weight.to(torch.bfloat16).to(dtype)
        return torch.sigmoid(xb @ wb.t()) + bias.to(torch.float32).to(dtype)


def _f32(v: float) -> float:
    """`v` rounded to f32 (the C ABI passes the scale as a float)."""
    return float(torch.tensor(v, dtype=torch.float32).item())


def routing_grad(topk_scores: Tensor, grad_topk_weights: Tensor, routed_scaling_factor: float,
                 norm_topk_prob: bool, dtype: torch.dtype = torch.float64) -> Tensor:
    """[T, K]: the gradient of the logits at the chosen experts.

    With ``c = routed_scaling_factor``: if ``norm_topk_prob``, ``S = sum(s) + 1e-20``,
    ``dot = sum(g * s)``, ``grad_s = c * (g / S - dot / S**2)``, else ``grad_s = c * g``;
    then ``grad_logit = grad_s * s * (1 - s)``.
    """
    s = topk_scores.to(dtype)
    g = grad_topk_weights.to(dtype)
    c = _f32(routed_scaling_factor)
    if norm_topk_prob:
        total = s.sum(-1, keepdim=True) + NORM_EPS
        dot = (g * s).sum(-1, keepdim=True)
        grad_s = c * (g / total - dot / (total * total))
    else:
        grad_s = c * g
    return grad_s * s * (1 - s)


def route_backward(
    x: Tensor,
    weight: Tensor,
    topk_idx: Tensor,
    topk_scores: Tensor,
    grad_topk_weights: Tensor,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    dtype: torch.dtype = torch.float64,
    grad_w_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Reference backward from saved scores: ``(grad_x [T, H], grad_w [E, H])`` in `dtype`.

    ``G[t, topk_idx[t, k]] += routing_grad[t, k]``, ``grad_x = G @ w``, ``grad_w = G.T @ x``;
    indices outside ``[0, E)`` contribute nothing. With ``grad_w_out`` ([E, H] float32, as
    the op takes it), ``grad_w`` is added into it and the second output is an empty tensor,
    as ``moe_routing.route_backward`` does.
    """
    e = weight.shape[0]
    if grad_w_out is not None:
        want = (e, weight.shape[1])
        if not isinstance(grad_w_out, Tensor):
            raise TypeError(f"grad_w_out must be a torch.Tensor, got {type(grad_w_out).__name__}")
        if grad_w_out.dtype != torch.float32 or tuple(grad_w_out.shape) != want:
            raise ValueError(f"grad_w_out must be torch.float32 of shape {list(want)}, got "
                             f"{grad_w_out.dtype} of shape {tuple(grad_w_out.shape)}")
        if grad_w_out.device != x.device:
            raise ValueError(f"grad_w_out is on {grad_w_out.device}, but x is on {x.device}")
        grad_x, grad_w = route_backward(x, weight, topk_idx, topk_scores, grad_topk_weights,
                                        routed_scaling_factor, norm_topk_prob, dtype)
        with torch.no_grad():
            grad_w_out.add_(grad_w.to(torch.float32))
        return grad_x, grad_w_out.new_empty((0,))
    xb = x.to(torch.bfloat16).to(dtype)
    wb = weight.to(torch.bfloat16).to(dtype)
    gl = routing_grad(topk_scores, grad_topk_weights, routed_scaling_factor, norm_topk_prob, dtype)
    idx = topk_idx.to(torch.int64)
    valid = (idx >= 0) & (idx < e)
    gl = torch.where(valid, gl, torch.zeros_like(gl))
    dense = torch.zeros((x.shape[0], e), dtype=dtype, device=x.device)
    dense.scatter_add_(1, idx.clamp(0, e - 1), gl)
    return dense @ wb, dense.t() @ xb


def rel_err(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0 if both are equal, inf if `b` is zero and `a` not)."""
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    if torch.isnan(a).any():
        return float("inf")
    d = (a - b).norm().item()
    if d == 0.0:
        return 0.0
    n = b.norm().item()
    return d / n if n > 0 else float("inf")


__all__ = [
    "route",
    "route_with_stats",
    "route_backward",
    "expert_counts",
    "routing_grad",
    "select_experts",
    "candidates",
    "group_scores",
    "rank_order",
    "near_ties",
    "choice_values",
    "rel_err",
]
