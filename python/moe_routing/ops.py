"""The router as PyTorch ops: ``torch.ops.moe_routing.route``,
``torch.ops.moe_routing.route_with_stats`` and ``torch.ops.moe_routing.route_backward``.

Both run the library's CUDA kernels on the current CUDA stream of the input's device, have
fake (meta) implementations, so ``torch.compile`` traces them without a graph break, and
allocate everything they use through PyTorch's allocator (CUDA graph capture works). ``route``
is differentiable in ``x`` and ``weight``: its backward is ``route_backward``, which reads
PyTorch's dtypes as they are (int64 or int32 indices, bf16 or f32 scores and gradients) and
writes ``grad_w`` as bf16 where asked: no conversion kernel runs around it, or adds ``grad_w``
into a given fp32 tensor (``grad_w_out``, e.g. Megatron's ``main_grad``). Its workspace is
allocated and zeroed once per (device, stream) and reused (the library leaves it zeroed).
``route_with_stats`` is ``route`` that can also return every expert's sigmoid score and the
token count of each expert, filled in by the same kernel call.

The ops have two implementations, with the same schemas, checks and results; :data:`BACKEND`
says which one is registered:

* ``"native"``: the op library ``libmoe_routing_torch.so`` (``csrc/torch_ops.cpp``), whose ops
  are registered from C++, so that a call goes from the dispatcher to the library's C ABI with
  no Python in between (route's autograd and both fake implementations are this module's). It
  is looked for at ``$MOE_ROUTING_TORCH_LIB``, else ``moe_routing/lib/libmoe_routing_torch.so``,
  and works with the torch build it was compiled against only (``csrc/build.sh``, or the
  ``MOE_ROUTING_TORCH_OP`` option of the CMake build). Loading it loads ``libmoe_routing.so``
  (:func:`moe_routing._lib.load`) at import, so that both bind to the same, checked library.
* ``"ctypes"``: Python custom ops (``torch.library.custom_op``) that check their inputs in
  Python and call the C ABI through ctypes, at a far higher host cost per call.

The native ops are used where their library is present and loads; one that is present but
fails to load (another torch build) gives a warning and the ctypes ops.
``MOE_ROUTING_TORCH_OP=0`` in the environment forces the ctypes ops, ``MOE_ROUTING_TORCH_OP=1``
makes a missing or unloadable native library an error.

Inputs are checked before any call into the library: a wrong device, dtype, layout, shape or
config raises ``ValueError``; a non-zero status from the library raises
:class:`moe_routing.MoeRoutingError` (a ``RuntimeError``) with the library's text, or, from the
native ops, a ``RuntimeError`` with the same text.
"""

import ctypes
import os
import threading
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import _lib

# Limits of the kernels (cpp/include/moe_routing/router.h).
MAX_HIDDEN = 65536
MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_TOKENS = 2**31 - 1


# --------------------------------------------------------------------------------------------
# The native ops' library

NATIVE_LIB_NAME = "libmoe_routing_torch.so"
NATIVE_LIB_ENV_VAR = "MOE_ROUTING_TORCH_LIB"
MODE_ENV_VAR = "MOE_ROUTING_TORCH_OP"


def native_library_candidates() -> List[Path]:
    """Where the native op library is looked for: ``$MOE_ROUTING_TORCH_LIB`` if set, else the
    package's ``lib/libmoe_routing_torch.so``."""
    env = os.environ.get(NATIVE_LIB_ENV_VAR)
    if env:
        return [Path(env)]
    return [Path(__file__).resolve().parent / "lib" / NATIVE_LIB_NAME]


def native_library_path() -> Optional[Path]:
    """The native op library in use (``BACKEND == "native"``), else None."""
    return _native_path


