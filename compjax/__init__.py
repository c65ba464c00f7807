"""compjax: communication-efficient distributed training in JAX.

Gradient compressors as optax transformations, the collectives that carry
their payloads, exact byte accounting and data-parallel helpers.
"""

from compjax import algorithms, bytecount, codecs, collectives, netmodel, parallel
from compjax.accounting import Collective, audit_collectives, payload_bytes
from compjax.algorithms import DelayedAveragingState, DilocoState, delayed_averaging, diloco
from compjax.compressors import (
    ApplyIfFiniteState,
    CastState,
    DgcState,
    E3m0State,
    IdentityState,
    OnebitState,
    PowerSGDState,
    QsgdState,
    RandomkState,
    SignsgdState,
    TerngradState,
    TopkState,
    TwobitState,
    apply_if_finite,
    cast,
    dgc,
    dgc_warmup_schedule,
    e3m0,
    identity,
    onebit,
    powersgd,
    qsgd,
    randomk,
    signsgd,
    terngrad,
    topk,
    twobit,
)

__version__ = "0.1.0"

__all__ = [
    "ApplyIfFiniteState",
    "CastState",
    "Collective",
    "DelayedAveragingState",
    "DgcState",
    "DilocoState",
    "E3m0State",
    "IdentityState",
    "OnebitState",
    "PowerSGDState",
    "QsgdState",
    "RandomkState",
    "SignsgdState",
    "TerngradState",
    "TopkState",
    "TwobitState",
    "__version__",
    "algorithms",
    "apply_if_finite",
    "audit_collectives",
    "bytecount",
    "cast",
    "codecs",
    "collectives",
    "delayed_averaging",
    "dgc",
    "dgc_warmup_schedule",
    "diloco",
    "e3m0",
    "identity",
    "netmodel",
    "onebit",
    "parallel",
    "payload_bytes",
    "powersgd",
    "qsgd",
    "randomk",
    "signsgd",
    "terngrad",
    "topk",
    "twobit",
]
