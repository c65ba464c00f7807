"""Multi-step methods built on the compressors: what they send goes through any compjax compressor.

* :func:`delayed_averaging` -- Delayed Gradient Averaging (Zhu et al., NeurIPS 2021).
* :func:`diloco` -- DiLoCo and Streaming DiLoCo (Douillard et al., 2023, 2025);
  :func:`diloco_global_params` -- the global model of its state, the parameters to evaluate;
  :func:`diloco_global_model` and :func:`diloco_swap_global` -- the same for a Flax NNX model and its
  ``nnx.Optimizer`` (a copy, or swapped in for a ``with`` block).
* :func:`sparseloco` -- SparseLoCo (Sarfi et al., 2025): DiLoCo with chunk-top-k, 2-bit outer gradients whose
  decayed error feedback replaces the outer momentum.
* :func:`multi_steps` -- gradient accumulation over ``k`` micro-steps with one exchange (``optax.MultiSteps``
  runs the exchange on every micro-step).
* :func:`demo` -- DeMo (Peng, Quesnelle & Kingma, 2024): DCT top-k of the momentum, sign update.
"""

from compjax.algorithms import federated
from compjax.algorithms.delayed import DelayedAveragingState, delayed_averaging, history_slots
from compjax.algorithms.demo import DemoState, demo
from compjax.algorithms.diloco import (
    DilocoState,
    describe_fragments,
    diloco,
    diloco_global_params,
    fragment_assignment,
)
from compjax.algorithms.diloco_nnx import diloco_global_model, diloco_swap_global
from compjax.algorithms.multi_steps import MultiStepsState, multi_steps
from compjax.algorithms.sparseloco import sparseloco

__all__ = ["DelayedAveragingState", "DemoState", "DilocoState", "MultiStepsState", "delayed_averaging", "demo", "describe_fragments", "diloco",
           "diloco_global_model", "diloco_global_params", "diloco_swap_global", "federated", "fragment_assignment", "history_slots", "multi_steps",
           "sparseloco"]
