"""``GroupedTopKRouter``: a drop-in for HF transformers' grouped top-k ("noaux_tc") routers
(``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``, ``Glm4MoeLiteTopkRouter``,
``Dots1TopkRouter`` and the same router in other models) that routes with the CUDA kernels,
and :func:`replace_hf_routers`, which finds those routers in a model by what they are (their
parameters, buffer, hyper-parameters and routing) rather than by class name."""

import functools
import logging
import math
import warnings
from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor, nn

from . import ops, reference, training

logger = logging.getLogger("moe_routing")

_BACKENDS = ("auto", "cuda", "reference")

#: Where HF routers keep their hyper-parameters, by GroupedTopKRouter config name: the
#: attribute names, then the names in the router's ``config``, first found wins (transformers
#: 5.x routers hold attributes, 4.x ones both attributes and a ``config``; an HF config's
#: ``top_k`` is a generation setting).
_HF_HPARAMS = {
    "num_experts_per_tok": (("top_k", "num_experts_per_tok"), ("num_experts_per_tok",)),
    "n_group": (("num_group", "n_group"), ("n_group", "num_group")),
    "topk_group": (("topk_group",), ("topk_group",)),
    "norm_topk_prob": (("norm_topk_prob",), ("norm_topk_prob",)),
    "routed_scaling_factor": (("routed_scaling_factor",), ("routed_scaling_factor",)),
}

#: The nn.Module attributes holding forward hooks and pre-hooks, which
#: :func:`replace_hf_routers` moves from each replaced router to its replacement.
_FORWARD_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)

#: Tokens of the probe that checks an HF router's routing before it is replaced.
_PROBE_TOKENS = 32


def _cfg(config, name: str, default=None):
    v = getattr(config, name, None)
    if v is None:
        if default is None:
            raise ValueError(f"the config has no `{name}`")
        return default
    return v


