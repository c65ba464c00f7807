"""compjax: communication-efficient distributed training in JAX.

Gradient compressors as optax transformations, the collectives that carry
their payloads, exact byte accounting and data-parallel helpers.
"""

from compjax import codecs, collectives, netmodel, parallel
from compjax.accounting import Collective, audit_collectives, payload_bytes
from compjax.compressors import (
    IdentityState,
    PowerSGDState,
    TopkState,
    identity,
    powersgd,
    topk,
)

__version__ = "0.1.0"

__all__ = [
    "Collective",
    "IdentityState",
    "PowerSGDState",
    "TopkState",
    "__version__",
    "audit_collectives",
    "codecs",
    "collectives",
    "identity",
    "netmodel",
    "parallel",
    "payload_bytes",
    "powersgd",
    "topk",
]
