"""PyTorch bindings of moe-routing: the grouped top-k MoE router of DeepSeek-V3 / GLM-4.5
(HF transformers' "noaux_tc" router) as CUDA kernels for Hopper (sm_90a).

* :class:`GroupedTopKRouter`: drop-in for transformers' grouped top-k routers
  (``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``, ``Glm4MoeLiteTopkRouter``,
  ``Dots1TopkRouter`` and others; :func:`replace_hf_routers` finds them by structure);
* ``torch.ops.moe_routing.route`` / ``route_backward`` (also :func:`route`,
  :func:`route_backward`): the custom ops, native (C++, ``libmoe_routing_torch.so``) where
  that library is present, else Python ones over ctypes (:mod:`moe_routing.ops` says which);
* :mod:`moe_routing.reference`: the same semantics in plain PyTorch;
* training: :func:`route_with_stats` (all scores and per-expert token counts from the same
  kernel call), :func:`update_expert_bias` (loss-free balancing), :func:`route_with_indices`
  (routing replay), grad_w added into Megatron's ``main_grad``
  (``GroupedTopKRouter(accumulate_grad_into_main_grad=True)``);
* :mod:`moe_routing.adapters`: :class:`MegatronTopKRouter` and :class:`TokenChoiceTopKRouter`,
  drop-ins for Megatron-LM's and torchtitan's routers.

The shared library ``libmoe_routing.so`` is loaded through ctypes on first use, or at import
with the native ops; see :func:`library_path` for where it is looked for.
"""

from . import adapters, reference
from ._lib import (
    ABI_VERSION,
    LibraryError,
    MoeRoutingError,
    abi_version,
    candidate_paths,
    find_library,
    library_path,
    status_string,
    version,
)
from ._lib import load as load_library
from .module import GroupedTopKRouter, replace_hf_routers
from .ops import check_config, kernel_paths, route, route_backward, route_with_stats
from .training import route_with_indices, update_expert_bias
from .adapters import MegatronTopKRouter, TokenChoiceTopKRouter

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "GroupedTopKRouter",
    "LibraryError",
    "MegatronTopKRouter",
    "MoeRoutingError",
    "TokenChoiceTopKRouter",
    "abi_version",
    "adapters",
    "candidate_paths",
    "check_config",
    "find_library",
    "kernel_paths",
    "library_path",
    "load_library",
    "reference",
    "replace_hf_routers",
    "route",
    "route_backward",
    "route_with_indices",
    "route_with_stats",
    "status_string",
    "update_expert_bias",
    "version",
]
