"""Gradient compressors as optax transformations: error feedback + codec + collective.

Each factory returns an ``optax.GradientTransformationExtraArgs`` whose
``update`` takes a worker's **local** gradients and returns the decompressed
**mean** over ``axis_name``; each state is a NamedTuple ``<Factory>State`` with
the fields ``count``, ``skipped`` and ``payload_bytes`` last (see
:mod:`compjax.compressors.base`).
"""

from compjax.compressors.applying import apply_gradients
from compjax.compressors.cast import CastState, cast
from compjax.compressors.chunktopk import ChunktopkState, chunktopk, chunktopk_bytes
from compjax.compressors.clip import ClipByGlobalNormState, clip_by_global_norm
from compjax.compressors.dgc import DgcState, dgc, dgc_warmup_schedule
from compjax.compressors.e3m0 import E3m0State, e3m0
from compjax.compressors.finite import ApplyIfFiniteState, apply_if_finite
from compjax.compressors.identity import IdentityState, identity
from compjax.compressors.onebit import OnebitState, onebit
from compjax.compressors.powersgd import PowerSGDState, powersgd
from compjax.compressors.qsgd import QsgdState, qsgd
from compjax.compressors.randomk import RandomkState, randomk
from compjax.compressors.signsgd import SignsgdState, signsgd
from compjax.compressors.terngrad import TerngradState, terngrad
from compjax.compressors.topk import TopkState, topk
from compjax.compressors.twobit import TwobitState, twobit

__all__ = [
    "ApplyIfFiniteState",
    "CastState",
    "ChunktopkState",
    "ClipByGlobalNormState",
    "DgcState",
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
    "apply_gradients",
    "apply_if_finite",
    "cast",
    "chunktopk",
    "chunktopk_bytes",
    "clip_by_global_norm",
    "dgc",
    "dgc_warmup_schedule",
    "e3m0",
    "identity",
    "onebit",
    "powersgd",
    "qsgd",
    "randomk",
    "signsgd",
    "terngrad",
    "topk",
    "twobit",
]