def _load_native() -> Optional[Path]:
    mode = os.environ.get(MODE_ENV_VAR, "").strip()
    if mode == "0":
        return None
    path = next((p for p in native_library_candidates() if p.is_file()), None)
    if path is None:
        if mode == "1":
            tried = ", ".join(str(p) for p in native_library_candidates())
            raise ImportError(
                f"{MODE_ENV_VAR}=1, but there is no {NATIVE_LIB_NAME} (tried {tried})")
        return None
    try:
        # The library the ctypes bindings find and check first: the op library needs it by
        # soname (libmoe_routing.so.1; in the wheel libmoe_routing.so, which its run path also
        # finds beside it), so it binds to that one wherever it lies.
        _lib.load()
        torch.ops.load_library(str(path))
    except Exception as e:
        if mode == "1":
            raise
        warnings.warn(
            f"moe_routing: the native ops {path} do not load ({e}); using the ctypes ops "
            f"(rebuild them for this torch, or set {MODE_ENV_VAR}=0)",
            RuntimeWarning,
        )
        return None
    return path


_native_path = _load_native()

#: Which implementation of the ops is registered: ``"native"`` or ``"ctypes"``.
BACKEND = "native" if _native_path is not None else "ctypes"


class _NativeWorkspaces:
    """The native ops' workspace cache, read-only, as ``_workspaces`` is the ctypes ops':
    (device index, stream handle) -> the zeroed uint8 workspace tensor."""

    def get(self, key, default=None):
        device, stream = key
        ws = torch.ops.moe_routing._cached_workspace(int(device), int(stream))
        return default if ws is None else ws

    def __getitem__(self, key):
        ws = self.get(key)
        if ws is None:
            raise KeyError(key)
        return ws

    def __contains__(self, key) -> bool:
        return self.get(key) is not None


# --------------------------------------------------------------------------------------------
# Checks (the ctypes ops' and the fake implementations'; the native ops make the same in C++)


def check_config(
    hidden_size: int,
    n_routed_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> None:
    """Raises ValueError with the reason if the router config is not supported."""
    H, E, K = hidden_size, n_routed_experts, top_k
    if H <= 0 or H % 8 != 0 or H > MAX_HIDDEN:
        raise ValueError(
            f"hidden_size must be a positive multiple of 8 up to {MAX_HIDDEN}, got {H}"
        )
    if E <= 0 or E > MAX_EXPERTS:
        raise ValueError(f"n_routed_experts must be in 1..{MAX_EXPERTS}, got {E}")
    if K <= 0 or K > MAX_TOP_K:
        raise ValueError(f"num_experts_per_tok (top_k) must be in 1..{MAX_TOP_K}, got {K}")
    if n_group <= 0 or E % n_group != 0:
        raise ValueError(f"n_group ({n_group}) must be positive and divide n_routed_experts ({E})")
    if topk_group <= 0 or topk_group > n_group:
        raise ValueError(f"topk_group must be in 1..n_group ({n_group}), got {topk_group}")
    per_group = E // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError(
            f"groups need at least 2 experts (the group score is the sum of the two best), "
            f"got {E} experts in {n_group} groups"
        )
    if K > topk_group * per_group:
        raise ValueError(
            f"num_experts_per_tok ({K}) exceeds the number of candidate experts "
            f"(topk_group {topk_group} x {per_group} experts per group)"
        )
    if not (float("-inf") < routed_scaling_factor < float("inf")):
        raise ValueError(f"routed_scaling_factor must be finite, got {routed_scaling_factor}")



def kernel_paths(
    hidden_size: int,
    n_routed_experts: int,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
) -> Dict[str, str]:
    """Which kernels a router config takes: ``{"forward": "fused" | "simple", "backward": ...}``.

    The simple CUDA-core kernels are far slower than the fused ones (the README's supported
    shapes). Needs the library (``moe_routing_kernel_paths``), not a GPU. Raises ValueError for
    an invalid config, :class:`moe_routing.LibraryError` without the library.
    """
    check_config(hidden_size, n_routed_experts, top_k, n_group, topk_group, 1.0)
    names = _lib.kernel_path_names(
        _lib.make_config(hidden_size, n_routed_experts, top_k, n_group, topk_group, 1.0, True))
    if names is None:
        raise _lib.LibraryError("the moe_routing library predates moe_routing_kernel_paths")
    return names