class GroupedTopKRouter(nn.Module):
    """Grouped top-k ("noaux_tc") MoE router with the interface of transformers 5.x's
    ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` (checked against transformers 5.25),
    which ``Glm4MoeLiteTopkRouter``, ``Dots1TopkRouter`` and others share.

    Args:
        config: an HF config (``DeepseekV3Config``, ``Glm4MoeConfig``, or any object) with
            ``hidden_size``, ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``,
            ``topk_group``, ``routed_scaling_factor`` and ``norm_topk_prob`` (``n_group`` and
            ``topk_group`` of None mean 1; ``initializer_range`` is used by
            :meth:`reset_parameters` if present).
        backend: ``"auto"`` (the CUDA kernels for inputs on a Hopper GPU,
            :mod:`moe_routing.reference` otherwise, with a one-time RuntimeWarning on another
            GPU), ``"cuda"`` (the kernels; other devices and GPUs raise ValueError) or
            ``"reference"`` (always the pure-PyTorch float64 reference).
        compute_router_logits: HF's router also returns the fp32 ``router_logits`` [T, E]
            (``x @ weight.T`` in fp32), which its MoE blocks discard and transformers' output
            recorder collects (``output_router_logits=True``). The kernels do not materialize
            them; with False (default) the first output is None, with True they are computed
            as HF does (an extra fp32 matrix product, differentiable), with None only while
            the module has a forward hook (transformers' recorder reads them through one;
            :func:`replace_hf_routers` uses None).
        precise_backward: fp32-accurate ``grad_w`` (a second pass over x).
        accumulate_grad_into_main_grad: Megatron-style gradient accumulation fusion. When
            True and ``weight`` has a ``main_grad`` attribute (an fp32 tensor of its shape, as
            Megatron's DDP attaches), the backward adds ``grad_w`` into ``weight.main_grad``
            in the kernel itself (no temporary, no extra kernel), sets
            ``weight.grad_added_to_main_grad = True`` where that attribute exists and then
            gives the weight a placeholder gradient that Megatron's hook skips (else None).
            A ``main_grad`` that is not fp32 [E, H] raises ValueError. Without ``main_grad``
            the gradient goes to ``weight.grad`` as usual.
        track_expert_counts: each forward also counts the tokens routed to each expert (the
            same kernel call): ``last_expert_counts`` [E] int32, and, in training mode with
            grad enabled, their sum since the last :meth:`update_expert_bias` in the
            non-persistent buffer ``tokens_per_expert`` [E] int64.
        keep_scores: each forward also keeps every expert's sigmoid score (no bias) as
            ``last_scores`` [T, E] fp32 (same kernel call; not differentiable).

    Parameters and buffers are those of HF: ``weight`` [E, H] (Parameter, fp32) and
    ``e_score_correction_bias`` [E] (buffer, fp32), so HF state dicts load as they are.

    Routing replay: ``forward(hidden_states, topk_indices=idx)``, or the attribute
    ``replay_indices`` set to a [T, K] tensor (used by every forward until set back to None),
    routes to the given experts instead of selecting them (see
    :func:`moe_routing.route_with_indices`; their values are checked once per call, which
    synchronises with the GPU).

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
        compute_router_logits: Optional[bool] = False,
        precise_backward: bool = False,
        accumulate_grad_into_main_grad: bool = False,
        track_expert_counts: bool = False,
        keep_scores: bool = False,
        device=None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        for name, flag in (("accumulate_grad_into_main_grad", accumulate_grad_into_main_grad),
                           ("track_expert_counts", track_expert_counts),
                           ("keep_scores", keep_scores)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if compute_router_logits not in (True, False, None):
            raise ValueError(
                f"compute_router_logits must be True, False or None, got {compute_router_logits!r}"
            )
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
        if backend != "reference":
            _log_kernel_paths(self.hidden_dim, self.num_experts, self.top_k, self.num_group,
                              self.topk_group, self.routed_scaling_factor, self.norm_topk_prob)
        self.compute_router_logits = compute_router_logits
        self.precise_backward = precise_backward
        self.accumulate_grad_into_main_grad = accumulate_grad_into_main_grad
        self.track_expert_counts = track_expert_counts
        self.keep_scores = keep_scores
        self.replay_indices: Optional[Tensor] = None
        self.last_expert_counts: Optional[Tensor] = None
        self.last_scores: Optional[Tensor] = None
        dtype = dtype or torch.float32
        self.weight = nn.Parameter(
            torch.empty((self.num_experts, self.hidden_dim), device=device, dtype=dtype)
        )
        self.register_buffer(
            "e_score_correction_bias",
            torch.zeros(self.num_experts, device=device, dtype=torch.float32),
        )
        if track_expert_counts:
            self.register_buffer(
                "tokens_per_expert",
                torch.zeros(self.num_experts, device=device, dtype=torch.int64),
                persistent=False,
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
        """A router with the hyper-parameters, parameters, device, dtypes, ``requires_grad``
        and training mode of an HF router (or any module with its structure: a Parameter
        ``weight`` [E, H], a buffer ``e_score_correction_bias`` [E], nothing else, and the
        hyper-parameters as attributes, ``top_k`` or ``num_experts_per_tok``, ``num_group``
        or ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``, or in
        its ``config``). Raises ValueError naming what the module lacks. Its ``forward`` has
        the 5.x interface; :func:`replace_hf_routers` also keeps the HF class's."""
        config = _hf_router_config(router)
        weight = router.weight
        new = cls(config, device=weight.device, dtype=weight.dtype, **kwargs)
        new.load_state_dict(router.state_dict())
        new.weight.requires_grad_(weight.requires_grad)
        return new.train(router.training)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_dim}, experts={self.num_experts}, top_k={self.top_k}, "
            f"n_group={self.num_group}, topk_group={self.topk_group}, "
            f"scale={self.routed_scaling_factor}, norm={self.norm_topk_prob}, "
            f"backend={self.backend!r}"
        )

    def _use_kernel(self, hidden_states: Tensor) -> bool:
        return _use_kernel(self.backend, hidden_states)

    def _tokens(self, hidden_states: Tensor) -> Tensor:
        """`hidden_states` as [T, H]."""
        if hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(
                f"hidden_states must end in hidden_size {self.hidden_dim}, "
                f"got shape {tuple(hidden_states.shape)}"
            )
        return hidden_states.reshape(-1, self.hidden_dim)

    def update_expert_bias(self, rate: float, group=None) -> Tensor:
        """The loss-free balancing step (:func:`moe_routing.update_expert_bias`) on
        ``e_score_correction_bias`` from ``tokens_per_expert`` (summed over `group` if given),
        which is then reset to zero. Needs ``track_expert_counts=True``. Returns the bias."""
        if not self.track_expert_counts:
            raise ValueError("update_expert_bias needs a router built with "
                             "track_expert_counts=True")
        training.update_expert_bias(self.tokens_per_expert, self.e_score_correction_bias, rate,
                                    group)
        self.tokens_per_expert.zero_()
        return self.e_score_correction_bias

    def _record(self, scores: Optional[Tensor], counts: Optional[Tensor]) -> None:
        if self.keep_scores:
            self.last_scores = scores
        if self.track_expert_counts:
            self.last_expert_counts = counts
            if self.training and torch.is_grad_enabled():
                with torch.no_grad():
                    self.tokens_per_expert.add_(counts)

    def _route(self, hidden_states: Tensor, topk_indices: Optional[Tensor] = None):
        """``(topk_weights [T, K] fp32, topk_indices [T, K] int64)`` of [T, H] tokens."""
        if topk_indices is None:
            topk_indices = self.replay_indices
        topk_weights, topk_indices, scores, counts = _route_tokens(
            hidden_states, self.weight, self.e_score_correction_bias, self.top_k,
            self.num_group, self.topk_group, self.routed_scaling_factor, self.norm_topk_prob,
            use_kernel=self._use_kernel(hidden_states), precise=self.precise_backward,
            topk_indices=topk_indices, main_grad=self.accumulate_grad_into_main_grad,
            return_scores=self.keep_scores, return_counts=self.track_expert_counts)
        if self.keep_scores or self.track_expert_counts:
            self._record(scores, counts)
        return topk_weights, topk_indices

    def forward(self, hidden_states: Tensor, topk_indices: Optional[Tensor] = None):
        hidden_states = self._tokens(hidden_states)
        topk_weights, topk_indices = self._route(hidden_states, topk_indices)
        wanted = self.compute_router_logits
        if wanted is None:
            wanted = bool(self._forward_hooks)
        router_logits = None
        if wanted:
            router_logits = nn.functional.linear(
                hidden_states.to(torch.float32), self.weight.to(torch.float32)
            )
        return router_logits, topk_weights, topk_indices


