"""Gradient compressors as optax transformations: error feedback + codec + collective.

Each factory returns an ``optax.GradientTransformationExtraArgs`` whose
``update`` takes a worker's **local** gradients and returns the decompressed
**mean** over ``axis_name``; each state is a NamedTuple ``<Factory>State`` with
an int32 ``payload_bytes`` field.
"""

from compjax.compressors.identity import IdentityState, identity
from compjax.compressors.powersgd import PowerSGDState, powersgd
from compjax.compressors.topk import TopkState, topk

__all__ = [
    "IdentityState",
    "identity",
    "PowerSGDState",
    "powersgd",
    "TopkState",
    "topk",
]