def _shape(t: Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(name: str, t: Tensor, dtypes, shape) -> None:
    _need(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _need(
        t.dim() == len(shape),
        f"{name} must have {len(shape)} dimension(s) {list(shape)}, got shape {_shape(t)}",
    )
    _need(
        t.dtype in dtypes,
        f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}",
    )
    for i, n in enumerate(shape):
        if n is not None:
            _need(t.shape[i] == n, f"{name} must have shape {list(shape)}, got {_shape(t)}")
    _need(t.is_contiguous(), f"{name} must be contiguous (call .contiguous())")


def _check_devices(device: torch.device, **tensors: Tensor) -> None:
    _need(device.type == "cuda", f"x must be a CUDA tensor, got device {device}")
    for name, t in tensors.items():
        _need(t.device == device, f"{name} is on {t.device}, but x is on {device}")


def _check_route(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor) -> None:
    _need(x.dim() == 2, f"x must be [T, H], got shape {_shape(x)}")
    _need(weight.dim() == 2, f"weight must be [E, H], got shape {_shape(weight)}")
    H = x.shape[1]
    E = weight.shape[0]
    _check_tensor("x", x, (torch.bfloat16,), (None, H))
    _check_tensor("weight", weight, (torch.bfloat16, torch.float32), (E, H))
    _check_tensor("bias", bias, (torch.float32,), (E,))
    check_config(int(H), int(E), top_k, n_group, topk_group, routed_scaling_factor)


def _check_backward(x, weight, topk_idx, topk_scores, grad_topk_weights, n_group, topk_group,
                    routed_scaling_factor, precise=False, grad_w_bf16=False,
                    grad_w_out=None) -> None:
    _need(x.dim() == 2, f"x must be [T, H], got shape {_shape(x)}")
    _need(weight.dim() == 2, f"weight must be [E, H], got shape {_shape(weight)}")
    _need(topk_idx.dim() == 2, f"topk_idx must be [T, K], got shape {_shape(topk_idx)}")
    _need(topk_scores.dim() == 2,
          f"topk_scores must be [T, K] or [T, E], got shape {_shape(topk_scores)}")
    T, H = x.shape
    E = weight.shape[0]
    K = topk_idx.shape[1]
    _check_tensor("x", x, (torch.bfloat16,), (None, H))
    _check_tensor("weight", weight, (torch.bfloat16, torch.float32), (E, H))
    _check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), (T, K))
    # The chosen experts' scores [T, K], or those of all experts [T, E] (read at the chosen).
    width = K if topk_scores.shape[1] == K else E
    _check_tensor("topk_scores", topk_scores, (torch.float32, torch.bfloat16), (T, width))
    _check_tensor("grad_topk_weights", grad_topk_weights, (torch.float32, torch.bfloat16), (T, K))
    _need(not (precise and grad_w_bf16),
          "grad_w_bf16: precise mode writes grad_w as float32 only")
    if grad_w_out is not None:
        _check_tensor("grad_w_out", grad_w_out, (torch.float32,), (E, H))
        _need(not grad_w_bf16,
              "grad_w_out: grad_w is added into it in float32, so grad_w_bf16 must be False")
    check_config(int(H), int(E), int(K), n_group, topk_group, routed_scaling_factor)


# --------------------------------------------------------------------------------------------
# The ctypes ops' plumbing


def _aligned(t: Tensor, align: int) -> Tensor:
    """`t`, or a fresh (aligned) copy if its data pointer is not `align`-byte aligned."""
    return t if t.data_ptr() % align == 0 else t.clone(memory_format=torch.contiguous_format)


def _stream(device: torch.device) -> ctypes.c_void_p:  # (route's)
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


# Element type of each tensor dtype the ABI structs point to.
_CTYPES = {
    torch.bfloat16: ctypes.c_uint16,
    torch.float32: ctypes.c_float,
    torch.int32: ctypes.c_int32,
}

# The C ABI's code of each dtype the backward takes in several (MOE_ROUTING_DTYPE_*).
_DTYPES = {
    torch.float32: _lib.DTYPE_F32,
    torch.bfloat16: _lib.DTYPE_BF16,
    torch.int32: _lib.DTYPE_I32,
    torch.int64: _lib.DTYPE_I64,
}