def _use_kernel(backend: str, hidden_states: Tensor) -> bool:
    """Whether `backend` ("auto", "cuda" or "reference") routes `hidden_states` with the
    kernels; "cuda" on a GPU other than Hopper raises ValueError."""
    if backend == "reference":
        return False
    # (The GPU is checked in eager calls; a compiled graph takes the kernels as before.)
    checked = hidden_states.is_cuda and not torch.compiler.is_compiling()
    if backend == "cuda":
        if checked and not kernels_run_on(hidden_states.device):
            raise ValueError(
                f"backend='cuda' needs a Hopper GPU (sm_90), but {hidden_states.device} is "
                f"{_device_text(hidden_states.device)}; use backend='auto' or 'reference'"
            )
        return True  # the op raises ValueError for other devices
    return hidden_states.is_cuda and (not checked or kernels_run_on(hidden_states.device))


def _route_tokens(hidden_states: Tensor, weight: Tensor, bias: Tensor, top_k: int,
                  n_group: int, topk_group: int, routed_scaling_factor: float,
                  norm_topk_prob: bool, *, use_kernel: bool, precise: bool = False,
                  topk_indices: Optional[Tensor] = None, main_grad: bool = False,
                  return_scores: bool = False, return_counts: bool = False):
    """The routing of the module and the adapters: [T, H] tokens by `weight` (the Parameter)
    and `bias`, with the kernels or the reference. With `topk_indices`, the replay of those
    experts; with `main_grad`, grad_w goes into ``weight.main_grad`` where it has one. Returns
    ``(topk_weights [T, K] fp32, topk_indices [T, K] int64, scores [T, E] fp32 or None,
    expert_counts [E] int32 or None)``."""
    bias = bias.to(torch.float32)
    grad_into = training.main_grad_of(weight) if main_grad else None
    w = weight
    if use_kernel and w.dtype not in (torch.bfloat16, torch.float32):
        w = w.to(torch.float32)
    if topk_indices is not None or grad_into is not None:
        # Replay and/or main_grad accumulation: moe_routing.training's autograd.
        if topk_indices is not None:
            training.check_topk_indices(
                topk_indices, hidden_states.shape[0], top_k, weight.shape[0],
                hidden_states.device, values=not torch.compiler.is_compiling())
            topk_indices = topk_indices.contiguous()
        x = hidden_states.to(torch.bfloat16).contiguous() if use_kernel else hidden_states
        spec = training._Spec(
            top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, precise,
            use_kernel, return_scores=return_scores, return_counts=return_counts,
            param=weight if grad_into is not None else None, main_grad=grad_into)
        topk_weights, idx, _, scores, counts = training._route(
            x, w.contiguous() if use_kernel else w, bias.contiguous(), topk_indices, spec)
        return topk_weights, idx.to(torch.int64), scores, counts
    stats = return_scores or return_counts
    if use_kernel:
        x = hidden_states.to(torch.bfloat16).contiguous()
        args = (x, w.contiguous(), bias.contiguous(), top_k, n_group, topk_group,
                routed_scaling_factor, norm_topk_prob, precise)
        # (int64 indices from the kernel itself: no conversion after it.)
        if not stats:
            topk_idx, topk_weights, _ = torch.ops.moe_routing.route(*args, True)
            return topk_weights, topk_idx, None, None
        topk_idx, topk_weights, _, scores, counts = torch.ops.moe_routing.route_with_stats(
            *args, return_scores, return_counts, True)
        return (topk_weights, topk_idx, scores if return_scores else None,
                counts if return_counts else None)
    topk_idx, topk_weights, _, scores, counts = reference.route_with_stats(
        hidden_states, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
        norm_topk_prob, return_scores=return_scores, return_counts=return_counts)
    return (topk_weights.to(torch.float32), topk_idx,
            None if scores is None else scores.to(torch.float32),
            None if counts is None else counts.to(torch.int32))


