"""Multi-step methods built on the compressors: what they send goes through any compjax compressor.

* :func:`delayed_averaging` -- Delayed Gradient Averaging (Zhu et al., NeurIPS 2021).
* :func:`diloco` -- DiLoCo and Streaming DiLoCo (Douillard et al., 2023, 2025);
  :func:`diloco_global_params` -- the global model of its state, the parameters to evaluate.
"""

from compjax.algorithms import federated
from compjax.algorithms.delayed import DelayedAveragingState, delayed_averaging, history_slots
from compjax.algorithms.diloco import DilocoState, diloco, diloco_global_params, fragment_assignment

__all__ = ["DelayedAveragingState", "DilocoState", "delayed_averaging", "diloco", "diloco_global_params", "federated",
           "fragment_assignment", "history_slots"]