# One zeroed backward workspace per (device, stream), grown when a call needs more: the
# library leaves it zeroed, so no call allocates or clears one. While a CUDA graph is being
# captured, a call whose stream has none large enough gets its own (zeroed in the graph, from
# the graph's memory pool), and nothing is cached.
_ctypes_workspaces: Dict[Tuple[int, int], Tensor] = {}
_workspaces_lock = threading.Lock()


def _workspace(device: torch.device, stream: int, nbytes: int) -> Tensor:
    key = (device.index, stream)
    ws = _ctypes_workspaces.get(key)
    if ws is not None and ws.numel() >= nbytes:
        return ws
    with torch.cuda.device(device):  # (capture is a property of that device's current stream)
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    with _workspaces_lock:
        ws = _ctypes_workspaces.get(key)
        if ws is None or ws.numel() < nbytes:
            # (The old one may still be in use by queued work on this stream: the allocator
            # keeps its memory until that work is done.)
            ws = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            _ctypes_workspaces[key] = ws
        return ws


def _spans(**tensors: Tensor) -> dict:
    """ABI struct fields for each named tensor: ``name`` (a typed pointer to its data) and
    ``name_len`` (its element count)."""
    fields = {}
    for name, t in tensors.items():
        fields[name] = _lib.ptr(t.data_ptr(), _CTYPES[t.dtype])
        fields[name + "_len"] = t.numel()
    return fields


# --------------------------------------------------------------------------------------------
# moe_routing::route and moe_routing::route_with_stats


def _forward(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
             return_scores, return_counts, int64_indices=False):
    """route's work: ``(topk_idx, topk_weights, topk_scores, scores, expert_counts)``, the last
    two None unless asked for; ``topk_idx`` int64 with ``int64_indices``, else int32."""
    _check_route(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor)
    _check_devices(x.device, weight=weight, bias=bias)
    T, H = x.shape
    E = weight.shape[0]
    K = top_k
    _need(T <= MAX_TOKENS, f"at most {MAX_TOKENS} tokens are supported, got {T}")
    topk_idx = torch.empty((T, K), dtype=torch.int64 if int64_indices else torch.int32,
                           device=x.device)
    topk_weights = torch.empty((T, K), dtype=torch.float32, device=x.device)
    topk_scores = torch.empty((T, K), dtype=torch.float32, device=x.device)
    scores = torch.empty((T, E), dtype=torch.float32, device=x.device) if return_scores else None
    counts = None
    if return_counts:
        counts = (torch.zeros if T == 0 else torch.empty)((E,), dtype=torch.int32, device=x.device)
    if T == 0:
        return topk_idx, topk_weights, topk_scores, scores, counts
    lib = _lib.load()
    w = weight if weight.dtype == torch.bfloat16 else weight.to(torch.bfloat16)
    x = _aligned(x, 16)
    w = _aligned(w, 16)
    cfg = _lib.make_config(H, E, K, n_group, topk_group, routed_scaling_factor, norm_topk_prob)
    outputs = dict(topk_weights=topk_weights, topk_scores=topk_scores)
    if scores is not None:
        outputs["scores"] = scores
    if counts is not None:
        outputs["expert_counts"] = counts
    args = _lib.MoeRoutingForwardArgs(
        struct_size=ctypes.sizeof(_lib.MoeRoutingForwardArgs),
        reserved=0,
        tokens=T,
        **_spans(x=x, w=w, bias=bias, **outputs),
        # (A pointer of the declared type; topk_idx_dtype says what it holds.)
        topk_idx=_lib.ptr(topk_idx.data_ptr(), ctypes.c_int32),
        topk_idx_len=topk_idx.numel(),
        flags=0,
        device=0,
        topk_idx_dtype=_DTYPES[topk_idx.dtype],
        reserved2=0,
    )
    with torch.cuda.device(x.device):
        status = lib.moe_routing_forward(ctypes.byref(cfg), ctypes.byref(args), _stream(x.device))
    _lib.check_status(status, "moe_routing_forward")
    return topk_idx, topk_weights, topk_scores, scores, counts