@functools.lru_cache(maxsize=None)
def _log_kernel_paths(*config) -> None:
    """Says once per config, on the ``moe_routing`` logger, which kernels it takes: INFO for
    the fused ones, WARNING where either pass takes the slower simple (unfused) kernels. Says
    nothing where the library is not there (CPU-only use)."""
    from . import _lib

    h, e, k, n_group, topk_group = config[:5]
    try:
        paths = ops.kernel_paths(h, e, k, n_group, topk_group)
    except (_lib.LibraryError, _lib.MoeRoutingError, OSError, ValueError):
        return
    fwd, bwd = paths["forward"], paths["backward"]
    text = (f"H={h}, E={e}, top-{k}, groups {topk_group} of {n_group}: forward {fwd}, "
            f"backward {bwd}")
    if fwd == bwd == "fused":
        logger.info("moe_routing: %s", text)
    else:
        logger.warning("moe_routing: %s; the simple (unfused) kernels are far slower than the "
                       "fused ones (the README's supported shapes)", text)


def _device_text(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


@functools.lru_cache(maxsize=None)
def _kernels_run_on_index(index: int) -> bool:
    ok = torch.cuda.get_device_capability(index) == (9, 0)
    if not ok:
        warnings.warn(
            f"moe_routing: cuda:{index} is {_device_text(torch.device('cuda', index))}, not a "
            f"Hopper GPU (sm_90a), for which the kernels are built; GroupedTopKRouter with "
            f"backend='auto' routes with the PyTorch reference there",
            RuntimeWarning,
            stacklevel=4,
        )
    return ok


def kernels_run_on(device: torch.device) -> bool:
    """Whether the CUDA kernels run on `device`: a Hopper GPU (compute capability 9.0),
    asked once per device; the first ``False`` also warns (RuntimeWarning) that
    ``backend="auto"`` routes with the reference there."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernels_run_on_index(index)


def _hf_hparam(router: nn.Module, key: str):
    """``(found, value)`` of hyper-parameter `key` (see ``_HF_HPARAMS``) of `router`."""
    attr_names, config_names = _HF_HPARAMS[key]
    for source, names in ((router, attr_names), (getattr(router, "config", None), config_names)):
        for name in names:
            if source is not None and hasattr(source, name):
                return True, getattr(source, name)
    return False, None


def _hf_router_config(router: nn.Module) -> SimpleNamespace:
    """The GroupedTopKRouter config of a module built like an HF grouped top-k router;
    ValueError naming what it lacks."""
    params = dict(router.named_parameters(recurse=False))
    buffers = {n: b for n, b in router.named_buffers(recurse=False) if b is not None}
    weight = params.get("weight")
    if weight is None or weight.dim() != 2:
        raise ValueError("no Parameter `weight` [E, H]")
    e, h = weight.shape
    bias = buffers.get("e_score_correction_bias")
    if bias is None:
        where = "a Parameter" if "e_score_correction_bias" in params else "missing"
        raise ValueError(f"buffer `e_score_correction_bias` is {where}")
    if tuple(bias.shape) != (e,):
        raise ValueError(
            f"`e_score_correction_bias` has shape {tuple(bias.shape)}, `weight` {e} experts"
        )
    extra = sorted(set(params) - {"weight"}) + sorted(set(buffers) - {"e_score_correction_bias"})
    extra += [n for n, _ in router.named_children()]
    if extra:
        raise ValueError(f"it also holds {', '.join(extra)}, which a GroupedTopKRouter lacks")
    values, missing = {}, []
    for key in _HF_HPARAMS:
        found, values[key] = _hf_hparam(router, key)
        if not found:
            missing.append("/".join(_HF_HPARAMS[key][0]))
    if missing:
        raise ValueError(f"no {', '.join(missing)} (attribute or config)")
    config = SimpleNamespace(hidden_size=h, n_routed_experts=e, **values)
    init_range = getattr(getattr(router, "config", None), "initializer_range", None)
    if init_range is not None:
        config.initializer_range = init_range
    return config


def _probe(router: nn.Module, ours: GroupedTopKRouter) -> bool:
    """Checks that `router` routes as `ours` (up to near ties and fp32 rounding) by running
    its own forward on random bf16-exact tokens, weight and bias (substituted for its tensors
    through ``torch.func.functional_call``, on the CPU) against :func:`reference.route`.
    Returns True for the 5.x interface ``(router_logits, topk_weights, topk_indices)``, False
    for 4.x's ``(topk_indices, topk_weights)``; raises ValueError otherwise. The bias is
    positive, as HF's 4.x routers (and some 5.x ones) give dropped groups' experts a biased
    score of 0, not -inf: they differ from the others only where fewer than top_k candidates
    of the kept groups score above 0."""
    e, h, k = ours.num_experts, ours.hidden_dim, ours.top_k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, _PROBE_TOKENS, h, generator=g).bfloat16().float()
    w = (torch.randn(e, h, generator=g) / math.sqrt(h)).bfloat16().float()
    bias = torch.rand(e, generator=g) * 0.5
    try:
        with torch.no_grad():
            out = torch.func.functional_call(
                router, {"weight": w, "e_score_correction_bias": bias}, (x,)
            )
    except Exception as err:  # any failure of third-party code means: not this router
        raise ValueError(f"its forward fails on a probe ({type(err).__name__}: {err})") from err
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        what = f"a {type(out).__name__}"
        if isinstance(out, Tensor):
            what = f"one tensor of shape {tuple(out.shape)} (a gate whose MoE block routes)"
        raise ValueError(f"its forward returns {what}, not the routing")
    returns_logits = len(out) == 3
    logits, weights, indices = out if returns_logits else (None,) + out[::-1]
    if not (isinstance(indices, Tensor) and isinstance(weights, Tensor)
            and not indices.is_floating_point() and weights.is_floating_point()
            and indices.shape == weights.shape == (_PROBE_TOKENS, k)):
        raise ValueError("its forward does not return [T, top_k] indices and weights")
    x = x.reshape(-1, h)
    n_group, topk_group = ours.num_group, ours.topk_group
    ref_idx, ref_w, _ = reference.route(x, w, bias, k, n_group, topk_group,
                                        ours.routed_scaling_factor, ours.norm_topk_prob)
    ok = ~reference.near_ties(reference.choice_values(x, w, bias), k, n_group, topk_group)
    idx, pos = indices.long().sort(-1)
    ref_idx, ref_pos = ref_idx.sort(-1)
    same = (
        int(ok.sum()) >= _PROBE_TOKENS // 2
        and torch.equal(idx[ok], ref_idx[ok])
        and torch.allclose(weights.gather(1, pos)[ok].double(), ref_w.gather(1, ref_pos)[ok],
                           rtol=1e-4, atol=1e-6)
    )
    if same and logits is not None:
        same = torch.allclose(logits.double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-5)
    if not same:
        raise ValueError("it routes differently (another scoring, selection or scaling)")
    return returns_logits


def _forward_indices_first(self, hidden_states: Tensor, topk_indices: Optional[Tensor] = None):
    """transformers 4.x's router interface: ``(topk_indices, topk_weights)``."""
    topk_weights, topk_indices = self._route(self._tokens(hidden_states), topk_indices)
    return topk_indices, topk_weights


def _reduce_drop_in(self, protocol):
    # The class is made at run time: pickle the instance as what its class is made from.
    cls = type(self)
    return _new_drop_in, (cls._hf_class, cls._hf_returns_logits), self.__dict__


def _new_drop_in(hf_class: type, returns_logits: bool) -> GroupedTopKRouter:
    cls = _drop_in_class(hf_class, returns_logits)
    return cls.__new__(cls)


_DROP_IN_CLASSES = {}


def _drop_in_class(hf_class: type, returns_logits: bool) -> type:
    """The subclass of both GroupedTopKRouter and `hf_class` that replaces `hf_class`'s
    instances: what matches HF's router class (``isinstance``, as transformers' output
    recorder and weight initialization do) matches it too, and its forward keeps
    `hf_class`'s interface (4.x's when not `returns_logits`)."""
    key = (hf_class, returns_logits)
    cls = _DROP_IN_CLASSES.get(key)
    if cls is None:
        body = {
            "__module__": __name__,
            "__doc__": f"GroupedTopKRouter in place of {hf_class.__qualname__}.",
            "__reduce_ex__": _reduce_drop_in,
            "_hf_class": hf_class,
            "_hf_returns_logits": returns_logits,
        }
        if not returns_logits:
            body["forward"] = _forward_indices_first
        cls = type(f"GroupedTopKRouter_{hf_class.__name__}", (GroupedTopKRouter, hf_class), body)
        _DROP_IN_CLASSES[key] = cls
    return cls


def _looks_like_router(module: nn.Module) -> bool:
    """Whether `module` has some of a router's features (the bias, or a Parameter ``weight``
    and a top-k), so that not replacing it is worth a log line."""
    if isinstance(module, GroupedTopKRouter):
        return False
    if hasattr(module, "e_score_correction_bias"):
        return True
    return isinstance(getattr(module, "weight", None), nn.Parameter) and _hf_hparam(
        module, "num_experts_per_tok")[0]


def _replacement(router: nn.Module, probes: dict, kwargs: dict) -> GroupedTopKRouter:
    """The drop-in replacing `router`, with its forward hooks; ValueError saying why there is
    none. `probes` caches the result of :func:`_probe` (the interface, or the reason it
    failed) by class and config."""
    new = GroupedTopKRouter.from_hf(router, **kwargs)
    key = (type(router), new.hidden_dim, new.num_experts, new.top_k, new.num_group,
           new.topk_group, new.routed_scaling_factor, new.norm_topk_prob)
    if key not in probes:
        try:
            probes[key] = _probe(router, new)
        except ValueError as err:
            probes[key] = str(err)
    if isinstance(probes[key], str):
        raise ValueError(probes[key])
    # Swapping the class of an instance, as torch.nn.utils.parametrize does.
    new.__class__ = _drop_in_class(type(router), probes[key])
    for hooks in _FORWARD_HOOKS:
        setattr(new, hooks, getattr(router, hooks))
    return new


def replace_hf_routers(model: nn.Module, **kwargs) -> int:
    """Replaces every grouped top-k router in `model` (transformers' ``DeepseekV3TopkRouter``,
    ``Glm4MoeTopkRouter``, ``Glm4MoeLiteTopkRouter``, ``Dots1TopkRouter`` and the same router
    under other names) by a :class:`GroupedTopKRouter` with the same hyper-parameters,
    parameters, device, dtypes and training mode. Returns the number replaced.

    A module is replaced for what it is, whatever its class name: a Parameter ``weight``
    [E, H], a buffer ``e_score_correction_bias`` [E] and nothing else, the hyper-parameters
    as attributes or in its ``config`` (see :meth:`GroupedTopKRouter.from_hf`), a config the
    kernels support, and a forward that routes as GroupedTopKRouter does (sigmoid scores,
    + bias for the selection, groups ranked by the sum of their two best biased scores,
    weights gathered from the unbiased scores, optional normalisation, times
    ``routed_scaling_factor``), checked once per class and config on random weights. (The
    routers of transformers 4.x and AXK2 give the experts of dropped groups a biased score of
    0 rather than excluding them: they differ only where fewer than top_k experts of the kept
    groups score above 0.) Modules with some of these features and not all (another scoring
    function, no bias, no groups, the bias held by the MoE block, gates that return only
    logits as in transformers 5.0 to 5.12, whose MoE blocks route) stay as they are, logged
    as warnings (or debug messages for modules without both ``weight`` and the bias) on the
    ``moe_routing`` logger.

    Each replacement is an instance of a subclass of both GroupedTopKRouter and the replaced
    class, so that transformers' output recorder, which hooks modules by ``isinstance`` of
    the router class, records it; its forward keeps the replaced class's interface (5.x:
    ``(router_logits, topk_weights, topk_indices)``, 4.x: ``(topk_indices, topk_weights)``).
    Forward hooks and pre-hooks of the replaced router move to its replacement. `kwargs` go
    to GroupedTopKRouter, ``compute_router_logits`` being None unless given: ``router_logits``
    are computed while the router has a forward hook. The recorder installs its hooks on the
    first call with ``output_router_logits=True`` and keeps them, so calls before it skip the
    extra fp32 matrix product and calls after it pay for it. A router shared by several
    parents stays shared."""
    kwargs.setdefault("compute_router_logits", None)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _looks_like_router(child)
    ]
    replaced, probes, skipped = {}, {}, {}
    for parent, name, child in targets:
        new = replaced.get(id(child))
        if new is None:
            try:
                new = replaced[id(child)] = _replacement(child, probes, kwargs)
            except ValueError as err:
                key = (type(child).__name__, str(err))
                router_like = isinstance(getattr(child, "weight", None), nn.Parameter) and hasattr(
                    child, "e_score_correction_bias")
                count, _ = skipped.get(key, (0, router_like))
                skipped[key] = (count + 1, router_like)
                continue
        setattr(parent, name, new)
    for (cls_name, reason), (count, router_like) in skipped.items():
        level = logging.WARNING if router_like else logging.DEBUG
        logger.log(level, "replace_hf_routers: %d %s not replaced: %s", count, cls_name, reason)
    if replaced:
        logger.debug("replace_hf_routers: %d routers replaced", len(replaced))
    return len(replaced)
