"""Multi-step methods built on the compressors: what they send goes through any compjax compressor.

* :func:`delayed_averaging` -- Delayed Gradient Averaging (Zhu et al., NeurIPS 2021).
"""

from compjax.algorithms.delayed import DelayedAveragingState, delayed_averaging

__all__ = ["DelayedAveragingState", "delayed_averaging"]