def route(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    precise_backward: bool = False,
    int64_indices: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Grouped top-k routing of ``x`` [T, H] bf16 by ``weight`` [E, H] and ``bias`` [E] f32.

    ``weight`` is bf16, or f32 (then rounded to bf16 for the kernel, and its gradient is the
    kernel's f32 ``grad_w`` as is). Returns ``topk_idx`` [T, K] int32 (best first),
    ``topk_weights`` [T, K] f32 and ``topk_scores`` [T, K] f32 (the sigmoid scores of the chosen
    experts). Only ``topk_weights`` is differentiable; ``precise_backward`` makes the
    backward's ``grad_w`` fp32-accurate (a second pass over x). ``int64_indices``: the kernel
    writes ``topk_idx`` as int64, PyTorch's index dtype.
    """
    topk_idx, topk_weights, topk_scores, _, _ = _forward(
        x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
        False, False, int64_indices)
    return topk_idx, topk_weights, topk_scores


def _route_fake(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
                norm_topk_prob, precise_backward=False, int64_indices=False):
    _check_route(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor)
    T = x.shape[0]
    return (
        x.new_empty((T, top_k), dtype=torch.int64 if int64_indices else torch.int32),
        x.new_empty((T, top_k), dtype=torch.float32),
        x.new_empty((T, top_k), dtype=torch.float32),
    )


def route_with_stats(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    precise_backward: bool = False,
    return_scores: bool = False,
    return_counts: bool = False,
    int64_indices: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``route``, with two more outputs filled in by the same kernel call: ``scores`` [T, E]
    f32, every expert's sigmoid score (no bias), with ``return_scores``, and
    ``expert_counts`` [E] int32, the number of tokens routed to each expert, with
    ``return_counts``. An output not asked for is an empty tensor (shape [0]). With
    ``int64_indices`` the kernel writes ``topk_idx`` as int64, PyTorch's index dtype (no
    conversion after it). Returns ``(topk_idx, topk_weights, topk_scores, scores,
    expert_counts)``; as in ``route``, only ``topk_weights`` is differentiable.
    """
    topk_idx, topk_weights, topk_scores, scores, counts = _forward(
        x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
        return_scores, return_counts, int64_indices)
    if scores is None:
        scores = torch.empty((0,), dtype=torch.float32, device=x.device)
    if counts is None:
        counts = torch.empty((0,), dtype=torch.int32, device=x.device)
    return topk_idx, topk_weights, topk_scores, scores, counts


def _route_with_stats_fake(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor,
                           norm_topk_prob, precise_backward=False, return_scores=False,
                           return_counts=False, int64_indices=False):
    _check_route(x, weight, bias, top_k, n_group, topk_group, routed_scaling_factor)
    T = x.shape[0]
    E = weight.shape[0]
    return (
        x.new_empty((T, top_k), dtype=torch.int64 if int64_indices else torch.int32),
        x.new_empty((T, top_k), dtype=torch.float32),
        x.new_empty((T, top_k), dtype=torch.float32),
        x.new_empty((T, E) if return_scores else (0,), dtype=torch.float32),
        x.new_empty((E,) if return_counts else (0,), dtype=torch.int32),
    )


# --------------------------------------------------------------------------------------------
# moe_routing::route_backward


def route_backward(
    x: Tensor,
    weight: Tensor,
    topk_idx: Tensor,
    topk_scores: Tensor,
    grad_topk_weights: Tensor,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    precise: bool = False,
    grad_w_bf16: bool = False,
    grad_w_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Gradients of ``x`` and ``weight`` from ``grad_topk_weights`` [T, K] (f32 or bf16).

    ``topk_idx`` [T, K] (int32 or int64) holds each token's chosen experts (distinct);
    ``topk_scores`` their sigmoid scores, either [T, K] (the chosen experts', as ``route``
    returns them) or [T, E] (every expert's: only the chosen are read), f32 or bf16. All are
    read in their own dtype, with no conversion. Returns ``grad_x`` [T, H] bf16 and ``grad_w``
    [E, H], f32, or bf16 with ``grad_w_bf16``. ``precise`` makes ``grad_w`` fp32-accurate (a
    second pass over x: slower; f32 ``grad_w`` only). ``weight`` may be bf16 or f32 (rounded
    to bf16, as in the forward).

    ``grad_w_out`` [E, H] f32 (contiguous, on x's device): ``grad_w`` is added into it by the
    kernel (no temporary, no extra kernel), as into Megatron's ``main_grad``; the second output
    is then an empty tensor (shape [0]), since an op's outputs cannot alias its inputs.
    """
    _check_backward(x, weight, topk_idx, topk_scores, grad_topk_weights, n_group, topk_group,
                    routed_scaling_factor, precise, grad_w_bf16, grad_w_out)
    out = {} if grad_w_out is None else {"grad_w_out": grad_w_out}
    _check_devices(x.device, weight=weight, topk_idx=topk_idx, topk_scores=topk_scores,
                   grad_topk_weights=grad_topk_weights, **out)
    T, H = x.shape
    E = weight.shape[0]
    K = topk_idx.shape[1]
    _need(T <= MAX_TOKENS, f"at most {MAX_TOKENS} tokens are supported, got {T}")
    grad_x = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    w_dtype = torch.bfloat16 if grad_w_bf16 else torch.float32
    accumulate = grad_w_out is not None
    if accumulate:
        placeholder = torch.empty((0,), dtype=torch.float32, device=x.device)
        # Written in place (below, or not at all for no tokens): its version is bumped, as the
        # native op does.
        torch.autograd.graph.increment_version(grad_w_out)
    if T == 0:
        return grad_x, (placeholder if accumulate else
                        torch.zeros((E, H), dtype=w_dtype, device=x.device))
    grad_w = grad_w_out if accumulate else torch.empty((E, H), dtype=w_dtype, device=x.device)
    lib = _lib.load()
    w = weight if weight.dtype == torch.bfloat16 else weight.to(torch.bfloat16)
    x = _aligned(x, 16)
    w = _aligned(w, 16)
    cfg = _lib.make_config(H, E, K, n_group, topk_group, routed_scaling_factor, norm_topk_prob)
    ws_bytes = _lib.backward_workspace_bytes(cfg, T)
    if ws_bytes <= 0:
        raise _lib.MoeRoutingError(
            _lib.INVALID_CONFIG,
            f"moe_routing_backward_workspace_bytes returned 0 for T={T}: "
            f"{_lib.status_string(_lib.validate_config(cfg))}",
        )
    stream = torch.cuda.current_stream(x.device).cuda_stream
    workspace = _workspace(x.device, stream, ws_bytes)
    all_scores = topk_scores.shape[1] != K
    args = _lib.MoeRoutingBackwardArgs(
        struct_size=ctypes.sizeof(_lib.MoeRoutingBackwardArgs),
        precision=_lib.PRECISION_PRECISE if precise else _lib.PRECISION_DEFAULT,
        tokens=T,
        **_spans(x=x, w=w, grad_x=grad_x),
        # (Pointers of the struct's declared types; the *_dtype fields say what they hold.)
        topk_idx=_lib.ptr(topk_idx.data_ptr(), ctypes.c_int32),
        topk_idx_len=topk_idx.numel(),
        grad_topk_weights=_lib.ptr(grad_topk_weights.data_ptr(), ctypes.c_float),
        grad_topk_weights_len=grad_topk_weights.numel(),
        grad_w=_lib.ptr(grad_w.data_ptr(), ctypes.c_float),
        grad_w_len=grad_w.numel(),
        workspace=ctypes.c_void_p(workspace.data_ptr()),
        workspace_bytes=workspace.numel(),
        accumulate_grad_w=1 if accumulate else 0,
        reserved=0,
        topk_idx_dtype=_DTYPES[topk_idx.dtype],
        scores_dtype=_DTYPES[topk_scores.dtype],
        grad_topk_weights_dtype=_DTYPES[grad_topk_weights.dtype],
        grad_w_dtype=_DTYPES[w_dtype],
        # Every tensor is on x's device (_check_backward) and the stream is that device's.
        flags=_lib.FLAG_CHECKED_DEVICE,
        device=x.device.index,
    )
    if all_scores:
        args.scores = ctypes.c_void_p(topk_scores.data_ptr())
        args.scores_len = topk_scores.numel()
    else:
        args.topk_scores = _lib.ptr(topk_scores.data_ptr(), ctypes.c_float)
        args.topk_scores_len = topk_scores.numel()
    with torch.cuda.device(x.device):
        status = lib.moe_routing_backward(ctypes.byref(cfg), ctypes.byref(args),
                                          ctypes.c_void_p(stream))
    _lib.check_status(status, "moe_routing_backward")
    return grad_x, (placeholder if accumulate else grad_w)


def _route_backward_fake(x, weight, topk_idx, topk_scores, grad_topk_weights, n_group,
                         topk_group, routed_scaling_factor, norm_topk_prob, precise=False,
                         grad_w_bf16=False, grad_w_out=None):
    _check_backward(x, weight, topk_idx, topk_scores, grad_topk_weights, n_group, topk_group,
                    routed_scaling_factor, precise, grad_w_bf16, grad_w_out)
    T, H = x.shape
    E = weight.shape[0]
    if grad_w_out is not None:
        torch.autograd.graph.increment_version(grad_w_out)  # (as the kernels do)
        return x.new_empty((T, H), dtype=torch.bfloat16), x.new_empty((0,), dtype=torch.float32)
    return (
        x.new_empty((T, H), dtype=torch.bfloat16),
        x.new_empty((E, H), dtype=torch.bfloat16 if grad_w_bf16 else torch.float32),
    )


# --------------------------------------------------------------------------------------------
# Autograd of route


def _setup_context(ctx, inputs, output):
    # (route's and route_with_stats': the same first inputs and outputs.)
    x, weight, _bias, _k, n_group, topk_group, scale, norm, precise = inputs[:9]
    topk_idx, _topk_weights, topk_scores = output[:3]
    ctx.save_for_backward(x, weight, topk_idx, topk_scores)
    ctx.cfg = (n_group, topk_group, scale, norm, precise)
    ctx.weight_dtype = weight.dtype
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(topk_idx, topk_scores, *output[3:])


def _route_autograd_backward(ctx, _grad_idx, grad_topk_weights, _grad_scores, *_grad_stats):
    x, weight, topk_idx, topk_scores = ctx.saved_tensors
    n_group, topk_group, scale, norm, precise = ctx.cfg
    grad_x = grad_w = None
    if grad_topk_weights is not None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        # bf16 and f32 gradients go to the kernel as they are; a bf16 weight gets its bf16
        # gradient from the kernel itself (f32 where precise).
        g = grad_topk_weights
        if g.dtype not in (torch.float32, torch.bfloat16):
            g = g.to(torch.float32)
        g = g.contiguous()
        grad_w_bf16 = ctx.weight_dtype == torch.bfloat16 and not precise
        grad_x, grad_w = torch.ops.moe_routing.route_backward(
            x, weight, topk_idx, topk_scores, g, n_group, topk_group, scale, norm, precise,
            grad_w_bf16,
        )
        grad_x = grad_x if ctx.needs_input_grad[0] else None
        grad_w = grad_w.to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
    return (grad_x, grad_w) + (None,) * (ctx.n_inputs - 2)


# --------------------------------------------------------------------------------------------
# The ctypes route_backward, defined by its schema: torch.library.custom_op cannot take it, as
# its in-place bookkeeping indexes the arguments as passed, and a call that leaves the mutable
# ``grad_w_out`` at its default passes fewer. Its schema, tags and dispatch keys are those of
# the native op (csrc/torch_ops.cpp); as there, the kernels bump grad_w_out's version.

ROUTE_BACKWARD_SCHEMA = (
    "route_backward(Tensor x, Tensor weight, Tensor topk_idx, Tensor topk_scores, "
    "Tensor grad_topk_weights, SymInt n_group, SymInt topk_group, float routed_scaling_factor, "
    "bool norm_topk_prob, bool precise=False, bool grad_w_bf16=False, "
    "Tensor(a11!)? grad_w_out=None) -> (Tensor, Tensor)"
)
_definitions: List[torch.library.Library] = []


class _NotDifferentiable(torch.autograd.Function):
    """Gives route_backward's outputs a backward that raises, as the native op's autograd
    kernel does (only where an input requires grad with grad mode on: never in route's
    backward)."""

    @staticmethod
    def forward(ctx, _anchor, grad_x, grad_w):
        return grad_x.clone(), grad_w.clone()

    @staticmethod
    def backward(ctx, *_grads):
        raise RuntimeError("the derivative of moe_routing::route_backward is not implemented")


def _define_route_backward(impl):
    lib = torch.library.Library("moe_routing", "FRAGMENT")
    _definitions.append(lib)  # (a library's registrations last as long as the object)
    lib.define(ROUTE_BACKWARD_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
    lib.impl("route_backward", impl, "CPU")
    lib.impl("route_backward", impl, "CUDA")
    torch.library.register_fake("moe_routing::route_backward", _route_backward_fake, lib=lib)
    op = torch.ops.moe_routing.route_backward.default

    def autograd(keyset, *args, **kwargs):
        with torch._C._AutoDispatchBelowAutograd():
            grad_x, grad_w = op.redispatch(keyset & torch._C._after_autograd_keyset, *args,
                                           **kwargs)
        if torch.is_grad_enabled():
            anchor = next((t for t in (*args, *kwargs.values())
                           if isinstance(t, Tensor) and t.requires_grad), None)
            if anchor is not None:
                grad_x, grad_w = _NotDifferentiable.apply(anchor, grad_x, grad_w)
        return grad_x, grad_w

    lib.impl("route_backward", autograd, "Autograd", with_keyset=True)
    return torch.ops.moe_routing.route_backward


# --------------------------------------------------------------------------------------------
# Registration: the native ops with this module's fake implementations and autograd, or the
# Python functions above as custom ops.

# The ctypes implementations stay callable as plain functions (the tests compare the two).
_route_ctypes = route
_route_with_stats_ctypes = route_with_stats
_route_backward_ctypes = route_backward

if BACKEND == "native":
    route = torch.ops.moe_routing.route
    route_with_stats = torch.ops.moe_routing.route_with_stats
    route_backward = torch.ops.moe_routing.route_backward
    # (From this module: the op library names it with set_python_module.)
    torch.library.register_fake("moe_routing::route", _route_fake)
    torch.library.register_fake("moe_routing::route_with_stats", _route_with_stats_fake)
    torch.library.register_fake("moe_routing::route_backward", _route_backward_fake)
    # The op library registers route's autograd in C++ (no Python per call); a library built
    # before it did gets this module's.
    for _name in ("route", "route_with_stats"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_routing::{_name}",
                                                              "Autograd"):
            torch.library.register_autograd(f"moe_routing::{_name}", _route_autograd_backward,
                                            setup_context=_setup_context)
    # The workspace cache of the ops in use: (device index, stream handle) -> workspace.
    _workspaces = _NativeWorkspaces()
else:
    _workspaces = _ctypes_workspaces  # type: ignore[assignment]
    route = torch.library.custom_op("moe_routing::route", mutates_args=())(route)
    route.register_fake(_route_fake)
    route_with_stats = torch.library.custom_op("moe_routing::route_with_stats",
                                               mutates_args=())(route_with_stats)
    route_with_stats.register_fake(_route_with_stats_fake)
    route_backward = _define_route_backward(route_backward)
    for _op in (route, route_with_stats):
        _op.register_autograd(_route_autograd_backward, setup_context=_setup_context)


__all__ = ["route", "route_with_stats", "route_backward", "check_config", "BACKEND",
           "native_library_path", "MAX_HIDDEN", "MAX_EXPERTS", "MAX_TOP_K"]
