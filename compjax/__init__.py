"""compjax: communication-efficient distributed training in JAX.

Gradient compressors as optax transformations, the collectives that carry
their payloads, exact byte accounting and data-parallel helpers.
"""

from compjax import codecs, collectives, netmodel, parallel
from compjax.accounting import Collective, audit_collectives, payload_bytes
from compjax.compressors import (
    CastState,
    DgcState,
    IdentityState,
    OnebitState,
    PowerSGDState,
    QsgdState,
    RandomkState,
    SignsgdState,
    TerngradState,
    TopkState,
    TwobitState,
    cast,
    dgc,
    dgc_warmup_schedule,
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
    "CastState",
    "Collective",
    "DgcState",
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
    "audit_collectives",
    "cast",
    "codecs",
    "collectives",
    "dgc",
    "dgc_warmup_schedule",
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
