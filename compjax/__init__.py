"""compjax: communication-efficient distributed training in JAX.

Gradient compressors as optax transformations, the collectives that carry
their payloads, exact byte accounting and data-parallel helpers.
"""

from compjax import codecs, collectives, netmodel, parallel
from compjax.accounting import Collective, audit_collectives, payload_bytes
from compjax.compressors import (
    CastState,
    IdentityState,
    OnebitState,
    PowerSGDState,
    QsgdState,
    SignsgdState,
    TerngradState,
    TopkState,
    TwobitState,
    cast,
    identity,
    onebit,
    powersgd,
    qsgd,
    signsgd,
    terngrad,
    topk,
    twobit,
)

__version__ = "0.1.0"

__all__ = [
    "CastState",
    "Collective",
    "IdentityState",
    "OnebitState",
    "PowerSGDState",
    "QsgdState",
    "SignsgdState",
    "TerngradState",
    "TopkState",
    "TwobitState",
    "__version__",
    "audit_collectives",
    "cast",
    "codecs",
    "collectives",
    "identity",
    "netmodel",
    "onebit",
    "parallel",
    "payload_bytes",
    "powersgd",
    "qsgd",
    "signsgd",
    "terngrad",
    "topk",
    "twobit",
]
