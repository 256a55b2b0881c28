"""Drop-in routers for training frameworks, on the CUDA kernels, with their own interfaces:

* :class:`MegatronTopKRouter`: Megatron-LM's ``TopKRouter`` (sigmoid, group-limited routing,
  expert bias), returning ``(probs, routing_map)``;
* :class:`TokenChoiceTopKRouter`: torchtitan's ``TokenChoiceTopKRouter`` (sigmoid,
  node-limited routing), returning ``(top_scores, selected_experts_indices, scores or
  num_tokens_per_expert)``.

Neither framework is imported: configs are read by attribute name.
"""

from .megatron import MegatronTopKRouter
from .torchtitan import TokenChoiceTopKRouter

__all__ = ["MegatronTopKRouter", "TokenChoiceTopKRouter"]
